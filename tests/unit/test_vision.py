"""asyncrl.vision: image loading from every accepted form, the original's resize rule, the
placeholder-alignment / limit_images trimming table (images beyond the prompt's placeholders or the
limit are dropped, from the end), lossless PNG wire
round trip through the protocol codec with hash checking, and placeholder collapsing for vLLM.
Also proves a trimming hazard is closed: the trimmed images give exactly as many image
features as the trimmed prompt has image tokens, the untrimmed list does not (and is an error)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from asyncrl.vision import (
    PreparedImages,
    align_images,
    collapse_placeholders,
    count_image_items,
    decode_png,
    encode_png,
    expand_placeholders,
    images_from_wire,
    load_image,
    prepare_images,
    resize_image,
    vllm_prompt,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
TINY_VL = ROOT / "assets/tiny-vl-policy"


def _img(w: int, h: int, color=(200, 10, 30), mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(w * 1000 + h)
    arr = rng.integers(0, 255, size=(h, w, 3), dtype=np.uint8)
    img = Image.fromarray(arr, "RGB")
    return img.convert(mode) if mode != "RGB" else img


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_load_image_accepts_every_form(tmp_path):
    img = _img(30, 20)
    (tmp_path / "a.png").write_bytes(_png(img))
    forms = [img, _png(img), {"bytes": _png(img)}, {"bytes": None, "path": str(tmp_path / "a.png")},
             str(tmp_path / "a.png"), tmp_path / "a.png"]
    for f in forms:
        assert np.array_equal(np.asarray(load_image(f).convert("RGB")), np.asarray(img)), type(f)
    assert np.array_equal(np.asarray(load_image("a.png", image_dir=tmp_path)), np.asarray(img))  # image_dir join
    with pytest.raises(TypeError):
        load_image(42)
    with pytest.raises(ValueError):
        load_image({"other": 1})


def test_resize_rule_of_the_original():
    # 1000x500 = 500000 px > max 125000: factor sqrt(125000/500000) = 0.5 -> 500x250
    assert resize_image(_img(1000, 500), 100, 125000).size == (500, 250)
    # 10x40 = 400 px < min 1600: factor sqrt(1600/400) = 2 -> 20x80
    assert resize_image(_img(10, 40), 1600, 10**6).size == (20, 80)
    # int truncation: 30x30 = 900 > 500: f = sqrt(500/900) = 0.745 -> int(22.36) = 22
    assert resize_image(_img(30, 30), 1, 500).size == (22, 22)
    out = resize_image(_img(20, 20, mode="L"), 1, 10**6)
    assert out.mode == "RGB" and out.size == (20, 20)


IMG = {"type": "image"}


def _txt(t: str) -> dict:
    return {"type": "text", "text": t}


# (case, content of the user message, number of images, limit_images) -> (kept images, content after)
ALIGN_TABLE = [
    ("equal", [IMG, _txt("a"), IMG, _txt("b")], 2, 0, 2, [IMG, _txt("a"), IMG, _txt("b")]),
    ("more images than placeholders", [IMG, _txt("a")], 3, 0, 1, [IMG, _txt("a")]),
    ("more placeholders than images", [IMG, _txt("a"), IMG, _txt("b")], 1, 0, 1, [IMG, _txt("a"), _txt("b")]),
    ("limit_images trims both", [IMG, IMG, IMG, _txt("q")], 3, 1, 1, [IMG, _txt("q")]),
    ("limit above count is a no-op", [IMG, _txt("q")], 1, 5, 1, [IMG, _txt("q")]),
    ("no placeholder drops images", [_txt("q")], 2, 0, 0, [_txt("q")]),
    ("no images", [IMG, _txt("q")], 0, 0, 0, [IMG, _txt("q")]),
]


@pytest.mark.parametrize("case,content,k,limit,kept,after", ALIGN_TABLE, ids=[c[0] for c in ALIGN_TABLE])
def test_alignment_table(case, content, k, limit, kept, after):
    images = [_img(10 + i, 10) for i in range(k)]
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": list(content)}]
    out, imgs = align_images(msgs, images, limit)
    assert len(imgs) == kept
    assert imgs == images[:kept]  # the first images are kept, in order
    assert out[0] == msgs[0] and out[1]["content"] == after
    assert msgs[1]["content"] == content  # inputs untouched
    if kept:
        assert count_image_items(out) == kept


def test_message_left_empty_gets_empty_string():
    msgs = [{"role": "user", "content": [IMG, _txt("q")]}, {"role": "user", "content": [IMG]}]
    out, imgs = align_images(msgs, [_img(8, 8)] * 2, limit_images=1)
    assert len(imgs) == 1 and out[0]["content"] == [IMG, _txt("q")] and out[1]["content"] == ""


def test_marker_reconciliation_then_limit_table():
    """Image markers placed in the messages (asyncrl.data.build_messages), then images aligned to the
    placeholders and trimmed to limit_images."""
    from asyncrl.config import DataConfig
    from asyncrl.data import build_messages

    cfg = DataConfig()
    a, b, c = _img(10, 10), _img(11, 10), _img(12, 10)
    cases = [  # (problem, images, limit) -> (images kept, image items kept, text)
        ("What is x?", [a], 0, 1, "\nWhat is x?"),  # no marker -> one prepended
        ("<image> x <image> y <image> z", [a, b], 0, 2, " x  y  z"),  # extra markers removed
        ("<image> x", [a, b, c], 0, 3, "\n\n x"),  # 2 missing markers prepended: "<image>\n" x2
        ("<image> x <image> y", [a, b], 1, 1, " x  y"),  # limit_images
    ]
    for problem, imgs, limit, kept, text in cases:
        msgs = build_messages({"problem": problem, "answer": "1", "images": imgs}, cfg)
        out, kept_imgs = align_images(msgs, imgs, limit)
        assert len(kept_imgs) == kept == count_image_items(out), problem
        assert "".join(it.get("text", "") for it in out[-1]["content"]) == text, problem


def test_png_wire_roundtrip_through_protocol_codec():
    from asyncrl.protocol import Group, Sample, decode, encode

    prep = PreparedImages.from_images([_img(40, 30), _img(20, 50)])
    s = Sample("u/0", "u", [1, 2], [3, 4], [1, 1], [-0.5, -0.25], [0, 0])
    g = Group.from_samples([s], metadata={"images": prep.to_wire()})
    back = decode(encode(g))
    imgs = images_from_wire(back.metadata["images"])
    assert [np.asarray(i).tolist() for i in imgs] == [np.asarray(i).tolist() for i in prep.images]
    bad = [dict(e) for e in back.metadata["images"]]
    bad[0]["png"] = encode_png(_img(41, 30))
    with pytest.raises(ValueError, match="sha256"):
        images_from_wire(bad)
    assert np.array_equal(np.asarray(decode_png(encode_png(prep.images[0]))), np.asarray(prep.images[0]))


def test_collapse_and_expand_placeholders():
    P, S, E = 9, 7, 8
    expanded = [1, S, P, P, P, P, E, 2, S, P, P, E, 3]
    collapsed = collapse_placeholders(expanded, P)
    assert collapsed == [1, S, P, E, 2, S, P, E, 3]
    assert expand_placeholders(collapsed, P, [4, 2]) == expanded
    with pytest.raises(ValueError):
        expand_placeholders(collapsed, P, [4])
    prompt = vllm_prompt(expanded, [_img(5, 5)], P)
    assert prompt["prompt_token_ids"] == collapsed and len(prompt["multi_modal_data"]["image"]) == 1
    assert "multi_modal_data" not in vllm_prompt([1, 2], [], P)


@pytest.mark.skipif(not TINY_VL.exists(), reason="assets/tiny-vl-policy not built")
def test_trimmed_images_match_prompt_tokens_untrimmed_do_not():
    """The trimming hazard: features from the untrimmed list no longer match the trimmed prompt's tokens."""
    from transformers import AutoConfig, AutoProcessor

    from asyncrl.learner.multimodal import ImageTokenMismatch, check_image_tokens

    proc = AutoProcessor.from_pretrained(TINY_VL)
    config = AutoConfig.from_pretrained(TINY_VL)
    raw = [_img(112, 56), _img(56, 56), _img(84, 56)]
    msgs = [{"role": "user", "content": [IMG, IMG, IMG, _txt("Which is larger?")]}]
    out, prep = prepare_images(msgs, raw, None, limit_images=2)
    assert len(prep) == 2 and count_image_items(out) == 2
    text = proc.apply_chat_template(out, add_generation_prompt=True, tokenize=False)
    enc = proc(text=[text], images=prep.images, return_tensors="pt")
    check_image_tokens(enc["input_ids"], enc["attention_mask"], enc["image_grid_thw"], config)  # ok
    untrimmed = proc.image_processor(images=raw, return_tensors="pt")
    with pytest.raises(ImageTokenMismatch):
        check_image_tokens(enc["input_ids"], enc["attention_mask"], untrimmed["image_grid_thw"], config)
    # wire size: PNG bytes vs float32 pixel_values (why processor outputs are recomputed, not shipped)
    png = sum(len(b) for b in prep.png)
    pv = enc["pixel_values"].numel() * 4
    print(f"\nwire bytes for 2 small figures: png {png}, pixel_values fp32 {pv} ({pv / png:.1f}x)")
    assert pv > png
