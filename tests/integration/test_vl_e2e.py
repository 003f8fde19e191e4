"""The VL quick start end to end through `python -m asyncrl.launch -c configs/quickstart_vl.yaml`:
real Ray, the Ray Serve rule verifier for `arith_vl`, a vLLM CPU engine serving the tiny random
Qwen2-VL with `multi_modal_data`, the ZeroMQ buffer (groups carry their PNG images once), the
DeepSpeed learner with the VL forward (processor features + mRoPE position ids + the sampler's
placeholder logit bias) and the gloo weight sync into the VL engine.

Proves: a VL policy trains through the whole system (rc 0, one metrics row per step, images on the
wire, non-zero gradients whenever a group has a reward spread), and -- the key check -- in a synchronous run (max_staleness=0, lr 1e-3,
so steps 2 and 3 train on tokens sampled AFTER one and two weight syncs of real updates) the VL
engine's behaviour log-probs equal the learner's VL recomputation: `train/mismatch_kl` ~ 0 and
importance weights ~ 1. Wrong mRoPE positions, a missing logit bias, stale encoder caches or a
failed weight load into the VL engine would each show up here as a large mismatch.
Slow tier (~4-6 min on 2 shared CPU cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "assets" / "tiny-vl-policy"
pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="tiny VL policy not built")]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
                "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"})
    return env


def test_vl_quickstart_synchronous_run_trains_and_logprobs_match(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "asyncrl.launch", "-c", "configs/quickstart_vl.yaml", f"trainer.run_dir={tmp_path}",
           "trainer.experiment_name=vl_sync", "trainer.max_steps=3", "buffer.max_staleness=0",
           "verifier.port=0", "trainer.logger=[jsonl]", "learner.weights.timeout_s=30", "learner.optim.lr=1e-3",
           "trainer.eval_limit=2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "vl_sync"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/mismatch_kl" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["buffer/staleness_max"] == 0
        # behaviour (vLLM VL engine, after r["step"]-1 weight syncs) vs learner VL recompute
        assert r["train/mismatch_kl"] < 1e-6, (r["step"], r["train/mismatch_kl"])
        assert abs(r["train/is_weight_mean"] - 1.0) < 1e-3, (r["step"], r["train/is_weight_mean"])
        assert r["train/num_samples"] == 8  # 2 prompts x n=4, every group pushed with its images
        assert r["perf/trained_tokens"] > 0
        if r["train/advantage_abs_mean"] > 0:  # some reward spread in a group -> a real update
            assert r["train/grad_norm"] > 0, r["step"]
    assert (run / "summary.json").exists()
    print("\n[vl e2e] mismatch_kl per step:", [f"{r['train/mismatch_kl']:.2e}" for r in steps],
          "is_weight_mean:", [f"{r['train/is_weight_mean']:.6f}" for r in steps],
          "reward_mean:", [r["train/reward_mean"] for r in steps])
