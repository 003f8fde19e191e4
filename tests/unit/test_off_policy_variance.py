"""Proves the variance-controlling off-policy modes against hand-derived values: M2PO's
second-moment mask (and its agreement with a literal implementation of the paper's masking
loop), the sequence-level drift budget, the normalised ESS and the step learning-rate factor
(`ess`, `lag`, the floor), per-group lag down-weighting, the learning rate actually applied by
the learner's scaled optimizer step, the metrics each mode logs, and the combinations the config
refuses by name."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from asyncrl.config import LearnerConfig
from asyncrl.config.roles import OffPolicyConfig
from asyncrl.learner.advantages import group_lag_weights
from asyncrl.learner.learner import LearnerWorker
from asyncrl.learner.losses import (
    drift_keep,
    effective_sample_size,
    finalize_metrics,
    m2po_keep,
    off_policy_weights,
    policy_loss,
    sequence_drift,
    step_lr_scale,
)

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------ M2PO
def test_m2po_masks_largest_squares_until_budget():
    # log r = [0.5, -0.1, 0.3, 0.0] -> (log r)^2 = [0.25, 0.01, 0.09, 0]; sorted desc 0.25, 0.09, 0.01, 0
    # mean of all = 0.35 / 4 = 0.0875 > 0.04; without 0.25: 0.10 / 3 = 0.0333 <= 0.04 -> mask token 0 only
    log_r = torch.tensor([[0.5, -0.1, 0.3, 0.0]])
    mask = torch.ones_like(log_r)
    assert m2po_keep(log_r, mask, 0.04).tolist() == [[0.0, 1.0, 1.0, 1.0]]
    # tau 0.02: 0.0333 > 0.02; without 0.25 and 0.09: 0.01 / 2 = 0.005 <= 0.02 -> mask tokens 0 and 2
    assert m2po_keep(log_r, mask, 0.02).tolist() == [[0.0, 1.0, 0.0, 1.0]]
    # tau 0.1: 0.0875 <= 0.1 -> nothing masked
    assert m2po_keep(log_r, mask, 0.1).tolist() == [[1.0, 1.0, 1.0, 1.0]]


def test_m2po_ignores_untrained_tokens_and_keeps_one():
    # a padding token with log r = 5 is not trained: not counted, not kept (keep = 0 off the mask)
    log_r = torch.tensor([[0.5, -0.1, 0.3, 0.0], [5.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    assert m2po_keep(log_r, mask, 0.04).tolist() == [[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    # (log r)^2 = [1, 4]: suffix means 2.5, 1 are both > 1e-9 -> all but the smallest masked
    assert m2po_keep(torch.tensor([[1.0, 2.0]]), torch.ones(1, 2), 1e-9).tolist() == [[1.0, 0.0]]
    assert m2po_keep(torch.zeros(2, 3), torch.zeros(2, 3), 0.04).sum() == 0


def _m2po_literal(sq: list[float], tau: float) -> list[int]:
    """The paper's loop as written: while the kept tokens' mean (log r)^2 exceeds tau, mask the
    largest kept one (keeping at least one, as AReaL's reference does)."""
    kept = list(range(len(sq)))
    while len(kept) > 1 and sum(sq[i] for i in kept) / len(kept) > tau:
        kept.remove(max(kept, key=lambda i: sq[i]))
    return sorted(kept)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_m2po_agrees_with_the_masking_loop(seed):
    # random log-ratios with a heavy tail (stale tokens), 3 x 16 with ragged masks
    g = torch.Generator().manual_seed(seed)
    log_r = torch.randn(3, 16, generator=g) * 0.1
    log_r[0, 3], log_r[2, 7] = 1.2, -0.9
    mask = torch.ones(3, 16)
    mask[1, 10:] = 0
    keep = m2po_keep(log_r, mask, 0.04)
    flat = [(i, t) for i in range(3) for t in range(16) if mask[i, t] > 0]
    sq = [float(log_r[i, t]) ** 2 for i, t in flat]
    expect = _m2po_literal(sq, 0.04)
    assert [k for k, (i, t) in enumerate(flat) if keep[i, t] > 0] == expect
    assert 0 < len(expect) < len(flat)  # the case masks something and keeps something


def test_m2po_weight_and_metrics_through_policy_loss():
    # prox - behaviour = log r = [0.5, -0.1, 0.3, 0.0]; token 0 masked (above) -> w = [0, e^-0.1, e^0.3, 1]
    beh = torch.zeros(1, 4)
    prox = torch.tensor([[0.5, -0.1, 0.3, 0.0]])
    mask = torch.ones(1, 4)
    config = LearnerConfig(off_policy={"mode": "m2po"})
    w, masked = off_policy_weights(prox, beh, mask, config.off_policy)
    assert w.tolist()[0] == pytest.approx([0.0, math.exp(-0.1), math.exp(0.3), 1.0], abs=1e-6)
    assert masked.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    # logp = prox (ratio 1, no clip), A = 1: pg = -mean(w) = -(0 + 0.904837 + 1.349859 + 1) / 4
    _, m = policy_loss(prox.clone().requires_grad_(), prox, beh, torch.ones(1, 4), mask, config)
    f = finalize_metrics(m)
    assert f["loss/pg"] == pytest.approx(-(math.exp(-0.1) + math.exp(0.3) + 1.0) / 4, abs=1e-6)
    assert f["train/m2po_masked_frac"] == pytest.approx(0.25)
    # mean w^2 = (0 + e^-0.2 + e^0.6 + 1) / 4
    assert f["train/is_weight_sq_mean"] == pytest.approx((math.exp(-0.2) + math.exp(0.6) + 1.0) / 4, abs=1e-6)
    assert "train/drift_masked_frac" not in f  # drift budget off: not logged
    _, m = policy_loss(prox.clone().requires_grad_(), prox, beh, torch.ones(1, 4), mask,
                       LearnerConfig(off_policy={"mode": "decoupled"}))
    assert "train/m2po_masked_frac" not in finalize_metrics(m)


# ------------------------------------------------------------------------------ drift budget
def test_drift_budget_masks_whole_sequences():
    # row 0: d = log(pi_prox/mu) = [0.1, 0.1] -> k3 = e^d - d - 1 = 0.0051709 each, sequence sum 0.0103418
    # row 1: d = [0.5, 0.0] -> k3 = [e^0.5 - 1.5 = 0.1487213, 0], sum 0.1487213
    # budget 0.03: row 0 kept, row 1 dropped; budget 0.2: both kept; budget 0.01: both dropped
    prox = torch.tensor([[0.1, 0.1], [0.5, 0.0]])
    beh = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    assert sequence_drift(prox, beh, mask).tolist() == pytest.approx([2 * (math.exp(0.1) - 1.1), math.exp(0.5) - 1.5], abs=1e-6)
    assert drift_keep(prox, beh, mask, 0.03).tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert drift_keep(prox, beh, mask, 0.2).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert drift_keep(prox, beh, mask, 0.01).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    # untrained positions do not count: row 0 with its second token masked sums 0.0051709 <= 0.01
    assert drift_keep(prox, beh, torch.tensor([[1.0, 0.0], [1.0, 1.0]]), 0.01).tolist()[0] == [1.0, 1.0]


def test_drift_budget_composes_with_decoupled():
    # decoupled cap 2: w = r = e^d where e^d <= 2: row 0 [e^0.1, e^0.1]; row 1 dropped by the budget
    prox = torch.tensor([[0.1, 0.1], [0.5, 0.0]])
    beh, mask = torch.zeros(2, 2), torch.ones(2, 2)
    config = LearnerConfig(off_policy={"mode": "decoupled", "seq_kl_budget": 0.03})
    w, masked = off_policy_weights(prox, beh, mask, config.off_policy)
    assert w.flatten().tolist() == pytest.approx([math.exp(0.1)] * 2 + [0.0, 0.0], abs=1e-6)
    assert masked.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    _, m = policy_loss(prox.clone().requires_grad_(), prox, beh, torch.ones(2, 2), mask, config)
    f = finalize_metrics(m)
    assert f["train/drift_masked_frac"] == pytest.approx(0.5)
    # conversation drift, mean over the 2 sequences: (0.0103418 + 0.1487213) / 2
    assert f["train/seq_mismatch_kl"] == pytest.approx((2 * (math.exp(0.1) - 1.1) + math.exp(0.5) - 1.5) / 2, abs=1e-6)
    # sequence weights w_i = e^(sum_t d): e^0.2, e^0.5 -> mean (1.221403 + 1.648721) / 2, mean square (e^0.4 + e^1) / 2
    assert f["train/seq_is_weight_mean"] == pytest.approx((math.exp(0.2) + math.exp(0.5)) / 2, abs=1e-6)
    assert f["train/seq_is_weight_sq_mean"] == pytest.approx((math.exp(0.4) + math.exp(1.0)) / 2, abs=1e-6)


# ------------------------------------------------------------------------- ESS and the LR factor
def test_effective_sample_size():
    # w = [1, 1, 0, 0]: (0.5)^2 / 0.5 = 0.5 (two tokens carry the batch); w = [2, 0, 0, 0]: 0.25 / 1 = 0.25
    assert effective_sample_size(0.5, 0.5) == pytest.approx(0.5)
    assert effective_sample_size(0.5, 1.0) == pytest.approx(0.25)
    assert effective_sample_size(1.0, 1.0) == pytest.approx(1.0)
    assert effective_sample_size(0.0, 0.0) == 1.0


def test_step_lr_scale_ess_lag_and_floor():
    versions = torch.tensor([[3, 3, -1], [4, 4, 4]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # ess: 4 sequences, sum w = 2, sum w^2 = 4 (w = [2, 0, 0, 0]) -> (0.5)^2 / 1 = 0.25
    sums = torch.tensor([[2.0, 4.0], [4.0, 4.0]], dtype=torch.float64)
    assert step_lr_scale(OffPolicyConfig(mode="tis", lr_scale="ess"), sums, versions, mask, 5) == pytest.approx(0.25)
    # floor 0.5 wins over 0.25
    floored = OffPolicyConfig(mode="tis", lr_scale="ess", lr_scale_min=0.5)
    assert step_lr_scale(floored, sums, versions, mask, 5) == pytest.approx(0.5)
    # lag at version 5: tokens lag [2, 2, 1, 1, 1] (the padding -1 is not counted) -> mean 7/5 = 1.4 -> 1/2.4
    assert step_lr_scale(OffPolicyConfig(lr_scale="lag"), sums, versions, mask, 5) == pytest.approx(1 / 2.4)
    assert step_lr_scale(OffPolicyConfig(), sums, versions, mask, 5) == 1.0


def test_scaled_optimizer_step_applies_then_restores_the_schedule():
    # SGD, lr 0.1, scheduler factor 1 then 0.5; grad 1; scale 0.25 -> the step moves p by 0.1 * 0.25 = 0.025
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s == 0 else 0.5)

    def step(applied: bool):
        def _step():
            if applied:
                opt.step()
                sched.step()
            return applied, 1.0
        return _step

    p.grad = torch.tensor([1.0])
    worker = SimpleNamespace(scheduler=sched, _optimizer_step=step(True))
    assert LearnerWorker._scaled_optimizer_step(worker, 0.25) == (True, 1.0)
    assert float(p.detach()) == pytest.approx(1.0 - 0.025)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)  # the scheduler's next value, unscaled
    worker._optimizer_step = step(False)  # a skipped (non-finite) step leaves the old lr, unscaled
    LearnerWorker._scaled_optimizer_step(worker, 0.25)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


# ------------------------------------------------------------------------------- lag weights
def test_group_lag_weights():
    # groups [a, a, b, b] at version 5; group a's oldest token is version 4 (lag 1), group b mixes
    # versions 2 and 4 within a sample (oldest 2: lag 3). decay 0.5 -> [0.5, 0.5, 0.125, 0.125]
    versions = torch.tensor([[4, 4, -1], [5, 5, 5], [2, 4, 4], [4, 4, 4]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    groups = torch.tensor([7, 7, 3, 3])
    w = group_lag_weights(versions, groups, mask, 5, 0.5)
    assert w.tolist() == pytest.approx([0.5, 0.5, 0.125, 0.125])
    assert group_lag_weights(versions, groups, mask, 5, 1.0).tolist() == [1.0] * 4
    # a group's GRPO advantages sum to 0; one factor per group keeps that
    adv = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]])
    assert float((adv * w[:, None])[:2].sum()) == 0.0


# ------------------------------------------------------------------------------ config refusals
@pytest.mark.parametrize("mode", ["none", "bypass"])
def test_config_refuses_combinations_that_do_nothing(mode):
    with pytest.raises(ValidationError, match="lr_scale=ess"):
        OffPolicyConfig(mode=mode, lr_scale="ess")
    with pytest.raises(ValidationError, match="seq_kl_budget"):
        OffPolicyConfig(mode=mode, seq_kl_budget=0.02)
    OffPolicyConfig(mode=mode, lr_scale="lag", lag_decay=0.5)  # these need no correction weight


@pytest.mark.parametrize("loss_type", ["ppo", "cispo", "gspo", "gspo_token"])
def test_m2po_composes_with_every_loss_type(loss_type):
    # logp = prox: every surrogate's weight is 1 at ratio 1, so pg = -mean(w) with M2PO's w (above)
    prox = torch.tensor([[0.5, -0.1, 0.3, 0.0]])
    config = LearnerConfig(loss_type=loss_type, off_policy={"mode": "m2po", "seq_kl_budget": 1.0})
    loss, m = policy_loss(prox.clone().requires_grad_(), prox, torch.zeros(1, 4), torch.ones(1, 4),
                          torch.ones(1, 4), config)
    expect = -(math.exp(-0.1) + math.exp(0.3) + 1.0) / 4
    if loss_type == "cispo":  # L = -A sg(clamp(ratio)) logp_t: value -mean(w logp)
        expect = -(math.exp(-0.1) * -0.1 + math.exp(0.3) * 0.3) / 4
    assert float(loss) == pytest.approx(expect, abs=1e-6)
    assert finalize_metrics(m)["train/drift_masked_frac"] == 0.0
