"""VL behaviour log-probs from vLLM (CPU build, fp32) == the learner's recompute with
`asyncrl.learner.multimodal` (pixel_values, image_grid_thw, 4-row mRoPE position ids), for a
tiny random Qwen2-VL (and Qwen2.5-VL, Qwen3-VL: slow) -- the test that catches wrong position ids.

A real 2-turn guided conversation is driven by the asyncrl protocol (`Conversation`,
`PolicyChat(processor)`, history=full): the prompt has TWO images of different sizes, the
processor-expanded prompt ids are kept for bookkeeping, vLLM is given the collapsed ids + the
PIL images every turn (`vision.vllm_prompt`), the verifier answers with guidance, the policy
answers again. Then `build_training_sample` gives the final_turn sample (last prompt + last
turn) and the full_turn sample (first prompt + turn 1 + user turn + turn 2), and for both the
transformers log-probs at mask-1 positions must equal vLLM's. Negative control: the same
recompute with plain 1-D positions (the multi-turn position bug of Guided-GRPO's recompute) is far off.
Sampling bias (identical in vLLM and the recompute): placeholders -100 (never sampled, as the
original), `<|im_end|>` +4.5 so a random model ends its turns within a few tokens.
One vLLM engine per architecture for the module.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
ROOT = Path(__file__).resolve().parents[2]
MODELS = {"qwen2_vl": ROOT / "assets/tiny-vl-policy", "qwen2_5_vl": ROOT / "assets/tiny-vl-policy-2_5",
          "qwen3_vl": ROOT / "assets/tiny-vl-policy-3"}
GUIDANCE = "Check the second number in the figure again."


def _figure(text: str, size: tuple[int, int]):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (255, 255, 255))
    ImageDraw.Draw(img).text((4, size[1] // 3), text, fill=(0, 0, 0))
    return img


@pytest.fixture(scope="module", params=["qwen2_vl", pytest.param("qwen2_5_vl", marks=pytest.mark.slow),
                                        pytest.param("qwen3_vl", marks=pytest.mark.slow)])
def vl(request):
    from types import SimpleNamespace

    from transformers import AutoProcessor
    from vllm import LLM

    from asyncrl.learner.multimodal import VLInputBuilder, load_vl_model
    from asyncrl.vision import vision_logit_bias

    torch.set_num_threads(1)
    path = MODELS[request.param]
    processor = AutoProcessor.from_pretrained(path)
    model = load_vl_model(str(path)).eval()
    bias = vision_logit_bias(model.config)
    bias[processor.tokenizer.convert_tokens_to_ids("<|im_end|>")] = 4.5
    # kv_cache_memory_bytes: without it vLLM's CPU worker asks for 92 % of the machine's memory free
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0, kv_cache_memory_bytes=256 << 20,
              limit_mm_per_prompt={"image": 2, "video": 0}, logprobs_mode="processed_logprobs",
              max_num_batched_tokens=2048, max_num_seqs=4, disable_log_stats=True)
    yield SimpleNamespace(arch=request.param, llm=llm, processor=processor, model=model,
                          builder=VLInputBuilder(model, processor), bias=bias)
    shutdown = getattr(llm, "shutdown", None)
    if shutdown is not None:
        shutdown()
    del llm


def _conversation(vl):
    """Run a 2-turn guided conversation on vLLM; returns (conversation, images)."""
    from vllm import SamplingParams

    from asyncrl.actors.guided import Conversation, GuideOptions, PolicyChat, run_conversation
    from asyncrl.vision import prepare_images, processor_prompt_ids, vllm_prompt

    raw = [_figure("3 + 4", (112, 56)), _figure("x 5", (56, 84))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compute it:"},
                                             {"type": "image"}, {"type": "text", "text": "Answer?"}]}]
    messages, prep = prepare_images(messages, raw, None, limit_images=0)
    prompt_ids = processor_prompt_ids(vl.processor, messages, prep.images)
    image_id = vl.model.config.image_token_id
    assert prompt_ids.count(image_id) > 2  # expanded: several tokens per image

    async def generate(ids, seed):
        params = SamplingParams(max_tokens=16, temperature=1.0, logprobs=0, seed=seed, detokenize=False,
                                logit_bias=vl.bias)
        out = vl.llm.generate([vllm_prompt(ids, prep.images, image_id)], params, use_tqdm=False)[0]
        assert list(out.prompt_token_ids) == list(ids)  # vLLM expanded the images exactly as the processor
        c = out.outputs[0]
        lps = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
        return list(c.token_ids), lps, 0, str(c.finish_reason)

    async def verify(_messages):
        return {"ok": True, "text": GUIDANCE, "version": "test"}

    opts = GuideOptions(max_turns=2, enable_hallucination_score=False, history="full", max_prompt_length=900)
    chat = PolicyChat(vl.processor)
    for seed in range(1, 40):  # a seed whose first turn ends with <|im_end|> (p ~ 0.98 per seed)
        conv = Conversation(messages, chat=chat, options=opts, prompt_ids=prompt_ids, seed=seed)
        asyncio.run(run_conversation(conv, generate, verify))
        if conv.num_turns == 2:
            return conv, prep
    pytest.fail("no seed gave a 2-turn conversation")


@pytest.fixture(scope="module")
def conv(vl):
    return _conversation(vl)


def _diffs(vl, ts, images, one_d: bool = False) -> float:
    from asyncrl.learner.multimodal import masked_logprobs, vl_response_logprobs

    mask = torch.as_tensor(ts.response_mask).bool()
    behaviour = torch.as_tensor(ts.behaviour_logprobs)
    if not one_d:
        lp = vl_response_logprobs(vl.model, vl.builder, ts.prompt_ids.tolist(), ts.response_ids.tolist(), images,
                                  logit_bias=vl.bias)
    else:  # Guided-GRPO's multi-turn path: 1-D positions broadcast to the mRoPE rows
        ids = torch.tensor([ts.prompt_ids.tolist() + ts.response_ids.tolist()])
        attn = torch.ones_like(ids)
        extra = vl.builder.forward_kwargs(ids, attn, [images])
        extra["position_ids"] = torch.arange(ids.shape[1]).unsqueeze(0)
        t = len(ts.response_ids)
        with torch.no_grad():
            out = vl.model(input_ids=ids, attention_mask=attn, **extra, logits_to_keep=t + 1, use_cache=False)
        lp = masked_logprobs(out.logits[:, :-1], ids[:, -t:], 1.0, vl.bias)[0]
    return float((lp - behaviour)[mask].abs().max())


def test_vl_behaviour_logprobs_match_learner_final_and_full_turn(vl, conv):
    from asyncrl.actors.guided import build_training_sample

    conv, prep = conv
    final = build_training_sample(conv, "final_turn")
    full = build_training_sample(conv, "full_turn")
    assert full.scope == "full_turn" and not full.fallback
    assert int(full.response_mask.sum()) == sum(len(t.token_ids) for t in conv.turns)  # both turns trained
    assert (full.response_mask == 0).sum() == len(conv.turns[0].user_ids) > 0  # the guidance is context
    d_final = _diffs(vl, final, prep.images)
    d_full = _diffs(vl, full, prep.images)
    d_1d = _diffs(vl, full, prep.images, one_d=True)
    print(f"\n[{vl.arch}] max |logprob_vllm - logprob_learner|: final_turn {d_final:.2e}, full_turn {d_full:.2e}; "
          f"with 1-D positions (the original's bug) {d_1d:.2e}")
    assert d_final < 1e-4
    assert d_full < 1e-4
    assert d_1d > 100 * max(d_full, 1e-5)  # the test does catch wrong position ids


def test_vl_group_over_the_wire_into_a_learner_micro_batch(vl, conv):
    """Rollout -> wire -> learner data path: both scopes' samples in one Group with the images in
    its metadata, through the msgpack codec, flattened and collated by the learner's batching
    (left-padded prompts of different lengths), features + mRoPE ids from the decoded PNGs."""
    from asyncrl.actors.group import build_sample
    from asyncrl.learner.batching import collate, flatten_groups
    from asyncrl.learner.multimodal import group_row_images, masked_logprobs
    from asyncrl.protocol import Group, decode, encode

    conv, prep = conv
    samples = [build_sample(conv, {"overall": 1.0}, scope=sc) for sc in ("final_turn", "full_turn")]
    samples[1].uid += "-full"
    frame = encode(Group.from_samples(samples, metadata={"images": prep.to_wire()}))
    group = decode(frame)
    flat = flatten_groups([group])
    assert flat.prompt_lengths[0] > flat.prompt_lengths[1]  # the full_turn prompt is the first turn's
    mb = collate(flat, [0, 1], pad_id=vl.processor.tokenizer.pad_token_id)
    images, hashes = group_row_images([group])
    extra = vl.builder.forward_kwargs(mb.input_ids, mb.attention_mask, images, hashes)
    with torch.no_grad():
        out = vl.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, **extra,
                       logits_to_keep=mb.response_len + 1, use_cache=False)
    lp = masked_logprobs(out.logits[:, :-1], mb.input_ids[:, -mb.response_len:], 1.0, vl.bias)
    behaviour = flat.behaviour_logprobs[:, :mb.response_len]
    diff = float(((lp - behaviour).abs() * mb.response_mask).max())
    png = sum(len(b) for b in prep.png)
    print(f"\n[{vl.arch}] group frame {len(frame)} B (images {png} B as PNG); collated micro-batch "
          f"max |logprob diff| {diff:.2e}")
    assert diff < 1e-4
