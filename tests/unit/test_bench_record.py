"""`python -m asyncrl.bench ... --record`: a result is kept as docs/results/<scenario>-<machine>.json, the
next run of the same scenario on the same kind of machine replaces it (one current file per scenario),
its plot comes along under the same name, and a --smoke run is refused before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from asyncrl.bench.common import machine_tag, record_result, write_result

ROOT = Path(__file__).resolve().parents[2]


def test_machine_tag_names_cores_or_gpus():
    assert machine_tag({"cpu_count": 2, "cuda": None}) == "cpu2"
    assert machine_tag({"cpu_count": 96, "cuda": "NVIDIA H100 80GB HBM3", "cuda_devices": 8}) == "h100x8"
    assert machine_tag({"cpu_count": 16, "cuda": "NVIDIA H200", "cuda_devices": 1}) == "h200x1"


def test_a_second_run_replaces_the_first(tmp_path):
    plot = tmp_path / "runs" / "convergence-20261205-101010.png"
    plot.parent.mkdir()
    plot.write_bytes(b"\x89PNG first")
    first = write_result("convergence", {"ratio": 0.5, "plot": str(plot)}, tmp_path / "bench")
    kept = record_result(first, tmp_path / "results")
    tag = machine_tag(json.loads(first.read_text())["machine"])
    assert kept == tmp_path / "results" / f"convergence-{tag}.json"
    assert json.loads(kept.read_text())["plot"] == f"convergence-{tag}.png"
    assert (tmp_path / "results" / f"convergence-{tag}.png").read_bytes() == b"\x89PNG first"

    second = write_result("convergence", {"ratio": 0.7}, tmp_path / "bench2")
    assert record_result(second, tmp_path / "results") == kept
    assert json.loads(kept.read_text())["ratio"] == 0.7
    assert sorted(p.name for p in (tmp_path / "results").glob("*.json")) == [kept.name]


def test_record_refuses_a_smoke_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "asyncrl.bench", "buffer", "--smoke", "--record", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "--record" in proc.stderr and "--smoke" in proc.stderr
    assert not any(tmp_path.iterdir())
