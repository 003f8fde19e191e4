"""Proves the KL machinery of `asyncrl.learner.kl` against hand-derived values: the four
estimators (k1, abs, k2, k3 with the original's clamps), the in-reward penalty and its metric,
and the fixed / adaptive controllers including the state_dict round trip used by checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import KLConfig
from asyncrl.learner.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimate,
    make_kl_controller,
)

torch.set_num_threads(1)


def _close(actual: torch.Tensor, expected: list, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_estimators_hand_values():
    # d = logp - logp_ref = [0.5, -0.5]
    logp = torch.tensor([-1.0, -1.0])
    ref = torch.tensor([-1.5, -0.5])
    # k1 = d
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -0.5])
    # abs = |d|
    assert kl_estimate(logp, ref, "abs").tolist() == pytest.approx([0.5, 0.5])
    # k2 = d^2 / 2 = 0.125
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.125])
    # k3: x = ref - logp = [-0.5, 0.5]; e^x - x - 1 = [0.606531 + 0.5 - 1, 1.648721 - 0.5 - 1]
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx(
        [math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1], abs=1e-6
    )
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([0.106531, 0.148721], abs=1e-6)


def test_k3_clamps_and_dtype():
    # x = ref - logp = -30 -> clamped to -20 -> e^-20 + 20 - 1 = 19.0 -> clamped to 10
    # x = +25 -> clamped to 20 -> e^20 - 21 = 4.85e8 -> clamped to 10
    logp = torch.tensor([0.0, -25.0], dtype=torch.bfloat16)
    ref = torch.tensor([-30.0, 0.0], dtype=torch.bfloat16)
    out = kl_estimate(logp, ref, "k3")
    assert out.dtype == torch.float32
    assert out.tolist() == [10.0, 10.0]
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "full")


def test_apply_kl_penalty_in_reward():
    # k1 with d = [[0.2, 0.4], [0.6, 9.0]], mask [[1, 1], [1, 0]] -> kld = [[0.2, 0.4], [0.6, 0]]
    # beta 0.5: rewards [[0, 1], [0, 0]] - 0.5 kld = [[-0.1, 0.8], [-0.3, 0]]
    # metric: mean over sequences of masked means = mean(0.3, 0.6) = 0.45
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = logp - torch.tensor([[0.2, 0.4], [0.6, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out, kl = apply_kl_penalty(rewards, logp, ref, mask, beta=0.5, estimator="k1")
    _close(out, [[-0.1, 0.8], [-0.3, 0.0]], 1e-6)
    assert float(kl) == pytest.approx(0.45, abs=1e-6)


def test_adaptive_controller_update_and_state_dict():
    ctl = AdaptiveKLController(0.1, target=0.1, horizon=10000)
    # kl 0.2: error = clip(0.2/0.1 - 1, -0.2, 0.2) = 0.2 -> beta = 0.1 * (1 + 0.2 * 100 / 10000) = 0.1002
    ctl.update(0.2, n_steps=100)
    assert ctl.value == pytest.approx(0.1002)
    # kl 0.09: error = -0.1 -> beta *= 1 - 0.1 * 100 / 10000 = 0.999 -> 0.1000998
    ctl.update(0.09, n_steps=100)
    assert ctl.value == pytest.approx(0.1000998)
    restored = AdaptiveKLController(0.5, target=1.0, horizon=1.0)
    restored.load_state_dict(ctl.state_dict())
    assert (restored.value, restored.target, restored.horizon) == (ctl.value, 0.1, 10000.0)


def test_fixed_controller_and_factory():
    fixed = FixedKLController(0.01)
    fixed.update(5.0, n_steps=1000)
    assert fixed.value == 0.01
    other = FixedKLController(0.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.01
    assert make_kl_controller(KLConfig(enable=True, coef=0.02)).value == 0.02
    assert make_kl_controller(KLConfig(enable=False, coef=0.02)).value == 0.0
    assert isinstance(make_kl_controller(KLConfig(enable=True, type="adaptive")), AdaptiveKLController)
