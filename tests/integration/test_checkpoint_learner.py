"""Learner checkpoints:

- directory helpers: `begin`/`commit` are atomic (an uncommitted temporary directory is never listed,
  an incomplete one is refused), `save_limit` keeps the newest K only after the new one exists;
- 2 ranks, ZeRO-2 (sharded optimizer state), cosine LR with warmup, adaptive KL as a loss: save after
  step 2, train step 3; a fresh job that loads the checkpoint continues at version 2 and its step 3
  has the same loss, KL coefficient, LR and resulting parameters as the uninterrupted run;
- the HF export loads in transformers (weights equal the learner's) with its tokenizer, and (slow tier)
  in vLLM's CPU build with matching log-probs; trainer_state.json
  carries step, version, LR scheduler and KL controller; the lead's `fill` hook writes into the
  checkpoint before it is committed.
"""

from __future__ import annotations

import json
import uuid

import pytest

from asyncrl.bench.learner import build_tiny_qwen2, synthetic_groups
from asyncrl.config import load_config
from asyncrl.learner import checkpoint as ckpt


def test_atomic_commit_and_retention(tmp_path) -> None:
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        tmp = ckpt.begin(root, step)
        assert ckpt.latest_checkpoint(root) == (ckpt.step_dir(root, step - 1) if step > 1 else None)
        ckpt.write_json(tmp / ckpt.TRAINER_STATE, {"step": step})
        final = ckpt.commit(tmp, save_limit=2)
        assert final == ckpt.step_dir(root, step) and final.is_dir()
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 3]
    half = ckpt.begin(root, 4)  # a crashed save: never listed, refused by commit
    assert ckpt.latest_checkpoint(root) == ckpt.step_dir(root, 3)
    with pytest.raises(RuntimeError):
        ckpt.commit(half, save_limit=2)
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 3]
    with ckpt.atomic_checkpoint(root, 4, save_limit=2) as tmp:  # retried save removes the leftover
        ckpt.write_json(tmp / ckpt.TRAINER_STATE, {"step": 4})
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [3, 4]
    assert not any(p.name.startswith(".tmp") for p in root.iterdir())


ray = pytest.importorskip("ray")
import learner_probe as lp  # noqa: E402 - after the skip


@pytest.mark.integration
def test_resume_matches_uninterrupted_run(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.learner.group import LearnerGroup

    model_dir = str(build_tiny_qwen2(tmp_path / "policy"))
    cfg = load_config(None, [f"{k}={v}" for k, v in {
        "model.path": model_dir, "trainer.run_dir": str(tmp_path / "runs"), "trainer.experiment_name": "ck",
        "trainer.save_limit": 2, "trainer.max_steps": 6, "learner.cpu_ranks": 2, "learner.cpus_per_rank": 0.5,
        "learner.zero_stage": 2, "learner.micro_batch_tokens": 64, "learner.optim.lr": 1e-3,
        "learner.optim.lr_scheduler": "cosine", "learner.optim.warmup_steps": 2, "learner.kl.enable": True,
        "learner.kl.type": "adaptive", "learner.kl.coef": 0.05, "learner.kl.horizon": 10,
        "learner.off_policy.mode": "decoupled", "cluster.startup_timeout_s": 240, "learner.batch_timeout_s": 240,
    }.items()])
    batches = [synthetic_groups(3, 4, 99, (3, 9), (4, 16), seed=s) for s in range(5)]
    ray.init(num_cpus=4, include_dashboard=False, namespace=f"test-ckpt-{uuid.uuid4().hex[:8]}", log_to_driver=False)
    group = LearnerGroup(cfg)
    try:
        lp.step(group, batches[0])
        lp.step(group, batches[1])
        state2 = lp.export_state(group)

        def fill(tmp):
            (tmp / "data_cursor.json").write_text(json.dumps({"cursor": 7}))
            (tmp / "buffer" / "snapshot.bin").write_bytes(b"x")

        path2 = group.save_checkpoint(fill=fill)
        assert path2 == cfg.run_path / "checkpoints" / "step_2"
        m3 = lp.step(group, batches[2])
        state3 = lp.export_state(group)
        group.save_checkpoint()

        # what a checkpoint holds
        state = json.loads((path2 / "trainer_state.json").read_text())
        assert state["step"] == 2 and state["version"] == 2 and state["optimizer_steps"] == 2
        assert state["lr_scheduler"]["last_epoch"] == 2 and state["kl_controller"]["type"] == "adaptive"
        assert json.loads((path2 / "data_cursor.json").read_text()) == {"cursor": 7}
        assert (path2 / "buffer" / "snapshot.bin").is_file() and (path2 / "rng" / "rank_1.json").is_file()
        hf = AutoModelForCausalLM.from_pretrained(path2 / "hf")
        assert AutoTokenizer.from_pretrained(path2 / "hf").pad_token == "<|endoftext|>"
        loaded = hf.state_dict()
        assert max(float((loaded[k] - state2[k]).abs().max()) for k in state2) == 0.0

        # a fresh job (initial weights) resumed from step 2 reproduces step 3
        lp.reconfigure(group, cfg)
        assert group.load_checkpoint(path2) == 2
        r3 = lp.step(group, batches[2])
        assert r3["train/version"] == 3.0
        for key in ("loss/total", "loss/pg", "loss/kl", "train/kl_coef", "train/lr", "train/grad_norm"):
            assert r3[key] == pytest.approx(m3[key], rel=1e-6, abs=1e-9), key
        assert m3["train/kl_coef"] != pytest.approx(0.05, rel=1e-9)  # the adaptive state really moved
        after = lp.export_state(group)
        assert max(float((after[k] - state3[k]).abs().max()) for k in state3) < 1e-7

        # re-saving an existing step replaces it; retention keeps the newest two after the new one exists
        group.save_checkpoint()
        lp.step(group, batches[3])
        group.save_checkpoint()
        assert [s for s, _ in ckpt.list_checkpoints(path2.parent)] == [3, 4]
    finally:
        group.shutdown()
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.integration
def test_hf_export_loads_in_vllm(tmp_path, monkeypatch) -> None:
    """The checkpoint's hf/ directory serves in vLLM's CPU build with the learner's weights: vLLM's
    prompt log-probs equal transformers' on the same export (fp32)."""
    pytest.importorskip("vllm")
    import socket

    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.learner import LearnerWorker

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = load_config(None, [f"model.path={build_tiny_qwen2(tmp_path / 'policy')}", "learner.optim.lr=1e-2",
                             f"trainer.run_dir={tmp_path}"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = LearnerWorker(cfg, 0, 1, "127.0.0.1", port)  # in-process rank (this test runs alone: slow tier)
    worker.train_step(synthetic_groups(2, 4, worker.vocab_size, (3, 9), (4, 16), seed=0))
    with ckpt.atomic_checkpoint(tmp_path / "checkpoints", worker.version) as tmp:
        worker.save_checkpoint(tmp)
    hf = str(tmp_path / "checkpoints" / "step_1" / "hf")
    ids = [1, 4, 13, 5, 17, 20, 2, 1, 30, 31, 32, 33]
    with torch.no_grad():
        lp = torch.log_softmax(AutoModelForCausalLM.from_pretrained(hf)(torch.tensor([ids])).logits[0].float(), -1)
    expected = [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    from vllm import LLM, SamplingParams

    llm = LLM(model=hf, dtype="float32", enforce_eager=True, max_model_len=256,
              kv_cache_memory_bytes=256 << 20)  # else vLLM's CPU worker wants 92 % of memory free
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))
    got = [out[0].prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(expected, got)) < 1e-4
