"""asyncrl.learner.multimodal on the tiny random Qwen2-VL: hand-derived 4-row mRoPE position ids
(padding-invariant), the image-token/feature mismatch error, freeze_vision_tower, and that a
learner micro-batch built by `batching.collate` (left-padded prompts, right-padded responses,
two samples with different images) gives the same response log-probs as each sample alone."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
TINY_VL = ROOT / "assets/tiny-vl-policy"
pytestmark = pytest.mark.skipif(not TINY_VL.exists(), reason="assets/tiny-vl-policy not built")


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoProcessor

    from asyncrl.learner.multimodal import VLInputBuilder, load_vl_model

    torch.set_num_threads(1)
    model = load_vl_model(str(TINY_VL)).eval()
    proc = AutoProcessor.from_pretrained(TINY_VL)
    return model, proc, VLInputBuilder(model, proc)


def test_mrope_ids_hand_derived_and_padding_invariant(tiny):
    from asyncrl.learner.multimodal import mrope_position_ids

    model, _, _ = tiny
    c = model.config
    S, E, I = c.vision_start_token_id, c.vision_end_token_id, c.image_token_id  # noqa: E741
    # text a b <vs> | 4 image tokens (grid t=1, h=4, w=4 patches -> 2x2 after the 2x2 merge) | <ve> c
    ids = torch.tensor([[20, 21, S, I, I, I, I, E, 22]])
    grid = torch.tensor([[1, 4, 4]])
    pos = mrope_position_ids(model, ids, torch.ones_like(ids), grid)
    # text 0,1,2; image block starts at 3: t = 3, h = 3 + row, w = 3 + col; then text resumes at
    # 3 + max(h, w) / merge = 3 + 2 = 5: <ve> 5, c 6. Row 0 = plain text positions 0..8.
    expect = torch.tensor([
        [0, 1, 2, 3, 4, 5, 6, 7, 8],
        [0, 1, 2, 3, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 3, 4, 4, 5, 6],
        [0, 1, 2, 3, 4, 3, 4, 5, 6],
    ])
    assert torch.equal(pos[:, 0], expect)
    # left padding by 3 (as collate does) shifts nothing: real tokens keep their ids, pads get 0
    pad = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    attn = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], 1)
    ppos = mrope_position_ids(model, pad, attn, grid)
    assert torch.equal(ppos[:, 0, 3:], expect) and not ppos[:, 0, :3].any()
    # right padding (responses): text row repeats the last position as collate does, mRoPE rows 0
    rpad = torch.cat([ids, torch.zeros(1, 2, dtype=torch.long)], 1)
    rattn = torch.cat([torch.ones_like(ids), torch.zeros(1, 2, dtype=torch.long)], 1)
    rpos = mrope_position_ids(model, rpad, rattn, grid)
    assert torch.equal(rpos[:, 0, :9], expect) and rpos[0, 0, 9:].tolist() == [8, 8] and not rpos[1:, 0, 9:].any()


def test_token_feature_mismatch_is_an_error(tiny):
    from asyncrl.learner.multimodal import ImageTokenMismatch, check_image_tokens

    model, _, _ = tiny
    c = model.config
    I = c.image_token_id  # noqa: E741
    ids = torch.tensor([[1, I, I, I, I, 2, I, 3]])
    check_image_tokens(ids, None, torch.tensor([[1, 4, 4], [1, 2, 2]]), c)  # runs 4 and 1: ok
    for bad in ([[1, 4, 4]], [[1, 2, 2], [1, 4, 4]], [[1, 4, 4], [1, 4, 4]]):
        with pytest.raises(ImageTokenMismatch):
            check_image_tokens(ids, None, torch.tensor(bad), c)


def test_freeze_vision_tower(tiny):
    import copy

    from asyncrl.learner.multimodal import freeze_vision_tower, vision_module

    model = copy.deepcopy(tiny[0])
    n_vis = sum(p.numel() for p in vision_module(model).parameters())
    assert freeze_vision_tower(model) == n_vis > 0
    assert not any(p.requires_grad for p in vision_module(model).parameters())
    assert model.lm_head.weight.requires_grad and model.model.language_model.embed_tokens.weight.requires_grad


def test_collated_micro_batch_equals_single_samples(tiny):
    from PIL import Image

    from asyncrl.learner.batching import collate, flatten_groups
    from asyncrl.learner.multimodal import group_row_images, masked_logprobs, vl_response_logprobs
    from asyncrl.protocol import Group, Sample
    from asyncrl.vision import PreparedImages, processor_prompt_ids

    model, proc, builder = tiny
    rng = np.random.default_rng(0)
    figs = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in ((112, 56), (56, 84))]
    groups = []
    for k, (fig, q, resp) in enumerate(zip(figs, ["Compute it.", "What number is shown here?"],
                                            [[30, 31, 32, 2], [40, 41, 2]])):
        prep = PreparedImages.from_images([fig])
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}]
        ids = processor_prompt_ids(proc, msgs, prep.images)
        s = Sample(f"p{k}/0", f"p{k}", ids, resp, [1] * len(resp), [-1.0] * len(resp), [0] * len(resp))
        groups.append(Group.from_samples([s], metadata={"images": prep.to_wire()}))
    flat = flatten_groups(groups)
    assert flat.prompt_lengths[0] != flat.prompt_lengths[1]  # the shorter prompt is left-padded
    mb = collate(flat, [0, 1], pad_id=proc.tokenizer.pad_token_id)
    per_row, hashes = group_row_images(groups)
    assert [len(r) for r in per_row] == [1, 1] and per_row[0][0].size == (112, 56)
    extra = builder.forward_kwargs(mb.input_ids, mb.attention_mask, per_row, hashes)
    assert extra["position_ids"].shape == (4, 2, mb.input_ids.shape[1])
    assert torch.equal(extra["position_ids"][0], mb.position_ids)  # row 0 == collate's text positions
    with torch.no_grad():
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, **extra,
                    logits_to_keep=mb.response_len + 1, use_cache=False)
    labels = mb.input_ids[:, -mb.response_len:]
    batched = masked_logprobs(out.logits[:, :-1], labels)
    for j, g in enumerate(groups):
        s = g.samples[0]
        alone = vl_response_logprobs(model, builder, s.prompt_ids.tolist(), s.response_ids.tolist(), per_row[j])
        t = len(s.response_ids)
        assert torch.allclose(batched[j, :t], alone, atol=1e-4), (batched[j, :t], alone)


def test_vl_forward_trains_language_and_vision_unless_frozen(tiny):
    """A learner micro-step through `vl_forward`: gradients reach the vision tower and the language
    model; with `freeze_vision_tower` only the language model; a dummy micro-batch runs text-only."""
    import copy

    from PIL import Image

    from asyncrl.learner.batching import collate, flatten_groups
    from asyncrl.learner.multimodal import (
        VLInputBuilder,
        freeze_vision_tower,
        group_row_images,
        masked_logprobs,
        vision_module,
        vl_forward,
    )
    from asyncrl.protocol import Group, Sample
    from asyncrl.vision import PreparedImages, processor_prompt_ids

    base, proc, _ = tiny
    prep = PreparedImages.from_images([Image.new("RGB", (84, 56), (250, 250, 250))])
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compute it."}]}]
    ids = processor_prompt_ids(proc, msgs, prep.images)
    samples = [Sample(f"p/{i}", "p", ids, [30 + i, 31, 2], [1, 1, 1], [-1.0] * 3, [0] * 3) for i in range(2)]
    groups = [Group.from_samples(samples, metadata={"images": prep.to_wire()})]
    flat = flatten_groups(groups)
    row_images, row_hashes = group_row_images(groups)
    for frozen in (False, True):
        model = copy.deepcopy(base).train()
        if frozen:
            freeze_vision_tower(model)
        builder = VLInputBuilder(model, proc)
        mb = collate(flat, [0, 1], pad_id=proc.tokenizer.pad_token_id)
        out = vl_forward(model, builder, mb, row_images, row_hashes)
        lp = masked_logprobs(out.logits[:, :-1], mb.input_ids[:, -mb.response_len:])
        (-(lp * mb.response_mask).sum()).backward()
        vis = [p.grad for p in vision_module(model).parameters()]
        assert all(g is None for g in vis) if frozen else any(g is not None and g.abs().sum() > 0 for g in vis)
        assert model.lm_head.weight.grad.abs().sum() > 0
        dummy = collate(flat, [], pad_id=proc.tokenizer.pad_token_id)  # ZeRO's padding micro-batch
        assert vl_forward(model, builder, dummy, row_images, row_hashes).logits.shape[0] == 1
