"""Policy losses of the GRPO family with off-policy correction, read top to bottom.

Three policies meet in an async learner: the current policy pi (`logp`, with gradient), the
proximal policy pi_prox (`logp_proximal`: the learner's weights at the start of the step,
recomputed) and the behaviour policy mu (`logp_behaviour`: the engine's log-probs of the sampled
tokens, possibly several versions old). The PPO trust region is centred on pi_prox; the
correction reweights for pi_prox != mu (off-policy lag and engine/learner numerics).

`policy_loss(logp, logp_proximal, logp_behaviour, advantages, response_mask, config)`:
1. anchor = pi_prox (mode `bypass`: anchor = mu, no recompute needed); log-ratio
   l_t = logp_t - anchor_t; `gspo`: l_t = s_i, the masked mean of the sequence's log-ratios;
   `gspo_token`: l_t = sg(s_i) + logp_t - sg(logp_t).
2. `ppo` / `gspo` / `gspo_token` (the original's `default`; docs/guided_grpo.md#algorithms):
   ratio = e^clamp(l, -20, 20), cratio = e^clamp(l, ln(1 - eps_low), ln(1 + eps_high)),
   L = max(-A ratio, -A cratio), and for A < 0 the dual clip L = min(L, -A c).
   `cispo`: L = -A sg(clamp(ratio, 1 - cispo_eps_low, 1 + cispo_eps_high)) logp_t with
   `cispo_eps_low = None` meaning no lower bound, as the CISPO paper means it (the original's
   recipe, clip_ratio_low = 0, raised every weight below 1 to 1; docs/guided_grpo.md#bug-cispo-clip).
3. correction weight w (detached, `off_policy.off_policy_weights`) of r = pi_prox/mu, multiplied into L:
   `none` / `bypass` w = 1; `tis` w = min(r, cap); `mis` (masked importance sampling, as TRL's
   `token_mask` and AReaL's `mask`) w = r 1[low <= r <= high]; `rs` (rejection only, verl's
   rejection mode) w = 1[low <= r <= high]; `seq_tis` / `seq_mis` / `seq_rs` the same on one ratio
   per sequence, r_i = the geometric mean of its token ratios (`seq_ratio=geometric_mean`, AReaL's
   choice: a bound means the same at any length) or their product (`seq_ratio=product`, the exact
   sequence weight, as verl and TRL define sequence-level TIS); `decoupled` (AReaL) w = r where
   r <= cap, else 0 (AReaL's `behav_imp_weight_cap` filters rather than clamps; the clamped form
   min(r, cap) under a pi/pi_prox clip is exactly `tis`). Masked tokens stay in the normaliser, so
   the global token count is known before the step.
   `m2po` (M2PO, arXiv 2510.01161) w = r M, M masking the tokens with the largest (log r)^2 until
   the mean (log r)^2 of the kept ones is <= `m2po_tau` (`m2po_keep`; per call, i.e. per
   micro-batch). `seq_kl_budget` (any mode but none/bypass) then zeroes every token of a sequence
   whose k3 KL(mu || pi_prox), summed over the sequence, exceeds it (`drift_keep`). The learner's other two variance
   controls live outside the loss: `lag_decay` scales a group's advantages
   (`advantages.group_lag_weights`), `lr_scale` the optimizer step's learning rate (`step_lr_scale`).
4. loss = agg(w L) + beta agg(kl(logp, logp_ref)) [KL as loss] - entropy_coef agg(H).

Aggregation (`loss_avg_mode`), exact under any micro-batch / rank split when the caller passes
the normalisers of the WHOLE mini-batch over ALL ranks (sum `loss_normalisers` over them):
- `token`: sum_{i,t} m x / global_num_tokens;
- `seq`: sum_i [sum_t m x / sum_t m] / global_num_seqs (a true mean of per-sequence means; the
  original re-weights it by micro-batch token counts);
- `seq_sum_token_mean` (Dr.GRPO): sum_i [sum_t m x / norm_length] / global_num_seqs, with
  norm_length a constant across micro-batches AND steps (the learner passes
  `learner.norm_length`, the configured response budget, the paper's MAX_TOKENS; without it, T of
  the tensor, which moves with the longest response of the batch).
The returned loss is this micro-batch's SHARE: summed over every micro-batch of every rank it is
the full-batch loss. An engine that averages gradients over W ranks and divides by the number of
accumulation steps must multiply it by W x steps before backward. Without normalisers each call
is normalised locally (a single micro-batch is then the whole batch).

Metrics: dict name -> float64 tensor [sum, count]; add them over micro-batches (and all-reduce
`stack_metrics` over ranks), then `finalize_metrics` gives sum / count. Token metrics count
trained tokens; `loss/*` count the micro-batch's share of the normaliser, so their finalised
value is the exact full-batch loss. Departures from the original's metrics: `train/clipfrac_high`
/ `train/clipfrac_low` are the fractions of tokens at the upper (A > 0) / lower (A < 0) clip
(cispo: ratio above / below its bounds), `train/clipfrac_dual` the dual-clip fraction (the
original logs "either bound" as `pg_clipfrac_higher` and dual as `pg_clipfrac_lower`);
`train/entropy` is the true entropy over the vocabulary (`entropy_from_logits`) instead of the
NLL proxy; `loss/kl` is averaged over micro-batches instead of keeping the last micro-batch's value;
`train/mismatch_kl` = k3 estimate of KL(mu || pi_prox) on the sampled tokens;
`train/seq_mismatch_kl` = the same summed over each sequence, averaged over sequences (the drift
of a whole conversation); `train/seq_is_weight_mean` / `_sq_mean` = mean w_i, w_i^2 of the
sequence weights w_i = prod_t pi_prox/mu (their ESS drives `lr_scale=ess`); `train/is_weight_sq_mean` = mean w^2 (with `train/is_weight_mean` the ESS); `train/m2po_masked_frac`,
`train/drift_masked_frac` the tokens each mask removed (count 0, so not logged, when it is off).

`logprobs_from_logits` / `entropy_from_logits` take logits divided by the rollout temperature
(as the original) in fp32 row chunks with an analytic backward, so no fp32 [tokens, vocab] copy
is kept alive between forward and backward (measured on CPU: as fast as log_softmax + gather).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import Tensor

from asyncrl.learner.kl import kl_estimate
from asyncrl.learner.off_policy import LOG_RATIO_LIMIT as _LOG_RATIO_LIMIT
from asyncrl.learner.off_policy import (  # re-exported: the loss's public surface stays one import
    drift_keep,
    effective_sample_size,
    m2po_keep,
    off_policy_weights,
    sequence_drift,
    step_lr_scale,
)

if TYPE_CHECKING:
    from asyncrl.config import KLConfig, OffPolicyConfig


class LossSettings(Protocol):
    """What the loss reads of `learner` (a `LearnerConfig` is one): the objective's own keys and
    the `kl` and `off_policy` sub-sections, nothing of the optimiser, batching or weight sync."""

    loss_type: str
    loss_avg_mode: str
    clip_eps_low: float
    clip_eps_high: float
    clip_ratio_dual: float
    cispo_eps_low: float | None
    cispo_eps_high: float
    entropy_coef: float
    kl: KLConfig
    off_policy: OffPolicyConfig

__all__ = [
    "policy_loss",
    "off_policy_weights",
    "loss_normalisers",
    "logprobs_from_logits",
    "entropy_from_logits",
    "METRIC_NAMES",
    "sum_metrics",
    "stack_metrics",
    "unstack_metrics",
    "finalize_metrics",
    "m2po_keep",
    "drift_keep",
    "sequence_drift",
    "effective_sample_size",
    "step_lr_scale",
]

METRIC_NAMES: tuple[str, ...] = (
    "loss/total",
    "loss/pg",
    "loss/kl",
    "loss/entropy",
    "train/clipfrac_high",
    "train/clipfrac_low",
    "train/clipfrac_dual",
    "train/ppo_kl",
    "train/is_weight_mean",
    "train/is_clipped_frac",
    "train/entropy",
    "train/mismatch_kl",
    "train/is_weight_sq_mean",
    "train/m2po_masked_frac",
    "train/drift_masked_frac",
    "train/seq_mismatch_kl",
    "train/seq_is_weight_mean",
    "train/seq_is_weight_sq_mean",
)


# ---------------------------------------------------------------------------------- log-probs
def _scaled(chunk: Tensor, temperature: float) -> Tensor:
    z = chunk.float()
    return z / temperature if temperature != 1.0 else z


class _LogProbs(torch.autograd.Function):
    """log softmax(x / T)[label] row-chunked; backward recomputes softmax per chunk
    (d/dx_j = (1[j = label] - p_j) / T), so nothing of size [rows, V] is saved."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, chunk_rows: int) -> Tensor:  # type: ignore[override]
        flat, lab = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, flat.shape[0], chunk_rows):
            z = _scaled(flat[start : start + chunk_rows], temperature)
            picked = z.gather(-1, lab[start : start + chunk_rows, None]).squeeze(-1)
            out[start : start + chunk_rows] = picked - torch.logsumexp(z, dim=-1)
        ctx.save_for_backward(logits, labels)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return out.reshape(labels.shape)

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        logits, labels = ctx.saved_tensors
        flat, lab, g = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), grad_out.reshape(-1).float()
        grad = torch.empty_like(flat)
        rows = ctx.chunk_rows
        for start in range(0, flat.shape[0], rows):
            gc = g[start : start + rows, None]
            d = torch.softmax(_scaled(flat[start : start + rows], ctx.temperature), dim=-1).mul_(-gc)
            d.scatter_add_(1, lab[start : start + rows, None], gc)
            grad[start : start + rows] = d.div_(ctx.temperature)
        return grad.reshape(logits.shape), None, None, None


class _Entropy(torch.autograd.Function):
    """H = -sum_j p_j log p_j of softmax(x / T), row-chunked; backward recomputes per chunk
    (dH/dx_j = -p_j (log p_j + H) / T)."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_rows: int) -> Tensor:  # type: ignore[override]
        flat = logits.reshape(-1, logits.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, flat.shape[0], chunk_rows):
            logq = torch.log_softmax(_scaled(flat[start : start + chunk_rows], temperature), dim=-1)
            out[start : start + chunk_rows] = -(logq.exp() * logq).sum(dim=-1)
        ctx.save_for_backward(logits, out)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return out.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        logits, entropy = ctx.saved_tensors
        flat, g = logits.reshape(-1, logits.shape[-1]), grad_out.reshape(-1).float()
        grad = torch.empty_like(flat)
        rows = ctx.chunk_rows
        for start in range(0, flat.shape[0], rows):
            logq = torch.log_softmax(_scaled(flat[start : start + rows], ctx.temperature), dim=-1)
            h = entropy[start : start + rows, None]
            d = logq.exp() * (logq + h)
            grad[start : start + rows] = d.mul_(-g[start : start + rows, None] / ctx.temperature)
        return grad.reshape(logits.shape), None, None


def logprobs_from_logits(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk_rows: int = 1024
) -> Tensor:
    """log softmax(logits / temperature) gathered at labels: [..., V], [...] -> [...] (fp32).

    Row-chunked in fp32 forward and backward: besides the logits (and their gradient), peak
    extra memory is ~ 2 x chunk_rows x V x 4 bytes; nothing of size [rows, V] is kept for
    backward. Differentiable once (no double backward)."""
    return _LogProbs.apply(logits, labels, float(temperature), int(chunk_rows))


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_rows: int = 1024) -> Tensor:
    """Entropy over the vocabulary of softmax(logits / temperature): [..., V] -> [...] (fp32),
    chunked like `logprobs_from_logits`; differentiable once."""
    return _Entropy.apply(logits, float(temperature), int(chunk_rows))


# ------------------------------------------------------------------------------ normalisers
def loss_normalisers(response_mask: Tensor) -> tuple[int, int]:
    """(trained tokens, sequences with >= 1 trained token) of a (micro-)batch. Sum them over every
    micro-batch of the mini-batch on every rank to get `global_num_tokens`, `global_num_seqs`."""
    tokens_per_seq = response_mask.float().sum(dim=1)
    return int(tokens_per_seq.sum().item()), int((tokens_per_seq > 0).sum().item())


def _aggregate(
    x: Tensor,
    mask: Tensor,
    mode: str,
    num_tokens: float | None,
    num_seqs: float | None,
    norm_length: float | None,
) -> tuple[Tensor, Tensor]:
    """(this micro-batch's share of the aggregated value, its share of the normaliser)."""
    if mode == "token":
        local = mask.sum()
        denom = (
            torch.as_tensor(num_tokens, dtype=torch.float32, device=mask.device)
            if num_tokens is not None
            else local.clamp_min(1.0)
        )
        return (x * mask).sum() / denom, local / denom
    seq_tokens = mask.sum(dim=1)
    local = (seq_tokens > 0).float().sum()
    denom = (
        torch.as_tensor(num_seqs, dtype=torch.float32, device=mask.device)
        if num_seqs is not None
        else local.clamp_min(1.0)
    )
    if mode == "seq":
        per_seq = (x * mask).sum(dim=1) / seq_tokens.clamp_min(1.0)
    elif mode == "seq_sum_token_mean":
        per_seq = (x * mask).sum(dim=1) / float(norm_length if norm_length is not None else mask.shape[1])
    else:
        raise ValueError(f"unknown loss_avg_mode {mode!r}")
    return per_seq.sum() / denom, local / denom


# ------------------------------------------------------------------------------ the loss
def _log1p_bound(x: float) -> float:
    return math.log1p(x) if x > -1.0 else -math.inf


def policy_loss(
    logp: Tensor,
    logp_proximal: Tensor | None,
    logp_behaviour: Tensor | None,
    advantages: Tensor,
    response_mask: Tensor,
    config: LossSettings,
    *,
    logp_ref: Tensor | None = None,
    entropy: Tensor | None = None,
    kl_coef: float | None = None,
    global_num_tokens: float | Tensor | None = None,
    global_num_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss (this micro-batch's share, see the module doc) and its metrics.

    All per-token tensors are [N, T]. `logp` carries the gradient; `logp_proximal` may be None
    only in `bypass` mode, `logp_behaviour` only in `none` mode. `logp_ref` is required when
    `config.kl.enable` and `config.kl.mode == "loss"` (given otherwise, `loss/kl` is logged
    only). `kl_coef` overrides `config.kl.coef` (pass the controller's value). `entropy` (from
    `entropy_from_logits`) is required when `config.entropy_coef > 0`, logged when given.
    The steps follow the module doc's numbered list, one function each.
    """
    mask = response_mask.float()
    logp = logp.float()
    adv = advantages.detach().float()
    anchor = _anchor(logp_proximal, logp_behaviour, config.off_policy)
    weight, clipped_is = off_policy_weights(logp_proximal, logp_behaviour, mask, config.off_policy)
    ell = _log_ratio(logp, anchor, mask, config.loss_type)
    if config.loss_type == "cispo":
        surrogate = _cispo_surrogate(ell, logp, adv, mask, config)
    else:
        surrogate = _ppo_surrogate(ell, adv, config)
    per_token = surrogate.per_token * weight

    def agg(x: Tensor) -> tuple[Tensor, Tensor]:
        return _aggregate(x, mask, config.loss_avg_mode, global_num_tokens, global_num_seqs, norm_length)

    terms = _loss_terms(agg, per_token, logp, mask, config, logp_ref, entropy, kl_coef)
    metrics = {
        **_loss_share_metrics(terms, mask, has_ref=logp_ref is not None, has_entropy=entropy is not None),
        "train/clipfrac_high": _token_metric(surrogate.clip_high, mask),
        "train/clipfrac_low": _token_metric(surrogate.clip_low, mask),
        "train/clipfrac_dual": _token_metric(surrogate.clip_dual, mask),
        "train/ppo_kl": _token_metric(anchor - logp, mask),
        "train/is_weight_mean": _token_metric(weight, mask),
        "train/is_clipped_frac": _token_metric(clipped_is, mask),
        "train/entropy": _token_metric(entropy, mask)
        if entropy is not None
        else torch.zeros(2, dtype=torch.float64, device=mask.device),
        "train/is_weight_sq_mean": _token_metric(weight * weight, mask),
        **_drift_metrics(logp_proximal, logp_behaviour, mask),
        **_mask_metrics(logp_proximal, logp_behaviour, mask, config.off_policy),
    }
    return terms.loss, metrics


def _anchor(logp_proximal: Tensor | None, logp_behaviour: Tensor | None, off_policy: OffPolicyConfig) -> Tensor:
    """Step 1's centre of the trust region, detached: pi_prox, or mu in `bypass` mode (which
    skips the proximal recompute). Missing log-probs fail here, naming the one the mode needs."""
    anchor = logp_proximal if off_policy.needs_proximal else logp_behaviour
    if anchor is None:
        needed = "logp_proximal" if off_policy.needs_proximal else "logp_behaviour"
        raise ValueError(f"off_policy.mode={off_policy.mode} needs {needed}")
    return anchor.detach().float()


def _log_ratio(logp: Tensor, anchor: Tensor, mask: Tensor, loss_type: str) -> Tensor:
    """Step 1's l_t: per token for ppo/cispo; gspo replaces it with the sequence's masked mean
    s_i (one ratio per sequence, so a long response is not clipped token by token); gspo_token
    keeps s_i's value but routes the gradient through each token (sg(s_i) + logp - sg(logp))."""
    log_ratio = (logp - anchor) * mask
    if loss_type not in ("gspo", "gspo_token"):
        return log_ratio
    seq = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp_min(1.0)
    if loss_type == "gspo":
        return seq.expand_as(logp) * mask
    return seq.detach() + logp - logp.detach()


class _Surrogate(NamedTuple):
    """Step 2's per-token loss and the 0/1 indicators behind the `train/clipfrac_*` metrics."""

    per_token: Tensor
    clip_high: Tensor
    clip_low: Tensor
    clip_dual: Tensor


def _cispo_surrogate(
    ell: Tensor, logp: Tensor, adv: Tensor, mask: Tensor, config: LossSettings
) -> _Surrogate:
    """CISPO: -A sg(clamped ratio) logp. The clamp only bounds the detached weight, so every
    token keeps a gradient (unlike PPO's clip, which zeroes it); no lower bound when
    `cispo_eps_low` is None, as the paper means it."""
    lo = _log1p_bound(-config.cispo_eps_low) if config.cispo_eps_low is not None else -math.inf
    hi = math.log1p(config.cispo_eps_high)
    is_weight = torch.exp(ell.detach().clamp(min=max(lo, -_LOG_RATIO_LIMIT), max=hi))
    per_token = -adv * is_weight * logp
    return _Surrogate(per_token, (ell > hi).float(), (ell < lo).float(), torch.zeros_like(mask))


def _ppo_surrogate(ell: Tensor, adv: Tensor, config: LossSettings) -> _Surrogate:
    """PPO's asymmetric clip max(-A ratio, -A cratio) plus the dual clip min(L, -A c) for A < 0,
    which caps how far one negative-advantage token with a huge ratio can push the step. The
    unclipped ratio's log is clamped to +-20 so that e^l stays finite."""
    lo, hi = _log1p_bound(-config.clip_eps_low), math.log1p(config.clip_eps_high)
    ratio = torch.exp(ell.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
    cratio = torch.exp(ell.clamp(lo, hi))
    loss_clip = torch.maximum(-adv * ratio, -adv * cratio)
    loss_dual = -adv * config.clip_ratio_dual
    negative = adv < 0
    per_token = torch.where(negative, torch.minimum(loss_clip, loss_dual), loss_clip)
    return _Surrogate(
        per_token,
        ((adv > 0) & (ell > hi)).float(),
        (negative & (ell < lo)).float(),
        (negative & (loss_clip > loss_dual)).float(),
    )


class _Terms(NamedTuple):
    """Step 4's aggregated parts, kept apart so that each `loss/*` metric reports its own."""

    loss: Tensor
    pg: Tensor
    share: Tensor  # this micro-batch's share of the normaliser
    kl: Tensor
    entropy: Tensor


def _loss_terms(
    agg: Callable[[Tensor], tuple[Tensor, Tensor]],
    per_token: Tensor,
    logp: Tensor,
    mask: Tensor,
    config: LossSettings,
    logp_ref: Tensor | None,
    entropy: Tensor | None,
    kl_coef: float | None,
) -> _Terms:
    """Step 4: loss = agg(w L) + beta agg(kl) - entropy_coef agg(H), every term through the same
    `agg` so that all of them share one normaliser and stay exact under any micro-batch split.
    The KL is aggregated (for `loss/kl`) whenever `logp_ref` is given, added only in loss mode."""
    pg, share = agg(per_token)
    loss = pg
    kl_value = torch.zeros((), device=mask.device)
    kl_as_loss = config.kl.enable and config.kl.mode == "loss"
    if kl_as_loss and logp_ref is None:
        raise ValueError("kl.enable with kl.mode=loss needs logp_ref")
    if logp_ref is not None:
        kl_value, _ = agg(kl_estimate(logp, logp_ref.detach(), config.kl.estimator))
        if kl_as_loss:
            loss = loss + (config.kl.coef if kl_coef is None else kl_coef) * kl_value
    ent_value = torch.zeros((), device=mask.device)
    if entropy is not None:
        ent_value, _ = agg(entropy.float())
        loss = loss - config.entropy_coef * ent_value
    elif config.entropy_coef > 0:
        raise ValueError("entropy_coef > 0 needs the entropy tensor (entropy_from_logits)")
    return _Terms(loss, pg, share, kl_value, ent_value)


def _token_metric(x: Tensor, mask: Tensor) -> Tensor:
    """[sum over trained tokens, trained tokens] (float64), the per-token metrics' form."""
    return torch.stack([(x.detach().float() * mask).sum(), mask.sum()]).double()


def _loss_share_metrics(
    terms: _Terms, mask: Tensor, *, has_ref: bool, has_entropy: bool
) -> dict[str, Tensor]:
    """`loss/*` as [this share's value, this share of the normaliser]: summed over micro-batches
    and ranks the count is 1, so sum / count is the exact full-batch loss. A term that was not
    computed gets count 0 and is left out of the finalised metrics."""
    no_count = torch.zeros((), device=mask.device)

    def share_of(value: Tensor, count: Tensor) -> Tensor:
        return torch.stack([value.detach().float(), count]).double()

    return {
        "loss/total": share_of(terms.loss, terms.share),
        "loss/pg": share_of(terms.pg, terms.share),
        "loss/kl": share_of(terms.kl, terms.share if has_ref else no_count),
        "loss/entropy": share_of(terms.entropy, terms.share if has_entropy else no_count),
    }


_DRIFT_METRICS = (
    "train/mismatch_kl",
    "train/seq_mismatch_kl",
    "train/seq_is_weight_mean",
    "train/seq_is_weight_sq_mean",
)


def _drift_metrics(
    logp_proximal: Tensor | None, logp_behaviour: Tensor | None, mask: Tensor
) -> dict[str, Tensor]:
    """How far mu lags pi_prox, per token (`train/mismatch_kl`, k3) and per sequence (summed
    drift, and the moments of the sequence weights prod_t pi_prox/mu that `lr_scale=ess` reads).
    All [0, 0] (not logged) when either log-prob is missing."""
    if logp_proximal is None or logp_behaviour is None:
        zero = torch.zeros(2, dtype=torch.float64, device=mask.device)
        return {name: zero for name in _DRIFT_METRICS}
    d = (logp_proximal.detach().float() - logp_behaviour.detach().float()).clamp(
        -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT
    )
    trained_seqs = mask.sum(dim=1) > 0
    seq_drift = sequence_drift(logp_proximal, logp_behaviour, mask)
    n_seq = trained_seqs.sum().float()
    seq_w = torch.exp((d * mask).sum(dim=1).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))[trained_seqs]
    return {
        "train/mismatch_kl": _token_metric(torch.exp(d) - d - 1.0, mask),
        "train/seq_mismatch_kl": torch.stack([seq_drift[trained_seqs].sum(), n_seq]).double(),
        "train/seq_is_weight_mean": torch.stack([seq_w.sum(), n_seq]).double(),
        "train/seq_is_weight_sq_mean": torch.stack([(seq_w * seq_w).sum(), n_seq]).double(),
    }


def _mask_metrics(
    logp_proximal: Tensor | None, logp_behaviour: Tensor | None, mask: Tensor, config: OffPolicyConfig
) -> dict[str, Tensor]:
    """Shares of trained tokens masked by M2PO and, separately, by the drift budget, as
    [sum, count]; count 0 (not logged) when that mode is off. Recomputed from the log-probs
    (a sort of one micro-batch's tokens) so that each share is that mask's own."""
    n_tok = mask.sum()
    off = torch.zeros(2, dtype=torch.float64, device=mask.device)
    out = {"train/m2po_masked_frac": off, "train/drift_masked_frac": off}
    if logp_proximal is None or logp_behaviour is None:
        return out
    log_w = (logp_proximal.detach().float() - logp_behaviour.detach().float()) * mask
    if config.mode == "m2po":
        masked = (1.0 - m2po_keep(log_w, mask, config.m2po_tau)) * mask
        out["train/m2po_masked_frac"] = torch.stack([masked.sum(), n_tok]).double()
    if config.seq_kl_budget is not None and config.weighs:
        masked = (1.0 - drift_keep(logp_proximal, logp_behaviour, mask, config.seq_kl_budget)) * mask
        out["train/drift_masked_frac"] = torch.stack([masked.sum(), n_tok]).double()
    return out


# ------------------------------------------------------------------------------ metric helpers
def sum_metrics(parts: Iterable[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Add [sum, count] metrics of several micro-batches."""
    total: dict[str, Tensor] = {}
    for part in parts:
        for name, value in part.items():
            total[name] = total[name] + value if name in total else value.clone()
    return total


def stack_metrics(metrics: dict[str, Tensor]) -> Tensor:
    """[len(METRIC_NAMES), 2] float64 tensor, for one all_reduce(SUM) across ranks."""
    return torch.stack([metrics[name] for name in METRIC_NAMES])


def unstack_metrics(stacked: Tensor) -> dict[str, Tensor]:
    return {name: stacked[i] for i, name in enumerate(METRIC_NAMES)}


def finalize_metrics(metrics: dict[str, Tensor]) -> dict[str, float]:
    """sum / count per metric; metrics with count 0 (not measured) are left out."""
    return {name: float(v[0] / v[1]) for name, v in metrics.items() if float(v[1]) > 0}
