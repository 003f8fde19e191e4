"""Settings of the guided protocol, as one frozen value built from `rollout.guide.*`.

A plain dataclass (not the pydantic section) so tests and tools can build it directly; the
defaults equal `asyncrl.config.GuideConfig`'s. `training` is not config: the same rollout code
serves training (True) and evaluation (False), and `verifier_sees_reference=train_only` depends
on it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = ["GuideOptions", "CONTINUE_PROMPT"]

CONTINUE_PROMPT = "Please continue and provide the final answer in the required format."
"""Guided-GRPO's hard-coded continue prompt (docs/guided_grpo.md#protocol), verbatim."""


@dataclass(frozen=True)
class GuideOptions:
    max_turns: int = 10
    stop_token: str = "###STOP###"
    prompt_template: str | None = None
    """Verifier system prompt; None = the shipped Guided-GRPO default."""
    continue_prompt: str = CONTINUE_PROMPT
    enable_hallucination_score: bool = True
    show_score_to_policy: bool = False
    train_scope: Literal["final_turn", "full_turn"] = "final_turn"
    on_error: Literal["stop", "continue", "drop_group"] = "stop"
    verifier_sees_reference: Literal["train_only", "always", "never"] = "train_only"
    history: Literal["full", "guided_grpo"] = "full"
    max_prompt_length: int | None = None
    """Token budget of the policy context at any turn (`data.max_prompt_length`); None = unbounded."""
    training: bool = True
    """True for training rollouts, False for evaluation (reference exposure)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        if self.train_scope == "full_turn" and self.history != "full":
            raise ValueError("train_scope=full_turn requires history=full (guided_grpo rewrites the context "
                             "every turn, so no single token sequence reproduces what each turn saw)")
        for name, allowed in (("train_scope", ("final_turn", "full_turn")),
                              ("on_error", ("stop", "continue", "drop_group")),
                              ("verifier_sees_reference", ("train_only", "always", "never")),
                              ("history", ("full", "guided_grpo"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not self.stop_token.strip():
            raise ValueError("stop_token must not be empty")
        object.__setattr__(self, "stop_token", self.stop_token.strip())

    @classmethod
    def from_config(cls, guide: Any, *, max_prompt_length: int | None = None, training: bool = True,
                    **overrides: Any) -> GuideOptions:
        """From an `asyncrl.config.GuideConfig` (or any object with the same attribute names)."""
        names = {f.name for f in fields(cls)} - {"max_prompt_length", "training"}
        kwargs = {n: getattr(guide, n) for n in names if hasattr(guide, n)}
        kwargs.update(overrides)
        return cls(max_prompt_length=max_prompt_length, training=training, **kwargs)

    @classmethod
    def from_root(cls, cfg: Any, *, training: bool = True, **overrides: Any) -> GuideOptions:
        """From a whole `asyncrl.config.Config`: `rollout.guide.*` + `data.max_prompt_length`."""
        return cls.from_config(cfg.rollout.guide, max_prompt_length=cfg.data.max_prompt_length,
                               training=training, **overrides)
