"""Reward functions: math grading (math-verify + Guided-GRPO's normalisations), format and
hallucination weighting, the built-ins `math`, `guided_math`, `dapo`, `r1v`, and plug-ins
compatible with Guided-GRPO's reward files.

Public API:
- `math_reward(response, ground_truth, format_weight=0.1, hallucination_weight=0.0,
  hallucination_score=None) -> dict` — one final turn.
- `get_reward(name) -> fn(reward_inputs, **kwargs) -> list[dict]` — a built-in (batch convention).
- `load_reward_function(spec, type="batch", kwargs=None) -> fn(reward_inputs) -> list[dict]` — a
  plug-in `path/to/file.py[:fn]`, whatever its type, returned in the batch convention.
- `build_reward_fn(cfg_or_name_or_spec) -> fn(reward_inputs) -> list[dict]` (kwargs bound,
  validated); `load_reward` is the same function.
- `score_samples(fn_or_cfg, items) -> list[dict]`; `RewardScorer(cfg).score(items)` and
  `score(fn_or_cfg, items)` are the async forms that run in a thread pool.
- `grade_answer(given, truth, timeout_s)`, `grade_final_answer(response, ground_truth)` (accuracy
  of a final turn: last `\\boxed{}` graded), `extract_boxed_content`, `answer_format_ok`.
Items / RewardInput dicts: `response`, `response_length`, `ground_truth`,
optional `verifier_hallucination_score`.
"""

from __future__ import annotations

from asyncrl.rewards.builtin import (
    BUILTIN_REWARDS,
    dapo_reward,
    get_reward,
    guided_math_reward,
    math_reward,
    r1v_reward,
)
from asyncrl.rewards.grading import (
    GradingTimeout,
    answer_format_ok,
    extract_boxed_content,
    grade_answer,
    grade_final_answer,
    grading_stats,
    normalize_answer,
)
from asyncrl.rewards.plugins import RewardFunctionError, load_reward_function, reward_inputs, validate_scores
from asyncrl.rewards.scorer import (
    RewardScorer,
    build_reward_fn,
    load_reward,
    score,
    score_samples,
)

__all__ = [
    "BUILTIN_REWARDS",
    "GradingTimeout",
    "RewardFunctionError",
    "RewardScorer",
    "answer_format_ok",
    "build_reward_fn",
    "dapo_reward",
    "extract_boxed_content",
    "get_reward",
    "grade_answer",
    "grade_final_answer",
    "grading_stats",
    "guided_math_reward",
    "load_reward",
    "load_reward_function",
    "math_reward",
    "normalize_answer",
    "r1v_reward",
    "reward_inputs",
    "score",
    "score_samples",
    "validate_scores",
]
