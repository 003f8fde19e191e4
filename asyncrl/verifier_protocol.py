"""What crosses the policy/verifier boundary as text: the request, the reply, the answer check.

Follows Guided-GRPO (docs/guided_grpo.md#verifier-request to #hallucination-score) where it is
data the released verifier was trained on, and departs where the original is fragile:

- `render_verifier_messages` reproduces the original's request byte for byte: system = the template,
  stripped; user = `### Problem Statement` / `### Reference Answer` / `### Conversation History`,
  one `Assistant: ` line per policy turn (the verifier never sees its own earlier guidance),
  `[IMAGE]` / `[VIDEO]` placeholders, `N/A` for a missing or empty reference.
- `has_final_answer` is the original's final-answer rule exactly (whitespace around `<`, `>`, `/`
  removed, exactly one `<answer>` and `</answer>`, exactly one `\\boxed{` ... `}` inside, dot matching newlines).
- `parse_verifier_reply` DEPARTS (docs/guided_grpo.md#bug-stop-detection). The original treats a
  reply as STOP only if it *starts* with the stop token, so a Qwen3 verifier's `<think>` block or a leading score line
  breaks termination, a STOP reply's score is thrown away, and the `[SCORE]` line is shown to the
  policy. asyncrl parses structurally: `<think>` blocks are removed; the `[SCORE]
  hallucination_detect=0|1` value is read (also from STOP replies) and its text is removed from
  the guidance unless `show_score_to_policy`; a leading `user:` is stripped. The reply is STOP when
  what is left starts with the stop token (the original's rule, so `###STOP####` and
  `###STOP###\n...` still stop), or the stop token stands alone on any line (give or take extra
  `#`s, quotes, `*`/backtick markdown, a final period), or nothing readable is left (empty, or no
  ASCII letter or digit: the original's "abnormal" rule). Every reply without think tags that the
  original reads as STOP is STOP here too (a property test checks it). A stop token inside a sentence (`Correct. ###STOP###`) stays guidance, as in
  the original: a verifier writing "do not send ###STOP### yet" must not end a conversation; the
  text is passed on verbatim.
- `aggregate_hallucination` is the original's: mean of the scored turns, 0.5 when none.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "VerifierReply",
    "flatten_content",
    "render_verifier_user_content",
    "render_verifier_messages",
    "parse_verifier_reply",
    "has_final_answer",
    "aggregate_hallucination",
    "SCORE_PATTERN",
    "NEUTRAL_HALLUCINATION_SCORE",
]

SCORE_PATTERN = re.compile(r"\[SCORE\]\s*hallucination_detect\s*=\s*([01])")
"""Guided-GRPO's score regex (first match anywhere wins)."""
NEUTRAL_HALLUCINATION_SCORE = 0.5
"""Score of a conversation none of whose verifier turns carried a score (the original's
neutral value)."""

_CLOSING_LINE = "Provide the next piece of guidance following the rules above."
_ALNUM = re.compile(r"[A-Za-z0-9]")
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def flatten_content(content: Any) -> str:
    """Chat content -> text as the original's verifier sees it: text items as is, image items
    `[IMAGE]`, video items `[VIDEO]`, joined with newlines, empty parts dropped."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for item in content:
            if isinstance(item, dict):
                kind = item.get("type")
                if kind == "text":
                    parts.append(item.get("text", ""))
                elif kind == "image":
                    parts.append("[IMAGE]")
                elif kind == "video":
                    parts.append("[VIDEO]")
        return "\n".join(p for p in parts if p)
    return str(content)


def render_verifier_user_content(problem: Any, reference: str | None, policy_turns: Sequence[Any]) -> str:
    """The user message of a verifier request (docs/guided_grpo.md#verifier-request), byte-exact."""
    conversation = "\n".join(f"Assistant: {flatten_content(t)}" for t in policy_turns)
    return (
        f"### Problem Statement\n{flatten_content(problem)}\n\n"
        f"### Reference Answer\n{reference or 'N/A'}\n\n"
        f"### Conversation History\n{conversation}\n\n"
        f"{_CLOSING_LINE}"
    )


def render_verifier_messages(
    problem: Any, reference: str | None, policy_turns: Sequence[Any], template: str | None = None
) -> list[dict[str, str]]:
    """OpenAI chat messages `[system, user]` for one verifier call.

    `problem`: the first user message's content (str or content list); `reference`: the reference
    answer, or None/"" for `N/A` (the caller applies `verifier_sees_reference`); `policy_turns`:
    the policy's turns in order (decoded text); `template`: the verifier system prompt, None = the
    shipped Guided-GRPO default. The template is stripped, as in the original."""
    from asyncrl.data.prompts import resolve_verifier_template

    return [
        {"role": "system", "content": resolve_verifier_template(template)},
        {"role": "user", "content": render_verifier_user_content(problem, reference, policy_turns)},
    ]


@dataclass(frozen=True)
class VerifierReply:
    """A parsed verifier reply.

    kind: `stop` or `guidance`. guidance: the text to show the policy as the next user turn
    ("" for stop). hallucination: the `[SCORE]` value (0 or 1) or None when absent.
    stop_cause: why it is a stop (`stop_token`, `empty`, `abnormal`), "" for guidance."""

    kind: Literal["stop", "guidance"]
    guidance: str
    hallucination: int | None
    stop_cause: str = ""


def _strip_think(text: str) -> str:
    text = _THINK_BLOCK.sub("", text)
    lowered = text.lower()
    close = lowered.rfind("</think>")
    if close >= 0:  # the template opened the block in the prompt: drop everything before its end
        text = text[close + len("</think>") :]
        lowered = text.lower()
    opened = lowered.find("<think>")
    if opened >= 0:  # unterminated thinking (cut by max_tokens): nothing after it is guidance
        text = text[:opened]
    return text


_DECOR = " \t*_`'\".!"  # markdown/quotes/punctuation a model may wrap a lone stop token in


def _is_stop_line(line: str, stop_token: str) -> bool:
    """The line is the stop token alone, give or take extra trailing `#`s and decoration."""
    s = line.strip(_DECOR)
    if not stop_token or not s.startswith(stop_token):
        return False
    return s[len(stop_token) :].strip("#" + _DECOR) == ""


def parse_verifier_reply(text: str | None, stop_token: str = "###STOP###", *,
                         show_score_to_policy: bool = False) -> VerifierReply:
    """Classify one verifier reply structurally (see the module docstring for the rules).

    Guarantees: once think blocks, the score and a leading `user:` are removed, `kind == "stop"`
    iff the text starts with the stop token, or the token stands alone on a line, or no ASCII
    letter/digit remains; `hallucination` is the first score anywhere in the reply outside think blocks;
    guidance never contains a `<think>` block and, unless `show_score_to_policy`, no score text."""
    stop_token = (stop_token or "").strip()
    body = _strip_think(str(text or "")).strip()
    match = SCORE_PATTERN.search(body)
    score = int(match.group(1)) if match else None
    without_score = body
    if match:  # remove every score (a line left empty by it goes entirely)
        kept = []
        for ln in body.splitlines():
            if SCORE_PATTERN.search(ln):
                ln = SCORE_PATTERN.sub("", ln).rstrip()
                if not ln.strip():
                    continue
            kept.append(ln)
        without_score = "\n".join(kept).strip()

    def unprefix(s: str) -> str:
        s = s.strip()
        return s.split(":", 1)[1].lstrip() if s.lower().startswith("user:") else s

    clean = unprefix(without_score)
    if clean.startswith(stop_token) or any(_is_stop_line(ln, stop_token) for ln in clean.splitlines()):
        return VerifierReply("stop", "", score, "stop_token")
    if not clean:
        return VerifierReply("stop", "", score, "empty")
    if not _ALNUM.search(clean):
        return VerifierReply("stop", "", score, "abnormal")
    guidance = unprefix(body) if show_score_to_policy else clean
    return VerifierReply("guidance", guidance, score)


def has_final_answer(text: str) -> bool:
    """Guided-GRPO's final-answer rule exactly: one `<answer>...</answer>` holding exactly one
    `\\boxed{...}`."""
    normalized = re.sub(r"\s*(<|>|/)\s*", r"\1", text)
    if normalized.count("<answer>") != 1 or normalized.count("</answer>") != 1:
        return False
    match = re.search(r"<answer>(.*)</answer>", normalized, re.DOTALL)
    if match is None:
        return False
    return len(re.findall(r"\\boxed\{.*?\}", match.group(1), re.DOTALL)) == 1


def aggregate_hallucination(scores: Sequence[int | float | None]) -> float:
    """Per-conversation score: mean of the turns that carried a score, 0.5 when none."""
    scored = [float(s) for s in scores if s is not None]
    return sum(scored) / len(scored) if scored else NEUTRAL_HALLUCINATION_SCORE
