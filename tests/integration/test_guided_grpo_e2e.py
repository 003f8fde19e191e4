"""One Guided-GRPO recipe end to end on CPU, launched as its user would: the original's
`examples/config.yaml` with `python -m asyncrl.launch config=...` and only overrides, in the
original's namespace (the quick start's model and a 24-row slice of its data substituted, 1 epoch)
and asyncrl's own keys for the CPU roles (a GPU recipe never gets a CPU learner on its own).

Proves, on the real topology (Ray, a vLLM CPU engine, the ZeroMQ buffer, a DeepSpeed CPU learner):
the step count is derived from the epoch once the rows are loaded and printed (24 rows // batch 8 =
3 steps), the recipe's global_batch_size becomes 2 optimizer steps per learner step, the original's
own reward file (examples/reward_function/math.py) scores every step with its keys, and the KL of
the recipe (low_var_kl as a loss, 1e-2) is on. Slow: ~2 minutes here, mostly engine and learner
start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "tests" / "fixtures" / "guided_grpo"
POLICY = ROOT / "assets" / "tiny-policy"
pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="quick-start policy not built")]


def test_original_recipe_trains_on_cpu_by_epochs(tmp_path: Path) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text("".join((ROOT / "assets/arith/train.jsonl").read_text().splitlines(keepends=True)[:24]))
    original = [  # the original's keys: what a Guided-GRPO user changes to try the quick start's data
        "config=examples/config.yaml", f"worker.actor.model.model_path={POLICY}", f"data.train_files={train}",
        f"data.val_files={ROOT / 'assets/arith/val.jsonl'}", "data.format_prompt=null", "data.max_prompt_length=256",
        "data.max_response_length=64", "data.rollout_batch_size=8", "worker.actor.global_batch_size=4",
        "worker.rollout.n=4", "worker.rollout.tensor_parallel_size=1", "trainer.total_epochs=1",
        "trainer.val_before_train=false", "trainer.val_freq=-1", "trainer.logger=[console,file]",
        "trainer.save_freq=-1", "trainer.experiment_name=gg_e2e", f"trainer.save_checkpoint_path={tmp_path}"]
    cpu = [  # asyncrl's keys: the roles of a CPU machine
        "learner.num_gpus=0", "rollout.num_actors=1", "rollout.gpus_per_actor=0", "learner.zero_stage=1",
        "rollout.cpus_per_actor=0.5", "learner.cpus_per_rank=0.5", "rollout.max_num_batched_tokens=2048",
        "learner.weights.timeout_s=30", "model.gradient_checkpointing=false", "rollout.groups_in_flight=4"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RAY_USAGE_STATS_ENABLED="0",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "asyncrl.launch", *original, *cpu], cwd=RECIPES, env=env,
                          capture_output=True, text=True, timeout=900)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]
    # 24 rows (none over 256 tokens) // rollout_batch_size 8 = 3 steps per epoch; 1 epoch
    assert "trainer.max_steps = 1 epochs x 3 steps = 3 steps (24 training rows // data.rollout_batch_size 8)" in console
    assert "[asyncrl] step 3/3" in console
    run = tmp_path / "gg_e2e"  # trainer.save_checkpoint_path / experiment_name
    cfg = json.loads((run / "config.resolved.json").read_text())
    assert cfg["trainer"]["max_steps"] == 3 and cfg["learner"]["mini_batches"] == 2
    assert (cfg["learner"]["kl"]["enable"], cfg["learner"]["kl"]["mode"], cfg["learner"]["kl"]["estimator"]) == \
        (True, "loss", "k3")
    assert cfg["reward"]["function"].endswith("examples/reward_function/math.py:compute_score")
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    trained = [m for m in steps if "train/optimizer_steps" in m]
    assert [m["step"] for m in trained] == [1, 2, 3]
    for m in trained:
        # cumulative: 2 optimizer steps per learner step (rollout_batch_size 8 / global_batch_size 4)
        assert m["train/optimizer_steps"] == 2 * m["step"]
        # math.py's keys, each a mean of 0/1 scores; overall = 0.9 accuracy + 0.1 format
        assert 0 <= m["reward/accuracy"] <= 1 and 0 <= m["reward/format"] <= 1
        assert m["reward/overall"] == pytest.approx(0.9 * m["reward/accuracy"] + 0.1 * m["reward/format"])
