"""KL regularisation against a frozen reference policy: per-token estimators, the in-reward
penalty, and the fixed / adaptive coefficient controllers.

Estimators of KL(pi || pi_ref) on tokens sampled from pi (d = logp - logp_ref), inputs cast to fp32:
- `k1`: d                      (Guided-GRPO `kl`)
- `abs`: |d|                   (Guided-GRPO `abs`)
- `k2`: d^2 / 2                (Guided-GRPO `mse`)
- `k3`: e^x - x - 1 with x = clamp(-d, -20, 20), result clamped to [-10, 10]
                               (Guided-GRPO `low_var_kl`, clamps included, for parity)
The original's `full` estimator is mis-specified (docs/guided_grpo.md#bug-estimators) and not offered.

Applying it (docs/guided_grpo.md#algorithms):
- as a loss term: `losses.policy_loss` adds beta * agg(kl(logp, logp_ref)) with the policy loss's
  own aggregation, so the term is exact under gradient accumulation too;
- in the reward: `apply_kl_penalty` gives r_t - beta * kl(logp, logp_ref) * m_t (the original
  uses its recomputed old log-probs as logp; pass `logp_proximal`, or `logp_behaviour` with
  `bypass`) and the metric the original logs as `actor/kl_penalty` (batch mean of per-sequence
  masked means).
Controllers: `FixedKLController` (beta constant) and `AdaptiveKLController`
(beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon), n_steps = batch size,
as the original). Departs from the original: both have `state_dict` / `load_state_dict` so the
adaptive beta survives checkpoints (the original does not save it), and the learner may drive the controller with the
KL it measures in either mode (the original only adapts the in-reward penalty).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:
    from asyncrl.config import KLConfig

__all__ = [
    "KLEstimator",
    "kl_estimate",
    "apply_kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
]

KLEstimator = Literal["k1", "abs", "k2", "k3"]


def kl_estimate(logp: Tensor, logp_ref: Tensor, estimator: KLEstimator | str) -> Tensor:
    """Per-token KL estimate (fp32, same shape as the inputs; not masked)."""
    logp, logp_ref = logp.float(), logp_ref.float()
    if estimator == "k1":
        return logp - logp_ref
    if estimator == "abs":
        return (logp - logp_ref).abs()
    if estimator == "k2":
        return 0.5 * (logp - logp_ref).square()
    if estimator == "k3":
        x = torch.clamp(logp_ref - logp, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(x) - x - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, abs, k2 or k3")


def apply_kl_penalty(
    token_rewards: Tensor,
    logp: Tensor,
    logp_ref: Tensor,
    response_mask: Tensor,
    beta: float,
    estimator: KLEstimator | str = "k1",
) -> tuple[Tensor, Tensor]:
    """KL-in-reward: returns (token_rewards - beta * kl * mask, mean KL).

    mean KL = batch mean over sequences of each sequence's masked mean KL (the original's
    `actor/kl_penalty`; sequences without trained tokens count as 0); feed it to the controller's
    `update`. Turn sequence scores into token rewards with
    `advantages.scores_to_token_rewards` first.
    """
    mask = response_mask.float()
    kld = kl_estimate(logp, logp_ref, estimator).detach() * mask
    seq_kl = kld.sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
    return token_rewards.float() - beta * kld, seq_kl.mean()


class FixedKLController:
    """beta stays at its initial value."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept so learners treat both controllers alike)."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. (2019), as in Guided-GRPO / verl."""

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


def make_kl_controller(config: KLConfig) -> FixedKLController | AdaptiveKLController:
    """Controller for `learner.kl` (beta = 0 when KL is disabled)."""
    coef = config.coef if config.enable else 0.0
    if config.type == "adaptive":
        return AdaptiveKLController(coef, config.target, config.horizon)
    return FixedKLController(coef)
