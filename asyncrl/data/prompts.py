"""Prompt data shipped with asyncrl: the Guided-GRPO verifier prompt and student prompts.

The texts live byte-identical to Guided-GRPO (Apache-2.0) as package data of `asyncrl.data` (see
its NOTICE.md); this module only reads them. Follows the original: the verifier template and a rendered format
prompt are used stripped of surrounding whitespace, exactly as Guided-GRPO does at runtime.
Importing this module imports no torch, ray or vllm.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

__all__ = [
    "read_data_file",
    "default_verifier_template",
    "resolve_verifier_template",
    "student_system_prompt",
    "format_prompt_template",
    "FORMAT_PROMPTS",
]

FORMAT_PROMPTS: dict[str, str] = {
    "math": "format_prompt/math.jinja",
    "guided_math": "format_prompt/math.jinja",  # Guided-GRPO trains with the math prompt
    "r1v": "format_prompt/r1v.jinja",
    "dapo": "format_prompt/dapo.jinja",
}
"""Built-in `data.format_prompt` names -> files shipped in the `asyncrl.data` package."""


@cache
def read_data_file(relpath: str) -> str:
    """Exact text (UTF-8, newlines untouched) of a file shipped in the `asyncrl.data` package."""
    ref = resources.files("asyncrl.data").joinpath(*relpath.split("/"))
    return ref.read_bytes().decode("utf-8")


def default_verifier_template() -> str:
    """Guided-GRPO's default verifier system prompt, stripped (its runtime value)."""
    return read_data_file("verifier_prompt.txt").strip()


def resolve_verifier_template(template: str | None) -> str:
    """`rollout.guide.prompt_template` -> the system prompt sent to the verifier.

    None means the shipped default; any given text is stripped, as the original does."""
    return default_verifier_template() if template is None else template.strip()


def student_system_prompt() -> str:
    """Guided-GRPO's student system prompt (`data.system_prompt: guided`), stripped."""
    return read_data_file("student_system_prompt.txt").strip()


def format_prompt_template(name: str) -> str:
    """Jinja2 source of a built-in format prompt (`math`, `guided_math`, `r1v`, `dapo`).

    Returned unstripped; the data stream strips it before rendering, as Guided-GRPO does."""
    try:
        return read_data_file(FORMAT_PROMPTS[name])
    except KeyError:
        raise KeyError(f"unknown built-in format prompt {name!r}; choose one of {sorted(FORMAT_PROMPTS)}") from None
