"""Guided multi-turn protocol (Guided-GRPO, docs/guided_grpo.md#protocol), engine-agnostic.

Everything a rollout actor does between two engine calls: build the verifier request, parse the
reply, decide the next turn, keep the token-exact history, and turn a finished conversation into
training arrays. No engine, no network: `generate` and `verify` are injected (driver.py).

Modules (each docstring says where asyncrl follows the original and where it departs, and why):
- verifier_io: render_verifier_messages, parse_verifier_reply, has_final_answer, scores.
- chat: PolicyChat, the policy chat template cut into token-exact pieces.
- options: GuideOptions (from rollout.guide.* + data.max_prompt_length + training/eval).
- conversation: the per-conversation state machine, sample_seed.
- training: build_training_sample (final_turn / full_turn), sample_metadata.
- driver: run_conversation, run_group, make_group, rule_verify.

Typical use (rollout actor or eval):

    chat = PolicyChat(tokenizer)
    opts = GuideOptions.from_root(cfg, training=True)   # or .from_config(cfg.rollout.guide, ...)
    convs = make_group(item.messages, chat=chat, options=opts, n=cfg.rollout.n,
                       ground_truth=item.ground_truth, base_seed=cfg.rollout.seed, prompt_index=item.index)
    await run_group(convs, generate, verify)
    for c in convs:
        ts = build_training_sample(c); meta = sample_metadata(c); text = c.final_text

The wire `Sample` of a scored conversation is built by `asyncrl.actors.group.build_sample` (the
one Conversation -> Sample builder, shared by training, the rollout bench and the tests).
"""

from __future__ import annotations

from asyncrl.actors.guided.chat import PolicyChat
from asyncrl.actors.guided.conversation import (
    Conversation,
    FinishReason,
    GenerateStep,
    PolicyTurn,
    VerifyStep,
    sample_seed,
    turn_seed,
)
from asyncrl.actors.guided.driver import (
    GroupDropped,
    VerifyOutcome,
    make_group,
    rule_verify,
    run_conversation,
    run_group,
)
from asyncrl.actors.guided.options import CONTINUE_PROMPT, GuideOptions
from asyncrl.actors.guided.training import (
    TrainingSample,
    build_training_sample,
    sample_metadata,
)
from asyncrl.verifier_protocol import (
    NEUTRAL_HALLUCINATION_SCORE,
    SCORE_PATTERN,
    VerifierReply,
    aggregate_hallucination,
    flatten_content,
    has_final_answer,
    parse_verifier_reply,
    render_verifier_messages,
    render_verifier_user_content,
)

__all__ = [
    "CONTINUE_PROMPT",
    "Conversation",
    "FinishReason",
    "GenerateStep",
    "GroupDropped",
    "GuideOptions",
    "NEUTRAL_HALLUCINATION_SCORE",
    "PolicyChat",
    "PolicyTurn",
    "SCORE_PATTERN",
    "TrainingSample",
    "VerifierReply",
    "VerifyOutcome",
    "VerifyStep",
    "aggregate_hallucination",
    "build_training_sample",
    "flatten_content",
    "has_final_answer",
    "make_group",
    "parse_verifier_reply",
    "render_verifier_messages",
    "render_verifier_user_content",
    "rule_verify",
    "run_conversation",
    "run_group",
    "sample_metadata",
    "sample_seed",
    "turn_seed",
]
