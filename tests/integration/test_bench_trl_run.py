"""`python -m asyncrl.bench trl --smoke` end to end where TRL is installed (`make bench-trl`):
both sides train 4 steps on the quick start's task, both are scored by `asyncrl.eval` at the same
steps, and the JSON carries the side-by-side figures. Slow (~4 min); skipped without TRL."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL not installed (make bench-trl)")]


def test_bench_trl_smoke_trains_both_sides_and_scores_them_at_the_same_steps(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "asyncrl.bench", "trl", "--config", "configs/quickstart.yaml",
                           "--smoke", "--output", str(out), "verifier.port=0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(next(out.glob("trl-*.json")).read_text())
    curves = result["curves"]
    assert [p["step"] for p in curves["asyncrl"]] == [p["step"] for p in curves["trl"]] == [0, 2, 4]
    for side in ("asyncrl", "trl"):
        s = result["summaries"][side]
        assert s["median_step_s"] > 0 and s["launch_to_exit_s"] > s["start_up_s"] > 0
        assert 0.0 <= s["final_accuracy"] <= 1.0
    assert result["ratios"]["step_s_asyncrl_over_trl"] > 0
    assert "median_step_s" in proc.stdout and "cannot be made equal" in proc.stdout
