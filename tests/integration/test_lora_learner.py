"""The LoRA learner on real DeepSpeed (CPU, in process) and real PEFT.

Proves:
- PEFT is applied before `deepspeed.initialize`: the optimizer holds exactly the lora_A/lora_B
  matrices, the base weights never change, and with `kl.enable` there is no reference replica:
  the reference log-probs (adapter disabled) equal the untouched base model's; the learner state
  it saves against full fine-tuning with a replica is measured (params + grads + Adam states +
  reference, summed over the real tensors after one step);
- exports: the adapter under PEFT's saved names with PEFT's values; the merged export loads into
  plain transformers under the base model's names and reproduces the PEFT model's log-probs;
- a checkpoint resumes the adapter exactly: save after step 2, train step 3; a fresh learner that
  loads the checkpoint trains the same step 3 to bit-identical adapter weights, optimizer included;
  the checkpoint's adapter/ loads with `PeftModel.from_pretrained`, its hf/ is the merged model, and
  `python -m asyncrl.export RUN_DIR [--merge]` writes the adapter or a merged HF model (exit 2
  without a run);
- under ZeRO-3 both exports gather the partitioned parameters (full-shape adapter, merged export
  equal to the learner's forward);
- an architecture vLLM cannot serve with LoRA (GPT-2) falls back to merged full weights with one
  warning, and the merged weights load into vLLM's CPU engine through the full-weight path with
  the learner's log-probs (slow tier).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import pytest
import torch

from asyncrl.bench.learner import build_tiny_qwen2, synthetic_groups
from asyncrl.config import load_config
from asyncrl.learner import checkpoint as ckpt

pytestmark = pytest.mark.integration
IDS = [1, 4, 13, 5, 17, 20, 2, 1, 30, 31, 32, 33]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(cfg):
    from asyncrl.learner.learner import LearnerWorker

    torch.set_num_threads(1)
    return LearnerWorker(cfg, 0, 1, "127.0.0.1", _free_port())


def _cfg(tmp_path: Path, model: str, *extra: str):
    return load_config(None, [f"model.path={model}", "model.lora.enable=true", "model.lora.rank=8",
                              "model.lora.alpha=16", "learner.optim.lr=0.02", f"trainer.run_dir={tmp_path}",
                              "learner.kl.enable=true", "learner.kl.coef=0.1", *extra])


def _logprobs(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _state_bytes(worker) -> dict[str, int]:
    """Bytes of the learner state held in real tensors after a step."""
    module, opt = worker.engine.module, worker.engine.optimizer
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None)
    inner = getattr(opt, "optimizer", opt)
    adam = sum(t.numel() * t.element_size() for st in inner.state.values() for t in st.values()
               if torch.is_tensor(t))
    ref = sum(p.numel() * p.element_size() for p in worker.ref_model.parameters()) if worker.ref_model else 0
    return {"params": params, "grads": grads, "adam": adam, "reference": ref}


@pytest.mark.slow  # 8-105 s here (two learners; DeepSpeed's first build)
def test_adapter_only_training_reference_and_exports(tmp_path, caplog):
    from peft import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    path = str(build_tiny_qwen2(tmp_path / "policy"))
    base = AutoModelForCausalLM.from_pretrained(path).eval()
    worker = _worker(_cfg(tmp_path, path))
    module = worker.engine.module
    trainable = [p for n, p in module.named_parameters() if p.requires_grad]
    assert all(".lora_" in n for n, p in module.named_parameters() if p.requires_grad)
    assert len(trainable) == 2 * 7 * 2  # A and B x 7 projections x 2 layers
    # ZeRO-1 flattens what it optimizes: its flat groups hold exactly the adapter's elements
    in_optimizer = sum(p.numel() for g in worker.engine.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(p.numel() for p in trainable)
    assert worker.ref_model is None and worker.sync_kind == "adapter"
    for step in range(2):
        metrics = worker.train_step(synthetic_groups(3, 4, worker.vocab_size, (3, 9), (4, 16), seed=step))
    assert metrics["loss/kl"] > 0  # the adapter moved the policy away from the (adapter-off) reference
    with module.disable_adapter():
        assert torch.equal(_logprobs(module.eval()), _logprobs(base))  # the reference is the base model
    for name, p in module.named_parameters():
        if ".base_layer." in name:  # frozen: identical to the checkpoint on disk
            hf = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(p, base.get_parameter(hf)), name

    [adapter] = list(worker.export_adapter_tensors())
    expected = get_peft_model_state_dict(module)
    assert sorted(n for n, _ in adapter) == sorted(expected)
    assert all(torch.equal(t, expected[n]) for n, t in adapter)
    merged = {n: t.clone() for bucket in worker.export_named_tensors(1 << 16) for n, t in bucket}
    assert sorted(merged) == sorted(base.state_dict())  # the base model's HF names, nothing else
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    plain.load_state_dict(merged)
    diff = float((_logprobs(plain) - _logprobs(module.eval())).abs().max())
    assert diff < 1e-5, diff

    lora_state = _state_bytes(worker)
    worker.close()
    full = _worker(load_config(None, [f"model.path={path}", "learner.optim.lr=0.02", f"trainer.run_dir={tmp_path}",
                                      "learner.kl.enable=true"]))
    full.train_step(synthetic_groups(3, 4, full.vocab_size, (3, 9), (4, 16), seed=0))
    full_state = _state_bytes(full)
    full.close()
    lora_total, full_total = sum(lora_state.values()), sum(full_state.values())
    print(f"\nlearner state after a step, LoRA r=8 {lora_state} = {lora_total / 1e6:.2f} MB vs full fine-tuning "
          f"{full_state} = {full_total / 1e6:.2f} MB ({full_total / lora_total:.2f}x)")
    assert lora_state["reference"] == 0 and full_state["reference"] == full_state["params"]
    # Adam keeps two fp32 moments per OPTIMIZED element (+ a step counter): the adapter's vs all
    adapter_numel = sum(p.numel() for p in trainable)
    assert 8 * adapter_numel <= lora_state["adam"] <= 8 * adapter_numel + 64
    assert full_state["adam"] >= 8 * full_state["params"] // 4


def test_checkpoint_resumes_the_adapter_exactly(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = str(build_tiny_qwen2(tmp_path / "policy"))
    cfg = _cfg(tmp_path, path, "learner.optim.lr_scheduler=cosine", "learner.optim.warmup_steps=2",
               "trainer.max_steps=6")
    batches = [synthetic_groups(3, 4, 99, (3, 9), (4, 16), seed=s) for s in range(3)]
    worker = _worker(cfg)
    worker.train_step(batches[0])
    worker.train_step(batches[1])
    with ckpt.atomic_checkpoint(tmp_path / "checkpoints", worker.version) as tmp:
        worker.save_checkpoint(tmp)
    m3 = worker.train_step(batches[2])
    [after3] = list(worker.export_adapter_tensors())
    worker.close()

    saved = tmp_path / "checkpoints" / "step_2"
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), str(saved / ckpt.ADAPTER_DIR))
    merged = AutoModelForCausalLM.from_pretrained(str(saved / "hf"))  # hf/ is the merged model
    expected = _logprobs(peft_model.eval())
    assert float((expected - _logprobs(merged.eval())).abs().max()) < 1e-5
    _check_export(tmp_path, cfg, expected)

    resumed = _worker(cfg)
    resumed.load_checkpoint(saved)
    assert resumed.version == 2
    r3 = resumed.train_step(batches[2])
    [again3] = list(resumed.export_adapter_tensors())
    resumed.close()
    assert r3["train/lr"] == m3["train/lr"] and r3["loss/kl"] == m3["loss/kl"]
    assert [n for n, _ in again3] == [n for n, _ in after3]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(again3, after3))  # bit-identical: Adam state restored


def _check_export(run_dir: Path, cfg, expected: torch.Tensor) -> None:
    """`python -m asyncrl.export RUN_DIR [--merge]` on the run: the adapter alone, or the merged
    model that plain transformers loads with the PEFT model's log-probs; exit 2 without a run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.export import main

    (run_dir / "config.resolved.json").write_text(cfg.to_json())
    assert main([str(run_dir)]) == 0
    assert sorted(p.name for p in (run_dir / "export" / "adapter").iterdir()) == \
        ["adapter_config.json", "adapter_model.safetensors"]
    assert main([str(run_dir), "--merge"]) == 0
    merged_dir = run_dir / "export" / "merged"
    assert float((_logprobs(AutoModelForCausalLM.from_pretrained(merged_dir).eval()) - expected).abs().max()) < 1e-5
    assert AutoTokenizer.from_pretrained(merged_dir).pad_token == "<|endoftext|>"
    assert main([str(run_dir / "nowhere"), "--merge"]) == 2


def _tiny_gpt2(path: Path) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    tok_dir = build_tiny_qwen2(path)  # a tokenizer (and a throw-away Qwen2 overwritten below)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=256, n_embd=64, n_layer=2, n_head=2,
                               bos_token_id=1, eos_token_id=2)).save_pretrained(tok_dir)
    return str(tok_dir)


@pytest.mark.slow
def test_architecture_vllm_cannot_serve_with_lora_falls_back_to_merged(tmp_path, caplog, monkeypatch):
    from asyncrl.weights.adapter import sync_kind

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    path = _tiny_gpt2(tmp_path / "gpt2")
    cfg = _cfg(tmp_path, path, "model.lora.target_modules=[c_attn,c_proj]", "learner.kl.enable=false")
    with caplog.at_level(logging.WARNING, logger="asyncrl.weights.adapter"):
        worker = _worker(cfg)
        assert sync_kind(cfg, warn=True) == "merged"
    warned = [r for r in caplog.records if "cannot serve" in r.getMessage()]
    assert len(warned) == 1 and "GPT2LMHeadModel" in warned[0].getMessage()  # one warning per process
    for step in range(2):
        worker.train_step(synthetic_groups(3, 4, worker.vocab_size, (3, 9), (4, 16), seed=step))
    weights = [(n, t.clone()) for bucket in worker.export_sync_tensors() for n, t in bucket]
    policy = worker.engine.module.eval()
    with policy.disable_adapter():
        base_lp = _logprobs(policy)
    assert float((base_lp - _logprobs(policy)).abs().max()) > 1e-3  # the adapter matters
    from test_engine import LoopThread, hf_logprobs

    from asyncrl.actors.engine import EngineSpec, PolicyEngine
    from asyncrl.config import RolloutConfig

    assert EngineSpec.from_job(cfg, "job").lora_adapter is None  # the engine is a plain full-weight engine
    lt = LoopThread()
    engine = lt.run(_make_engine(PolicyEngine, path, RolloutConfig(cpu_kvcache_gb=1, max_num_seqs=8)))
    try:
        res = lt.run(engine.load_named_tensors(weights, 2))  # the full-weight path, as a sync would
        assert res["status"] == "ok" and engine.version == 2
        gens = lt.run(_sample(engine, 4))
    finally:
        engine.shutdown()
        lt.loop.call_soon_threadsafe(lt.loop.stop)
    diff = max(float((hf_logprobs(policy, IDS, g.token_ids) - torch.tensor(g.logprobs)).abs().max()) for g in gens)
    print(f"\nGPT-2 LoRA, merged full-weight sync into vLLM: max logprob diff {diff:.2e}")
    assert diff < 1e-4


async def _sample(engine, n: int):
    return await asyncio.gather(*[engine.generate(IDS, 16, 1.0, seed=s) for s in range(n)])


async def _make_engine(cls, path: str, rollout):
    from asyncrl.actors.engine import EngineSpec

    return cls(EngineSpec(path, rollout, engine_id="gpt2-eng", max_model_len=128, weight_timeout_s=30))


def test_zero3_gathers_the_adapter_and_the_merged_export(tmp_path):
    """ZeRO-3 (one rank): parameters are partitioned, so both exports must gather; the adapter
    comes out at full shape and the merged export reproduces the learner's own forward."""
    from transformers import AutoModelForCausalLM

    path = str(build_tiny_qwen2(tmp_path / "policy"))
    worker = _worker(_cfg(tmp_path, path, "learner.zero_stage=3"))
    worker.train_step(synthetic_groups(3, 4, worker.vocab_size, (3, 9), (4, 16), seed=0))
    module = worker.engine.module
    assert all(p.numel() == 0 for n, p in module.named_parameters() if ".lora_" in n)  # partitioned away
    [adapter] = list(worker.export_adapter_tensors())
    assert len(adapter) == 2 * 7 * 2 and all(t.numel() > 0 for _, t in adapter)
    assert any(float(t.abs().sum()) > 0 for n, t in adapter if ".lora_B." in n)  # trained, not the zero init
    merged = {n: t.clone() for bucket in worker.export_named_tensors(1 << 16) for n, t in bucket}
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    plain.load_state_dict(merged)
    learner_lp = _logprobs(module.eval())
    worker.close()
    assert float((_logprobs(plain) - learner_lp).abs().max()) < 1e-5
