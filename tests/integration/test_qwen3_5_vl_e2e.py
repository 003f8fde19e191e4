"""A tiny random Qwen3.5 VISION-LANGUAGE policy (`Qwen3_5ForConditionalGeneration`: 3 Gated DeltaNet + 1
attention layer, a 2-block vision tower; scripts/make_tiny_qwen3_5.py --vl) trained end to end through
`python -m asyncrl.launch -c configs/qwen3_5_vl_tiny.yaml` on `arith_vl` (the expression drawn in a figure):
real Ray, the rule verifier behind Serve, vLLM's CPU build serving the checkpoint with the figure as
multimodal data (its Qwen3-VL processor and mRoPE), the DeepSpeed CPU learner with the VL forward
(processor features + Qwen3.5's `get_rope_index` positions + the placeholder logit bias), the vision tower
trained too, and the gloo weight sync of every weight (language model and vision tower) into the VL engine.

Proves, for each weight path (extension, native): 2 learner steps train (8 samples each, a nonzero
gradient), every sync's read-back matches, and in this synchronous run (max_staleness 0) the VL engine's
behaviour log-probs equal the learner's VL recomputation after each sync (mismatch KL < 1e-3; wrong mRoPE
positions, a missing logit bias or a weight that did not reach the engine would each show as a large one).
Slow (one launch per weight path, minutes on 2 cores): -m slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_qwen3_5", ROOT / "scripts" / "make_tiny_qwen3_5.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("qwen3_5") / "vl"
    mod.build(out, vl=True, seed=0)
    return out


@pytest.mark.parametrize("weight_path", ["extension", "native"])
def test_vl_policy_trains_two_steps(policy: Path, tmp_path: Path, weight_path: str) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "asyncrl.launch", "-c", "configs/qwen3_5_vl_tiny.yaml", f"model.path={policy}",
           f"trainer.run_dir={tmp_path}", "trainer.experiment_name=q35vl", f"rollout.weight_transfer={weight_path}",
           "trainer.logger=[jsonl]", "learner.weights.timeout_s=60"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "q35vl" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/mismatch_kl" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/num_samples"] == 8 and r["weights/fingerprint_mismatch"] == 0, r
        assert r["train/grad_norm"] > 0 and r["buffer/staleness_max"] == 0, r
        assert r["train/mismatch_kl"] < 1e-3, r  # bf16 engine vs bf16 learner on the same weights
    print(f"\nqwen3.5 VL {weight_path}: mismatch_kl per step",
          [f"{r['train/mismatch_kl']:.2e}" for r in rows], "grad_norm", [f"{r['train/grad_norm']:.2e}" for r in rows])
