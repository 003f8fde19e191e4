"""From a row to chat messages: format prompts (Jinja2), `<image>` markers, the system prompt.

Follows Guided-GRPO (docs/guided_grpo.md#data-format): the question rendered through the Jinja2
`format_prompt` (file content stripped, variable `content`; built-in names read the
byte-identical copies shipped in this package, `asyncrl.data.prompts`), `<image>` markers
reconciled with the image count, an optional system message, one user message (a content list
when the row has images or videos).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncrl.config import DataConfig
from asyncrl.data.prompts import FORMAT_PROMPTS, format_prompt_template, student_system_prompt

__all__ = ["STUDENT_SYSTEM_PROMPT_NAME", "load_format_prompt", "build_messages"]

STUDENT_SYSTEM_PROMPT_NAME = "guided"
"""`data.system_prompt: guided` selects Guided-GRPO's student system prompt (shipped in this package)."""

_TEMPLATE_CACHE: dict[str, Any] = {}


def load_format_prompt(name_or_path: str | None) -> Any:
    """A compiled Jinja2 template: a built-in name (`math`, `guided_math`, `r1v`, `dapo`) or a file
    (content stripped, as in Guided-GRPO). None -> None (the question as is)."""
    if name_or_path is None:
        return None
    if name_or_path not in _TEMPLATE_CACHE:
        import jinja2

        if name_or_path in FORMAT_PROMPTS:
            text = format_prompt_template(name_or_path).strip()
        elif Path(name_or_path).expanduser().is_file():
            text = Path(name_or_path).expanduser().read_text(encoding="utf-8").strip()
        else:
            raise ValueError(f"data.format_prompt {name_or_path!r}: neither a built-in "
                             f"({', '.join(FORMAT_PROMPTS)}) nor an existing file")
        _TEMPLATE_CACHE[name_or_path] = jinja2.Template(text)
    return _TEMPLATE_CACHE[name_or_path]


def _reconcile_markers(prompt: str, marker: str, k: int) -> str:
    """Guided-GRPO's marker rule for k images: 0 markers -> prepend one; more than k -> keep the
    first k; fewer -> prepend the missing ones."""
    count = prompt.count(marker)
    if count == 0:
        return marker + "\n" + prompt
    if count > k:
        pieces = prompt.split(marker)
        return marker.join(pieces[: k + 1]) + "".join(pieces[k + 1:])
    if count < k:
        return (marker + "\n") * (k - count) + prompt
    return prompt


def _content_list(prompt: str, marker: str, kind: str) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = []
    for i, piece in enumerate(prompt.split(marker)):
        if i > 0:
            content.append({"type": kind})
        if piece:
            content.append({"type": "text", "text": piece})
    return content


def build_messages(row: Mapping[str, Any], cfg: DataConfig | None = None) -> list[dict[str, Any]]:
    """OpenAI-style messages for one row, as Guided-GRPO builds them: [system] + one user message whose
    content is a string, or a list of text/image (or video) items when the row has the image
    (video) column."""
    cfg = cfg or DataConfig()
    prompt = row[cfg.prompt_key]
    template = load_format_prompt(cfg.format_prompt)
    if template is not None:
        prompt = template.render(content=prompt)
    messages: list[dict[str, Any]] = []
    if cfg.system_prompt:
        messages.append({"role": "system",
                         "content": student_system_prompt() if cfg.system_prompt == STUDENT_SYSTEM_PROMPT_NAME else cfg.system_prompt})
    # As the original: a row that HAS the image (video) column gets a content list, even when the
    # list is empty; markers are reconciled only when there are images.
    if cfg.image_key in row:
        images = row.get(cfg.image_key) or []
        k = len(images) if isinstance(images, (list, tuple)) else 1
        if k > 0:
            prompt = _reconcile_markers(prompt, "<image>", k)
        messages.append({"role": "user", "content": _content_list(prompt, "<image>", "image")})
    elif cfg.video_key in row:
        messages.append({"role": "user", "content": _content_list(prompt, "<video>", "video")})
    else:
        messages.append({"role": "user", "content": prompt})
    return copy.deepcopy(messages)
