"""Built-in reward functions: `math`, `guided_math`, `dapo`, `r1v`.

Every built-in uses the Guided-GRPO *batch* convention (docs/guided_grpo.md#rewards): called with
a list of RewardInput dicts (`response`, `response_length`, `ground_truth`, optional
`verifier_hallucination_score`) and keyword arguments, it returns one dict per input with
`overall` plus named parts (logged as `reward/<part>`).

Follows the original:
- `math` = the original's examples/reward_function/math.py: 0.9·accuracy + 0.1·format on the
  final turn.
- `guided_math` = the paper's reward (not in the original's code): (1 − w_fmt − w_hal)·accuracy
  + w_fmt·format + w_hal·hallucination, defaults 0.8/0.1/0.1; hallucination = the conversation's
  `verifier_hallucination_score`, or 0.5 (the original's neutral value) when absent, as the
  paper's description implies. (A later revision of the original's math.py instead drops the
  term and keeps the 0.9/0.1 split when no score is passed; with `enable_hallucination_score`
  on, the rollout always passes one, so the two agree in the configuration the paper uses.)
- `dapo`: answer from the last `Answer:` line in the last 300 characters, Minerva
  normalisation, accuracy ±1, soft overlong penalty.
- `r1v`: `<think>…</think><answer>…</answer>` format, accuracy on the first answer block.
Departs: accuracy in `math`/`guided_math`/`r1v` is graded by `grade_answer` (math-verify plus the
original's string normalisations, see grading.py) instead of mathruler; `r1v` is sequential in
the original and is wrapped here into the batch convention.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from asyncrl.rewards.grading import (
    DEFAULT_TIMEOUT_S,
    answer_format_ok,
    extract_boxed_content,
    grade_answer,
    strip_tag_whitespace,
)

__all__ = ["BUILTIN_REWARDS", "dapo_reward", "get_reward", "guided_math_reward", "math_reward", "r1v_reward"]

NEUTRAL_HALLUCINATION = 0.5
"""Hallucination score of a conversation with no scored verifier turn (Guided-GRPO's neutral value)."""

RewardFn = Callable[..., list[dict[str, float]]]


def math_reward(
    response: str,
    ground_truth: str,
    format_weight: float = 0.1,
    hallucination_weight: float = 0.0,
    hallucination_score: float | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> dict[str, float]:
    """Score one final policy turn.

    `overall = (1 − format_weight − hallucination_weight)·accuracy + format_weight·format
    + hallucination_weight·hallucination`. With the defaults this is Guided-GRPO's shipped math
    reward (0.9/0.1). Keys: `overall`, `accuracy`, `format`, plus `hallucination` when
    `hallucination_weight > 0` or a score is given (None -> 0.5, the neutral value).
    """
    if not (0.0 <= format_weight <= 1.0 and 0.0 <= hallucination_weight <= 1.0):
        raise ValueError(f"weights must lie in [0, 1] (format_weight={format_weight}, hallucination_weight={hallucination_weight})")
    if format_weight + hallucination_weight > 1.0 + 1e-9:
        raise ValueError(f"format_weight + hallucination_weight = {format_weight + hallucination_weight} > 1")
    r = strip_tag_whitespace(response)
    fmt = 1.0 if answer_format_ok(r) else 0.0
    acc = 1.0 if grade_answer(extract_boxed_content(r), ground_truth, timeout_s=timeout_s) else 0.0
    out = {"overall": 0.0, "accuracy": acc, "format": fmt}
    overall = (1.0 - format_weight - hallucination_weight) * acc + format_weight * fmt
    if hallucination_weight > 0 or hallucination_score is not None:
        hal = NEUTRAL_HALLUCINATION if hallucination_score is None else float(hallucination_score)
        out["hallucination"] = hal
        overall += hallucination_weight * hal
    out["overall"] = overall
    return out


def _math_batch(reward_inputs: list[dict[str, Any]], format_weight: float = 0.1,
                timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list[dict[str, float]]:
    """Guided-GRPO math.py::compute_score (batch). Ignores the hallucination score, like the original."""
    return [math_reward(x["response"], x["ground_truth"], format_weight=format_weight, timeout_s=timeout_s)
            for x in reward_inputs]


def guided_math_reward(reward_inputs: list[dict[str, Any]], format_weight: float = 0.1,
                       hallucination_weight: float = 0.1, turn_cost: float = 0.0,
                       timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list[dict[str, float]]:
    """Paper reward (docs/guided_grpo.md#rewards), batch. `hallucination_weight=0` reproduces the
    shipped 0.9/0.1 split
    while still logging `reward/hallucination`.

    `turn_cost` (asyncrl extension, default 0 = the paper's reward): a correct answer reached in
    k policy turns loses `turn_cost·(k−1)·accuracy` (input key `num_turns`), so among correct
    samples the one needing less guidance scores higher. It scales with accuracy, so a quick
    wrong answer is never preferred to a slow right one (k ≤ 1 + 1/turn_cost keeps it positive).
    Logged as `turns_penalty`."""
    if turn_cost < 0:
        raise ValueError(f"turn_cost must be >= 0, got {turn_cost}")
    out = []
    for x in reward_inputs:
        hal = x.get("verifier_hallucination_score")
        hal = NEUTRAL_HALLUCINATION if hal is None else float(hal)
        row = math_reward(x["response"], x["ground_truth"], format_weight=format_weight,
                          hallucination_weight=hallucination_weight, hallucination_score=hal,
                          timeout_s=timeout_s)
        if turn_cost > 0:
            if "num_turns" not in x:
                raise ValueError("guided_math with turn_cost > 0 needs the reward input key 'num_turns'")
            row["turns_penalty"] = turn_cost * max(0, int(x["num_turns"]) - 1) * row["accuracy"]
            row["overall"] -= row["turns_penalty"]
        out.append(row)
    return out


# ------------------------------------------------------------------------------------------- DAPO
_DAPO_SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]
_DAPO_REMOVED = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
    r",\!", "{,}", '"', "\\dots",
]


def dapo_normalize_final_answer(final_answer: str) -> str:
    """DAPO/Minerva `normalize_final_answer` (as shipped with DAPO and Guided-GRPO's dapo.py)."""
    final_answer = final_answer.split("=")[-1]
    for before, after in _DAPO_SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in _DAPO_REMOVED:
        final_answer = final_answer.replace(expr, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def dapo_overlong_penalty(response_length: int, max_response_length: int, overlong_buffer_length: int) -> float:
    """0 if L <= L_max − B; (L_max − B − L)/B inside the buffer; −1 beyond L_max."""
    expected = max_response_length - overlong_buffer_length
    if response_length <= expected:
        return 0.0
    if response_length <= max_response_length:
        return (expected - response_length) / overlong_buffer_length
    return -1.0


def dapo_reward(reward_inputs: list[dict[str, Any]], max_response_length: int, overlong_buffer_length: int,
                overlong_penalty_factor: float = 1.0) -> list[dict[str, float]]:
    """DAPO reward (batch): accuracy ±1 on the normalised last `Answer:` line, plus
    `overlong_penalty_factor`·penalty. Keys: overall, accuracy, overlong, accuracy_normalized."""
    if overlong_buffer_length <= 0 or overlong_buffer_length > max_response_length:
        raise ValueError(f"dapo: need 0 < overlong_buffer_length <= max_response_length "
                         f"(got {overlong_buffer_length}, {max_response_length})")
    out = []
    for x in reward_inputs:
        matches = _DAPO_ANSWER.findall(x["response"][-300:])
        pred = dapo_normalize_final_answer(matches[-1]) if matches else "[INVALID]"
        acc = 1.0 if pred == dapo_normalize_final_answer(str(x["ground_truth"])) else -1.0
        pen = dapo_overlong_penalty(int(x["response_length"]), max_response_length, overlong_buffer_length)
        out.append({"overall": acc + overlong_penalty_factor * pen, "accuracy": acc, "overlong": pen,
                    "accuracy_normalized": 0.5 * (acc + 1.0)})
    return out


# -------------------------------------------------------------------------------------------- R1-V
_R1V_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_R1V_ANSWER = re.compile(r"<answer>(.*?)</answer>")  # no DOTALL: single-line answer, as shipped


def r1v_reward(reward_inputs: list[dict[str, Any]], format_weight: float = 0.5,
               timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list[dict[str, float]]:
    """R1-V reward: format = the whole response fully matches think-then-answer; accuracy on the
    first single-line answer block (or the whole response)."""
    out = []
    for x in reward_inputs:
        response = x["response"]
        fmt = 1.0 if _R1V_FORMAT.fullmatch(response) else 0.0
        m = _R1V_ANSWER.search(response)
        given = m.group(1).strip() if m else response.strip()
        acc = 1.0 if grade_answer(given, str(x["ground_truth"]).strip(), timeout_s=timeout_s) else 0.0
        out.append({"overall": (1 - format_weight) * acc + format_weight * fmt, "format": fmt, "accuracy": acc})
    return out


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": _math_batch,
    "guided_math": guided_math_reward,
    "dapo": dapo_reward,
    "r1v": r1v_reward,
}


def get_reward(name: str) -> RewardFn:
    """The built-in batch reward function `name` (`math`, `guided_math`, `dapo`, `r1v`); call it as
    `fn(reward_inputs, **kwargs) -> list[dict]`."""
    try:
        return BUILTIN_REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown built-in reward {name!r}; built-ins: {', '.join(BUILTIN_REWARDS)}; "
                         "a plug-in is given as 'path/to/file.py:function'") from None
