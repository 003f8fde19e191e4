"""A policy's size at launch, without torch: parameter count, weight bytes and KV-cache bytes per
token from its `config.json` (docs/role_split.md). The role split (`asyncrl.config.role_split`)
uses them to narrow a rollout engine's tensor parallelism when the recipe's TP leaves no GPU for the
learner.

Where the config comes from, in order: `model.path` as a local directory (its `config.json`), the
Hugging Face cache (offline; `huggingface_hub.try_to_load_from_cache`), then `KNOWN_MODELS` below:
a small table of the model ids the original's recipes name, holding the dimensions of each one's
published `config.json`, copied here so that a recipe naming a hub id resolves offline. A model in
none of the three has an unknown size (`None`): the split then keeps its explicit error.

Parameter count of a decoder of the Llama/Qwen family (H hidden, L layers, n_q / n_kv heads of
size d, I the MLP width, V the vocabulary):

    embed   = V*H, and V*H again for an untied output head
    layer   = H*n_q*d + 2*H*n_kv*d + n_q*d*H            (q, k, v, o projections)
              + (n_q + 2*n_kv)*d                          (qkv biases: Qwen2 / Qwen2.5 families)
              + 2*d                                       (q/k norms: Qwen3 families)
              + 3*H*I                                     (gated MLP; MoE: E*3*H*I_e + H*E router)
              + 2*H                                       (two RMSNorms)
    total   = embed + L*layer + H (final norm) + vision tower

The vision tower (VL models) counts its blocks (4*h^2 + 4*h attention, MLP 3*h*I for Qwen2.5-VL's
gated one, 2*h*I + I + h for Qwen3-VL's) and its patch embedding and merger; the unit tests check
the whole count against transformers' own classes built on the meta device (within 1 %).
Hybrid models (Qwen3.5 / Qwen3-Next, `layer_types`): a `linear_attention` layer has a Gated DeltaNet
mixer instead of q/k/v/o (n_k key / n_v value heads of d_k / d_v, conv kernel K; C = 2*n_k*d_k + n_v*d_v):
H*C + H*n_v*d_v + 2*H*n_v (in_proj_qkv, _z, _b, _a) + C*K (conv1d) + 2*n_v (dt_bias, A_log) + d_v (gated
norm) + n_v*d_v*H (out_proj), and holds no per-token KV cache; their full-attention layers' q_proj
is twice as wide (it also emits the output gate).

KV bytes per token = 2 (K and V) * full-attention layers * n_kv * d * dtype bytes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelSize", "KNOWN_MODELS", "model_size", "param_count", "size_from_config"]

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}


@dataclass(frozen=True)
class ModelSize:
    """What the role split needs of a policy; `source` says where the numbers came from."""

    params: int
    dtype_bytes: int
    kv_bytes_per_token: int
    """Over the whole model (every full-attention layer, all KV heads)."""
    kv_heads: int
    source: str

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes


def _text(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("text_config") or cfg.get("llm_config") or cfg


def _vision_params(v: dict[str, Any], out_hidden: int) -> int:
    h, inter, depth = v["hidden_size"], v["intermediate_size"], v["depth"]
    patch = v.get("in_channels", 3) * v.get("temporal_patch_size", 2) * v.get("patch_size", 14) ** 2 * h
    merged = h * v.get("spatial_merge_size", 2) ** 2
    qwen3 = "deepstack_visual_indexes" in v or "num_position_embeddings" in v
    mlp = 2 * h * inter + inter + h if qwen3 else 3 * h * inter
    block = 4 * h * h + 4 * h + mlp + 4 * h  # qkv + proj (with biases), MLP, two norms
    merger = merged * merged + merged + merged * out_hidden + out_hidden  # two linears
    deepstack = len(v.get("deepstack_visual_indexes") or [])
    pos = v.get("num_position_embeddings", 0) * h
    if qwen3:  # patch bias; the main merger's norm is over h (before the 2x2 shuffle), deepstack's over merged
        return depth * block + patch + h + pos + merger + 2 * h + deepstack * (merger + 2 * merged)
    return depth * block + patch + pos + merger + 2 * merged


def _gated_deltanet_params(t: dict[str, Any]) -> int:
    """One Gated DeltaNet (linear-attention) layer's mixer, as transformers' Qwen3.5 builds it."""
    h, kernel = t["hidden_size"], t.get("linear_conv_kernel_dim", 4)
    n_v = t["linear_num_value_heads"]
    dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
    key, value = t["linear_num_key_heads"] * dk, n_v * dv
    conv = 2 * key + value
    return (h * conv + h * value + 2 * h * n_v  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
            + conv * kernel + 2 * n_v + dv + value * h)  # conv1d, dt_bias + A_log, gated norm, out_proj


def param_count(cfg: dict[str, Any]) -> int:
    """Parameters of a model from its config.json (formula in the module docstring)."""
    t = _text(cfg)
    h, layers, vocab = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    n_q = t["num_attention_heads"]
    n_kv = t.get("num_key_value_heads") or n_q
    d = t.get("head_dim") or h // n_q
    model_type = str(cfg.get("model_type", ""))
    attn = h * n_q * d + 2 * h * n_kv * d + n_q * d * h
    if t.get("attention_bias") or model_type.startswith("qwen2"):
        attn += (n_q + 2 * n_kv) * d
    if model_type.startswith("qwen3"):
        attn += 2 * d
    if model_type.startswith(("qwen3_5", "qwen3_next")):
        attn += h * n_q * d  # gated attention: q_proj also emits the output gate
    experts = t.get("num_experts") or t.get("n_routed_experts") or 0
    if experts:
        mlp = experts * 3 * h * t["moe_intermediate_size"] + h * experts
        if t.get("shared_expert_intermediate_size"):
            mlp += 3 * h * t["shared_expert_intermediate_size"] + h
    else:
        mlp = 3 * h * t["intermediate_size"]
    tied = cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    types = t.get("layer_types") or []
    linear = sum(1 for k in types if k == "linear_attention")
    total = vocab * h * (1 if tied else 2) + layers * (mlp + 2 * h) + (layers - linear) * attn + h
    if linear:
        total += linear * _gated_deltanet_params(t)
    if cfg.get("vision_config"):
        total += _vision_params(cfg["vision_config"], cfg["vision_config"].get("out_hidden_size", h))
    return int(total)


def size_from_config(cfg: dict[str, Any], source: str, dtype: str | None = None) -> ModelSize:
    """`ModelSize` of a config.json; `dtype` (the engine's, e.g. the recipe's `bf16`) wins over
    the checkpoint's; neither: 2 bytes (bf16, what GPU engines serve)."""
    t = _text(cfg)
    name = str(dtype or cfg.get("torch_dtype") or cfg.get("dtype") or t.get("torch_dtype") or "bfloat16").lower()
    nbytes = DTYPE_BYTES.get(name.removeprefix("torch."), 2)
    n_q = t["num_attention_heads"]
    n_kv = t.get("num_key_value_heads") or n_q
    d = t.get("head_dim") or t["hidden_size"] // n_q
    types = t.get("layer_types")
    full = sum(1 for k in types if k == "full_attention") if types else t["num_hidden_layers"]
    return ModelSize(param_count(cfg), nbytes, 2 * full * n_kv * d * nbytes, n_kv, source)


def _read_config(path: str) -> tuple[dict[str, Any], str] | None:
    local = Path(path) / "config.json"
    if local.is_file():
        return json.loads(local.read_text()), f"{local}"
    if os.path.isabs(path) or path.startswith(".") or path.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of transformers, always there
        return None
    cached = try_to_load_from_cache(path, "config.json")
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text()), f"{path} config.json (Hugging Face cache)"
    return None


def model_size(path: str, dtype: str | None = None) -> ModelSize | None:
    """The size of `model.path` (a local dir, a cached hub id, or an id in `KNOWN_MODELS`);
    None when it cannot be known offline."""
    found = _read_config(path)
    if found is not None:
        return size_from_config(found[0], found[1], dtype)
    if path in KNOWN_MODELS:
        return size_from_config(KNOWN_MODELS[path], f"{path} (asyncrl's known-model table: its published "
                                "config.json dimensions)", dtype)
    return None


def _qwen(model_type: str, h: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tied: bool,
          **extra: Any) -> dict[str, Any]:
    return {"model_type": model_type, "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "intermediate_size": inter, "vocab_size": vocab,
            "tie_word_embeddings": tied, "torch_dtype": "bfloat16", **extra}


_QWEN25_VIT = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14,
               "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}


def _qwen3_vit(depth: int, h: int, inter: int, out: int, deepstack: list[int]) -> dict[str, Any]:
    return {"depth": depth, "hidden_size": h, "intermediate_size": inter, "num_heads": 16, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3, "out_hidden_size": out,
            "num_position_embeddings": 2304, "deepstack_visual_indexes": deepstack}


def _qwen3_vl(h: int, layers: int, heads: int, kv: int, vocab: int, tied: bool, vision: dict[str, Any],
              **text: Any) -> dict[str, Any]:
    model_type = "qwen3_vl_moe" if "num_experts" in text else "qwen3_vl"
    text_config = {"hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
                   "num_key_value_heads": kv, "head_dim": 128, "vocab_size": vocab, **text}
    return {"model_type": model_type, "text_config": text_config, "vision_config": vision,
            "tie_word_embeddings": tied, "torch_dtype": "bfloat16"}


KNOWN_MODELS: dict[str, dict[str, Any]] = {
    # The policies the original's example recipes name (dimensions of each published config.json).
    "Qwen/Qwen2.5-7B-Instruct": _qwen("qwen2", 3584, 28, 28, 4, 18944, 152064, False),
    "Qwen/Qwen3-4B": _qwen("qwen3", 2560, 36, 32, 8, 9728, 151936, True, head_dim=128),
    "Qwen/Qwen3-14B-Base": _qwen("qwen3", 5120, 40, 40, 8, 17408, 151936, False, head_dim=128),
    "Qwen/Qwen3-32B": _qwen("qwen3", 5120, 64, 64, 8, 25600, 151936, False, head_dim=128),
    "Qwen/Qwen2.5-VL-3B-Instruct": _qwen("qwen2_5_vl", 2048, 36, 16, 2, 11008, 151936, True,
                                         vision_config={**_QWEN25_VIT, "out_hidden_size": 2048}),
    "Qwen/Qwen2.5-VL-7B-Instruct": _qwen("qwen2_5_vl", 3584, 28, 28, 4, 18944, 152064, False,
                                         vision_config={**_QWEN25_VIT, "out_hidden_size": 3584}),
    "Qwen/Qwen2.5-VL-32B-Instruct": _qwen("qwen2_5_vl", 5120, 64, 40, 8, 27648, 152064, False,
                                          vision_config={**_QWEN25_VIT, "out_hidden_size": 5120}),
    "Qwen/Qwen3-VL-4B-Instruct": _qwen3_vl(2560, 36, 32, 8, 151936, True, _qwen3_vit(24, 1024, 4096, 2560, [5, 11, 17]),
                                           intermediate_size=9728),
    "Qwen/Qwen3-VL-8B-Instruct": _qwen3_vl(4096, 36, 32, 8, 151936, False,
                                           _qwen3_vit(27, 1152, 4304, 4096, [8, 16, 24]), intermediate_size=12288),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": _qwen3_vl(2048, 48, 32, 4, 151936, False,
                                                _qwen3_vit(27, 1152, 4304, 2048, [8, 16, 24]),
                                                intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
                                                moe_intermediate_size=768),
}
"""Model id -> the dimensions of its published config.json (only what `param_count` and the KV
cache need), for recipes that name a hub id the launch cannot read offline. A table, not a
download: an id missing here (and not on disk) keeps the role split's explicit error."""


def human_bytes(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)
