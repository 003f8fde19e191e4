"""The prompt data of a job: datasets, prompt templates, message building, the prompt stream.

Layout:
- `sources`: dataset specs (`path[@split]`, local files or hub ids), row loading with checks, the
  overlong-prompt filter, and `load_training_rows`, the loader the job uses;
- `messages`: format prompts (Jinja2), `<image>` markers, the system prompt -> chat messages;
- `stream`: `PromptStream`, the endless deterministic resumable order the coordinator draws from;
- `prompts`: the Guided-GRPO prompt texts shipped as package data (`verifier_prompt.txt`,
  `student_system_prompt.txt`, `format_prompt/*.jinja`; see NOTICE.md).

Follows Guided-GRPO's data format (docs/guided_grpo.md#data-format). Images and videos are
carried through as they are stored (decoding, resizing and processor expansion belong to the
vision-language path, asyncrl.vision).
"""

from __future__ import annotations

from asyncrl.data.messages import STUDENT_SYSTEM_PROMPT_NAME, build_messages, load_format_prompt
from asyncrl.data.prompts import FORMAT_PROMPTS
from asyncrl.data.sources import (
    derive_max_steps,
    filter_overlong_prompts,
    has_preloaded_rows,
    load_rows,
    load_training_rows,
    parse_data_spec,
    preload_training_rows,
)
from asyncrl.data.stream import PromptItem, PromptStream, make_item

__all__ = [
    "FORMAT_PROMPTS",
    "STUDENT_SYSTEM_PROMPT_NAME",
    "PromptItem",
    "PromptStream",
    "build_messages",
    "derive_max_steps",
    "filter_overlong_prompts",
    "has_preloaded_rows",
    "load_format_prompt",
    "load_rows",
    "load_training_rows",
    "make_item",
    "parse_data_spec",
    "preload_training_rows",
]
