"""The policy's chat template, cut into the pieces a token-exact multi-turn rollout needs.

Token fidelity contract (asyncrl's, not in Guided-GRPO):
- A policy turn is kept as the exact ids the engine sampled, including its end-of-turn token
  (`<|im_end|>` for ChatML/Qwen); it is never re-tokenised from decoded text.
- The text between two policy turns (for ChatML `\\n<|im_start|>user\\n{content}<|im_end|>\\n
  <|im_start|>assistant\\n`) is rendered from the tokenizer's own chat template and tokenised
  once (`encode_user_turn`).
- Hence `initial + turn_1 + user_1 + turn_2 + ...` equals `encode(apply_chat_template(messages,
  add_generation_prompt=True))` of the same conversation whenever the sampled ids are the
  tokenizer's canonical encoding of their text and the template renders an assistant message as
  `content + eos` (ChatML/Qwen2/2.5 do; tests/unit/test_guided_conversation.py checks it). Where that
  does not hold (a non-canonical sampled tokenisation, or a template that rewrites earlier
  assistant turns, like Qwen3 dropping old `<think>` blocks) the rollout still feeds the engine
  exactly these ids and the learner trains on exactly these ids, so behaviour and training
  contexts stay identical; only "what the template would render" differs.
The piece boundaries are special tokens in ChatML, so tokenising a piece alone gives the same
ids as tokenising it inside the whole conversation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["PolicyChat"]

_SENT_A = "\x00ASSISTANT_SENTINEL\x00"
_SENT_U = "\x00USER_SENTINEL\x00"


class PolicyChat:
    """Chat-template pieces of one policy tokenizer (HF tokenizer or processor).

    `end_of_turn`: the token that closes a policy turn (default: the tokenizer's eos token).
    `eos_token_ids`: ids that end a sampled turn (default: end_of_turn's id plus eos_token_id).
    `template_kwargs`: extra `apply_chat_template` arguments (e.g. `enable_thinking=False`)."""

    def __init__(self, tokenizer: Any, *, end_of_turn: str | None = None,
                 eos_token_ids: Iterable[int] | None = None, template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
        self._renderer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.end_of_turn = end_of_turn or self.tokenizer.eos_token
        if not self.end_of_turn:
            raise ValueError("the policy tokenizer has no eos token; pass end_of_turn=")
        eot_id = self.tokenizer.convert_tokens_to_ids(self.end_of_turn)
        ids = set(eos_token_ids) if eos_token_ids is not None else {eot_id, self.tokenizer.eos_token_id}
        self.eos_token_ids: frozenset[int] = frozenset(i for i in ids if isinstance(i, int) and i >= 0)
        self._pieces: tuple[str, str] | None = None  # derived on first use: only history=full needs them

    # ------------------------------------------------------------------ rendering
    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat template's text for `messages`."""
        return self._renderer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False, **self.template_kwargs
        )

    def encode_text(self, text: str) -> list[int]:
        """Ids of rendered template text (special tokens in the text are parsed, none added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Ids of the prompt for the next assistant turn (generation header included), exactly
        as Guided-GRPO builds text-only prompts: encode(render(messages)), no special tokens added."""
        return self.encode_text(self.render(messages, add_generation_prompt=True))

    def encode_user_turn(self, content: str) -> list[int]:
        """Ids that follow a policy turn's end-of-turn token: the rest of that turn's closing,
        the user message `content`, and the next assistant header."""
        pre, post = self.user_turn_pieces
        return self.encode_text(pre + content + post)

    @property
    def user_turn_pieces(self) -> tuple[str, str]:
        """(text before, text after) a user message that follows a policy turn's end-of-turn token.
        Raises ValueError if the template makes token-exact history impossible."""
        if self._pieces is None:
            self._pieces = self._derive_user_turn_pieces()
        return self._pieces

    def decode(self, ids: Sequence[int]) -> str:
        """Text of sampled ids, special tokens skipped (as Guided-GRPO decodes policy turns)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def ends_turn(self, ids: Sequence[int]) -> bool:
        """Whether a sampled turn ended with an end-of-turn token (rather than hitting max_tokens)."""
        return bool(ids) and int(ids[-1]) in self.eos_token_ids

    # ------------------------------------------------------------------ derivation
    def _derive_user_turn_pieces(self) -> tuple[str, str]:
        """Text before/after a user message inserted after an assistant turn, read off the template.

        Renders [user, assistant=A, user=U] + generation prompt and takes what lies between
        `A + end_of_turn` and `U`, and after `U`."""
        msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": _SENT_A},
                {"role": "user", "content": _SENT_U}]
        text = self.render(msgs, add_generation_prompt=True)
        a, u = text.find(_SENT_A), text.find(_SENT_U)
        if a < 0 or u < 0 or u < a:
            raise ValueError("cannot locate message contents in the policy chat template's rendering")
        after_a = text[a + len(_SENT_A):u]
        if not after_a.startswith(self.end_of_turn):
            raise ValueError(
                f"the policy chat template does not close an assistant turn with {self.end_of_turn!r} right after "
                "its content; token-exact history (rollout.guide.history=full) is impossible with it "
                "(use history=guided_grpo, or pass end_of_turn=)"
            )
        return after_a[len(self.end_of_turn):], text[u + len(_SENT_U):]
