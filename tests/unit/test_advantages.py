"""Proves every advantage estimator of `asyncrl.learner.advantages` against hand-derived values:
grpo (unbiased std, eps 1e-6, zero-variance group -> 0, optional no-std), dr_grpo, rloo,
reinforce_plus_plus (discounted returns + batch whitening, holes in the mask),
reinforce_plus_plus_baseline (group mean, then batch whitening), grpo_passk (the original's bug
fixed: non-best samples get 0), remax; masking, grouping and input checks."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import AlgorithmConfig
from asyncrl.learner.advantages import (
    advantages_from_config,
    compute_advantages,
    group_ids,
    scores_to_token_rewards,
)

torch.set_num_threads(1)


def _close(actual: torch.Tensor, expected: list, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


EPS = 1e-6


def _rowvals(adv: torch.Tensor) -> list[float]:
    """First column of each row (outcome estimators broadcast one value over the row)."""
    return adv[:, 0].tolist()


def test_grpo_unbiased_std_and_zero_variance_group():
    # group 0 = [1, 2, 3]: mean 2, unbiased var = (1 + 0 + 1) / (3 - 1) = 1, std 1
    #   -> A = (s - 2) / (1 + 1e-6) = [-1, 0, 1] / (1 + 1e-6)
    # group 1 = [5, 5]: std 0 -> A = 0 / (0 + 1e-6) = 0 (zero-variance group)
    scores = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0])
    mask = torch.ones(5, 3)
    mask[1, 2] = 0  # masked positions get 0
    adv = compute_advantages("grpo", scores, [0, 0, 0, 1, 1], mask)
    expected = [-1 / (1 + EPS), 0.0, 1 / (1 + EPS), 0.0, 0.0]
    assert _rowvals(adv) == pytest.approx(expected, abs=1e-7)
    assert adv[0].tolist() == pytest.approx([expected[0]] * 3)
    assert adv[1, 2] == 0.0
    # a biased (population) std would give sqrt(2/3) -> A_0 = -1.2247; make sure we are not that
    assert adv[0, 0] != pytest.approx(-1 / math.sqrt(2 / 3), abs=1e-3)


def test_grpo_two_sample_group_and_no_std_option():
    # group [0, 2]: mean 1, unbiased std = sqrt((1 + 1) / 1) = sqrt(2) -> A = -+1/(sqrt2 + 1e-6)
    adv = compute_advantages("grpo", torch.tensor([0.0, 2.0]), torch.tensor([7, 7]), torch.ones(2, 1))
    assert _rowvals(adv) == pytest.approx([-1 / (math.sqrt(2) + EPS), 1 / (math.sqrt(2) + EPS)], abs=1e-7)
    # norm_by_std=False: A = s - mean = [-1, 1]
    adv = compute_advantages("grpo", torch.tensor([0.0, 2.0]), [7, 7], torch.ones(2, 1), norm_by_std=False)
    assert _rowvals(adv) == pytest.approx([-1.0, 1.0])


def test_grpo_token_rewards_are_summed_and_group_needs_two():
    # token rewards [[0, 1], [0, 0]] -> scores [1, 0]; mean 0.5, std sqrt(0.5) = 0.7071
    # -> A = +-0.5 / (0.70711 + 1e-6) = +-0.70711
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    adv = compute_advantages("grpo", rewards, ["a", "a"], torch.ones(2, 2))
    assert _rowvals(adv) == pytest.approx(
        [0.5 / (math.sqrt(0.5) + EPS), -0.5 / (math.sqrt(0.5) + EPS)], abs=1e-6
    )
    with pytest.raises(ValueError, match=">= 2"):
        compute_advantages("grpo", torch.tensor([1.0, 2.0, 3.0]), [0, 0, 1], torch.ones(3, 1))


def test_dr_grpo_is_mean_baseline_only():
    # group 0 [1, 2, 3] -> [-1, 0, 1]; group 1 [4, 0] -> mean 2 -> [2, -2]; no std, no length norm
    adv = compute_advantages(
        "dr_grpo", torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0]), [0, 0, 0, 1, 1], torch.ones(5, 4)
    )
    assert _rowvals(adv) == pytest.approx([-1.0, 0.0, 1.0, 2.0, -2.0])


def test_rloo_leave_one_out_baseline():
    # [1, 2, 3]: A_1 = 1 - (2 + 3)/2 = -1.5; A_2 = 2 - (1 + 3)/2 = 0; A_3 = 3 - (1 + 2)/2 = 1.5
    # [4, 0]: A = 4 - 0 = 4 and 0 - 4 = -4
    adv = compute_advantages(
        "rloo", torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0]), [0, 0, 0, 1, 1], torch.ones(5, 2)
    )
    assert _rowvals(adv) == pytest.approx([-1.5, 0.0, 1.5, 4.0, -4.0])
    with pytest.raises(ValueError):
        compute_advantages("rloo", torch.tensor([1.0]), [0], torch.ones(1, 1))


def test_grpo_passk_best_gets_gap_others_zero():
    # group [1, 3, 2]: mean 2, unbiased std = sqrt((1 + 1 + 0)/2) = 1; r1 = 3, r2 = 2
    #   best (index 1) gets (3 - 2)/(1 + 1e-6); the others 0 (the original kept their raw 1 and 2)
    # group [2, 2, 0] (tie at the top): gap 0 -> every sample 0
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0, 0.0])
    adv = compute_advantages("grpo_passk", scores, [0, 0, 0, 1, 1, 1], torch.ones(6, 2))
    assert _rowvals(adv) == pytest.approx([0.0, 1 / (1 + EPS), 0.0, 0.0, 0.0, 0.0], abs=1e-7)
    adv = compute_advantages("grpo_passk", scores, [0, 0, 0, 1, 1, 1], torch.ones(6, 2), norm_by_std=False)
    assert _rowvals(adv) == pytest.approx([0.0, 1.0, 0.0, 0.0, 0.0, 0.0])


def test_remax_subtracts_given_baseline():
    # A = s - b: [1 - 0.5, 0 - 0.5] = [0.5, -0.5], times the mask
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = compute_advantages(
        "remax", torch.tensor([1.0, 0.0]), [0, 1], mask, baseline_rewards=torch.tensor([0.5, 0.5])
    )
    _close(adv, [[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]])
    with pytest.raises(ValueError, match="baseline"):
        compute_advantages("remax", torch.tensor([1.0]), [0], torch.ones(1, 1))


def test_reinforce_plus_plus_discounted_returns_and_whitening():
    # masks: row0 [1, 1, 0], row1 [1, 1, 1]; scores [1, 0] placed on the last trained token.
    # gamma 0.5: row0 returns t1 = 1, t0 = 0 + 0.5 * 1 = 0.5; row1 returns all 0.
    # masked values [0.5, 1, 0, 0, 0]: mean 0.3; unbiased var = (0.04 + 0.49 + 3 * 0.09) / 4 = 0.2
    # A = (G - 0.3) / sqrt(0.2 + 1e-8): 0.5 -> 0.447214, 1 -> 1.565248, 0 -> -0.670820
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = compute_advantages("reinforce_plus_plus", torch.tensor([1.0, 0.0]), [0, 1], mask, gamma=0.5)
    s = math.sqrt(0.2 + 1e-8)
    expected = [[0.2 / s, 0.7 / s, 0.0], [-0.3 / s, -0.3 / s, -0.3 / s]]
    _close(adv, expected, 1e-6)
    # whitened over the batch: masked mean 0
    assert float((adv * mask).sum()) == pytest.approx(0.0, abs=1e-6)


def test_reinforce_plus_plus_return_crosses_mask_holes():
    # row0 mask [1, 0, 1] (a verifier turn in the middle), reward 1 at t2, gamma 1:
    # G_2 = 1, and G_0 = r_0 + G_2 = 1 (the hole is skipped; the original's reset would give 0).
    # row1 mask [1, 1, 1], no reward: G = 0. Values [1, 1, 0, 0, 0]: mean 0.4,
    # var = (2 * 0.36 + 3 * 0.16) / 4 = 0.3 -> row0 A = 0.6 / sqrt(0.3) = 1.095445, row1 -0.730297
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    adv = compute_advantages("reinforce_plus_plus", rewards, [0, 1], mask, gamma=1.0)
    a, b = 0.6 / math.sqrt(0.3), -0.4 / math.sqrt(0.3)
    _close(adv, [[a, 0.0, a], [b, b, b]], 1e-6)


def test_scores_to_token_rewards_and_group_ids():
    # the last 1 of each row gets the score; an all-zero row gets nothing
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    out = scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert out.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]
    assert group_ids(["b", "a", "b"]).tolist() == [0, 1, 0]
    assert group_ids(torch.tensor([9, 3, 9])).tolist() == [1, 0, 1]


def test_unknown_estimator_and_shape_mismatch():
    with pytest.raises(ValueError, match="unknown"):
        compute_advantages("gae", torch.tensor([1.0, 2.0]), [0, 0], torch.ones(2, 1))
    with pytest.raises(ValueError, match="match"):
        compute_advantages("grpo", torch.tensor([1.0, 2.0]), [0, 0], torch.ones(3, 1))


def test_advantages_from_config():
    # algorithm.norm_adv_by_std = False -> grpo numerator only: [1, 2, 3] -> [-1, 0, 1]
    config = AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std=False)
    adv = advantages_from_config(config, torch.tensor([1.0, 2.0, 3.0]), [0, 0, 0], torch.ones(3, 1))
    assert _rowvals(adv) == pytest.approx([-1.0, 0.0, 1.0])


def test_turn_score_advantages_hand_derived() -> None:
    """Group 0: turns scored 1, 0, 1 (one token each) -> mean 2/3, unbiased std sqrt(1/3)=0.5774:
    (1-2/3)/0.5774 = +0.5774, (0-2/3)/0.5774 = -1.1547. Group 1: scores all 1 -> std 0 -> 0.
    Unscored (NaN) and masked tokens get 0."""
    import math

    from asyncrl.learner.advantages import turn_score_advantages

    nan = float("nan")
    scores = torch.tensor([[1.0, nan, 0.0], [1.0, nan, nan], [1.0, 1.0, nan]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    group = torch.tensor([0, 0, 1])
    out = turn_score_advantages(scores, group, mask)
    s = math.sqrt(1 / 3)
    assert torch.allclose(out[0], torch.tensor([(1 - 2 / 3) / s, 0.0, (0 - 2 / 3) / s]), atol=1e-5)
    assert torch.allclose(out[1], torch.tensor([(1 - 2 / 3) / s, 0.0, 0.0]), atol=1e-5)
    assert torch.equal(out[2], torch.zeros(3))


def test_turn_token_scores_map_turns_and_score_an_accepted_final_turn() -> None:
    """Response mask runs [1,1] [0] [1] [0,0] [1] = three policy turns, scored 0, 1 and STOP (None).
    The last turn ended with the verifier's STOP token after a formatted final answer, so with
    accept_score=1.0 it scores 1 like a correct step; with None it stays unscored (NaN).
    A STOP that is not an acceptance (empty reply, or no final answer) is never scored."""
    from types import SimpleNamespace

    from asyncrl.learner.advantages import turn_token_scores

    nan = float("nan")
    mask = [1, 1, 0, 1, 0, 0, 1]

    def sample(**meta):
        base = {"hallucination_scores": [0, 1, None], "stop_causes": ["", "", "stop_token"], "has_final_answer": True}
        return SimpleNamespace(response_mask=mask, metadata={**base, **meta})

    def row(smp, accept):
        return turn_token_scores([smp], (1, len(mask)), accept)[0].tolist()

    def same(a, b):
        return all((x != x and y != y) or x == y for x, y in zip(a, b, strict=True))

    assert same(row(sample(), 1.0), [0, 0, nan, 1, nan, nan, 1])
    assert same(row(sample(), None), [0, 0, nan, 1, nan, nan, nan])
    assert same(row(sample(has_final_answer=False), 1.0), [0, 0, nan, 1, nan, nan, nan])
    assert same(row(sample(stop_causes=["", "", "empty"]), 1.0), [0, 0, nan, 1, nan, nan, nan])


def test_reinforce_plus_plus_baseline_group_mean_then_batch_whitening():
    # scores [1, 0 | 1, 1] in groups 0, 0, 1, 1; trained tokens per sample [2, 1, 1, 1]
    # group-mean baseline: a = s - mean_g = [0.5, -0.5, 0, 0], on every trained token:
    #   tokens [0.5, 0.5 | -0.5 | 0 | 0], n = 5, mean 0.1, deviations [0.4, 0.4, -0.6, -0.1, -0.1]
    #   Bessel var = (0.16 + 0.16 + 0.36 + 0.01 + 0.01) / 4 = 0.175 -> A = dev / sqrt(0.175 + 1e-8)
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    adv = compute_advantages("reinforce_plus_plus_baseline", scores, [0, 0, 1, 1], mask)
    sd = math.sqrt(0.175 + 1e-8)
    _close(adv, [[0.4 / sd, 0.4 / sd], [-0.6 / sd, 0.0], [-0.1 / sd, 0.0], [-0.1 / sd, 0.0]], atol=1e-5)
    # whitened: zero mean and unit (Bessel) variance over the trained tokens
    vals = adv[mask > 0]
    assert float(vals.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(vals.var(unbiased=True)) == pytest.approx(1.0, abs=1e-5)
    # the config route selects it, and a group of one is refused (rollout.n > 1)
    config = AlgorithmConfig(adv_estimator="reinforce_plus_plus_baseline")
    torch.testing.assert_close(advantages_from_config(config, scores, [0, 0, 1, 1], mask), adv)
    with pytest.raises(ValueError, match=">= 2 samples"):
        compute_advantages("reinforce_plus_plus_baseline", scores, [0, 1, 2, 2], mask)
