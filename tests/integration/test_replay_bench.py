"""`python -m asyncrl.bench buffer --smoke` runs end to end over real sockets and processes and
reports the figures the issue asks for (ratio vs bare PUSH/PULL, groups/s, MB/s, latency, 1 MB codec)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_buffer_bench_smoke_writes_figures(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "asyncrl.bench", "buffer", "--smoke", "--output", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("buffer-*.json")
    result = json.loads(path.read_text())
    assert result["ratio"] > 0 and result["ratio"] == pytest.approx(
        result["buffer"]["groups_per_s"] / result["bare"]["groups_per_s"])
    assert result["durable_ratio"] == pytest.approx(
        result["buffer_durable"]["groups_per_s"] / result["buffer"]["groups_per_s"])
    for part in ("bare", "codec_pipe", "buffer", "buffer_durable"):
        assert result[part]["groups"] >= 40
        assert result[part]["mb_per_s"] > 0 and result[part]["latency_p99_ms"] >= result[part]["latency_p50_ms"]
    assert result["buffer"]["dropped_stale"] <= 4
    assert 0.9 < result["codec_1mb"]["frame_mb"] < 1.2 and result["codec_1mb"]["encode_decode_ms"] > 0
