"""From a finished conversation to what the learner trains on (docs/guided_grpo.md#train-scope) and its metadata.

`final_turn` follows the original: prompt = the exact context of the last policy turn,
response = that turn's sampled ids; earlier turns are context only. Departure: the original
left-pads/truncates the prompt to `max_prompt_length` after sampling (docs/guided_grpo.md#bug-prompt-truncation); here the
prompt is the context the engine really saw (the budget was enforced before generating), and
padding is the learner's business.

`full_turn` is the README's advertised mode the original never implemented: prompt = the
first turn's context; response = every later token in order: policy turn 1 (through its
end-of-turn token), the user turn after it (template + verifier text + next assistant header),
policy turn 2, ..., the last policy turn. `response_mask` is 1 exactly on tokens the policy
sampled (each turn through its first end-of-turn token, the original's EOS rule applied per
turn) and 0 on every template/verifier token, so the learner's log-probs at mask-1 positions are
computed on exactly the context each token was sampled in. That holds only if no history was
dropped for the prompt budget: a conversation that dropped turns falls back to `final_turn` for
that sample (`TrainingSample.fallback`, counted in the metadata); the length
of a full_turn sample is then at most max_prompt_length + max_response_length by construction.

`behaviour_logprobs` hold the engine's logprob of each sampled token (0 where mask 0) and
`token_versions` the policy version that sampled it (-1 where mask 0), aligned with `response_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from asyncrl.actors.guided.conversation import Conversation

__all__ = ["TrainingSample", "build_training_sample", "sample_metadata"]


@dataclass(frozen=True)
class TrainingSample:
    """Arrays with the dtypes of `asyncrl.protocol.Sample`; all response arrays have one length."""

    prompt_ids: np.ndarray  # int32[P]
    response_ids: np.ndarray  # int32[T]
    response_mask: np.ndarray  # int8[T]
    behaviour_logprobs: np.ndarray  # float32[T]
    token_versions: np.ndarray  # int32[T]
    scope: Literal["final_turn", "full_turn"]
    """The scope actually used (full_turn may have fallen back)."""
    fallback: bool = False
    """full_turn was asked for but history had been dropped, so final_turn was used."""


def _turn_mask(ids: list[int], eos: frozenset[int]) -> list[int]:
    """1 up to and including the first end-of-turn token, 0 after (the original's EOS rule)."""
    out, seen = [], False
    for t in ids:
        out.append(0 if seen else 1)
        seen = seen or t in eos
    return out


def build_training_sample(conversation: Conversation, scope: str | None = None) -> TrainingSample:
    """Training arrays for `conversation` under `scope` (default: its options' train_scope)."""
    conv = conversation
    scope = scope or conv.options.train_scope
    if scope not in ("final_turn", "full_turn"):
        raise ValueError(f"unknown train scope {scope!r}")
    if not conv.turns:
        raise ValueError("conversation has no policy turn")
    eos = conv.chat.eos_token_ids
    fallback = False
    if scope == "full_turn" and (conv.options.history != "full" or any(t.dropped_turns for t in conv.turns)):
        scope, fallback = "final_turn", True
    turns = conv.turns if scope == "full_turn" else conv.turns[-1:]
    prompt = conv.initial_ids if scope == "full_turn" else conv.turns[-1].prompt_ids
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    vers: list[int] = []
    for i, t in enumerate(turns):
        m = _turn_mask(t.token_ids, eos)
        ids += t.token_ids
        mask += m
        lps += [lp if k else 0.0 for lp, k in zip(t.logprobs, m, strict=True)]
        vers += [t.version if k else -1 for k in m]
        if i < len(turns) - 1:
            ids += t.user_ids
            mask += [0] * len(t.user_ids)
            lps += [0.0] * len(t.user_ids)
            vers += [-1] * len(t.user_ids)
    return TrainingSample(
        prompt_ids=np.asarray(prompt, dtype=np.int32),
        response_ids=np.asarray(ids, dtype=np.int32),
        response_mask=np.asarray(mask, dtype=np.int8),
        behaviour_logprobs=np.asarray(lps, dtype=np.float32),
        token_versions=np.asarray(vers, dtype=np.int32),
        scope=scope,  # type: ignore[arg-type]
        fallback=fallback,
    )


def sample_metadata(conversation: Conversation, *, include_text: bool = False) -> dict[str, Any]:
    """JSON-able per-sample metadata: turns, finish reason, answer flag, per-turn scores,
    tokens per role, verifier errors/latency/versions; `include_text` adds the transcript."""
    conv = conversation
    scores = conv.hallucination_scores
    user_tokens = sum(len(t.user_ids) for t in conv.turns)
    meta: dict[str, Any] = {
        "num_turns": conv.num_turns,
        "finish_reason": conv.finish_reason,
        "has_final_answer": bool(conv.turns and conv.turns[-1].has_final_answer),
        "hallucination_scores": scores,
        "verifier_hallucination_score": conv.hallucination_score,
        "verifier_errors": conv.verifier_errors,
        "stop_causes": [t.reply.stop_cause if t.reply is not None else None for t in conv.turns],
        "tokens": {
            "prompt": len(conv.initial_ids),
            "policy": sum(len(t.token_ids) for t in conv.turns),
            "user": user_tokens,
            "verifier": sum(t.verifier_tokens or 0 for t in conv.turns),
            "policy_per_turn": [len(t.token_ids) for t in conv.turns],
        },
        "dropped_turns": max((t.dropped_turns for t in conv.turns), default=0),
        "turn_versions": [t.version for t in conv.turns],
        "verifier_latency_ms": [t.verifier_latency_ms for t in conv.turns],
        "verifier_version": next((t.verifier_version for t in reversed(conv.turns) if t.verifier_version), None),
        "seed": conv.seed,
        "drop_group": conv.drop_group,
    }
    if include_text:
        meta["messages"] = conv.messages()
        meta["verifier_texts"] = [t.verifier_text for t in conv.turns]
    return meta
