"""Qwen3.5 in the REAL vLLM CPU build (slow: one engine start per case, minutes on 2 busy cores).

vLLM 0.32's CPU build runs Gated DeltaNet layers with its own kernels (`cpu_gdn_attention_core`,
`causal_conv1d_*_cpu`), which take bf16 only ("CPU GDN attention requires BF16."), so the engine runs
in bfloat16 while transformers computes the reference in float32: logprobs agree to bf16 precision,
not to 1e-6 as for fp32 models. Proves, for each weight path (`extension`, `native`): the engine
generates from the tiny text checkpoint, dense and MoE (`--moe`: 4 routed experts, top 2, + a
shared expert; its logprobs equal transformers' to bf16 precision); after a weight broadcast of
perturbed weights the dense engine's logprobs follow the new weights (closer to the perturbed model
than to the old one by a wide margin); the MoE engine does not (the trainer's fused experts sent under
the checkpoint's per-expert names): a strict xfail naming the vLLM CPU kernel, so the record flips
when vLLM fixes it.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_engine import LoopThread, hf_logprobs, perturbed

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _build(out: Path, moe: bool = False) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_qwen3_5", ROOT / "scripts" / "make_tiny_qwen3_5.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.build(out, vl=False, seed=0, moe=moe)
    return out


MOE_CPU_RELOAD = ("vLLM 0.32 CPU build: after an in-place reload of expert weights its MoE kernel (prepacked weights, "
                  "vllm/model_executor/layers/fused_moe/experts/cpu_moe.py:208) follows neither the old nor the sent "
                  "experts (0.89 nats to the sent model, 0.77 to the old); asyncrl refuses MoE + CPU engines "
                  "(refuse_cpu_moe_sync). Flips to a pass when vLLM's CPU reload handles experts.")


@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=pytest.mark.xfail(reason=MOE_CPU_RELOAD,
                                                                                          strict=True))])
@pytest.mark.parametrize("weight_path", ["extension", "native"])
def test_engine_follows_a_weight_update(tmp_path: Path, weight_path: str, kind: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.actors.engine import EngineSpec, PolicyEngine
    from asyncrl.config import RolloutConfig
    from asyncrl.learner.export import split_fused_experts
    from asyncrl.weights.sender import WeightSender

    torch.set_num_threads(1)
    path = _build(tmp_path / "qwen3_5", moe=kind == "moe")
    tok = AutoTokenizer.from_pretrained(path)
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "Compute 2 + 3."}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lt = LoopThread()

    async def make():
        # prefix caching off: on a hybrid model vLLM caches prefixes in mamba mode `align`, which needs
        # chunked prefill, which asyncrl turns off on CPU (seeded requests)
        cfg = RolloutConfig(cpu_kvcache_gb=0.25, max_num_seqs=8, dtype="bfloat16", enable_prefix_caching=False,
                            weight_transfer=weight_path)
        return PolicyEngine(EngineSpec(str(path), cfg,
                            engine_id="q35", max_model_len=128, weight_timeout_s=60))

    engine = lt.run(make())
    try:
        async def sample():
            return [await engine.generate(prompt, 12, 1.0, seed=i) for i in range(3)]

        def gap(model, gens) -> float:
            return max(float((hf_logprobs(model, prompt, g.token_ids) - torch.tensor(g.logprobs)).abs().max())
                       for g in gens)

        before = lt.run(sample())
        assert all(len(g.token_ids) > 0 for g in before)
        base_err = gap(hf, before)
        new = perturbed(hf, 0.05, seed=1)
        sender = WeightSender(SimpleNamespace(bucket_mb=0.05, backend="gloo", timeout_s=60.0, host="127.0.0.1"),
                              members=engine.weight_member_ids())
        box: dict = {}
        # sent in the engine's dtype, as a bf16 learner sends them (the receiver checks a fingerprint of
        # the loaded values against the sent ones, so an fp32 broadcast into a bf16 engine is refused)
        # MoE: the fused experts under the checkpoint's per-expert names, as the learner's export sends them
        sent = split_fused_experts([(n, p.detach().to(torch.bfloat16)) for n, p in new.named_parameters()])
        t = threading.Thread(target=lambda: box.update(r=sender.broadcast(sent, 1)))
        t.start()
        res = lt.run(engine.update_weights_from_group(sender.address))
        t.join(60)
        assert res["status"] == "ok" and engine.version == 1
        after = lt.run(sample())
        new_err, old_err = gap(new, after), gap(hf, after)
        print(f"\nqwen3.5 {kind} {weight_path}: bf16 engine vs fp32 transformers, max |logprob diff| before update "
              f"{base_err:.3f}, after update vs new weights {new_err:.3f}, vs old weights {old_err:.3f}")
        assert base_err < 0.1 and new_err < 0.1 and old_err > 3 * new_err
        sender.close()
    finally:
        engine.shutdown()
        lt.loop.call_soon_threadsafe(lt.loop.stop)
