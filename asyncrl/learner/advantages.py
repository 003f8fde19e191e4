"""Advantage estimators of the GRPO family, as pure torch functions.

`compute_advantages(estimator, rewards, group_index, response_mask, **options)` returns
advantages of shape [N, T] (fp32), already multiplied by `response_mask`. It runs on the WHOLE
step batch (every group complete) before micro-batching: group baselines and REINFORCE++'s batch
whitening are statistics of the full batch, so the learner must call it once per step, never per
micro-batch.

Inputs
- `rewards`: [N] sequence scores s_i, or [N, T] token rewards r_{i,t} (then s_i = sum_t r_{i,t};
  KL-in-reward penalties from `kl.apply_kl_penalty` are token rewards). REINFORCE++ needs token
  rewards; [N] scores are placed on each sequence's last trained token
  (`scores_to_token_rewards`).
- `group_index`: [N] group id per sample (ints, or any hashable values, e.g. prompt uids).
- `response_mask`: [N, T], 1 on trained response tokens.

Follows Guided-GRPO (docs/guided_grpo.md#algorithms):
- `grpo`: A_i = (s_i - mean_g) / (std_g + eps), std UNBIASED (N-1), eps 1e-6; a group whose
  rewards are all equal gets A = 0; groups need >= 2 samples (the original asserts the same).
- `rloo`: A_i = s_i - mean of the OTHER samples of the group.
- `reinforce_plus_plus`: G_t = r_t + gamma * G_{t'} over trained tokens; masked whitening over
  the whole batch, (G - mean) / sqrt(var + 1e-8), var with Bessel's correction; no baseline.
- `remax`: A_i = s_i - b_i with b_i the caller-given greedy-rollout score (`baseline_rewards`).
Not in Guided-GRPO:
- `reinforce_plus_plus_baseline` (REINFORCE++ paper v2, verl's estimator of that name): the group
  mean as baseline, then whitening over every trained token of the batch: a_i = s_i - mean_g on each
  trained token, A = (a - mean) / sqrt(var + 1e-8), mean and (Bessel) var over the masked tokens.
Departs from Guided-GRPO:
- `grpo` takes `norm_by_std=False` (the original has no such switch) = Dr.GRPO's numerator.
- `dr_grpo` (not in the original): A_i = s_i - mean_g, no std, no length normalisation (pair it
  with `loss_avg_mode=seq_sum_token_mean` for the full Dr.GRPO objective).
- `grpo_passk`: the original leaves the raw score s_j as the advantage of the non-best samples
  (docs/guided_grpo.md#bug-estimators); here they get 0, as intended. The best sample (first on ties)
  gets (r1 - r2) / (std_g + eps) (or r1 - r2 with `norm_by_std=False`).
- `reinforce_plus_plus` skips untrained positions (t' = the next trained token) where the
  original resets the running return at every mask-0 token. Identical for right padding; with a
  multi-turn mask whose holes are verifier/user tokens, the original would cut the final reward
  off from every earlier turn.
- `gae` is not offered (asyncrl has no critic, and the original's GAE is broken:
  docs/guided_grpo.md#bug-estimators).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from asyncrl.config import AlgorithmConfig

__all__ = [
    "compute_advantages",
    "advantages_from_config",
    "scores_to_token_rewards",
    "group_ids",
    "turn_score_advantages",
    "group_lag_weights",
    "turn_token_scores",
    "sample_baselines",
    "ESTIMATORS",
]

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo_passk",
                    "remax"]
ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                               "grpo_passk", "remax")


def group_ids(group_index: Tensor | Sequence[Hashable], device: torch.device | None = None) -> Tensor:
    """Map group ids (a tensor or any hashables) to dense int64 ids 0..G-1 (first-seen order)."""
    if isinstance(group_index, Tensor):
        _, inverse = torch.unique(group_index.reshape(-1), return_inverse=True)
        return inverse.to(device if device is not None else group_index.device)
    seen: dict[Hashable, int] = {}
    dense = [seen.setdefault(g, len(seen)) for g in group_index]
    return torch.tensor(dense, dtype=torch.long, device=device)


def scores_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place each sequence score on its last trained token (mask == 1); zeros elsewhere.

    A sequence without trained tokens gets no reward (its row stays 0)."""
    mask = response_mask.to(torch.bool)
    n, t = mask.shape
    positions = torch.arange(t, device=mask.device).expand(n, t)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1)
    out = torch.zeros(n, t, dtype=torch.float32, device=mask.device)
    has = last >= 0
    out[has.nonzero().squeeze(1), last[has]] = scores.to(out)[has]
    return out


def _sequence_scores(rewards: Tensor, response_mask: Tensor) -> Tensor:
    if rewards.dim() == 1:
        return rewards.float()
    return (rewards.float() * response_mask.float()).sum(dim=1)


def _group_stats(scores: Tensor, gid: Tensor, min_size: int, estimator: str) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group size, group mean and unbiased group std (0 for size-1 groups)."""
    num_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float64, device=scores.device).index_add_(
        0, gid, torch.ones_like(scores, dtype=torch.float64)
    )
    if num_groups and int(count.min().item()) < min_size:
        raise ValueError(f"{estimator} needs every group to have >= {min_size} samples (rollout.n > 1)")
    s64 = scores.double()
    total = torch.zeros(num_groups, dtype=torch.float64, device=scores.device).index_add_(0, gid, s64)
    mean = total / count
    sq = torch.zeros_like(total).index_add_(0, gid, (s64 - mean[gid]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    return count[gid], mean[gid], std[gid]


def _reinforce_plus_plus(token_rewards: Tensor, mask: Tensor, gamma: float, eps: float) -> Tensor:
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        # untrained positions are skipped: the return flows across them unchanged
        running = m * (token_rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    return _whiten(returns, mask, eps)


def _whiten(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the trained tokens of the whole batch (Bessel var), 0 elsewhere."""
    n = mask.sum()
    if n < 2:
        raise ValueError("reinforce_plus_plus whitening needs >= 2 trained tokens in the batch")
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def compute_advantages(
    estimator: Estimator | str,
    rewards: Tensor,
    group_index: Tensor | Sequence[Hashable],
    response_mask: Tensor,
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    gamma: float = 1.0,
    whiten_eps: float = 1e-8,
    baseline_rewards: Tensor | None = None,
) -> Tensor:
    """Advantages [N, T] (fp32, zero where `response_mask` is 0) for the named estimator.

    Options: `eps` (grpo/grpo_passk std epsilon, 1e-6 as the original), `norm_by_std`
    (grpo/grpo_passk; False = no std division), `gamma` (reinforce_plus_plus discount),
    `whiten_eps` (reinforce_plus_plus[_baseline], 1e-8 as the original), `baseline_rewards` ([N], remax).
    """
    mask = response_mask.float()
    if rewards.shape[0] != mask.shape[0] or (rewards.dim() == 2 and rewards.shape != mask.shape):
        raise ValueError(f"rewards {tuple(rewards.shape)} do not match response_mask {tuple(mask.shape)}")
    if estimator == "reinforce_plus_plus":
        token_rewards = rewards.float() if rewards.dim() == 2 else scores_to_token_rewards(rewards, mask)
        return _reinforce_plus_plus(token_rewards * mask, mask, gamma, whiten_eps)

    scores = _sequence_scores(rewards, mask)
    if estimator == "remax":
        if baseline_rewards is None:
            raise ValueError("remax needs baseline_rewards (the greedy rollout's score per sample)")
        adv = scores - baseline_rewards.to(scores)
        return adv[:, None] * mask

    gid = group_ids(group_index, device=scores.device)
    if gid.shape[0] != scores.shape[0]:
        raise ValueError("group_index must have one entry per sample")
    if estimator == "reinforce_plus_plus_baseline":
        _, mean, _ = _group_stats(scores, gid, 2, estimator)
        return _whiten((scores.double() - mean).float()[:, None] * mask, mask, whiten_eps)
    if estimator in ("grpo", "dr_grpo", "grpo_passk"):
        _, mean, std = _group_stats(scores, gid, 2, estimator)
        if estimator == "grpo":
            adv = scores.double() - mean
            if norm_by_std:
                adv = adv / (std + eps)
        elif estimator == "dr_grpo":
            adv = scores.double() - mean
        else:
            adv = _passk(scores, gid, std, eps, norm_by_std)
    elif estimator == "rloo":
        count, mean, _ = _group_stats(scores, gid, 2, estimator)
        # mean of the others = (count * mean - s_i) / (count - 1)
        adv = scores.double() - (count * mean - scores.double()) / (count - 1)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ESTIMATORS}")
    return adv.float()[:, None] * mask


def _passk(scores: Tensor, gid: Tensor, std: Tensor, eps: float, norm_by_std: bool) -> Tensor:
    adv = torch.zeros_like(scores, dtype=torch.float64)
    for g in torch.unique(gid).tolist():
        idx = (gid == g).nonzero().squeeze(1)
        top = torch.topk(scores[idx].double(), 2)  # ties: topk may pick any; use the first index below
        r1, r2 = top.values[0], top.values[1]
        best = idx[(scores[idx].double() == r1).nonzero()[0, 0]]
        gap = r1 - r2
        adv[best] = gap / (std[best] + eps) if norm_by_std else gap
    return adv


def advantages_from_config(
    config: AlgorithmConfig,
    rewards: Tensor,
    group_index: Tensor | Sequence[Hashable],
    response_mask: Tensor,
    baseline_rewards: Tensor | None = None,
) -> Tensor:
    """`compute_advantages` with `algorithm.{adv_estimator, gamma, norm_adv_by_std}`."""
    return compute_advantages(
        config.adv_estimator,
        rewards,
        group_index,
        response_mask,
        norm_by_std=config.norm_adv_by_std,
        gamma=config.gamma,
        baseline_rewards=baseline_rewards,
    )


def turn_score_advantages(token_scores: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor,
                          eps: float = 1e-6) -> torch.Tensor:
    """Per-token process advantage from per-turn verifier scores (asyncrl extension).

    `token_scores[N, T]` holds, on every token of a policy turn, that turn's verifier step score
    (1 = correct, 0 = error) and NaN where the turn was not scored or the token is not trained.
    Within each group the scored turns' tokens are standardised by the mean and (unbiased) std of
    the group's turn scores (each turn counted once per token — longer turns weigh more, as in the
    token-mean loss); unscored tokens get 0. A group whose turns all scored alike gets 0.
    """
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    valid = ~torch.isnan(token_scores) & (response_mask > 0)
    for g in torch.unique(group_index):
        rows = group_index == g
        sel = valid & rows[:, None]
        vals = token_scores[sel]
        if vals.numel() < 2:
            continue
        std = vals.std(unbiased=True)
        if not torch.isfinite(std) or std < eps:
            continue
        out[sel] = (vals - vals.mean()) / (std + eps)
    return out


def sample_baselines(samples: Sequence[Any]) -> Tensor:
    """[N] per-sample baseline rewards for `remax` (`sample.metadata['baseline_reward']`, NaN where absent)."""
    return torch.tensor([float(s.metadata.get("baseline_reward", float("nan"))) for s in samples])


def turn_token_scores(samples: Sequence[Any], shape: tuple[int, int],
                      accept_score: float | None = None) -> torch.Tensor:
    """[N, T] verifier step score of each trained token's turn (NaN where unscored). Turns are
    the contiguous mask-1 runs of the response, matched to the sample's last per-turn scores
    (final_turn: the last turn; full_turn: every turn). A final turn the verifier accepted
    (STOP token after a formatted final answer) scores `accept_score` when it is not None."""
    out = torch.full(shape, float("nan"))
    for i, smp in enumerate(samples):
        meta = smp.metadata
        scores = list(meta.get("hallucination_scores") or [])
        causes = list(meta.get("stop_causes") or [])
        if (accept_score is not None and scores and scores[-1] is None and meta.get("has_final_answer")
                and len(causes) == len(scores) and causes[-1] == "stop_token"):
            scores[-1] = accept_score
        mask = np.asarray(smp.response_mask)
        runs, start = [], None
        for t, m in enumerate(mask):
            if m and start is None:
                start = t
            if not m and start is not None:
                runs.append((start, t))
                start = None
        if start is not None:
            runs.append((start, len(mask)))
        for (a, b), score in zip(runs, scores[-len(runs):] if runs else []):
            if score is not None:
                out[i, a:b] = float(score)
    return out


def group_lag_weights(token_versions: Tensor, group_index: Tensor, response_mask: Tensor, current_version: int,
                      decay: float) -> Tensor:
    """[N] fp32 weight decay^lag_g of every sample, lag_g = current_version minus the OLDEST
    version among its group's trained tokens (a group is as stale as its stalest token: a
    multi-turn sample can mix versions). Multiplied into the advantages, it down-weights a stale
    group as a whole, so the group's baseline stays intact (the advantages keep summing to 0
    within the group) and the version bound still decides admission. decay = 1 gives 1."""
    mask = response_mask > 0
    big = torch.iinfo(torch.int64).max
    versions = torch.where(mask, token_versions.long(), torch.full_like(token_versions, big, dtype=torch.int64))
    oldest_per_sample = versions.min(dim=1).values
    gid = group_ids(group_index, device=token_versions.device)
    oldest = torch.full((int(gid.max()) + 1 if gid.numel() else 0,), big, dtype=torch.int64, device=gid.device)
    oldest = oldest.scatter_reduce(0, gid, oldest_per_sample, reduce="amin")
    group_oldest = oldest[gid]
    lag = torch.where(group_oldest == big, torch.zeros_like(group_oldest), current_version - group_oldest)
    return torch.pow(torch.tensor(float(decay)), lag.clamp_min(0).double()).float()
