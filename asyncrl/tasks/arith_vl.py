"""Task `arith_vl`: the `arith` problems with the operands drawn in a small image (the VL quick start).

The policy sees ONLY the figure: its problem text is `<image>\\nCompute the expression shown in the
image.` and the expression (`4 * 8 - 6`) is rendered with PIL into a white 224x56 PNG (16 image
tokens for a Qwen-VL processor: 8x2 cells of 28x28 px). The answer and the rule verifier are the
text task's (`asyncrl.tasks.arith`, `ArithRuleVerifier`): the verifier is text-only
(docs/guided_grpo.md#verifier-request) and needs the operands, so every row also carries
`verifier_problem` = `Compute 4 * 8 - 6.`.

How the verifier gets the operands (decision, a departure from the original, which only has
`[IMAGE]` for the verifier): the rollout builds each conversation from `verifier_view(messages,
row)` -- the first user message's text items replaced by `verifier_problem`, its image items kept
-- while the policy's prompt ids come from the ORIGINAL messages through the processor
(`Conversation(verifier_view(...), prompt_ids=processor_ids)`; a conversation's `messages` feed
only the verifier request and the transcript under history=full). The verifier therefore reads
`[IMAGE]\\nCompute 4 * 8 - 6.`, i.e. the figure's caption, exactly as a human grader would know
the figure; rows without `verifier_problem` fall back to the policy's messages (plain
Guided-GRPO). `get_rule_verifier()` returns the unchanged arith verifier.

Files (`python -m asyncrl.tasks.arith_vl --out assets/arith_vl`): `{train,val,test}.jsonl` with
columns problem, answer, images (a one-element list of a path relative to `data.image_dir` =
the output dir), verifier_problem, expression, num_steps, difficulty, id; and `images/<split>/*.png`.
Deterministic (same rows as `arith.generate_split`, same PNG bytes for the same Pillow version).
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from asyncrl.tasks.arith import generate_split, write_jsonl
from asyncrl.vision import VERIFIER_PROBLEM_KEY
from asyncrl.vision import verifier_view as _verifier_view

__all__ = ["POLICY_PROBLEM", "VERIFIER_PROBLEM_KEY", "render_expression", "make_rows", "verifier_view",
           "get_rule_verifier", "write_splits"]

POLICY_PROBLEM = "<image>\nCompute the expression shown in the image."
SIZE = (224, 56)


def render_expression(expr: str, size: tuple[int, int] = SIZE) -> Image.Image:
    """Black text of `expr` centred on a white RGB image (PIL's built-in font, 28 px)."""
    img = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(img)
    try:
        font = ImageFont.load_default(size=28)
    except TypeError:  # Pillow < 10.1: fixed bitmap font
        font = ImageFont.load_default()
    left, top, right, bottom = draw.textbbox((0, 0), expr, font=font)
    x = (size[0] - (right - left)) // 2 - left
    y = (size[1] - (bottom - top)) // 2 - top
    draw.text((x, y), expr, fill=(0, 0, 0), font=font)
    return img


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=9)
    return buf.getvalue()


def make_rows(split: str, n: int, seed: int = 0, difficulty: int = 1, image_subdir: str | None = None
              ) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Rows of a split and the PNG bytes of their figures (row i <-> png i). `images` holds the
    relative path `{image_subdir}/{id}.png` (default `images/<split>`)."""
    sub = image_subdir or f"images/{split}"
    rows, pngs = [], []
    for r in generate_split(split, n, seed=seed, difficulty=difficulty):
        pngs.append(png_bytes(render_expression(r["expression"])))
        rows.append({"problem": POLICY_PROBLEM, "answer": r["answer"], "images": [f"{sub}/{r['id']}.png"],
                     VERIFIER_PROBLEM_KEY: r["problem"], "expression": r["expression"],
                     "num_steps": r["num_steps"], "difficulty": r["difficulty"], "id": r["id"].replace("arith", "arith_vl")})
    return rows, pngs


def verifier_view(messages: list[dict[str, Any]], row: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The messages the verifier is built from: the first user message's text replaced by
    `row["verifier_problem"]` (image items kept, so the verifier sees `[IMAGE]` then the text).
    Unchanged copy when the row has no such column. (`asyncrl.vision.build_vl_prompt` does this
    for every VL prompt.)"""
    return _verifier_view(messages, (row or {}).get(VERIFIER_PROBLEM_KEY))


def get_rule_verifier():
    """The arith rule verifier, unchanged (it reads `Compute <expr>.` from the verifier's problem)."""
    from asyncrl.tasks.arith_verifier import ArithRuleVerifier

    return ArithRuleVerifier()


def write_splits(out_dir: str | Path, sizes: dict[str, int], seed: int = 0, difficulty: int = 1) -> None:
    out = Path(out_dir)
    for split, n in sizes.items():
        rows, pngs = make_rows(split, n, seed, difficulty)
        for r, b in zip(rows, pngs):
            p = out / r["images"][0]
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b)
        write_jsonl(rows, out / f"{split}.jsonl")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write the arith_vl splits (JSONL + PNG figures).")
    p.add_argument("--out", default="assets/arith_vl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--difficulty", type=int, default=1)
    p.add_argument("--train", type=int, default=400)
    p.add_argument("--val", type=int, default=32)
    p.add_argument("--test", type=int, default=32)
    a = p.parse_args(argv)
    write_splits(a.out, {"train": a.train, "val": a.val, "test": a.test}, a.seed, a.difficulty)
    print(f"wrote {a.out}/{{train,val,test}}.jsonl and images/")


if __name__ == "__main__":
    main()
