"""configs/smollm2_math.yaml end to end, 2 learner steps: SmolLM2-135M-Instruct (the converted GGUF) on the
mathds task through `python -m asyncrl.launch` (real Ray, the mathds rule verifier behind Serve, a vLLM CPU
engine, a DeepSpeed CPU learner with LoRA and merged-weight sync).

Proves: the run exits 0 with 2 step rows, every step trained 2 groups x 8 samples, every weight sync's
fingerprint matched (the tied head included), the verifier's turns carried scores, and summary.json has
the before/after numbers on the interpolation rows. Slow (a 538 MB model on 2 cores): -m slow. Skipped,
with the reason, when the smollm2 extra or the converted checkpoint is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_two_steps_of_the_smollm2_config(tmp_path: Path) -> None:
    from asyncrl.models import smollm2

    try:
        smollm2.find_gguf()
    except smollm2.ConversionError as e:
        pytest.skip(str(e))
    if not (smollm2.DEFAULT_OUT / "provenance.json").is_file():
        pytest.skip(f"no converted checkpoint at {smollm2.DEFAULT_OUT}: python -m asyncrl.models.smollm2")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "asyncrl.launch", "-c", "configs/smollm2_math.yaml", f"trainer.run_dir={tmp_path}",
           "trainer.experiment_name=smol", "trainer.max_steps=2", "trainer.eval_every=-1", "trainer.eval_limit=4",
           "trainer.logger=[jsonl]"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "smol"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step" in r and "resumed_from" not in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/num_samples"] == 2 * 8 for r in rows)
    assert all(r["weights/fingerprint_mismatch"] == 0 for r in rows)
    summary = json.loads((run / "summary.json").read_text())
    for key in ("guided_accuracy", "solver_accuracy", "mean_turns", "mean_policy_tokens"):
        assert key in summary["before"] and key in summary["after"], key
