"""The shipped lag testbed (`configs/lag_testbed.yaml`) really is stale: a 10-step run of it at
η = 4 through `python -m asyncrl.launch` (real Ray, Serve, vLLM CPU engine, ZeroMQ buffer, DeepSpeed
learner) trains most of its groups at lag ≥ 3, and none beyond the bound.

The staleness grid of `python -m asyncrl.bench convergence --config configs/lag_testbed.yaml`
(docs/benchmarks.md) measures the off-policy corrections on this testbed; on the quick start the lag
stays near one version and the corrections have nothing to correct, so this test guards the
premise of that grid. Lag can only build up after the start (step k trains groups at most k - 1
versions old), so of 10 steps x 8 groups at most 8 x 7 = 56 can be at lag ≥ 3; "most" = over half
of all 80 needs the buffer at the bound from about step 4 on, which the slow learner
(16 updates per batch) and the 16 groups in flight give.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import zip_longest
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "assets" / "tiny-policy"
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="quick-start policy not built")]


def test_ten_steps_at_eta_4_train_most_groups_at_lag_3_or_more(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "asyncrl.launch", "-c", "configs/lag_testbed.yaml", f"trainer.run_dir={tmp_path}",
           "trainer.experiment_name=lag", "trainer.max_steps=10", "buffer.max_staleness=4",
           "trainer.eval_before_after=false", "trainer.eval_every=-1", "trainer.save_every=-1",
           "trainer.logger=[jsonl]"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "lag" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "buffer/staleness_hist" in r]
    assert [r["step"] for r in steps] == list(range(1, 11))
    # buffer/staleness_hist of a step: trained groups by lag (index = versions behind the learner).
    hist = [sum(col) for col in zip_longest(*(r["buffer/staleness_hist"] for r in steps), fillvalue=0)]
    total = sum(hist)
    assert total == 10 * 8, hist  # every step trained a whole batch of 8 groups
    assert sum(hist[5:]) == 0, f"a group beyond the bound of 4: {hist}"
    at_least_3 = sum(hist[3:])
    assert at_least_3 > total / 2, f"only {at_least_3}/{total} groups at lag >= 3: {hist}"
