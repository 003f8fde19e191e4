"""Off-policy correction weights of the policy loss, and the step-level variance controls.

The loss (`asyncrl.learner.losses`, whose module docstring is the one place that reads the
objective top to bottom, step 3 there) multiplies its per-token surrogate by the detached weight
`off_policy_weights` returns for r = pi_prox / mu. The masks the weighting modes compose
(`m2po_keep`, `drift_keep` over `sequence_drift`) and the optimizer step's learning-rate factor
(`step_lr_scale`, with `effective_sample_size`) live here with it: all of them read the same two
log-probs of the sampled tokens and nothing of the policy gradient itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from asyncrl.config import OffPolicyConfig

__all__ = [
    "LOG_RATIO_LIMIT",
    "off_policy_weights",
    "m2po_keep",
    "drift_keep",
    "sequence_drift",
    "effective_sample_size",
    "step_lr_scale",
]

LOG_RATIO_LIMIT = 20.0
"""|log ratio| clamp before exponentiating: e^20 ~ 5e8 stays finite in fp32."""


def off_policy_weights(
    logp_proximal: Tensor | None,
    logp_behaviour: Tensor | None,
    response_mask: Tensor,
    config: OffPolicyConfig,
) -> tuple[Tensor, Tensor]:
    """(weight w, clipped-or-masked indicator), both [N, T] fp32 and detached; see `asyncrl.learner.losses`' module doc (step 3)."""
    mode = config.mode
    mask = response_mask.float()
    if not config.weighs:
        return torch.ones_like(mask), torch.zeros_like(mask)
    if logp_proximal is None or logp_behaviour is None:
        raise ValueError(f"off_policy.mode={mode} needs logp_proximal and logp_behaviour")
    log_w = (logp_proximal.detach().float() - logp_behaviour.detach().float()) * mask
    if mode.startswith("seq_"):  # one ratio per sequence, on every one of its tokens
        log_w = log_w.sum(dim=1, keepdim=True)
        if config.seq_ratio == "geometric_mean":
            log_w = log_w / mask.sum(dim=1, keepdim=True).clamp_min(1.0)
        log_w = log_w.expand_as(mask)
    raw = torch.exp(log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    if mode in ("tis", "seq_tis"):
        clipped = (raw > config.cap).float()
        weight = raw.clamp(max=config.cap)
    elif mode in ("mis", "seq_mis", "rs", "seq_rs"):
        keep = (raw >= config.low) & (raw <= config.high)
        clipped = (~keep).float()
        kept = raw if mode in ("mis", "seq_mis") else torch.ones_like(raw)  # rs: reject only, no reweighting
        weight = torch.where(keep, kept, torch.zeros_like(raw))
    elif mode == "decoupled":
        keep = raw <= config.cap
        clipped, weight = (~keep).float(), torch.where(keep, raw, torch.zeros_like(raw))
    elif mode == "m2po":
        keep_m2 = m2po_keep(log_w, mask, config.m2po_tau)
        clipped, weight = (1.0 - keep_m2), raw * keep_m2
    else:
        raise ValueError(f"unknown off_policy.mode {mode!r}")
    if config.seq_kl_budget is not None:  # composes with every weighting mode above
        seq_keep = drift_keep(logp_proximal, logp_behaviour, mask, config.seq_kl_budget)
        clipped, weight = torch.maximum(clipped, 1.0 - seq_keep), weight * seq_keep
    return weight * mask, clipped * mask


def m2po_keep(log_ratio: Tensor, response_mask: Tensor, tau: float) -> Tensor:
    """M2PO's second-moment mask, [N, T] fp32 (1 = kept): the trained tokens with the largest
    (log r)^2 are masked, largest first, until the mean (log r)^2 of the kept ones is <= tau.

    Why a second moment instead of a clip: the mean of (log r)^2 bounds the variance the stale
    tokens add, while clipping every token past 1 +- eps discards many informative ones (the
    paper masks ~0.06% where clipping hit 1.2%). Vectorised: sorted descending, the kept set is
    a suffix; the first suffix whose mean is <= tau decides how many are masked. When no suffix
    qualifies one token (the smallest) is kept, as AReaL's `get_m2po_loss_mask` does, so a
    micro-batch never loses every token. The set is this call's tokens (the learner calls per
    micro-batch), so the budget holds per micro-batch."""
    m = response_mask > 0
    sq = log_ratio.detach().double().pow(2)[m]
    keep = torch.zeros_like(response_mask, dtype=torch.float32)
    n = sq.numel()
    if n == 0:
        return keep
    order = torch.argsort(sq, descending=True, stable=True)
    suffix_sum = sq[order].flip(0).cumsum(0).flip(0)
    suffix_mean = suffix_sum / torch.arange(n, 0, -1, dtype=torch.float64, device=sq.device)
    ok = torch.nonzero(suffix_mean <= tau)
    masked = int(ok[0]) if ok.numel() else n - 1
    kept = torch.ones(n, dtype=torch.float32, device=sq.device)
    kept[order[:masked]] = 0.0
    keep[m] = kept
    return keep


def sequence_drift(logp_proximal: Tensor, logp_behaviour: Tensor, response_mask: Tensor) -> Tensor:
    """[N] k3 estimate of KL(mu || pi_prox) of each whole sequence: the sum over its trained tokens
    of e^d - d - 1, d = log pi_prox - log mu (the KL of a sequence distribution is the sum of its
    per-token KLs)."""
    mask = response_mask.float()
    d = (logp_proximal.detach().float() - logp_behaviour.detach().float()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return ((torch.exp(d) - d - 1.0) * mask).sum(dim=1)


def drift_keep(logp_proximal: Tensor, logp_behaviour: Tensor, response_mask: Tensor, budget: float) -> Tensor:
    """Sequence-level drift mask, [N, T] fp32: 0 on every token of a sequence whose drift
    (`sequence_drift`, summed over the conversation) exceeds `budget`, else 1.

    Why per sequence: stale damage shows in a conversation's summed drift, not in per-token
    ratios (which average ~1); dropping the whole sequence keeps no half-trained turn."""
    per_seq = sequence_drift(logp_proximal, logp_behaviour, response_mask)
    return (per_seq <= budget).float()[:, None].expand_as(response_mask).float()


def effective_sample_size(weight_mean: float, weight_sq_mean: float) -> float:
    """Normalised effective sample size of importance weights, ESS/n = (mean w)^2 / mean(w^2),
    in (0, 1]: 1 when every weight is equal, ~k/n when k weights carry the batch (Kong's ESS).
    1.0 when nothing was weighted (mean w^2 = 0)."""
    return weight_mean**2 / weight_sq_mean if weight_sq_mean > 0 else 1.0


def step_lr_scale(config: OffPolicyConfig, weight_sums: Tensor, token_versions: Tensor, response_mask: Tensor,
                  version: int) -> float:
    """Learning-rate factor of one optimizer step (`off_policy.lr_scale`), floored at `lr_scale_min`.

    `weight_sums` = [[sum w, n], [sum w^2, n]] of the step's sequence importance weights
    w_i = prod_t pi_prox/mu over all ranks (the `train/seq_is_weight_mean` and
    `train/seq_is_weight_sq_mean` metric pairs). `ess`: (mean w)^2 / mean(w^2) (VCPO: a step
    whose weight is carried by few sequences moves less; per-token weights stay ~1 at small lag,
    a conversation's product does not); `lag`:
    1 / (1 + mean lag per trained token), lag = version - token version (stability needs the step
    size to shrink like 1/staleness). Adam's update is invariant to the loss scale, hence the LR."""
    if config.lr_scale == "none":
        return 1.0
    if config.lr_scale == "ess":
        n = float(weight_sums[0, 1])
        if n <= 0:
            return 1.0
        raw = effective_sample_size(float(weight_sums[0, 0]) / n, float(weight_sums[1, 0]) / n)
    else:
        mask = response_mask.float()
        lag = ((version - token_versions.float()) * mask).sum() / mask.sum().clamp_min(1.0)
        raw = 1.0 / (1.0 + max(float(lag), 0.0))
    return max(raw, config.lr_scale_min)
