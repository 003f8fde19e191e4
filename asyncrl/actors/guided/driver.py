"""Engine-agnostic async driver of guided conversations.

The rollout actor (vLLM), the evaluation command and the tests share this code; they differ
only in the two injected callables:

- `generate(prompt_ids, seed) -> (token_ids, logprobs, version, finish_reason)` (or an object
  with those attributes): one policy turn. The caller binds max_tokens, temperature, ... .
- `verify(messages) -> VerifierResult` (`ok`, `text`, `version`, `error`, optional `latency_ms`;
  a dict with those keys or a plain reply string also work): one verifier call. It must not raise
  for remote failures (asyncrl.serve's client returns ok=False); exceptions propagate, because
  they are bugs, not verifier errors.

All conversations of a group share one prompt, so a multimodal actor binds the group's images
into its `generate` closure (one closure per group). Conversations of a group run concurrently
and independently (continuous batching in the engine does the rest); the original runs every turn
in lock-step over the whole batch (docs/guided_grpo.md#bug-lock-step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.actors.guided.chat import PolicyChat
from asyncrl.actors.guided.conversation import Conversation, GenerateStep, sample_seed
from asyncrl.actors.guided.options import GuideOptions

__all__ = [
    "GenerateFn",
    "VerifyFn",
    "VerifyOutcome",
    "GroupDropped",
    "make_group",
    "run_conversation",
    "run_group",
    "rule_verify",
]

GenerateFn = Callable[[list[int], "int | None"], Awaitable[Any]]
VerifyFn = Callable[[list[dict[str, str]]], Awaitable[Any]]


@dataclass(frozen=True)
class VerifyOutcome:
    """Minimal verifier result (same field names as asyncrl.serve.client.VerifierResult)."""

    ok: bool
    text: str
    version: str | None = None
    error: str | None = None
    latency_ms: float | None = None


class GroupDropped(Exception):
    """A conversation of the group hit a verifier error under on_error=drop_group; the caller must
    not push the group (release its ticket) and should count it."""

    def __init__(self, conversations: list[Conversation]):
        super().__init__("group dropped after a verifier error (rollout.guide.on_error=drop_group)")
        self.conversations = conversations


def _unpack_generation(out: Any) -> tuple[list[int], list[float] | None, int, str]:
    if isinstance(out, tuple | list):
        token_ids, logprobs, version, finish_reason = out
    else:
        token_ids, logprobs = out.token_ids, out.logprobs
        version, finish_reason = out.version, out.finish_reason
    return list(token_ids), (None if logprobs is None else list(logprobs)), int(version), str(finish_reason)


async def run_conversation(conv: Conversation, generate: GenerateFn, verify: VerifyFn) -> Conversation:
    """Drive `conv` to its end, one request at a time; returns it (finished)."""
    while (step := conv.next_step()) is not None:
        if isinstance(step, GenerateStep):
            conv.on_generated(*_unpack_generation(await generate(step.prompt_ids, step.seed)))
        else:
            conv.on_verified(await verify(step.messages))
    return conv


def make_group(messages: list[dict[str, Any]], *, chat: PolicyChat, options: GuideOptions, n: int,
               ground_truth: str | None = None, base_seed: int | None = 1, prompt_index: int = 0,
               prompt_ids: list[int] | None = None, prompt_uid: str = "") -> list[Conversation]:
    """`n` independent conversations of one prompt, each with its own seed (`sample_seed`) and uid
    `{prompt_uid}/{i}`. The initial prompt is tokenised once and shared (copied)."""
    ids = list(prompt_ids) if prompt_ids is not None else chat.encode_prompt(messages)
    return [
        Conversation(messages, chat=chat, options=options, ground_truth=ground_truth, prompt_ids=ids,
                     seed=None if base_seed is None else sample_seed(base_seed, prompt_index, i),
                     uid=f"{prompt_uid}/{i}", prompt_uid=prompt_uid)
        for i in range(n)
    ]


async def run_group(conversations: Sequence[Conversation], generate: GenerateFn, verify: VerifyFn) -> list[Conversation]:
    """Run all conversations concurrently; returns them in order once all are finished.

    Under on_error=drop_group the first conversation that ends with a dropping verifier error
    cancels the others and `GroupDropped` is raised. Any exception cancels the rest and propagates."""
    convs = list(conversations)
    tasks = [asyncio.ensure_future(run_conversation(c, generate, verify)) for c in convs]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t.result().drop_group:
                    raise GroupDropped(convs)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return convs


def rule_verify(fn: Callable[[list[dict[str, str]]], str], version: str = "rule") -> VerifyFn:
    """Adapt a synchronous rule verifier (`asyncrl.tasks.get_rule_verifier(task)`) to `verify`."""

    async def verify(messages: list[dict[str, str]]) -> VerifyOutcome:
        return VerifyOutcome(ok=True, text=fn(messages), version=version)

    return verify
