"""Wire format of the weight broadcast: named tensors packed into flat per-dtype buckets of about
`bucket_mb` (each bucket is ONE collective), a JSON manifest per bucket
(`{"dtype", "numel", "params": [[name, shape, offset], ...]}`), and the integrity fingerprint:
float64 sum and |sum| of 64 elements at indices fixed by each tensor's name, so the sender, every
receiver and every engine compare exactly the same elements. Pure torch, no I/O.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

PREFIX = "asyncrl_w"
"""Key prefix of every weight-protocol key in the rendezvous store."""
NamedTensor = tuple[str, torch.Tensor]
WeightsInput = Iterable["NamedTensor | list[NamedTensor]"]

_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
            torch.int8, torch.uint8, torch.bool)}


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


def _flatten(items: WeightsInput) -> Iterator[NamedTensor]:
    """Accept (name, tensor) pairs or buckets (lists) of them, as `export_named_tensors` yields."""
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield item
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], dict):
            yield from unpack_bucket(*item)  # an already packed (manifest, flat) bucket
        else:
            yield from item


def pack_buckets(items: WeightsInput, bucket_bytes: int) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    """Pack named tensors into flat per-dtype buckets of about `bucket_bytes` (a larger tensor gets
    its own bucket). Yields `(manifest, flat)`; `flat` is on the tensors' device, contiguous.
    Tensors are consumed lazily so a ZeRO-3 exporter never holds more than a bucket or two."""
    pending: dict[torch.dtype, list[NamedTensor]] = {}
    sizes: dict[torch.dtype, int] = {}

    def emit(dtype: torch.dtype) -> tuple[dict[str, Any], torch.Tensor]:
        group = pending.pop(dtype)
        sizes.pop(dtype)
        params, offset = [], 0
        for name, t in group:
            params.append([name, list(t.shape), offset])
            offset += t.numel()
        flat = torch.cat([t.detach().reshape(-1) for _, t in group]) if len(group) > 1 \
            else group[0][1].detach().reshape(-1).contiguous()
        return {"dtype": str(dtype).removeprefix("torch."), "numel": offset, "params": params}, flat

    for name, tensor in _flatten(items):
        dtype = tensor.dtype
        pending.setdefault(dtype, []).append((name, tensor))
        sizes[dtype] = sizes.get(dtype, 0) + tensor.numel() * tensor.element_size()
        if sizes[dtype] >= bucket_bytes:
            yield emit(dtype)
    for dtype in list(pending):
        yield emit(dtype)


def unpack_bucket(manifest: dict[str, Any], flat: torch.Tensor) -> list[NamedTensor]:
    """Views of `flat` named and shaped by `manifest` (no copy)."""
    out = []
    for name, shape, offset in manifest["params"]:
        numel = 1
        for s in shape:
            numel *= s
        out.append((name, flat[offset:offset + numel].view(shape)))
    return out


# ---- integrity fingerprint -------------------------------------------------------------------
FINGERPRINT_SAMPLES = 64
_INDEX_CACHE: dict[tuple[str, int], torch.Tensor] = {}


def sample_index(name: str, numel: int, k: int = FINGERPRINT_SAMPLES) -> torch.Tensor:
    """The fixed random element indices sampled from parameter `name` (seeded by the name alone,
    so the learner, every receiver and every engine pick the same elements)."""
    key = (name, numel)
    idx = _INDEX_CACHE.get(key)
    if idx is None:
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        idx = _INDEX_CACHE[key] = torch.randint(0, numel, (min(k, numel),), generator=g)
    return idx


def sample_values(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The sampled elements of `tensor` (its own dtype, on the CPU): what fingerprints compare."""
    flat = tensor.detach().reshape(-1)
    return flat[sample_index(name, flat.numel()).to(flat.device)].cpu()


def fingerprint_of(samples: torch.Tensor) -> list[float]:
    """[sum, sum of |x|] of sampled elements in float64; equal inputs give bit-equal outputs."""
    v = samples.double()
    return [float(v.sum()), float(v.abs().sum())]


def bucket_fingerprint(manifest: dict[str, Any], flat: torch.Tensor) -> dict[str, list[float]]:
    """Fingerprint of every tensor of one packed bucket (one device-to-host copy per bucket)."""
    views = unpack_bucket(manifest, flat)
    if not views:
        return {}
    picked = torch.cat([v.reshape(-1)[sample_index(n, v.numel()).to(v.device)] for n, v in views]).cpu()
    out, at = {}, 0
    for n, v in views:
        k = min(FINGERPRINT_SAMPLES, v.numel())
        out[n] = fingerprint_of(picked[at:at + k])
        at += k
    return out


def fingerprint_mismatches(expected: dict[str, list[float]], got: dict[str, list[float]]) -> list[str]:
    """Names whose fingerprints differ (or that are missing from `got`); exact comparison, since
    both sides sum the same elements of the same dtype in the same order."""
    return [n for n, fp in expected.items() if got.get(n) != fp]

