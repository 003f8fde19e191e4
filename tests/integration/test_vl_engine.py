"""The lead's `PolicyEngine` (AsyncLLM, weight receiver) serves a VL policy: an image prompt made by
`vision.vllm_prompt` samples through `engine.llm` (what `PolicyEngine.generate` will do once it
forwards `multi_modal_data`), and learner-named tensors of a perturbed tiny Qwen2-VL (transformers
5 in-memory names `model.language_model.*` / `model.visual.*`, vision tower included) loaded with
`load_named_tensors` make vLLM's log-probs equal the perturbed model's recompute by
`asyncrl.learner.multimodal`. One engine for the module; slow (~2-3 min on 2 busy cores).

Found here: after a weight load, vLLM 0.32's worker drops its encoder/mm caches
(`reload_weights`) but the scheduler's encoder-cache manager and the front end's mm processor
cache still list the image, so the next request with the same image dies with "Encoder cache
miss" (EngineDeadError). Resetting both (`AsyncLLM.reset_mm_cache()` + `reset_encoder_cache()`)
after the load fixes it and also guarantees no vision features computed by old weights are
reused; the test does exactly that, as the engine must."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest
import torch
from conftest import LoopThread

pytestmark = [pytest.mark.integration, pytest.mark.slow]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
TINY_VL = ROOT / "assets/tiny-vl-policy"


@pytest.fixture(scope="module", params=["extension", "native"])
def eng(request):
    from types import SimpleNamespace

    from transformers import AutoProcessor

    from asyncrl.actors.engine import EngineSpec, PolicyEngine
    from asyncrl.config import RolloutConfig
    from asyncrl.learner.multimodal import VLInputBuilder, load_vl_model

    torch.set_num_threads(1)
    proc = AutoProcessor.from_pretrained(TINY_VL)
    hf = load_vl_model(str(TINY_VL)).eval()
    cfg = RolloutConfig(cpu_kvcache_gb=1, max_num_seqs=8, max_num_batched_tokens=1024,
                        weight_transfer=request.param)  # both weight paths into vLLM
    lt = LoopThread()

    async def make():
        return PolicyEngine(EngineSpec(str(TINY_VL), cfg, engine_id="vl0", max_model_len=512, weight_timeout_s=30))

    engine = lt.run(make())
    yield SimpleNamespace(engine=engine, lt=lt, proc=proc, hf=hf, builder=VLInputBuilder(hf, proc))
    engine.shutdown()
    lt.loop.call_soon_threadsafe(lt.loop.stop)


def _sample(s, prompt_ids, images, seeds, bias):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from asyncrl.vision import vllm_prompt

    async def one(seed):
        params = SamplingParams(max_tokens=10, temperature=1.0, logprobs=0, seed=seed, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY, logit_bias=bias)
        prompt = dict(vllm_prompt(prompt_ids, images, s.hf.config.image_token_id), cache_salt=f"v{s.engine.version}")
        final = None
        async for out in s.engine.llm.generate(prompt, params, uuid.uuid4().hex):
            final = out
        c = final.outputs[0]
        return list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]

    async def go():
        return await asyncio.gather(*[one(x) for x in seeds])

    return s.lt.run(go())


def _max_diff(model, builder, prompt_ids, images, gens, bias) -> float:
    from asyncrl.learner.multimodal import vl_response_logprobs

    worst = 0.0
    for ids, lps in gens:
        ref = vl_response_logprobs(model, builder, prompt_ids, ids, images, logit_bias=bias)
        worst = max(worst, float((ref - torch.tensor(lps)).abs().max()))
    return worst


def test_vl_engine_samples_and_loads_learner_named_vl_weights(eng):
    import copy

    from PIL import Image, ImageDraw

    from asyncrl.learner.multimodal import VLInputBuilder
    from asyncrl.vision import PreparedImages, processor_prompt_ids, vision_logit_bias

    s = eng
    img = Image.new("RGB", (112, 56), (255, 255, 255))
    ImageDraw.Draw(img).text((6, 20), "6 * 7", fill=(0, 0, 0))
    prep = PreparedImages.from_images([img])
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compute it."}]}]
    prompt_ids = processor_prompt_ids(s.proc, msgs, prep.images)
    bias = vision_logit_bias(s.hf.config)
    gens = _sample(s, prompt_ids, prep.images, range(4), bias)
    d0 = _max_diff(s.hf, s.builder, prompt_ids, prep.images, gens, bias)
    new = copy.deepcopy(s.hf)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    names = [n for n, _ in new.named_parameters()]
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("model.language_model.") for n in names)
    res = s.lt.run(s.engine.load_named_tensors(list(new.named_parameters()), 1))
    assert res["status"] == "ok" and s.engine.version == 1

    async def reset_vision_caches():  # what PolicyEngine._paused must add for VL policies (see below)
        await s.engine.llm.reset_mm_cache()
        await s.engine.llm.reset_encoder_cache()

    s.lt.run(reset_vision_caches())
    gens2 = _sample(s, prompt_ids, prep.images, range(10, 14), bias)
    nb = VLInputBuilder(new, s.proc)
    d_new = _max_diff(new, nb, prompt_ids, prep.images, gens2, bias)
    d_old = _max_diff(s.hf, s.builder, prompt_ids, prep.images, gens2, bias)
    print(f"\nVL engine: max diff before update {d0:.2e}; after loading perturbed weights {d_new:.2e} "
          f"(vs the old weights {d_old:.2e})")
    assert d0 < 1e-4 and d_new < 1e-4 < d_old
