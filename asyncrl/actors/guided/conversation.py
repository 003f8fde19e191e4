"""One guided conversation as a state machine (docs/guided_grpo.md#protocol).

A `Conversation` never calls an engine. It alternates two requests, `next_step()` returning a
`GenerateStep` (token ids to continue, a seed) or a `VerifyStep` (chat messages for the
verifier), and the caller feeds the answers back with `on_generated` / `on_verified`; `None`
means finished. Conversations of one group therefore advance independently (driver.py runs
them concurrently), with no lock-step batches.

Follows the original's turn logic (#turn-loop; `#name` below = a section of docs/guided_grpo.md):
STOP + a final answer (#final-answer) ends the conversation; STOP without one sends the continue
prompt; any other reply is the next user turn, even after an answer; at most `max_turns` policy
turns. Departures, each for a reason:
- The verifier is not called after the last allowed turn unless `enable_hallucination_score`
  needs its score (the original wastes that call: #bug-lock-step).
- A policy turn that hits `max_tokens` without an end-of-turn token ends the conversation with
  `finish_reason=length` and no verifier call: continuing would need an end-of-turn token the
  policy never sampled, and the original would train on a truncated turn anyway.
- Verifier errors are counted per turn and handled by `on_error` (stop: end now; continue: send
  the continue prompt; drop_group: end now and mark the group for dropping); a conversation ended
  by one has `finish_reason=verifier_error`. The original silently turns errors into STOP.
- `verifier_sees_reference` (train_only = the original, always, never) decides whether the
  verifier gets the reference answer (#bug-reference-leak).
- Prompt budget (`max_prompt_length`) is enforced before generating, never by truncating after
  sampling (#bug-prompt-truncation). history=full drops the oldest whole turns (a policy turn together with
  the user turn that answered it), which keeps the context a valid rendering of [system, problem,
  later turns...]; history=guided_grpo drops the oldest assistant messages as the original does.
  If the context still does not fit, the conversation ends with `finish_reason=length`.
  Dropping history changes what later turns saw, so under `train_scope=full_turn` such a sample
  falls back to final_turn (training.py; recorded as `scope_fallback`).
- history=full keeps the conversation append-only and token-exact (chat.py); history=guided_grpo
  reproduces the original's text rewriting (#policy-prompt: every turn the policy sees system + problem + all
  its own turns + only the latest user message), re-rendered and re-tokenised every turn.
  Multimodal prompts need history=full (the caller passes the processor's expanded `prompt_ids`;
  user turns are text); the original's multimodal path, which re-runs the processor every turn
  (#bug-image-reencode), is not reproduced.
- The verifier always sees every policy turn (#verifier-request), also those dropped from the policy's context
  for the budget under history=full; under guided_grpo it sees what the original's verifier sees,
  the assistant messages left in the rewritten list.
- Every sample has its own seed (`sample_seed`), each turn a distinct one (#bug-shared-seed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncrl.actors.guided.chat import PolicyChat
from asyncrl.actors.guided.options import GuideOptions
from asyncrl.verifier_protocol import (
    VerifierReply,
    aggregate_hallucination,
    flatten_content,
    has_final_answer,
    parse_verifier_reply,
    render_verifier_messages,
)

__all__ = [
    "Conversation",
    "PolicyTurn",
    "GenerateStep",
    "VerifyStep",
    "FinishReason",
    "sample_seed",
    "turn_seed",
]

FinishReason = Literal["verifier_stop", "max_turns", "verifier_error", "length"]
_SEED_MOD = 2**31 - 1  # fits every engine's seed type
_TURN_STRIDE = 1_000_003


def sample_seed(base_seed: int, prompt_index: int, sample_index: int) -> int:
    """Seed of sample `sample_index` of prompt `prompt_index` (global stream index).

    hash(base_seed, prompt_index) + sample_index: deterministic, and distinct within a group for
    any group size < 2**31 (the original gives all G copies one seed: docs/guided_grpo.md#bug-shared-seed)."""
    digest = hashlib.blake2b(f"{base_seed}:{prompt_index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") + sample_index) % _SEED_MOD


def turn_seed(seed: int | None, turn: int) -> int | None:
    """Seed of policy turn `turn` (0-based) of a sample; distinct across a group's samples at every
    turn (the offset is the same for all of them) and across one sample's turns."""
    return None if seed is None else (seed + turn * _TURN_STRIDE) % _SEED_MOD


@dataclass(frozen=True)
class GenerateStep:
    """Ask the policy for turn `turn` (0-based) continuing `prompt_ids`."""

    prompt_ids: list[int]
    seed: int | None
    turn: int


@dataclass(frozen=True)
class VerifyStep:
    """Ask the verifier about policy turn `turn` (0-based)."""

    messages: list[dict[str, str]]
    turn: int


@dataclass
class PolicyTurn:
    """One policy turn and the verifier's answer to it."""

    prompt_ids: list[int]
    """The exact context the policy was given for this turn."""
    token_ids: list[int]
    """Sampled ids, including the end-of-turn token when the turn ended normally."""
    logprobs: list[float]
    version: int
    engine_finish_reason: str
    seed: int | None
    text: str
    has_final_answer: bool
    dropped_turns: int = 0
    """Oldest turns left out of `prompt_ids` for the prompt budget (history=full: policy turns)."""
    reply: VerifierReply | None = None
    verifier_request: list[dict[str, str]] | None = None
    """The chat messages the verifier was sent about this turn, exactly (verifier SFT data,
    asyncrl.verifier_training)."""
    verifier_text: str | None = None
    verifier_version: str | None = None
    verifier_error: str | None = None
    verifier_latency_ms: float | None = None
    verifier_tokens: int | None = None
    """Tokens the verifier generated for its reply, when the verifier reports it."""
    user_content: str | None = None
    """The user turn that followed (guidance or the continue prompt); None if none did."""
    user_ids: list[int] = field(default_factory=list)
    """Token ids of that user turn (history=full), from this turn's end-of-turn token to the next
    assistant header."""


class Conversation:
    """State of one guided conversation; see the module docstring for the protocol.

    `messages`: the initial chat (optional system, then the problem as the first user message);
    `prompt_ids`: its token ids with the generation header (default: rendered with `chat`; pass
    the processor's ids for images); `ground_truth`: the reference answer (shown to the verifier
    per `verifier_sees_reference`); `seed`: this sample's seed (`sample_seed`), None = engine
    default. Raises ValueError if the initial prompt alone exceeds `max_prompt_length`."""

    def __init__(self, messages: list[dict[str, Any]], *, chat: PolicyChat, options: GuideOptions,
                 ground_truth: str | None = None, prompt_ids: list[int] | None = None,
                 seed: int | None = None, uid: str = "", prompt_uid: str = ""):
        if not any(m.get("role") == "user" for m in messages):
            raise ValueError("a conversation needs a user message (the problem)")
        self.chat, self.options = chat, options
        self.uid, self.prompt_uid, self.seed = uid, prompt_uid, seed
        self.initial_messages = [dict(m) for m in messages]
        self.ground_truth = ground_truth
        self.problem = next(m["content"] for m in messages if m.get("role") == "user")
        self.initial_ids = list(prompt_ids) if prompt_ids is not None else chat.encode_prompt(messages)
        budget = options.max_prompt_length
        if budget is not None and len(self.initial_ids) > budget:
            raise ValueError(f"initial prompt has {len(self.initial_ids)} tokens > max_prompt_length {budget}")
        if options.history == "guided_grpo" and any(isinstance(m.get("content"), list) for m in messages):
            raise ValueError("history=guided_grpo re-renders text prompts every turn and cannot expand image "
                             "tokens; use history=full for multimodal prompts (pass processor-made prompt_ids)")
        if options.history == "full":
            chat.user_turn_pieces  # noqa: B018 -- fail now, not mid-rollout, if the template cannot do it
        self.turns: list[PolicyTurn] = []
        self.finish_reason: FinishReason | None = None
        self.drop_group = False
        self.verifier_errors = 0
        self._first_kept = 0  # history=full: index of the oldest turn still in the context
        self._gg_messages = [dict(m) for m in messages]  # history=guided_grpo: the rewritten list
        self._awaiting: Literal["generate", "verify"] = "generate"
        self._pending_prompt: list[int] | None = None
        self._pending_dropped = 0

    # ------------------------------------------------------------------ public state
    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def reference_for_verifier(self) -> str | None:
        mode = self.options.verifier_sees_reference
        show = mode == "always" or (mode == "train_only" and self.options.training)
        return self.ground_truth if show else None

    @property
    def hallucination_scores(self) -> list[int | None]:
        """Per-turn verifier scores (None: no score, no verifier call, or scoring disabled)."""
        if not self.options.enable_hallucination_score:
            return [None] * len(self.turns)
        return [t.reply.hallucination if t.reply is not None else None for t in self.turns]

    @property
    def hallucination_score(self) -> float:
        """Mean of the scored turns, 0.5 (the original's neutral value) when none."""
        return aggregate_hallucination(self.hallucination_scores)

    @property
    def final_text(self) -> str:
        """Decoded text of the last policy turn (what the reward grades)."""
        return self.turns[-1].text if self.turns else ""

    def messages(self) -> list[dict[str, Any]]:
        """The whole transcript as chat messages (initial messages, then every policy and user
        turn, append-only, whatever `history` is): for logs and samples/."""
        out = [dict(m) for m in self.initial_messages]
        for t in self.turns:
            out.append({"role": "assistant", "content": t.text})
            if t.user_content is not None:
                out.append({"role": "user", "content": t.user_content})
        return out

    # ------------------------------------------------------------------ the machine
    def next_step(self) -> GenerateStep | VerifyStep | None:
        """The next request this conversation needs, or None once finished. Idempotent."""
        if self.done:
            return None
        turn = len(self.turns)
        if self._awaiting == "verify":
            messages = self._verifier_messages()
            self.turns[-1].verifier_request = messages
            return VerifyStep(messages, turn - 1)
        if self._pending_prompt is None:
            prompt, dropped = self._build_prompt()
            if prompt is None:
                self._finish("length")
                return None
            self._pending_prompt, self._pending_dropped = prompt, dropped
        return GenerateStep(list(self._pending_prompt), turn_seed(self.seed, turn), turn)

    def on_generated(self, token_ids: list[int], logprobs: list[float] | None, version: int,
                     finish_reason: str = "stop") -> None:
        """Record the policy's sampled turn (ids exactly as sampled)."""
        if self.done or self._awaiting != "generate" or self._pending_prompt is None:
            raise RuntimeError("on_generated called when no generation was requested")
        ids = [int(i) for i in token_ids]
        lps = [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]
        if len(lps) != len(ids):
            raise ValueError(f"{len(lps)} logprobs for {len(ids)} tokens")
        text = self.chat.decode(ids).strip()
        turn = PolicyTurn(self._pending_prompt, ids, lps, int(version), str(finish_reason),
                          turn_seed(self.seed, len(self.turns)), text, has_final_answer(text),
                          dropped_turns=self._pending_dropped)
        self.turns.append(turn)
        self._pending_prompt, self._pending_dropped = None, 0
        if self.options.history == "guided_grpo":
            self._gg_messages.append({"role": "assistant", "content": text})
        if not self.chat.ends_turn(ids):
            self._finish("length")
        elif len(self.turns) >= self.options.max_turns and not self.options.enable_hallucination_score:
            self._finish("max_turns")
        else:
            self._awaiting = "verify"

    def on_verified(self, result: Any) -> None:
        """Record the verifier's answer: an object with `ok`, `text`, `version`, `error` (and
        optionally `latency_ms`), a dict with those keys, or a plain reply string (ok)."""
        if self.done or self._awaiting != "verify":
            raise RuntimeError("on_verified called when no verification was requested")
        ok, text, version, error, latency, tokens = _unpack_verifier_result(result)
        turn = self.turns[-1]
        turn.verifier_text, turn.verifier_version = text, version
        turn.verifier_latency_ms, turn.verifier_tokens = latency, tokens
        self._awaiting = "generate"
        last = len(self.turns) >= self.options.max_turns
        if not ok:
            self.verifier_errors += 1
            turn.verifier_error = error or "verifier error"
            if self.options.on_error == "continue":
                if last:
                    self._finish("max_turns")
                else:
                    self._add_user_turn(self.options.continue_prompt)
                return
            self.drop_group = self.options.on_error == "drop_group"
            self._finish("verifier_error")
            return
        reply = parse_verifier_reply(text, self.options.stop_token,
                                     show_score_to_policy=self.options.show_score_to_policy)
        turn.reply = reply
        if reply.kind == "stop" and turn.has_final_answer:
            self._finish("verifier_stop")
        elif last:
            self._finish("max_turns")
        else:
            self._add_user_turn(self.options.continue_prompt if reply.kind == "stop" else reply.guidance)

    # ------------------------------------------------------------------ internals
    def _finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason

    def _add_user_turn(self, content: str) -> None:
        turn = self.turns[-1]
        turn.user_content = content
        if self.options.history == "full":
            turn.user_ids = self.chat.encode_user_turn(content)
        else:
            self._gg_messages.append({"role": "user", "content": content})

    def _full_context(self, first_kept: int) -> list[int]:
        ids = list(self.initial_ids)
        for t in self.turns[first_kept:]:
            ids += t.token_ids
            ids += t.user_ids
        return ids

    def _build_prompt(self) -> tuple[list[int] | None, int]:
        """Context for the next policy turn within the budget, and how many turns were dropped."""
        budget = self.options.max_prompt_length
        if self.options.history == "full":
            while True:
                ids = self._full_context(self._first_kept)
                if budget is None or len(ids) <= budget:
                    return ids, self._first_kept
                if self._first_kept >= len(self.turns) - 1:  # only the latest turn + its guidance left
                    return None, self._first_kept
                self._first_kept += 1
        return self._build_prompt_guided_grpo(budget)

    def _build_prompt_guided_grpo(self, budget: int | None) -> tuple[list[int] | None, int]:
        if not self.turns:
            return list(self.initial_ids), 0
        msgs = self._gg_messages
        system = [msgs[0]] if msgs[0].get("role") == "system" else []
        users = [i for i, m in enumerate(msgs) if m.get("role") == "user"]
        first_user, last_user = users[0], users[-1]
        prefix = system + [msgs[first_user]]
        assistants = [m for m in msgs if m.get("role") == "assistant"]
        suffix = [msgs[last_user]] if last_user != first_user else []
        while True:
            kept = prefix + assistants + suffix
            ids = self.chat.encode_prompt(kept)
            fits = budget is None or len(ids) <= budget
            if fits or not assistants:
                self._gg_messages = kept  # the rewritten list replaces the state, as in the original
                return (ids if fits else None), len(self.turns) - len(assistants)
            assistants = assistants[1:]

    def _verifier_messages(self) -> list[dict[str, str]]:
        if self.options.history == "guided_grpo":  # the original shows the turns still in the state
            policy_turns = [flatten_content(m["content"]) for m in self._gg_messages if m.get("role") == "assistant"]
        else:
            policy_turns = [t.text for t in self.turns]
        return render_verifier_messages(self.problem, self.reference_for_verifier, policy_turns,
                                        self.options.prompt_template)


def conversation_record(conv: Any, sample: int) -> dict[str, Any]:
    """What a rollout actor sends back of one finished conversation (plain JSON): the records verifier
    SFT synthesis turns into rows (asyncrl.verifier_training.rows)."""
    return {
        "prompt_uid": str(conv.prompt_uid), "sample": sample, "problem": str(conv.problem),
        "ground_truth": conv.ground_truth, "finish_reason": str(conv.finish_reason),
        "initial_messages": conv.initial_messages,
        "turns": [{"policy": t.text, "user": t.user_content, "request": t.verifier_request, "reply": t.verifier_text,
                   "error": t.verifier_error, "version": t.verifier_version, "policy_tokens": len(t.token_ids)}
                  for t in conv.turns],
    }


def _unpack_verifier_result(result: Any) -> tuple[bool, str, str | None, str | None, float | None, int | None]:
    if isinstance(result, str):
        return True, result, None, None, None, None
    get = result.get if isinstance(result, dict) else (lambda k, d=None: getattr(result, k, d))
    ok = bool(get("ok", True))
    text = get("text", "") or ""
    version = get("version", None)
    latency, tokens = get("latency_ms", None), get("tokens", None)
    return (ok, str(text), None if version is None else str(version), get("error", None),
            None if latency is None else float(latency), None if tokens is None else int(tokens))
