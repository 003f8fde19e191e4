"""`LearnerWorker`: one rank of the DeepSpeed job that trains the policy.

One `train_step(groups)` = one policy version:
1. flatten the groups (`batching`), split them into `mini_batches` (whole groups, in order) and
   shard every mini-batch over the ranks (token-balanced); plan token-budget micro-batches with the
   same count on every rank;
2. recompute pi_prox (the weights at the start of the step) unless `off_policy.mode=bypass`, and
   the reference log-probs when `kl.enable` (frozen copy of the initial weights);
3. advantages on the whole batch (after the KL penalty when `kl.mode=reward`);
4. `ppo_epochs` passes over the mini-batches, one optimizer step per mini-batch: each micro-batch's
   loss is its share of the mini-batch loss normalised by the GLOBAL token / sequence count
   (all-reduced), multiplied by W before `engine.backward` because DeepSpeed averages gradients
   over W ranks; DeepSpeed runs with `managed_gradient_accumulation=false`, so a variable number of
   micro-batches accumulates until `engine.step()`. This makes `token` mode an exact token mean
   of the mini-batch whatever the split;
5. clipping to `max_grad_norm`; a non-finite global norm skips the optimizer step (DeepSpeed's
   overflow path for ZeRO 1-3 and bf16, a pre-check for ZeRO-0 fp32) and is counted; the LR
   schedule advances per applied optimizer step; `version += 1`.

Log-probs are taken from logits / `rollout.temperature` (as the original), on response positions
only (`logits_to_keep`). When a step has one mini-batch and one epoch, pi_prox equals the
training forward's own detached log-probs (same weights, same inputs), so that forward is reused
instead of a second pass (exact; saves a third of the compute); otherwise pi_prox is recomputed.

Model, optimizer and DeepSpeed engine are built in `build.py`; this module is the step. The
step's inputs (groups -> flat batch, the per-sample baselines and turn scores the advantages
read) are computed in `train_step` and passed down as arguments; its metrics come from one
function, `step_metrics`.

Departs from Guided-GRPO: the LR scheduler steps per optimizer step, and the warmup factor is
(s + 1) / warmup, so the first step does not run at LR 0 (`build.lr_factor`); loss aggregation is
exact across micro-batches and ranks in every mode, where the original's depends on the
micro-batch split (docs/guided_grpo.md#bug-lr-per-step, #bug-seq-mean).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.config import Config
from asyncrl.learner import checkpoint as ckpt
from asyncrl.learner.advantages import (
    compute_advantages,
    group_lag_weights,
    sample_baselines,
    scores_to_token_rewards,
    turn_score_advantages,
    turn_token_scores,
)
from asyncrl.learner.batching import (
    FlatBatch,
    MicroBatch,
    balance_into,
    collate,
    flatten_groups,
    plan_micro_batches,
    shard_indices,
    split_mini_batches,
)
from asyncrl.learner.build import build_engine, init_distributed, load_policy
from asyncrl.learner.kl import apply_kl_penalty, make_kl_controller
from asyncrl.learner.losses import (
    entropy_from_logits,
    finalize_metrics,
    logprobs_from_logits,
    policy_loss,
    stack_metrics,
    step_lr_scale,
    sum_metrics,
    unstack_metrics,
)
from asyncrl.weights.adapter import (
    adapter_config,
    is_adapter_param,
    peft_saved_name,
    sync_kind,
    write_adapter_dir,
)

__all__ = ["LearnerWorker", "step_metrics"]

RowImages = tuple[list[list[Any]], list[list[str]] | None]
"""A VL step's decoded images of every FlatBatch row and their sha256s (`multimodal.group_row_images`)."""


def step_metrics(flat: FlatBatch, advantages: torch.Tensor, loss_metrics: dict[str, float],
                 extra: dict[str, float], *, version: int, optim_steps: int, skipped: int, skipped_total: int,
                 grad_norms: Sequence[float], lrs: Sequence[float], kl_coef: float, ppo_epochs: int,
                 step_s: float, prox_s: float, padded_tokens: float, micro_batches: float) -> dict[str, float]:
    """The metrics of one step: the loss metrics (already summed over micro-batches and ranks and
    finalised), the advantage extras, and the `train/` and `perf/` figures of the batch.
    `padded_tokens` / `micro_batches` are totals over ranks; `version` is the new one."""
    out = dict(loss_metrics)
    mask = flat.response_mask
    real_tokens = int(flat.prompt_lengths.sum() + flat.response_lengths.sum())
    lag = (version - 1 - flat.token_versions.float()) * mask
    out.update(extra)
    out.update({
        "train/version": float(version),
        "train/optimizer_steps": float(optim_steps),
        "train/skipped_steps": float(skipped),
        "train/skipped_steps_total": float(skipped_total),
        "train/grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
        "train/lr": lrs[-1] if lrs else float("nan"),
        "train/kl_coef": kl_coef,
        "train/reward_mean": float(flat.rewards.mean()),
        "train/advantage_abs_mean": float((advantages.abs() * mask).sum() / mask.sum().clamp_min(1)),
        "train/version_lag_mean": float(lag.sum() / mask.sum().clamp_min(1)),
        "train/response_length_mean": float(flat.response_lengths.mean()),
        "train/num_samples": float(flat.num_samples),
        "perf/learner_step_s": step_s,
        "perf/learner_tokens": float(real_tokens),
        "perf/trained_tokens": float(mask.sum()),
        "perf/learner_tokens_per_s": real_tokens * ppo_epochs / step_s,
        "perf/prox_ref_s": prox_s,
        "perf/micro_batches": micro_batches,
        "perf/padding_frac": 1.0 - real_tokens * ppo_epochs / max(padded_tokens, 1.0),
    })
    return out


@dataclass
class _StepBatch:
    """One step's batch with what steps 2-3 computed for it: the input of every micro-batch."""

    flat: FlatBatch
    images: RowImages | None
    logp_prox: torch.Tensor | None
    logp_ref: torch.Tensor | None
    advantages: torch.Tensor
    reuse_prox: bool  # pi_prox = the training forward's own detached log-probs


@dataclass
class _StepTally:
    """What one step's optimizer steps and micro-batches add up, for `step_metrics`."""

    metric_parts: list[dict[str, torch.Tensor]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    lr_scales: list[float] = field(default_factory=list)
    skipped: int = 0
    padded: int = 0
    micro: int = 0


class LearnerWorker:
    """One rank. All ranks of a job must call `train_step`, `export_named_tensors` (iterate it to
    the end), `save_checkpoint` and `load_checkpoint` together: they contain collectives."""

    def __init__(self, cfg: Config, rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                 master_port: int = 29500) -> None:
        self.cfg, self.lc = cfg, cfg.learner
        self.rank, self.world_size = rank, world_size
        d = init_distributed(rank, world_size, master_addr, master_port, on_gpu=self.lc.num_gpus > 0)
        self._ds, self._dist, self.device, self._cpu_group = d.deepspeed, d.dist, d.device, d.cpu_group
        self.precision = cfg.learner_precision
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        torch.manual_seed(cfg.trainer.seed + rank)
        np.random.seed(cfg.trainer.seed + rank)

        policy = load_policy(cfg, self.device, dtype)
        self.tokenizer, self.pad_id, self.vocab_size = policy.tokenizer, policy.pad_id, policy.vocab_size
        self.is_vl, self.vl, self._vl_bias = policy.is_vl, policy.vl, policy.vl_bias
        self._has_dropout = policy.has_dropout
        self.ref_model = policy.ref_model
        self._ref_adapter_off = policy.ref_adapter_off
        self.lora = cfg.model.lora.enable
        self.sync_kind = sync_kind(cfg, warn=rank == 0)  # what a version is on the weight wire
        built = build_engine(self._ds, policy.model, cfg, world_size, self.precision)
        self.engine, self.scheduler, self.ds_config = built.engine, built.scheduler, built.ds_config
        self.total_optim_steps, self.warmup_steps = built.total_optim_steps, built.warmup_steps
        self.kl_ctl = make_kl_controller(self.lc.kl)
        self.version = 0
        self.optim_steps = 0
        self.skipped_steps = 0
        self._last_clip_norm: float | None = None
        if self.lc.zero_stage == 0 and self.precision == "fp32":
            self.engine.clip_fp32_gradients = self._clip_fp32_gradients  # record the norm DeepSpeed computes

    # ------------------------------------------------------------------------------ collectives
    def _all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world_size == 1:
            return t
        dist = self._dist
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        if self._cpu_group is not None:
            cpu = t.cpu()
            dist.all_reduce(cpu, op=red, group=self._cpu_group)
            return cpu.to(t.device)
        dist.all_reduce(t, op=red)
        return t

    def _clip_fp32_gradients(self) -> None:
        from deepspeed.runtime.utils import clip_grad_norm_

        norm = clip_grad_norm_(parameters=self.engine.module.parameters(), max_norm=self.lc.max_grad_norm)
        self._last_clip_norm = float(norm)

    # ---------------------------------------------------------------------------------- forward
    def _forward_logits(self, model: Any, mb: MicroBatch, images: RowImages | None) -> torch.Tensor:
        if self.is_vl:
            return self._vl_forward_logits(model, mb, images)
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                    logits_to_keep=mb.response_len + 1, use_cache=False)
        return out.logits[:, :-1]

    def _vl_forward_logits(self, model: Any, mb: MicroBatch, images: RowImages | None) -> torch.Tensor:
        """VL micro-batch: processor features of the rows' images (cached by sha256) and (4, n, L)
        mRoPE position ids (`multimodal.vl_forward`), then the sampler's placeholder logit bias, so
        the learner's softmax is over the distribution vLLM sampled from."""
        from asyncrl.learner.multimodal import vl_forward

        row_images, row_hashes = images if images is not None else ([], None)
        out = vl_forward(model, self.vl, mb, row_images, row_hashes)
        logits = out.logits[:, :-1]
        if self._vl_bias:
            bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
            for tok, b in self._vl_bias.items():
                if tok < bias.numel():
                    bias[tok] = b
            logits = logits + bias
        return logits

    def _labels(self, mb: MicroBatch) -> torch.Tensor:
        return mb.input_ids[:, -mb.response_len:]

    @torch.no_grad()
    def _logprobs(self, model: Any, flat: FlatBatch, plans: list[list[list[int]]],
                  images: RowImages | None) -> torch.Tensor:
        """[N, T] log-probs of this rank's rows (zeros elsewhere) under `model` (eval mode)."""
        out = torch.zeros_like(flat.response_mask)
        was_training = model.training
        model.eval()
        temp = self.cfg.rollout.temperature
        for plan in plans:
            for rows in plan:
                mb = collate(flat, rows, self.pad_id).to(self.device)
                lp = logprobs_from_logits(self._forward_logits(model, mb, images), self._labels(mb), temp)
                if not mb.is_dummy:
                    out[mb.indices, : mb.response_len] = lp.float().cpu()
        model.train(was_training)
        return out

    def _reference_logprobs(self, flat: FlatBatch, plans: list[list[list[int]]],
                            images: RowImages | None) -> torch.Tensor | None:
        """Log-probs under the KL reference: the frozen replica, or with LoRA the policy itself
        with its adapter disabled (the base weights never change, so that is the initial policy)."""
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, flat, plans, images)
        if self._ref_adapter_off:
            with self.engine.module.disable_adapter():
                return self._logprobs(self.engine, flat, plans, images)
        return None

    # --------------------------------------------------------------------------------- planning
    def _plan(self, flat: FlatBatch, rows: np.ndarray) -> list[list[int]]:
        """This rank's micro-batches of one mini-batch; the same count on every rank."""
        plen, rlen = flat.prompt_lengths, flat.response_lengths
        mine = shard_indices(rows, plen + rlen, self.world_size, self.rank)
        plan = plan_micro_batches(mine, plen, rlen, self.lc.micro_batch_tokens, self.lc.max_micro_batch_size)
        k = int(self._all_reduce(torch.tensor([max(len(plan), 1)], dtype=torch.long), "max").item())
        if k != len(plan):
            plan = balance_into(mine, plen, rlen, k)
        return plan

    def _advantages(self, flat: FlatBatch, logp_anchor: torch.Tensor | None, logp_ref: torch.Tensor | None,
                    baselines: torch.Tensor, token_scores: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        """[N, T] advantages of the whole batch (after the KL penalty in `kl.mode=reward`) plus the
        turn-score term; `baselines` [N] are ReMax's per-sample baseline rewards (NaN if absent),
        `token_scores` [N, T] the verifier's turn scores (`advantages.turn_token_scores`)."""
        alg, kc = self.cfg.algorithm, self.lc.kl
        extra: dict[str, float] = {}
        rewards: torch.Tensor = flat.rewards
        if kc.enable and kc.mode == "reward":
            assert logp_anchor is not None and logp_ref is not None
            token_rewards = scores_to_token_rewards(flat.rewards, flat.response_mask)
            rewards, kl_mean = apply_kl_penalty(token_rewards, logp_anchor, logp_ref, flat.response_mask,
                                                self.kl_ctl.value, kc.estimator)
            extra["train/kl_penalty"] = float(kl_mean)
        options: dict[str, Any] = {"norm_by_std": alg.norm_adv_by_std, "gamma": alg.gamma}
        if alg.adv_estimator == "remax":
            if torch.isnan(baselines).any():
                raise ValueError("adv_estimator=remax needs sample.metadata['baseline_reward'] on every sample")
            options["baseline_rewards"] = baselines
        adv = compute_advantages(alg.adv_estimator, rewards, flat.group_index, flat.response_mask, **options)
        if alg.turn_score_coef > 0 and token_scores is not None:
            proc = turn_score_advantages(token_scores, flat.group_index, flat.response_mask)
            adv = adv + alg.turn_score_coef * proc
            extra["train/turn_score_adv_abs_mean"] = float(proc.abs().sum() / flat.response_mask.sum().clamp_min(1))
        return adv, extra

    # ------------------------------------------------------------------------------------- step
    def train_step(self, groups: Sequence[Any]) -> dict[str, float]:
        """One policy version from `groups` (every rank gets the same groups). Returns metrics
        (identical on every rank) and bumps `self.version`. The steps follow the module doc."""
        t0 = time.perf_counter()
        lc = self.lc
        flat, images, baselines, token_scores = self._step_inputs(groups)
        minis = split_mini_batches(flat.group_sizes, lc.mini_batches)
        plans = [self._plan(flat, rows) for rows in minis]
        reuse_prox = (len(minis) == 1 and lc.ppo_epochs == 1 and not self._has_dropout
                      and not (lc.kl.enable and lc.kl.mode == "reward"))
        t_prox = time.perf_counter()
        logp_prox, logp_ref = self._step_logprobs(flat, plans, images, reuse_prox)
        prox_s = time.perf_counter() - t_prox
        advantages, extra = self._step_advantages(flat, logp_prox, logp_ref, baselines, token_scores)
        batch = _StepBatch(flat, images, logp_prox, logp_ref, advantages, reuse_prox)
        tally = _StepTally()
        for _epoch in range(lc.ppo_epochs):
            for plan in plans:
                self._train_mini_batch(batch, plan, tally)
        self.version += 1
        self._update_kl_controller(extra, tally.metric_parts, flat)
        if lc.off_policy.lr_scale != "none":
            extra["train/lr_scale"] = float(np.mean(tally.lr_scales))
        # metrics: [sum, count] pairs summed over micro-batches and ranks
        summed = self._all_reduce(stack_metrics(sum_metrics(tally.metric_parts)))
        step_s = time.perf_counter() - t0
        counts = self._all_reduce(torch.tensor([float(tally.padded), float(tally.micro)], dtype=torch.float64))
        return step_metrics(
            flat, advantages, finalize_metrics(unstack_metrics(summed)), extra, version=self.version,
            optim_steps=self.optim_steps, skipped=tally.skipped, skipped_total=self.skipped_steps,
            grad_norms=tally.grad_norms, lrs=tally.lrs, kl_coef=float(self.kl_ctl.value), ppo_epochs=lc.ppo_epochs,
            step_s=step_s, prox_s=prox_s, padded_tokens=float(counts[0]), micro_batches=float(counts[1]))

    def _step_inputs(self, groups: Sequence[Any]) -> tuple[FlatBatch, RowImages | None, torch.Tensor,
                                                            torch.Tensor | None]:
        """Step 1's batch and what the advantages read beside it: (flat batch, the VL rows' images
        (decoded once per group, hashes verified) or None, ReMax's per-sample baselines, the
        verifier's per-token turn scores or None when `turn_score_coef` is 0)."""
        flat = flatten_groups(groups)
        images: RowImages | None = None
        if self.is_vl:
            from asyncrl.learner.multimodal import group_row_images

            images = group_row_images(groups)
        samples = [s for g in groups for s in g.samples]
        baselines = sample_baselines(samples)
        alg = self.cfg.algorithm
        token_scores = (turn_token_scores(samples, tuple(flat.response_mask.shape), alg.turn_score_accept)
                        if alg.turn_score_coef > 0 else None)
        return flat, images, baselines, token_scores

    def _step_logprobs(self, flat: FlatBatch, plans: list[list[list[int]]], images: RowImages | None,
                       reuse_prox: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Step 2: (pi_prox, reference) log-probs of this rank's rows, [N, T] or None. pi_prox is
        not recomputed in `bypass` mode (mu is the anchor) nor when the training forward's own
        log-probs can stand in for it (`reuse_prox`). The KL penalty in `kl.mode=reward` enters
        the advantages, which need every row: then both are all-reduced."""
        kc = self.lc.kl
        need_prox = self.lc.off_policy.mode != "bypass" and not reuse_prox
        logp_prox = self._logprobs(self.engine, flat, plans, images) if need_prox else None
        logp_ref = self._reference_logprobs(flat, plans, images)
        if kc.enable and kc.mode == "reward":  # the penalty needs every row before advantages
            logp_ref = self._all_reduce(logp_ref)
            logp_prox = self._all_reduce(logp_prox) if logp_prox is not None else None
        return logp_prox, logp_ref

    def _step_advantages(self, flat: FlatBatch, logp_prox: torch.Tensor | None, logp_ref: torch.Tensor | None,
                         baselines: torch.Tensor, token_scores: torch.Tensor | None
                         ) -> tuple[torch.Tensor, dict[str, float]]:
        """Step 3: the batch's advantages against pi_prox (mu when it was not recomputed), then,
        with `lag_decay` < 1, each group's scaled down by its lag (older groups move the policy
        less), and the extra metrics of both."""
        op = self.lc.off_policy
        anchor = logp_prox if logp_prox is not None else flat.behaviour_logprobs
        advantages, extra = self._advantages(flat, anchor, logp_ref, baselines, token_scores)
        if op.lag_decay < 1.0:  # per-group down-weighting by lag
            lag_w = group_lag_weights(flat.token_versions, flat.group_index, flat.response_mask, self.version,
                                      op.lag_decay)
            advantages, extra["train/lag_weight_mean"] = advantages * lag_w[:, None], float(lag_w.mean())
        return advantages, extra

    def _train_mini_batch(self, batch: _StepBatch, plan: list[list[int]], tally: _StepTally) -> None:
        """Step 4-5 for one mini-batch: backward through this rank's micro-batches of it, then one
        optimizer step at lr x `lr_scale`. Every micro-batch loss is normalised by the whole
        mini-batch's token / sequence count over ALL ranks, so the accumulated gradient is the
        mini-batch's exact gradient however it was split."""
        flat = batch.flat
        plan_start = len(tally.metric_parts)
        my_rows = [i for mb_rows in plan for i in mb_rows]
        tok, seqs = flat.response_mask[my_rows].sum(), (flat.response_mask[my_rows].sum(1) > 0).sum()
        glob = self._all_reduce(torch.tensor([float(tok), float(seqs)], dtype=torch.float64))
        g_tok, g_seq = max(float(glob[0]), 1.0), max(float(glob[1]), 1.0)
        for mb_rows in plan:
            mb = collate(flat, mb_rows, self.pad_id).to(self.device)
            m = self._micro_batch_backward(batch, mb, g_tok, g_seq)
            tally.metric_parts.append({k: v.detach().cpu() for k, v in m.items()})
            tally.padded += mb.padded_tokens
            tally.micro += 1
        scale = self._lr_scale(flat, tally.metric_parts[plan_start:])
        tally.lr_scales.append(scale)
        tally.lrs.append(float(self.scheduler.get_last_lr()[0]) * scale)
        applied, norm = self._scaled_optimizer_step(scale)
        tally.skipped += 0 if applied else 1
        if norm is not None and math.isfinite(norm):
            tally.grad_norms.append(norm)

    def _micro_batch_backward(self, batch: _StepBatch, mb: MicroBatch, g_tok: float,
                              g_seq: float) -> dict[str, torch.Tensor]:
        """Forward, loss and backward of one micro-batch; returns its [sum, count] loss metrics.
        The entropy is always computed for its metric, with a gradient only when it is a loss
        term. A dummy micro-batch (a rank with fewer rows than the plan's count) contributes a
        zero loss but still runs backward, so every rank joins the same collectives. The loss is
        multiplied by W because DeepSpeed averages gradients over the W ranks."""
        lc, temp = self.lc, self.cfg.rollout.temperature
        norm_length = float(lc.norm_length or self.cfg.data.max_response_length)  # Dr.GRPO: a constant budget
        logits = self._forward_logits(self.engine, mb, batch.images)
        logp = logprobs_from_logits(logits, self._labels(mb), temp)
        if lc.entropy_coef > 0:
            entropy = entropy_from_logits(logits, temp)
        else:
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach(), temp)
        reuse = batch.reuse_prox and lc.off_policy.mode != "bypass"
        prox = logp.detach() if reuse else self._rows(batch.logp_prox, mb)
        loss, m = policy_loss(
            logp, prox, self._rows(batch.flat.behaviour_logprobs, mb), self._rows(batch.advantages, mb),
            mb.response_mask, lc, logp_ref=self._rows(batch.logp_ref, mb), entropy=entropy,
            kl_coef=self.kl_ctl.value, global_num_tokens=g_tok, global_num_seqs=g_seq,
            norm_length=norm_length)
        if mb.is_dummy:
            loss = loss * 0.0
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
        return m

    def _update_kl_controller(self, extra: dict[str, float], metric_parts: list[dict[str, torch.Tensor]],
                              flat: FlatBatch) -> None:
        """The adaptive KL controller steers by this step's KL: the reward penalty's mean when the
        KL is a reward term, else the loss's KL over all ranks."""
        kc = self.lc.kl
        if not (kc.enable and kc.type == "adaptive"):
            return
        kl_now = extra.get("train/kl_penalty")
        if kl_now is None:
            part = self._all_reduce(sum_metrics(metric_parts)["loss/kl"].clone())
            kl_now = float(part[0] / max(float(part[1]), 1e-12))
        self.kl_ctl.update(kl_now, flat.num_samples)

    def _rows(self, t: torch.Tensor | None, mb: MicroBatch) -> torch.Tensor | None:
        """Rows of a [N, T] batch tensor for a micro-batch, on the device (zeros for a dummy)."""
        if t is None:
            return None
        if mb.is_dummy:
            return torch.zeros_like(mb.response_mask)
        return t[mb.indices, : mb.response_len].to(self.device)

    def _lr_scale(self, flat: FlatBatch, parts: list[dict[str, torch.Tensor]]) -> float:
        """`off_policy.lr_scale` of one optimizer step from its micro-batches' weight sums (all ranks)."""
        op = self.lc.off_policy
        if op.lr_scale == "none":
            return 1.0
        summed = sum_metrics(parts)
        sums = self._all_reduce(torch.stack([summed["train/seq_is_weight_mean"], summed["train/seq_is_weight_sq_mean"]]))
        return step_lr_scale(op, sums, flat.token_versions, flat.response_mask, self.version)

    def _scaled_optimizer_step(self, scale: float) -> tuple[bool, float | None]:
        """`_optimizer_step` at lr x scale; after it every group's lr is the scheduler's own again
        (its new value when the step was applied, the unscaled old one when it was skipped)."""
        groups = self.scheduler.optimizer.param_groups
        for g in groups:
            g["lr"] *= scale
        try:
            return self._optimizer_step()
        finally:
            for g, lr in zip(groups, self.scheduler.get_last_lr()):
                g["lr"] = lr

    def _optimizer_step(self) -> tuple[bool, float | None]:
        """engine.step() unless the global gradient is non-finite. Returns (applied, grad norm)."""
        eng = self.engine
        if self.lc.zero_stage == 0 and self.precision == "fp32":
            # plain torch optimizer under DeepSpeed: no overflow path, so check before it reduces
            bad = any(p.grad is not None and not torch.isfinite(p.grad).all() for p in eng.module.parameters())
            if int(self._all_reduce(torch.tensor([int(bad)]), "max").item()):
                eng.zero_grad()
                self.skipped_steps += 1
                return False, float("inf")
            self._last_clip_norm = None
            eng.step()
            applied, norm = True, self._last_clip_norm
        else:
            eng.step()
            applied = eng.was_step_applied()
            norm = eng.get_global_grad_norm()
            norm = float(norm) if norm is not None else None
        if applied:
            self.optim_steps += 1
        else:
            self.skipped_steps += 1
        return applied, norm

    # ---------------------------------------------------------------------------------- export
    def export_named_tensors(self, bucket_bytes: int = 256 * 2**20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full parameters (HF names, training dtype) in buckets of about `bucket_bytes`.

        ZeRO-3: each bucket's parameters are gathered with `GatheredParameters` and copied out
        (clones), so at most one bucket is ever materialised in full; every rank must iterate to
        the end (the gathers are collectives) and every rank receives the same tensors. Other
        stages: the live parameters, valid until the next optimizer step (copy before that)."""
        module = self.engine.module
        zero3 = self.lc.zero_stage == 3
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # DeepSpeed >= 0.17.3 binds NCCL to the device at init
        self._warm_zero3_export()
        persistent = set(module.state_dict().keys())
        items: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
        items += [(n, b) for n, b in module.named_buffers() if n in persistent]
        if self.lora:  # merged: each base weight carries its adapter's delta (`_emit_bucket`)
            items = [(n, t) for n, t in items if not is_adapter_param(n)]
        from asyncrl.weights.names import checkpoint_name_map

        # the checkpoint's names, which the engine resolves (a text class on a multimodal checkpoint)
        rename = checkpoint_name_map(self.cfg.model.path, [hf_param_name(n) for n, _ in items])
        if rename("model.x") != "model.x":
            items = [(n if self.lora else rename(n), t) for n, t in items]
            self._checkpoint_rename = rename
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0

        def full_bytes(t: torch.Tensor) -> int:
            numel = t.ds_numel if hasattr(t, "ds_numel") else t.numel()
            return int(numel) * t.element_size()

        for name, tensor in items:
            bucket.append((name, tensor))
            size += full_bytes(tensor)
            if size >= bucket_bytes:
                yield from self._emit_bucket(bucket, zero3)
                bucket, size = [], 0
        if bucket:
            yield from self._emit_bucket(bucket, zero3)

    def _warm_zero3_export(self) -> None:
        """The first gather after deepspeed.initialize under ZeRO-3 can return uninitialised
        storage (NaN logprobs in the engines): one forward first, on every rank (collective)."""
        if self.lc.zero_stage == 3 and not getattr(self, "_export_warmed", False):
            with torch.no_grad():
                self.engine.module(input_ids=torch.full((1, 1), int(self.pad_id), device=self.device), use_cache=False)
            self._export_warmed = True

    def _emit_bucket(self, bucket: list[tuple[str, torch.Tensor]], zero3: bool) -> Iterator[list[tuple[str, torch.Tensor]]]:
        if self.lora:
            yield self._merged_bucket(bucket, zero3)
            return
        if not zero3:
            yield [(n, t.detach()) for n, t in bucket]
            return
        params = [t for _, t in bucket if hasattr(t, "ds_id")]
        with self._ds.zero.GatheredParameters(params, modifier_rank=None):
            out = [(n, t.detach().clone()) for n, t in bucket]
        yield out

    def _merged_bucket(self, bucket: list[tuple[str, torch.Tensor]], zero3: bool) -> list[tuple[str, torch.Tensor]]:
        """A bucket of a LoRA policy under the base model's HF names, each adapted weight merged
        (W + scaling * B @ A, PEFT's own `get_delta_weight`, which knows each layer's layout).
        ZeRO-3: the bucket's base weights and their adapters are gathered together."""
        module = self.engine.module
        layers = {n: _lora_layer(module, n) for n, _ in bucket}
        params = [t for _, t in bucket]
        for layer in filter(None, layers.values()):
            params += [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
        with self._gathered([p for p in params if hasattr(p, "ds_id")] if zero3 else []):
            out = []
            for name, t in bucket:
                layer, value = layers[name], t.detach()
                if layer is not None:
                    value = value + layer.get_delta_weight("default").to(value.dtype)
                elif zero3:
                    value = value.clone()
                out.append((getattr(self, "_checkpoint_rename", str)(hf_param_name(name)), value))
        return out

    def _gathered(self, params: list[torch.Tensor]) -> Any:
        from contextlib import nullcontext

        return self._ds.zero.GatheredParameters(params, modifier_rank=None) if params else nullcontext()

    def export_adapter_tensors(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The LoRA adapter alone, one bucket of CPU copies under PEFT's saved names (what
        `adapter_model.safetensors` holds). ZeRO-3: gathered; every rank must iterate."""
        self._warm_zero3_export()
        params = [(n, p) for n, p in self.engine.module.named_parameters() if is_adapter_param(n)]
        with self._gathered([p for _, p in params if hasattr(p, "ds_id")] if self.lc.zero_stage == 3 else []):
            yield [(peft_saved_name(n), p.detach().to("cpu", copy=True)) for n, p in params]

    def export_sync_tensors(self, bucket_bytes: int = 256 * 2**20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """What one policy version is on the weight wire (`weights.adapter.sync_kind`): the
        adapter alone, or full weights (merged with the adapter under LoRA)."""
        if self.sync_kind == "adapter":
            return self.export_adapter_tensors()
        return self.export_named_tensors(bucket_bytes)

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Write this rank's part of a checkpoint into `directory` (normally the temporary dir of
        `checkpoint.begin`; the caller commits it). All ranks call it together."""
        d = Path(directory)
        self.engine.save_checkpoint(str(d / "deepspeed"), tag="state", save_latest=False)
        buckets = self.export_named_tensors(256 * 2**20)
        if self.rank == 0:
            module = self.engine.module
            ckpt.write_hf_export(d / "hf", buckets, module.config, self.tokenizer,
                                 generation_config=getattr(module, "generation_config", None))
        else:
            for _ in buckets:  # take part in the ZeRO-3 gathers
                pass
        if self.lora:  # the adapter alone, PEFT format (hf/ holds the merged model)
            adapter = [nt for bucket in self.export_adapter_tensors() for nt in bucket]
            if self.rank == 0:
                write_adapter_dir(d, ckpt.ADAPTER_DIR, adapter, adapter_config(self.cfg.model.lora, self.cfg.model.path))
        ckpt.write_json(d / "rng" / f"rank_{self.rank}.json", ckpt.rng_state())
        if self.rank == 0:
            ckpt.write_json(d / ckpt.TRAINER_STATE, {
                "step": self.version, "version": self.version, "optimizer_steps": self.optim_steps,
                "skipped_steps": self.skipped_steps, "world_size": self.world_size,
                "zero_stage": self.lc.zero_stage, "lr_scheduler": self.scheduler.state_dict(),
                "kl_controller": self.kl_ctl.state_dict(), "rng": "rng/rank_<r>.json",
            })
        self._barrier()

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Restore engine (weights, optimizer, LR scheduler), version, counters, KL and RNG."""
        d = Path(directory)
        path, _ = self.engine.load_checkpoint(str(d / "deepspeed"), tag="state", load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed state under {d / 'deepspeed'}")
        state = ckpt.read_json(d / ckpt.TRAINER_STATE)
        self.version = int(state["version"])
        self.optim_steps = int(state["optimizer_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.kl_ctl.load_state_dict(state["kl_controller"])
        rng = d / "rng" / f"rank_{self.rank}.json"
        if rng.is_file():
            ckpt.set_rng_state(ckpt.read_json(rng))

    def _barrier(self) -> None:
        if self.world_size > 1:
            self._dist.barrier(group=self._cpu_group)

    def close(self) -> None:
        """Drop the engine (the process group stays: it belongs to the process)."""
        self.engine = None  # type: ignore[assignment]
        self.ref_model = None


def hf_param_name(name: str) -> str:
    """A PEFT model's parameter name under the base model's HF name
    (`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` -> `model.layers.0.self_attn.q_proj.weight`)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _lora_layer(module: Any, name: str) -> Any:
    """The PEFT LoRA layer whose base weight is `name`, or None."""
    suffix = ".base_layer.weight"
    if not name.endswith(suffix):
        return None
    layer = module.get_submodule(name[: -len(suffix)])
    return layer if hasattr(layer, "get_delta_weight") and "default" in getattr(layer, "lora_A", {}) else None
