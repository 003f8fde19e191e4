"""A model directory's config read without loading the model: its text part, vision type, chat
template and context length, for the preflight checks (`asyncrl.checks.preflight`). Plain JSON:
no torch, transformers or vLLM import unless the config names none of the context keys.

The policy's context follows vLLM 0.32's own derivation (`vllm.config.model._get_and_verify_max_len`
with `ModelArchConfigConvertor.derive_max_model_len_and_key`), on the text part of the config
(`text_config` of a vision-language model, as `get_hf_text_config`):
- the smallest of `max_position_embeddings`, `n_positions`, `max_seq_len`, `seq_length`,
  `model_max_length`, `max_target_positions`, `max_sequence_length`, `max_seq_length`, `seq_len`,
  except that a `model_max_length` of the text config wins outright (Command-R);
- not capped by the tokenizer's `model_max_length` (vLLM reads it only for pooling models with
  absolute positions, `ModelConfig.get_and_verify_max_len`);
- times the RoPE `factor` unless the rope type is su/longrope/llama3/yarn/deepseek_yarn/
  deepseek_llama_scaling (their `max_position_embeddings` is already scaled) or the model is gemma3;
- a sliding window does not cap it (vLLM does so only with `disable_sliding_window`, never set here);
- a configured `max_model_len` above it is refused unless the config's `model_max_length` allows
  it or `VLLM_ALLOW_LONG_MAX_MODEL_LEN` is set. With none of the keys vLLM assumes 2048; here the
  config is then read through transformers' `AutoConfig`, whose class defaults vLLM sees too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# vLLM 0.32, ModelArchConfigConvertor.derive_max_model_len_and_key: candidates, the smallest wins.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# vLLM 0.32, _get_and_verify_max_len: rope types whose max_position_embeddings is already scaled.
PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
# transformers' get_text_config: where a composite config keeps its text model.
TEXT_CONFIG_NAMES = ("text_encoder", "decoder", "generator", "text_config")
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


@dataclass
class Context:
    """A model's context length as vLLM derives it, and where the number comes from."""

    tokens: int
    source: str  # e.g. "max_position_embeddings=1024 in assets/tiny-policy/config.json"
    allows: int = 0  # a configured max_model_len up to this passes vLLM's check (model_max_length / env)


@dataclass
class ModelFiles:
    """What the checks read of one model directory: its config and its tokenizer's files."""

    key: str  # the config key naming it: model.path or verifier.model_path
    path: Path
    tokenizer_path: Path
    config: dict[str, Any]
    tokenizer_config: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> dict[str, Any]:
        """The text model's part of the config (vLLM's `hf_text_config`)."""
        found = [self.config[n] for n in TEXT_CONFIG_NAMES if isinstance(self.config.get(n), dict)]
        return found[0] if len(found) == 1 else self.config

    @property
    def is_vl(self) -> bool:
        return self.config.get("model_type", "") in VL_MODEL_TYPES

    def has_chat_template(self) -> bool:
        """Where transformers looks: tokenizer_config.json's `chat_template`, chat_template.jinja,
        chat_template.json (processors), additional_chat_templates/."""
        t = self.tokenizer_path
        return bool(self.tokenizer_config.get("chat_template")) or (t / "chat_template.jinja").is_file() or \
            (t / "chat_template.json").is_file() or any((t / "additional_chat_templates").glob("*.jinja"))


def read_model(key: str, path: str, tokenizer_path: str | None) -> ModelFiles:
    """The config of a local model directory (already resolved); ValueError naming `key` if unreadable."""
    directory = Path(path)
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{key}={path}: no readable config.json ({type(exc).__name__}: {exc})") from None
    tok = Path(tokenizer_path or path)
    try:
        tok_cfg = json.loads((tok / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tok_cfg = {}
    return ModelFiles(key, directory, tok, config, tok_cfg)


def model_context(model: ModelFiles) -> Context:
    """The model's context length, derived as vLLM 0.32 derives it (see the module docstring)."""
    text = model.text
    where = f"in {model.path}/config.json"
    tokens, key = float("inf"), None
    for name in CONTEXT_KEYS:
        value = text.get(name)
        if isinstance(value, (int, float)) and value < tokens:
            tokens, key = value, name
    if isinstance(text.get("model_max_length"), (int, float)) and text["model_max_length"]:
        tokens, key = text["model_max_length"], "model_max_length"
    if key is None:  # class defaults fill the keys: read them the way vLLM does
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(model.path)).get_text_config()
        text = {**hf.to_dict(), **text}
        return model_context(ModelFiles(model.key, model.path, model.tokenizer_path,
                                        {**model.config, "text_config": text}, model.tokenizer_config))
    source = f"{key}={tokens:g} {where}"
    factor = rope_factor(text, model.config.get("model_type", ""))
    if factor != 1.0:
        tokens, source = tokens * factor, f"{source} x RoPE factor {factor:g}"
    allows = int(text.get("model_max_length") or 0)
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").lower() in ("1", "true"):
        allows = 1 << 40
    return Context(int(tokens), source, allows)


def rope_factor(text: dict[str, Any], model_type: str) -> float:
    """vLLM's scaling of the derived length: the last `factor` of the rope parameters whose type
    is not pre-scaled (transformers' `rope_parameters`, or a legacy `rope_scaling`)."""
    params = text.get("rope_parameters") or text.get("rope_scaling")
    if not isinstance(params, dict) or not params or "gemma3" in model_type:
        return 1.0
    nested = all(isinstance(v, dict) for v in params.values())
    factor = 1.0
    for p in (params.values() if nested else [params]):
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in PRESCALED_ROPE:
            factor = p.get("factor", factor)
    return 1.0 if factor is None else float(factor)


def max_model_len_error(model: ModelFiles, ctx: Context, key: str, value: int) -> str | None:
    """vLLM's refusal of a configured max_model_len, phrased for the config key, or None."""
    if value <= ctx.tokens or (ctx.allows and value <= ctx.allows):
        return None
    return (f"{key}={value} exceeds the context of {model.key}={model.path}: {ctx.tokens} tokens "
            f"({ctx.source})")
