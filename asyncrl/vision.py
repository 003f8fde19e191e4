"""Images of a multimodal prompt: loading, resizing, trimming, wire encoding, and the Qwen-VL
config helpers both roles need (`is_vl_config`, `vision_logit_bias`). The original's image
handling is described in docs/guided_grpo.md#bug-image-reencode and #bug-limit-images.

One pipeline, used by the rollout AND the learner, so both see the same pixels:

    vp = build_vl_prompt(item, processor, cfg.data, cfg.rollout.limit_images, image_token_id=...)
    convs = make_group(vp.verifier_messages, ..., prompt_ids=vp.prompt_ids)    # once per group
    ids, mm = vp.engine_inputs(turn_prompt_ids)   # every turn: collapsed ids + the same PIL images
    Group.from_samples(..., metadata={"images": vp.images.to_wire()})          # PNG once per group
    # learner: asyncrl.learner.multimodal.group_row_images(groups) -> decoded images per row

Guarantees
- `load_image` accepts what Guided-GRPO's image column accepts: a PIL image, a path (joined to
  `image_dir` when relative), raw bytes, or a dict with `bytes` (or `path`).
- `resize_image` is the original's rule: downscale by sqrt(max_pixels/area) when the
  area exceeds max_pixels, upscale by sqrt(min_pixels/area) when below min_pixels (int-truncated
  sizes, PIL's default resampling), then convert to RGB.
- `align_images` is the original's placeholder alignment: k = #images, cut to `limit_images`
  when > 0; p = #image items in all messages; p == 0 -> images dropped (a one-time warning); else
  the first min(k, p) image items and images are kept, later image items are removed (a message
  left with no items gets content ""), later images dropped. asyncrl applies it ONCE per prompt,
  before anything is encoded, and ships the trimmed images: the learner never sees the untrimmed
  list (the original trims only in the rollout).
- Images travel as PNG bytes of the final (resized, RGB, trimmed) image, once per group, each with
  its sha256. PNG is lossless, so `decode_png(encode_png(img))` has exactly the pixels vLLM was
  given and the learner's processor recomputes exactly the features the engine used.
  Measured here: an arith_vl figure (224x56) is 1.8 KB as PNG vs 301 KB of float32
  pixel_values (166x); random-noise images (PNG's worst case) 7.9x (tests/unit/test_vision.py);
  the processor takes ~15 ms per figure on one busy core and the learner caches it per sha256.
  So processor outputs are recomputed on the learner, not carried (exact: same pixels, same
  processor config read from the checkpoint as vLLM's).
- `collapse_placeholders` turns processor-expanded prompt ids (N `<|image_pad|>` per image) back
  into one pad per image: vLLM's input form. vLLM (0.32) re-expands a run it is given, so the
  expanded ids must never be sent to it (that silently yields a different prompt).
Videos: the column is recognised by `asyncrl.data`; decoding videos is not implemented here.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

__all__ = [
    "PreparedImages", "load_image", "resize_image", "count_image_items", "align_images", "prepare_images",
    "encode_png", "decode_png", "image_hash", "images_from_wire", "collapse_placeholders", "expand_placeholders",
    "vllm_prompt", "processor_prompt_ids", "vllm_mm_engine_kwargs", "verifier_view", "VLPrompt", "build_vl_prompt",
    "VERIFIER_PROBLEM_KEY", "VL_MODEL_TYPES", "is_vl_config", "placeholder_token_ids", "vision_logit_bias",
]

log = logging.getLogger(__name__)
VERIFIER_PROBLEM_KEY = "verifier_problem"
"""Optional dataset column: the problem text the (text-only) verifier reads instead of the
policy's text (e.g. arith_vl's figure caption). Absent = Guided-GRPO's behaviour."""
_warned_no_placeholder = False
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
"""`model_type`s served as VL policies. Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) reuses Qwen3-VL's processor,
placeholders and `get_rope_index`; its text-only checkpoints say `qwen3_5_text` / `qwen3_5_moe_text`."""


# ------------------------------------------------------------------------------------ model config
def is_vl_config(config: Any) -> bool:
    """Whether an HF config (or a path to one) is a supported Qwen-VL policy."""
    if isinstance(config, str):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(config)
    return getattr(config, "model_type", "") in VL_MODEL_TYPES


def placeholder_token_ids(config: Any) -> tuple[int, int | None]:
    """(image placeholder id, video placeholder id or None) of a Qwen-VL config."""
    image = getattr(config, "image_token_id", None)
    video = getattr(config, "video_token_id", None)
    if image is None:
        raise ValueError("config has no image_token_id (not a Qwen-VL policy?)")
    return int(image), (None if video is None else int(video))


def vision_logit_bias(config: Any, bias: float = -100.0) -> dict[int, float]:
    """{token id: bias} banning the image/video placeholders in sampling (vLLM `logit_bias`); the
    learner adds the same bias before its softmax, so both sides use one distribution."""
    image, video = placeholder_token_ids(config)
    return {t: bias for t in (image, video) if t is not None}


# ----------------------------------------------------------------------------------------- loading
def load_image(obj: Any, image_dir: str | os.PathLike[str] | None = None) -> Image.Image:
    """A PIL image from a PIL image, a path (relative paths joined to `image_dir`), bytes, or a
    dict with `bytes` / `path` (HF datasets' Image feature). The image is fully loaded."""
    if isinstance(obj, Image.Image):
        img = obj
    elif isinstance(obj, dict):
        if obj.get("bytes") is not None:
            return load_image(obj["bytes"], image_dir)
        if obj.get("path"):
            return load_image(obj["path"], image_dir)
        raise ValueError("image dict has neither 'bytes' nor 'path'")
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        img = Image.open(io.BytesIO(bytes(obj)))
    elif isinstance(obj, (str, os.PathLike)):
        path = os.fspath(obj)
        if image_dir is not None and not os.path.isabs(path):
            path = os.path.join(image_dir, path)
        img = Image.open(path)
    else:
        raise TypeError(f"unsupported image value of type {type(obj).__name__}")
    img.load()
    return img


def resize_image(img: Image.Image, min_pixels: int | None, max_pixels: int | None) -> Image.Image:
    """Guided-GRPO's `process_image`: area bounds by an isotropic factor, then RGB."""
    if max_pixels is not None and img.width * img.height > max_pixels:
        f = math.sqrt(max_pixels / (img.width * img.height))
        img = img.resize((int(img.width * f), int(img.height * f)))
    if min_pixels is not None and img.width * img.height < min_pixels:
        f = math.sqrt(min_pixels / (img.width * img.height))
        img = img.resize((int(img.width * f), int(img.height * f)))
    if img.mode != "RGB":
        img = img.convert("RGB")
    return img


# --------------------------------------------------------------------------------------- alignment
def _is_image_item(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "image"


def count_image_items(messages: Sequence[dict[str, Any]]) -> int:
    """Number of `{"type": "image"}` items over all messages' content lists."""
    return sum(1 for m in messages if isinstance(m.get("content"), list) for it in m["content"] if _is_image_item(it))


def align_images(messages: Sequence[dict[str, Any]], images: Sequence[Any] | None,
                 limit_images: int = 0) -> tuple[list[dict[str, Any]], list[Any]]:
    """Guided-GRPO's placeholder alignment (see the module docstring). Returns new
    messages (inputs untouched) and the kept images (first ones, in order)."""
    global _warned_no_placeholder
    msgs = [dict(m) for m in messages]
    imgs = list(images or [])
    if not imgs:
        return msgs, []
    max_images = min(len(imgs), limit_images) if limit_images > 0 else len(imgs)
    placeholders = count_image_items(msgs)
    if placeholders == 0:
        if not _warned_no_placeholder:
            log.warning("images given but no image placeholder in the messages: images dropped (text-only)")
            _warned_no_placeholder = True
        return msgs, []
    keep = min(max_images, placeholders)
    seen = 0
    for m in msgs:
        content = m.get("content")
        if not isinstance(content, list):
            continue
        new = []
        for it in content:
            if _is_image_item(it):
                seen += 1
                if seen > keep:
                    continue
            new.append(it)
        m["content"] = new if new else ""
    return msgs, imgs[:keep]


# ------------------------------------------------------------------------------------------- wire
def encode_png(img: Image.Image) -> bytes:
    """Lossless PNG bytes of an RGB image (deterministic: no timestamps, fixed compression)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def decode_png(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(bytes(data)))
    img.load()
    return img if img.mode == "RGB" else img.convert("RGB")


def image_hash(data: bytes) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


@dataclass
class PreparedImages:
    """The final images of one prompt (resized, RGB, trimmed), their PNG bytes and sha256."""

    images: list[Image.Image] = field(default_factory=list)
    png: list[bytes] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.images)

    @classmethod
    def from_images(cls, images: Sequence[Image.Image]) -> PreparedImages:
        """Round-trips every image through PNG so the rollout uses exactly the learner's pixels."""
        png = [encode_png(i) for i in images]
        return cls([decode_png(b) for b in png], png, [image_hash(b) for b in png])

    def to_wire(self) -> list[dict[str, Any]]:
        """msgpack-able list for `Group.metadata["images"]` (bytes travel as msgpack bin)."""
        return [{"sha256": h, "png": b} for h, b in zip(self.hashes, self.png)]


def images_from_wire(entries: Sequence[dict[str, Any]] | None) -> list[Image.Image]:
    """Decode `PreparedImages.to_wire()` output; raises ValueError on a hash mismatch."""
    out = []
    for i, e in enumerate(entries or []):
        data = bytes(e["png"])
        if image_hash(data) != e["sha256"]:
            raise ValueError(f"image {i}: sha256 mismatch (corrupt or tampered bytes)")
        out.append(decode_png(data))
    return out


def prepare_images(messages: Sequence[dict[str, Any]], images: Sequence[Any] | None, data_cfg: Any = None,
                   limit_images: int = 0) -> tuple[list[dict[str, Any]], PreparedImages]:
    """Align (with `limit_images`), then load + resize only the kept images, then PNG.
    `data_cfg`: an object with `image_dir`, `min_pixels`, `max_pixels` (DataConfig) or None."""
    msgs, kept = align_images(messages, images, limit_images)
    image_dir = getattr(data_cfg, "image_dir", None)
    lo, hi = getattr(data_cfg, "min_pixels", None), getattr(data_cfg, "max_pixels", None)
    loaded = [resize_image(load_image(x, image_dir), lo, hi) for x in kept]
    return msgs, PreparedImages.from_images(loaded)


# ----------------------------------------------------------------------------------- engine input
def collapse_placeholders(ids: Sequence[int], placeholder_ids: Sequence[int] | int) -> list[int]:
    """Each run of identical placeholder ids -> one id (processor-expanded -> vLLM input form)."""
    ph = {placeholder_ids} if isinstance(placeholder_ids, int) else set(placeholder_ids)
    out: list[int] = []
    for t in ids:
        t = int(t)
        if t in ph and out and out[-1] == t:
            continue
        out.append(t)
    return out


def expand_placeholders(ids: Sequence[int], placeholder_id: int, counts: Sequence[int]) -> list[int]:
    """Inverse of `collapse_placeholders` for one placeholder kind: the i-th single placeholder
    becomes `counts[i]` copies. Raises ValueError when the number of placeholders differs."""
    out: list[int] = []
    it = iter(counts)
    n = 0
    for t in ids:
        if int(t) == placeholder_id:
            c = next(it, None)
            if c is None:
                raise ValueError("more placeholders than counts")
            out += [placeholder_id] * int(c)
            n += 1
        else:
            out.append(int(t))
    if n != len(counts):
        raise ValueError(f"{n} placeholders for {len(counts)} images")
    return out


def vllm_prompt(prompt_ids: Sequence[int], images: Sequence[Image.Image], image_token_id: int,
                video_token_id: int | None = None) -> dict[str, Any]:
    """vLLM prompt dict for processor-expanded `prompt_ids` and the prompt's final images."""
    ph = [image_token_id] + ([video_token_id] if video_token_id is not None else [])
    prompt: dict[str, Any] = {"prompt_token_ids": collapse_placeholders(prompt_ids, ph)}
    if images:
        prompt["multi_modal_data"] = {"image": list(images)}
    return prompt


def processor_prompt_ids(processor: Any, messages: Sequence[dict[str, Any]], images: Sequence[Image.Image],
                         **template_kwargs: Any) -> list[int]:
    """Prompt ids of the first turn with the image pads expanded, as Guided-GRPO makes them:
    the processor's chat template (generation prompt, not tokenized) run through the processor
    with the prompt's final images. Pass these as `Conversation(..., prompt_ids=...)`."""
    text = processor.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                         **template_kwargs)
    enc = processor(text=[text], images=list(images) or None, return_tensors="np")
    return [int(t) for t in enc["input_ids"][0]]


def vllm_mm_engine_kwargs(limit_images: int = 0, default_max_images: int = 4) -> dict[str, Any]:
    """Extra vLLM engine arguments for a VL policy: images per prompt bounded by
    `rollout.limit_images` (or `default_max_images`), no video (not implemented)."""
    return {"limit_mm_per_prompt": {"image": limit_images if limit_images > 0 else default_max_images, "video": 0}}


def verifier_view(messages: Sequence[dict[str, Any]], text: str | None) -> list[dict[str, Any]]:
    """Messages a conversation is built from for the verifier: the first user message's text items
    replaced by `text` (image items kept first, so the verifier reads `[IMAGE]` then `text`).
    A deep copy of `messages` when `text` is empty (Guided-GRPO: the verifier sees the policy's text)."""
    import copy

    out = copy.deepcopy(list(messages))
    if not text:
        return out
    for m in out:
        if m.get("role") == "user":
            content = m.get("content")
            images = [it for it in content if _is_image_item(it)] if isinstance(content, list) else []
            m["content"] = images + [{"type": "text", "text": str(text)}]
            break
    return out


@dataclass
class VLPrompt:
    """Everything a rollout needs for one multimodal prompt (built once per group)."""

    messages: list[dict[str, Any]]
    """Aligned policy messages (`align_images`)."""
    verifier_messages: list[dict[str, Any]]
    """What to give `make_group` / `Conversation` as `messages` (verifier request + transcript)."""
    prompt_ids: list[int]
    """Processor-expanded first-turn ids: `make_group(..., prompt_ids=...)`."""
    images: PreparedImages
    image_token_id: int

    def engine_inputs(self, prompt_ids: Sequence[int]) -> tuple[list[int], dict[str, Any] | None]:
        """(vLLM prompt_token_ids, multi_modal_data or None) for a turn's expanded context."""
        p = vllm_prompt(prompt_ids, self.images.images, self.image_token_id)
        return p["prompt_token_ids"], p.get("multi_modal_data")


def build_vl_prompt(prompt: Any, processor: Any, data_cfg: Any = None, limit_images: int = 0, *,
                    image_token_id: int, **template_kwargs: Any) -> VLPrompt:
    """From a stream item (`PromptItem` or its `to_dict()`): align + load + resize + PNG the
    images, expand the prompt with the processor, and build the verifier's view (the row's
    `verifier_problem` column when present). Text-only items (no images kept) get the tokenizer's
    ids, exactly what `PolicyChat.encode_prompt` gives, and no multimodal data."""
    get = prompt.get if isinstance(prompt, dict) else (lambda k, d=None: getattr(prompt, k, d))
    messages, prep = prepare_images(get("messages"), get("images"), data_cfg, limit_images)
    if len(prep):
        ids = processor_prompt_ids(processor, messages, prep.images, **template_kwargs)
    else:
        tok = getattr(processor, "tokenizer", processor)
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
        ids = list(tok.encode(text, add_special_tokens=False))
    row = get("row") or {}
    return VLPrompt(messages, verifier_view(messages, row.get(VERIFIER_PROBLEM_KEY)), ids, prep, int(image_token_id))
