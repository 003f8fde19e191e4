"""Task arith_vl: deterministic rows whose figure really shows the expression (ink present, the
policy's text has no operand), the shipped assets load through asyncrl.data + asyncrl.vision
(image_dir, one image token run per figure), and the unchanged arith rule verifier grades a
conversation built from `verifier_view` (it reads `[IMAGE]` + the caption), while the policy's
own messages give the verifier nothing to check."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from asyncrl.actors.guided import render_verifier_messages
from asyncrl.tasks.arith_vl import (
    POLICY_PROBLEM,
    get_rule_verifier,
    make_rows,
    render_expression,
    verifier_view,
)
from asyncrl.vision import prepare_images

ROOT = Path(__file__).resolve().parents[2]


def test_rows_deterministic_and_figures_show_the_expression():
    rows, pngs = make_rows("val", 5, seed=0)
    rows2, pngs2 = make_rows("val", 5, seed=0)
    assert rows == rows2 and pngs == pngs2
    for r in rows:
        assert r["problem"] == POLICY_PROBLEM and not any(ch.isdigit() for ch in r["problem"])
        assert r["verifier_problem"] == f"Compute {r['expression']}."
    ink = (np.asarray(render_expression("7 + 8")) < 128).any(-1).sum()
    assert ink > 50  # the digits are drawn
    a, b = np.asarray(render_expression("7 + 8")), np.asarray(render_expression("7 + 9"))
    assert (a != b).any()  # different operands -> different figures


def test_shipped_assets_load_with_image_dir():
    from asyncrl.config import DataConfig
    from asyncrl.data import build_messages, load_rows

    cfg = DataConfig(train_files=str(ROOT / "assets/arith_vl/val.jsonl"), image_dir=str(ROOT / "assets/arith_vl"),
                     min_pixels=3136, max_pixels=200704)
    rows = load_rows(cfg.train_files, cfg)
    row = dict(rows[0])
    msgs = build_messages(row, cfg)
    out, prep = prepare_images(msgs, row["images"], cfg, limit_images=1)
    assert len(prep) == 1 and prep.images[0].size == (224, 56) and prep.images[0].mode == "RGB"
    assert out[-1]["content"][0] == {"type": "image"}


def test_rule_verifier_reads_the_caption_not_the_figure():
    row = make_rows("train", 1, seed=3)[0][0]
    expr = row["expression"]
    msgs = [{"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": "\nCompute the expression shown in the image."}]}]
    view = verifier_view(msgs, row)
    assert view[0]["content"][0] == {"type": "image"} and msgs[0]["content"][1]["text"].startswith("\nCompute the")
    from asyncrl.tasks.arith import canonical_steps, parse_expr

    a, op, b, c = canonical_steps(parse_expr(expr))[0]
    turn = f"<think>{a} {op} {b} = {c}</think> Is that right?"
    verify = get_rule_verifier()
    problem = view[0]["content"]
    reply = verify(render_verifier_messages(problem, row["answer"], [turn], None))
    assert reply.startswith("Correct"), reply
    assert "[IMAGE]" in render_verifier_messages(problem, row["answer"], [turn], None)[-1]["content"]
    blind = verify(render_verifier_messages(msgs[0]["content"], row["answer"], [turn], None))
    assert blind.startswith("Error: I cannot read an expression"), blind
    assert verifier_view(msgs, {"answer": "1"}) == msgs  # no caption column: plain Guided-GRPO


def test_build_vl_prompt_from_a_stream_item():
    """The rollout's one call per group: aligned messages, processor-expanded ids (16 tokens for a
    224x56 figure), the verifier's view with the caption, collapsed engine ids + the PIL figure;
    a text-only item gives exactly PolicyChat's ids and no multimodal data."""
    from transformers import AutoProcessor

    from asyncrl.actors.guided import PolicyChat, flatten_content
    from asyncrl.config import DataConfig
    from asyncrl.data import load_rows, make_item
    from asyncrl.vision import build_vl_prompt

    proc = AutoProcessor.from_pretrained(ROOT / "assets/tiny-vl-policy")
    image_id = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    cfg = DataConfig(image_dir=str(ROOT / "assets/arith_vl"), min_pixels=3136, max_pixels=200704)
    rows = load_rows(str(ROOT / "assets/arith_vl/val.jsonl"), cfg)
    item = make_item(rows, 0, cfg, index=0, name="val").to_dict()
    vp = build_vl_prompt(item, proc, cfg, limit_images=1, image_token_id=image_id)
    assert vp.prompt_ids.count(image_id) == 16 and len(vp.images) == 1
    problem = vp.verifier_messages[-1]["content"]
    assert flatten_content(problem) == f"[IMAGE]\n{rows[0]['verifier_problem']}"
    ids, mm = vp.engine_inputs(vp.prompt_ids + [40, 41])
    assert ids.count(image_id) == 1 and len(ids) == len(vp.prompt_ids) + 2 - 15 and mm["image"] == vp.images.images
    text_item = {"messages": [{"role": "user", "content": "Compute 2 + 3."}], "images": None, "row": {}}
    tp = build_vl_prompt(text_item, proc, cfg, image_token_id=image_id)
    assert tp.prompt_ids == PolicyChat(proc).encode_prompt(text_item["messages"])
    assert tp.engine_inputs(tp.prompt_ids)[1] is None and tp.verifier_messages == text_item["messages"]
