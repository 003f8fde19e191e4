"""Parameter names between the trainer's model class and the engine's checkpoint class.

The learner sends HF checkpoint names and the engine resolves them with its own mapper (vLLM's
`hf_to_vllm_mapper`, `reload_weights(..., is_checkpoint_format=True)`; the native weight-transfer API
takes the same names). That holds when the trainer's class is the checkpoint's class. It breaks for a
natively multimodal family used as a text policy: a Qwen3.5 checkpoint ships as
`Qwen3_5ForConditionalGeneration` (names `model.language_model.*`, `model.visual.*`, `lm_head.*`),
while `AutoModelForCausalLM` loads its text part as `Qwen3_5ForCausalLM` (names `model.*`), and the
engine, built from the checkpoint's `architectures`, cannot resolve `model.embed_tokens.weight`
(TRL #5269, open-rl #229). `checkpoint_name` puts the trainer's names back under the checkpoint's
prefix; the vision tower, which the text trainer does not hold, is never sent and keeps its loaded
weights in the engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

__all__ = ["checkpoint_name_map", "TEXT_UNDER_LANGUAGE_MODEL"]

TEXT_UNDER_LANGUAGE_MODEL = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                             "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
"""Checkpoint classes whose text decoder lives under `model.language_model.` (transformers 5)."""


def _identity(name: str) -> str:
    return name


def checkpoint_name_map(model_path: str, trainer_names: list[str]) -> Callable[[str], str]:
    """`name -> checkpoint name` for the trainer's parameters of the checkpoint at `model_path`:
    the identity unless a text-only class holds a checkpoint of a class in
    `TEXT_UNDER_LANGUAGE_MODEL` (then `model.X` -> `model.language_model.X`; `lm_head.*` stays)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return _identity
    arch = (json.loads(config.read_text()).get("architectures") or [""])[0]
    text_only = any(n.startswith("model.layers.") for n in trainer_names) and \
        not any(n.startswith("model.language_model.") for n in trainer_names)
    if arch not in TEXT_UNDER_LANGUAGE_MODEL or not text_only:
        return _identity

    def rename(name: str) -> str:
        return "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name

    return rename
