"""The report's line under "Curves": the trained reward over the first vs the last sixth of the steps
next to the greedy accuracy before/after (or the first/last validation evaluation), with the reason
they differ; nothing for a run with fewer than two logged steps. Numbers by hand."""

from __future__ import annotations

from asyncrl.report import reward_vs_accuracy

CONFIG = {"rollout": {"temperature": 0.5}}


def _rows() -> list[dict]:
    rewards = [0.7, 0.8] + [0.9] * 8 + [0.6, 0.7]  # 12 steps: a sixth is 2 steps
    rows = [{"step": i + 1, "train/reward_mean": r} for i, r in enumerate(rewards)]
    rows[4]["eval/guided_accuracy"], rows[11]["eval/guided_accuracy"] = 0.55, 0.70
    return rows


def test_the_reward_and_the_greedy_accuracy_side_by_side() -> None:
    note = reward_vs_accuracy(_rows(), CONFIG, {"guided_accuracy": 0.6025}, {"guided_accuracy": 0.7175})
    # first sixth (0.7 + 0.8) / 2 = 0.750, last (0.6 + 0.7) / 2 = 0.650: -0.100; greedy 0.7175 - 0.6025 = +0.115
    assert "temperature 0.5" in note and "0.750 over steps 1-2 → 0.650 over steps 11-12 (-0.100)" in note
    assert "0.603 before → 0.718 after (+0.115)" in note and "Why they can differ" in note


def test_without_test_evaluations_the_validation_ones_are_used() -> None:
    note = reward_vs_accuracy(_rows(), CONFIG, None, None)
    assert "(val): 0.550 at step 5 → 0.700 at step 12 (+0.150)" in note


def test_nothing_before_two_steps() -> None:
    assert reward_vs_accuracy(_rows()[:1], CONFIG, None, None) == ""
