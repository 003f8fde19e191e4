"""Proves Guided-GRPO reward plug-ins load and run unchanged (batch and sequential, kwargs bound,
the original RewardInput keys), that every failure names the file and the function (missing
file, failed import, missing function, exception inside, no `overall`, non-numeric value, wrong
length), that `RewardConfig` resolves built-ins and plug-ins, and that the async scorer runs off
the event loop (the loop keeps ticking while a batch is graded)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from asyncrl.config import RewardConfig
from asyncrl.rewards import (
    RewardFunctionError,
    RewardScorer,
    build_reward_fn,
    load_reward_function,
    score,
    score_samples,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "rewards"
MATH_PLUGIN = f"{FIX / 'guided_grpo_math.py'}:compute_score"
SEQ = FIX / "sequential_plugin.py"

ITEMS = [
    {"response": r"<think>t</think>< answer >\boxed{\frac{1}{2}}</answer>", "response_length": 12,
     "ground_truth": "0.5", "verifier_hallucination_score": 0.75},
    {"response": r"the answer is \boxed{3}", "response_length": 7, "ground_truth": "4"},
]


def test_original_batch_plugin_matches_builtin() -> None:
    fn = load_reward_function(MATH_PLUGIN, "batch", {"format_weight": 0.2})
    got = fn([dict(x) for x in ITEMS])
    # item 0: acc 1, fmt 1 -> 0.8*1 + 0.2*1 = 1.0; item 1: acc 0, fmt 0 -> 0
    assert got == [{"overall": 1.0, "format": 1.0, "accuracy": 1.0},
                   {"overall": 0.0, "format": 0.0, "accuracy": 0.0}]
    builtin = build_reward_fn(RewardConfig(function="math", kwargs={"format_weight": 0.2}))
    assert [b["overall"] for b in builtin([dict(x) for x in ITEMS])] == [g["overall"] for g in got]


def test_sequential_plugin_gets_original_keys() -> None:
    fn = load_reward_function(f"{SEQ}:compute_score", "sequential", {"bonus": 0.5})
    got = fn([{"response": " 4 ", "response_length": 3, "ground_truth": "4", "verifier_hallucination_score": 1.0},
              {"response": "5", "response_length": 1, "ground_truth": "4"}])
    # correct + bonus = 1.5; wrong + bonus = 0.5; hallucination default 0.5 when the key is absent
    assert got == [{"overall": 1.5, "accuracy": 1.0, "hallucination": 1.0, "length": 3.0},
                   {"overall": 0.5, "accuracy": 0.0, "hallucination": 0.5, "length": 1.0}]


def test_default_function_name_is_main() -> None:
    assert load_reward_function(str(SEQ), "sequential")([ITEMS[1]]) == [{"overall": 1.0}]


def test_wrong_type_is_reported_with_the_plugin_message() -> None:
    fn = load_reward_function(MATH_PLUGIN, "sequential")
    with pytest.raises(RewardFunctionError, match=r"guided_grpo_math\.py:compute_score.*reward_type=batch"):
        fn([dict(ITEMS[0])])


@pytest.mark.parametrize(
    ("spec", "rtype", "pattern"),
    [
        (f"{FIX / 'missing.py'}:f", "batch", r"missing\.py:f: no such file"),
        (f"{FIX / 'broken_import.py'}:compute_score", "batch",
         r"broken_import\.py:compute_score: importing .* failed: ModuleNotFoundError"),
        (f"{SEQ}:nope", "sequential", r"sequential_plugin\.py:nope: .* has no function 'nope'"),
    ],
)
def test_load_errors_name_file_and_function(spec: str, rtype: str, pattern: str) -> None:
    with pytest.raises(RewardFunctionError, match=pattern):
        load_reward_function(spec, rtype)


@pytest.mark.parametrize(
    ("fn", "pattern"),
    [
        ("no_overall", r"sequential_plugin\.py:no_overall: score 0 has no 'overall'"),
        ("explodes", r"sequential_plugin\.py:explodes raised ZeroDivisionError: boom"),
        ("not_a_number", r"sequential_plugin\.py:not_a_number: score 0 key 'overall' is not a number"),
    ],
)
def test_call_errors_name_file_and_function(fn: str, pattern: str) -> None:
    loaded = load_reward_function(f"{SEQ}:{fn}", "sequential")
    with pytest.raises(RewardFunctionError, match=pattern):
        loaded([dict(ITEMS[1])])


def test_batch_length_mismatch_is_an_error() -> None:
    fn = build_reward_fn(lambda items: [{"overall": 1.0}])
    with pytest.raises(RewardFunctionError, match="returned 1 scores for 2 inputs"):
        fn([dict(x) for x in ITEMS])


def test_reward_config_resolution() -> None:
    with pytest.raises(ValueError, match="unknown kwargs"):
        build_reward_fn(RewardConfig(function="math", kwargs={"format_wieght": 0.1}))
    with pytest.raises(ValueError, match=r"needs reward.kwargs \['max_response_length', 'overlong_buffer_length'\]"):
        build_reward_fn(RewardConfig(function="dapo"))
    seq = RewardConfig(function=f"{SEQ}:compute_score", type="sequential")
    assert score_samples(seq, [ITEMS[1]])[0]["accuracy"] == 0.0


def test_score_samples_drops_none_hallucination_and_checks_keys() -> None:
    # guided_math with score None -> neutral 0.5: 0.8*1 + 0.1*1 + 0.1*0.5 = 0.95
    item = dict(ITEMS[0], verifier_hallucination_score=None)
    assert score_samples("guided_math", [item])[0]["overall"] == pytest.approx(0.95)
    with pytest.raises(ValueError, match="reward input 0 has no 'ground_truth'"):
        score_samples("math", [{"response": "x", "response_length": 1}])
    assert score_samples("math", []) == []


def test_async_scorer_keeps_the_loop_free() -> None:
    slow_calls: list[float] = []

    def slow(items: list[dict]) -> list[dict]:
        time.sleep(0.3)  # stands for grading; runs in the worker thread
        slow_calls.append(time.monotonic())
        return [{"overall": 1.0} for _ in items]

    async def main() -> tuple[int, list[dict], list[dict]]:
        scorer = RewardScorer(slow)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        try:
            a = await asyncio.wait_for(scorer.score([dict(ITEMS[1])]), 10)
            b = await asyncio.wait_for(score("guided_math", [dict(ITEMS[0])]), 30)
        finally:
            task.cancel()
            scorer.close()
        return ticks, a, b

    ticks, a, b = asyncio.run(main())
    assert a == [{"overall": 1.0}] and b[0]["accuracy"] == 1.0
    assert ticks >= 10  # ~30 ticks expected during the 0.3 s sleep; a blocked loop gives ~0


def test_load_reward_alias_resolves_the_default_config() -> None:
    from asyncrl.rewards import load_reward

    fn = load_reward(RewardConfig())  # default: guided_math
    got = fn([dict(ITEMS[0])])[0]
    # acc 1, fmt 1, hallucination 0.75: 0.8 + 0.1 + 0.1*0.75 = 0.975
    assert got["overall"] == pytest.approx(0.975)


def test_none_hallucination_score_reaches_plugins_as_absent_key() -> None:
    # The original passes the key only when the rollout produced a score; a rollout that stores
    # None must not hand a plug-in a None it would do arithmetic on.
    fn = build_reward_fn(RewardConfig(function=f"{SEQ}:compute_score", type="sequential"))
    got = fn([{"response": "4", "response_length": 1, "ground_truth": "4", "verifier_hallucination_score": None}])
    assert got[0]["hallucination"] == 0.5  # the plug-in's own default for a missing key


def test_every_shipped_config_reward_section_resolves() -> None:
    from asyncrl.config import load_config

    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        fn = build_reward_fn(load_config(path).reward)
        got = fn([{"response": r"<answer>\boxed{1}</answer>", "response_length": 3, "ground_truth": "1",
                   "num_turns": 2}])  # the keys the rollout gives (asyncrl.actors.group.reward_inputs)
        assert "overall" in got[0], path.name
