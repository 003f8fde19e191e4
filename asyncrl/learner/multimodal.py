"""Learner side of vision-language policies (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

What a VL micro-batch needs beyond `batching.collate`'s text tensors, and how to get it right:

    vl = VLInputBuilder(model, processor)                      # once per learner
    extra = vl.forward_kwargs(mb.input_ids, mb.attention_mask, images_per_row)
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, **extra,
                logits_to_keep=mb.response_len + 1, use_cache=False)

`extra` = `pixel_values`, `image_grid_thw` (the processor's, recomputed from the PNG-exact images
that the engine saw; cached per image hash) and `position_ids` of shape (4, n, L): row 0 the text
positions (real tokens counted: exactly `collate`'s `position_ids`), rows 1-3 the mRoPE
(temporal, height, width) positions from the model's own `get_rope_index` over the WHOLE sequence
prompt + response, so both train scopes (final_turn: last prompt + last turn; full_turn: first
prompt + every turn and user turn) get the positions vLLM used when it sampled each token.
Departs from Guided-GRPO, which trains multi-turn VL samples with plain 1-D positions (biased
ratios for Qwen3-VL, a crash for Qwen2/2.5-VL; docs/guided_grpo.md#bug-vl-positions) and silently pads/truncates image features when their count differs from the image
tokens; here such a mismatch raises `ImageTokenMismatch` before the forward.

Sampling bans the image/video placeholder tokens (`vision_logit_bias`, as the original's
logit_bias of -100); `masked_logprobs` applies the same bias on the learner, so old and new
log-probs are over the same distribution (the difference is exp(-100)-small for a real model,
but ~1/vocab for a tiny random one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from asyncrl.vision import placeholder_token_ids

__all__ = [
    "ImageTokenMismatch", "load_vl_model", "load_vl_processor",
    "vision_module", "freeze_vision_tower", "mm_token_type_ids", "check_image_tokens",
    "mrope_position_ids", "VLInputBuilder", "masked_logprobs", "vl_response_logprobs", "group_row_images",
    "vl_forward",
]

class ImageTokenMismatch(ValueError):
    """The image placeholder tokens of a batch do not match the number of image features."""


# --------------------------------------------------------------------------------- model / loading
def load_vl_model(path: str, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Any:
    """The policy as `AutoModelForImageTextToText` (Qwen*VLForConditionalGeneration); transformers
    5 has no `AutoModelForCausalLM` mapping for Qwen-VL configs, so the learner must load it this way."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, **kwargs)


def load_vl_processor(path: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def vision_module(model: Any) -> torch.nn.Module:
    """The vision tower (`visual`) of a Qwen-VL model (also through a DeepSpeed engine `.module`)."""
    m = getattr(model, "module", model)
    for cand in (getattr(m, "visual", None), getattr(getattr(m, "model", None), "visual", None)):
        if isinstance(cand, torch.nn.Module):
            return cand
    raise ValueError(f"{type(m).__name__} has no vision tower (`visual`)")


def freeze_vision_tower(model: Any) -> int:
    """`model.freeze_vision_tower`: requires_grad=False on every vision-tower parameter (the
    patch merger included, as EasyR1). Returns the number of frozen parameters. Call BEFORE
    `deepspeed.initialize` so the optimizer holds only trainable parameters."""
    n = 0
    for p in vision_module(model).parameters():
        p.requires_grad_(False)
        n += p.numel()
    return n


# ------------------------------------------------------------------------------ positions / checks
def mm_token_type_ids(input_ids: Tensor, config: Any) -> Tensor:
    """0 text, 1 image placeholder, 2 video placeholder (what `get_rope_index` groups by)."""
    image, video = placeholder_token_ids(config)
    out = (input_ids == image).to(torch.int32)
    if video is not None:
        out = out + 2 * (input_ids == video).to(torch.int32)
    return out


def _merge(config: Any) -> int:
    return int(config.vision_config.spatial_merge_size)


def check_image_tokens(input_ids: Tensor, attention_mask: Tensor | None, image_grid_thw: Tensor | None,
                       config: Any) -> None:
    """Raise `ImageTokenMismatch` unless every row's placeholder runs match its images exactly:
    total placeholder tokens == sum(t*h*w)/merge^2 and, image by image, run length == features."""
    image, _ = placeholder_token_ids(config)
    ids = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, -1)
    per_image = [] if image_grid_thw is None else (image_grid_thw.prod(-1) // _merge(config) ** 2).tolist()
    runs: list[int] = []
    for row in ids.tolist():
        run = 0
        for t in row + [-2]:
            if t == image:
                run += 1
            elif run:
                runs.append(run)
                run = 0
    if runs != per_image:
        raise ImageTokenMismatch(
            f"image placeholder runs {runs} (total {sum(runs)}) != image features per image {per_image} "
            f"(total {sum(per_image)}); refusing to pad or truncate features")


def mrope_position_ids(model: Any, input_ids: Tensor, attention_mask: Tensor, image_grid_thw: Tensor | None,
                       video_grid_thw: Tensor | None = None) -> Tensor:
    """(4, n, L) position ids: [text positions; 3 mRoPE rows from the model's `get_rope_index`].
    Row 0 is `batching.collate`'s formula (real tokens counted; left pads 0, right pads repeat
    the last position); mRoPE rows are 0 on padding. Left and right padding are both fine."""
    m = getattr(model, "module", model)
    inner = getattr(m, "model", m)
    config = m.config
    rope, _ = inner.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids(input_ids, config),
                                   image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                                   attention_mask=attention_mask)
    text = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # == batching.collate's position_ids
    return torch.cat([text.unsqueeze(0), rope.to(text.dtype)], dim=0)


def group_row_images(groups: Sequence[Any], key: str = "images") -> tuple[list[list[Any]], list[list[str]]]:
    """Images and sha256s of every sample row, in `batching.flatten_groups` order. A group's images
    (`Group.metadata[key]`, written by `vision.PreparedImages.to_wire`) are decoded once and shared
    by its samples; hashes are verified. Text-only groups give empty lists."""
    from asyncrl.vision import images_from_wire

    imgs: list[list[Any]] = []
    hashes: list[list[str]] = []
    for g in groups:
        entries = (getattr(g, "metadata", None) or {}).get(key) or []
        decoded = images_from_wire(entries)
        hs = [str(e["sha256"]) for e in entries]
        for _ in g.samples:
            imgs.append(decoded)
            hashes.append(hs)
    return imgs, hashes


# ----------------------------------------------------------------------------------- batch builder
class VLInputBuilder:
    """Processor outputs + position ids of VL micro-batches, with pixel features cached by image
    sha256 (all samples of a group share the group's images: processed once per step, not once
    per sample or per turn)."""

    def __init__(self, model: Any, processor: Any, cache_size: int = 256):
        self.model = model
        self.config = getattr(model, "module", model).config
        self.image_processor = getattr(processor, "image_processor", processor)
        self._cache: OrderedDict[str, tuple[Tensor, Tensor]] = OrderedDict()
        self.cache_size = cache_size

    def image_features(self, images: Sequence[Any], hashes: Sequence[str] | None = None) -> tuple[Tensor, Tensor]:
        """(pixel_values [sum patches, C*T*P*P], image_grid_thw [k, 3]) of `images`, in order."""
        pv, grid = [], []
        for i, img in enumerate(images):
            key = hashes[i] if hashes is not None else None
            hit = self._cache.get(key) if key is not None else None
            if hit is None:
                out = self.image_processor(images=[img], return_tensors="pt")
                hit = (out["pixel_values"], out["image_grid_thw"])
                if key is not None:
                    self._cache[key] = hit
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            pv.append(hit[0])
            grid.append(hit[1])
        if not pv:
            return torch.zeros(0), torch.zeros(0, 3, dtype=torch.long)
        return torch.cat(pv), torch.cat(grid)

    def forward_kwargs(self, input_ids: Tensor, attention_mask: Tensor, images_per_row: Sequence[Sequence[Any]],
                       hashes_per_row: Sequence[Sequence[str]] | None = None) -> dict[str, Tensor]:
        """`pixel_values`, `image_grid_thw` (rows' images concatenated in row order) and (4, n, L)
        `position_ids` for a micro-batch; raises ImageTokenMismatch on any count mismatch."""
        flat = [img for row in images_per_row for img in row]
        hashes = None if hashes_per_row is None else [h for row in hashes_per_row for h in row]
        out: dict[str, Tensor] = {}
        grid = None
        if flat:
            pv, grid = self.image_features(flat, hashes)
            dev = input_ids.device
            dtype = next(getattr(self.model, "module", self.model).parameters()).dtype
            out["pixel_values"], out["image_grid_thw"] = pv.to(dev, dtype), grid.to(dev)
        check_image_tokens(input_ids, attention_mask, grid, self.config)
        out["position_ids"] = mrope_position_ids(self.model, input_ids, attention_mask,
                                                 None if grid is None else grid.to(input_ids.device))
        return out


def vl_forward(model: Any, builder: VLInputBuilder, mb: Any, row_images: Sequence[Sequence[Any]],
               row_hashes: Sequence[Sequence[str]] | None = None) -> Any:
    """The learner's forward of one `batching.MicroBatch` of a VL policy (drop-in for the text
    forward in `LearnerWorker._forward_logits`): `row_images`/`row_hashes` are indexed by FlatBatch
    row (`group_row_images(groups)`); a dummy micro-batch (no rows) runs text-only."""
    rows = [int(i) for i in mb.indices.tolist()]
    imgs = [row_images[i] for i in rows] if rows else [[] for _ in range(mb.input_ids.shape[0])]
    hs = None
    if row_hashes is not None and rows:
        hs = [row_hashes[i] for i in rows]
    extra = builder.forward_kwargs(mb.input_ids, mb.attention_mask, imgs, hs)
    return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, **extra,
                 logits_to_keep=mb.response_len + 1, use_cache=False)


# -------------------------------------------------------------------------------------- log-probs
def masked_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0,
                    logit_bias: dict[int, float] | None = None) -> Tensor:
    """log softmax((logits + bias) / T) at `labels` (vLLM applies logit_bias before temperature)."""
    logits = logits.float()
    if logit_bias:
        idx = torch.tensor(list(logit_bias), device=logits.device)
        logits = logits.clone()
        logits[..., idx] += torch.tensor(list(logit_bias.values()), device=logits.device, dtype=logits.dtype)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def vl_response_logprobs(model: Any, builder: VLInputBuilder, prompt_ids: Sequence[int], response_ids: Sequence[int],
                         images: Sequence[Any], *, temperature: float = 1.0,
                         logit_bias: dict[int, float] | None = None) -> Tensor:
    """Per-token log-probs [T] of `response_ids` after `prompt_ids` (processor-expanded) with the
    sample's images: one unpadded sequence through the same path the learner uses."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long)
    attn = torch.ones_like(ids)
    extra = builder.forward_kwargs(ids, attn, [list(images)])
    t = len(response_ids)
    out = model(input_ids=ids, attention_mask=attn, **extra, logits_to_keep=t + 1, use_cache=False)
    return masked_logprobs(out.logits[:, :-1], ids[:, -t:], temperature, logit_bias)[0]
