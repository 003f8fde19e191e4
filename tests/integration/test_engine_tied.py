"""Tied word embeddings survive a weight update on the REAL vLLM CPU build.

The CPU build repacks `lm_head` for its GEMM kernels at load time, so a reloaded
`embed_tokens` alone would leave the head on the old embedding (logprob error ~4 nats, seen
here). Proves: after broadcasting perturbed weights of a tied model (HF yields only
`model.embed_tokens.weight` for the shared matrix), vLLM's logprobs equal the perturbed model's,
with the head kept out of the layer-wise reload (vLLM's "Failed to load weights" warning for the
head, which receives nothing, is not logged) and the input embedding never packed for a GEMM.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from test_engine import LoopThread, build_tiny_qwen, hf_logprobs, perturbed

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PROMPT = [1, 4, 3, 10, 16, 14, 18, 2, 3, 1, 5, 3]


@pytest.mark.parametrize("weight_path", ["extension", "native"])
def test_tied_embeddings_reach_the_head_after_update(tmp_path, weight_path, capfd):
    from transformers import AutoModelForCausalLM

    from asyncrl.actors.engine import EngineSpec, PolicyEngine
    from asyncrl.config import RolloutConfig
    from asyncrl.weights.sender import WeightSender

    torch.set_num_threads(1)
    path = build_tiny_qwen(tmp_path / "tied", tie=True, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    names = [n for n, _ in hf.named_parameters()]
    assert "lm_head.weight" not in names  # the shared matrix is sent once, as embed_tokens
    lt = LoopThread()

    async def make():
        return PolicyEngine(EngineSpec(str(path), RolloutConfig(cpu_kvcache_gb=1, max_num_seqs=8,
                                                     weight_transfer=weight_path),
                            engine_id="tied", max_model_len=128, weight_timeout_s=30))

    engine = lt.run(make())
    try:
        new = perturbed(hf, 0.0, seed=0)
        with torch.no_grad():  # only the embedding moves: the head must follow it
            new.model.embed_tokens.weight.add_(torch.randn_like(new.model.embed_tokens.weight) * 0.5)
        sender = WeightSender(SimpleNamespace(bucket_mb=0.05, backend="gloo", timeout_s=30.0, host="127.0.0.1"),
                              members=engine.weight_member_ids())
        box = {}
        t = threading.Thread(target=lambda: box.update(r=sender.broadcast(new.named_parameters(), 1)))
        t.start()
        res = lt.run(engine.update_weights_from_group(sender.address))
        t.join(60)
        assert res["status"] == "ok" and engine.version == 1 and box["r"].acked == engine.weight_member_ids()
        assert "Failed to load weights" not in capfd.readouterr().err  # the engine core writes to our fd 2

        async def sample():
            return [await engine.generate(PROMPT, 16, 1.0, seed=i) for i in range(3)]

        # what a stale head would give: new embedding in, OLD embedding as the output matrix
        stale = perturbed(new, 0.0, seed=0)
        stale.lm_head.weight = torch.nn.Parameter(hf.model.embed_tokens.weight.detach().clone())
        worst = stale_gap = 0.0
        gens = lt.run(sample())
        for g in gens:
            lp = torch.tensor(g.logprobs)
            worst = max(worst, float((hf_logprobs(new, PROMPT, g.token_ids) - lp).abs().max()))
            stale_gap = max(stale_gap, float((hf_logprobs(stale, PROMPT, g.token_ids) - lp).abs().max()))
        print(f"\ntied embeddings: {sum(len(g.token_ids) for g in gens)} tokens, max |logprob diff| after "
              f"update {worst:.2e} (a stale head would differ by {stale_gap:.2f})")
        assert worst < 1e-4 < 0.1 < stale_gap
        sender.close()
    finally:
        engine.shutdown()
        lt.loop.call_soon_threadsafe(lt.loop.stop)
