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

Departs from Guided-GRPO: the LR scheduler steps per optimizer step (item 20); the warmup factor
is (s + 1) / warmup, so the first step does not run at LR 0; loss aggregation is exact across
micro-batches and ranks in every mode (item 18).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.config import Config, LearnerConfig
from asyncrl.learner import checkpoint as ckpt
from asyncrl.learner.advantages import compute_advantages, scores_to_token_rewards, turn_score_advantages
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
from asyncrl.learner.kl import apply_kl_penalty, make_kl_controller
from asyncrl.learner.losses import (
    entropy_from_logits,
    finalize_metrics,
    logprobs_from_logits,
    policy_loss,
    stack_metrics,
    sum_metrics,
    unstack_metrics,
)

__all__ = ["LearnerWorker", "build_ds_config", "lr_factor"]


def build_ds_config(lc: LearnerConfig, world_size: int, precision: str) -> dict[str, Any]:
    """DeepSpeed config from `learner.*`. Batch sizes are nominal (1 per micro-step): the learner
    owns micro-batching and calls `engine.step()` itself (unmanaged gradient accumulation)."""
    zero: dict[str, Any] = {"stage": lc.zero_stage}
    if lc.zero_stage == 3:
        # unmanaged accumulation supports overlap_comm only with stage 2
        zero.update(overlap_comm=False, stage3_param_persistence_threshold=0, stage3_max_live_parameters=int(1e9),
                    stage3_prefetch_bucket_size=int(5e7))
    elif lc.zero_stage in (1, 2):
        zero.update(overlap_comm=False, contiguous_gradients=True, reduce_bucket_size=int(5e7),
                    allgather_bucket_size=int(5e7))
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": lc.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16", "check_grad_overflow": True},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """LR multiplier for optimizer step `step` (0-based): linear warmup (s+1)/warmup, then constant
    or cosine down to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / max(1, warmup)
    if schedule == "constant":
        return 1.0
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return max(min_ratio, (1 + min_ratio) / 2 + (1 - min_ratio) / 2 * math.cos(math.pi * p))


class LearnerWorker:
    """One rank. All ranks of a job must call `train_step`, `export_named_tensors` (iterate it to
    the end), `save_checkpoint` and `load_checkpoint` together: they contain collectives."""

    def __init__(self, cfg: Config, rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                 master_port: int = 29500) -> None:
        self.cfg, self.lc = cfg, cfg.learner
        self.rank, self.world_size = rank, world_size
        on_gpu = self.lc.num_gpus > 0
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr,
                          MASTER_PORT=str(master_port), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_gpu else "cpu")
        import deepspeed  # after DS_ACCELERATOR is set
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._ds, self._dist = deepspeed, dist
        if on_gpu:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", auto_mpi_discovery=False,
                                       verbose=False, timeout=timedelta(minutes=30), rank=rank, world_size=world_size)
        # gloo group for small host-side collectives (counts, metrics) also on GPU jobs
        self._cpu_group = dist.new_group(backend="gloo") if on_gpu else None
        self.precision = cfg.learner_precision
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        torch.manual_seed(cfg.trainer.seed + rank)
        np.random.seed(cfg.trainer.seed + rank)

        path = cfg.model.path
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or path,
                                                       trust_remote_code=cfg.model.trust_remote_code)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id or 0)
        load_kw = dict(dtype=dtype, trust_remote_code=cfg.model.trust_remote_code, **cfg.model.override_config)
        self.ds_config = build_ds_config(self.lc, world_size, self.precision)
        # ZeRO-3 partitions at deepspeed.initialize: each rank briefly holds the full model in host
        # memory (partition-on-load via transformers' HfDeepSpeedConfig would need `accelerate`)
        from asyncrl.vision import is_vl_config

        self.is_vl = is_vl_config(path)
        self.vl: Any = None  # multimodal.VLInputBuilder for a VL policy
        self._vl_bias: dict[int, float] = {}
        self._row_images: list[list[Any]] = []
        self._row_hashes: list[list[str]] | None = None
        if self.is_vl:  # Qwen-VL: no AutoModelForCausalLM mapping in transformers 5
            from asyncrl.learner.multimodal import load_vl_model

            model = load_vl_model(path, **load_kw)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, **load_kw)
        model.config.use_cache = False
        model.train()  # from_pretrained returns eval mode; gradient checkpointing needs train mode
        self._has_dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) or any(
            float(getattr(model.config, k, 0.0) or 0.0) > 0 for k in ("attention_dropout", "hidden_dropout"))
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.is_vl:
            from asyncrl.learner.multimodal import VLInputBuilder, freeze_vision_tower, load_vl_processor
            from asyncrl.vision import vision_logit_bias

            text_cfg = getattr(model.config, "text_config", model.config)
            self.vocab_size = int(getattr(model.config, "vocab_size", None) or text_cfg.vocab_size)
            if cfg.model.freeze_vision_tower:
                freeze_vision_tower(model)  # before the optimizer and deepspeed.initialize
            # the sampler's placeholder ban (-100 on image/video tokens), applied before the softmax here too
            self._vl_bias = vision_logit_bias(model.config)
            self.vl = VLInputBuilder(model, load_vl_processor(cfg.model.tokenizer_path or path))
        else:
            self.vocab_size = int(model.config.vocab_size)
        self.ref_model = None
        if self.lc.kl.enable and self.is_vl:
            from asyncrl.learner.multimodal import load_vl_model

            self.ref_model = load_vl_model(path, **load_kw).to(self.device).eval()
            self.ref_model.requires_grad_(False)
        elif self.lc.kl.enable:  # frozen initial weights (a full replica per rank; not sharded)
            self.ref_model = AutoModelForCausalLM.from_pretrained(path, **load_kw).to(self.device).eval()
            self.ref_model.requires_grad_(False)

        oc = self.lc.optim
        params = [p for n, p in model.named_parameters()
                  if p.requires_grad and not (cfg.model.freeze_vision_tower and "visual" in n)]
        optimizer = torch.optim.AdamW(params, lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps,
                                      weight_decay=oc.weight_decay)
        self.total_optim_steps = cfg.trainer.max_steps * self.lc.mini_batches * self.lc.ppo_epochs
        warmup = oc.warmup_steps if oc.warmup_steps is not None else int(oc.warmup_ratio * self.total_optim_steps)
        self.warmup_steps = warmup
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, self.total_optim_steps, warmup, oc.lr_scheduler, oc.min_lr_ratio))
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config)
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
    def _forward_logits(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        if self.is_vl:
            return self._vl_forward_logits(model, mb)
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                    logits_to_keep=mb.response_len + 1, use_cache=False)
        return out.logits[:, :-1]

    def _vl_forward_logits(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        """VL micro-batch: processor features of the rows' images (cached by sha256) and (4, n, L)
        mRoPE position ids (`multimodal.vl_forward`), then the sampler's placeholder logit bias, so
        the learner's softmax is over the distribution vLLM sampled from."""
        from asyncrl.learner.multimodal import vl_forward

        out = vl_forward(model, self.vl, mb, self._row_images, self._row_hashes)
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
    def _logprobs(self, model: Any, flat: FlatBatch, plans: list[list[list[int]]]) -> torch.Tensor:
        """[N, T] log-probs of this rank's rows (zeros elsewhere) under `model` (eval mode)."""
        out = torch.zeros_like(flat.response_mask)
        was_training = model.training
        model.eval()
        temp = self.cfg.rollout.temperature
        for plan in plans:
            for rows in plan:
                mb = collate(flat, rows, self.pad_id).to(self.device)
                lp = logprobs_from_logits(self._forward_logits(model, mb), self._labels(mb), temp)
                if not mb.is_dummy:
                    out[mb.indices, : mb.response_len] = lp.float().cpu()
        model.train(was_training)
        return out

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

    def _advantages(self, flat: FlatBatch, logp_anchor: torch.Tensor | None,
                    logp_ref: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
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
            if torch.isnan(self._baselines).any():
                raise ValueError("adv_estimator=remax needs sample.metadata['baseline_reward'] on every sample")
            options["baseline_rewards"] = self._baselines
        adv = compute_advantages(alg.adv_estimator, rewards, flat.group_index, flat.response_mask, **options)
        if alg.turn_score_coef > 0 and self._token_scores is not None:
            proc = turn_score_advantages(self._token_scores, flat.group_index, flat.response_mask)
            adv = adv + alg.turn_score_coef * proc
            extra["train/turn_score_adv_abs_mean"] = float(proc.abs().sum() / flat.response_mask.sum().clamp_min(1))
        return adv, extra

    @staticmethod
    def _turn_token_scores(samples: Sequence[Any], shape: tuple[int, int],
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

    # ------------------------------------------------------------------------------------- step
    def train_step(self, groups: Sequence[Any]) -> dict[str, float]:
        """One policy version from `groups` (every rank gets the same groups). Returns metrics
        (identical on every rank) and bumps `self.version`."""
        t0 = time.perf_counter()
        lc, kc = self.lc, self.lc.kl
        flat = flatten_groups(groups)
        if self.is_vl:  # images of every FlatBatch row (decoded once per group, hashes verified)
            from asyncrl.learner.multimodal import group_row_images

            self._row_images, self._row_hashes = group_row_images(groups)
        samples = [s for g in groups for s in g.samples]
        self._baselines = torch.tensor([float(s.metadata.get("baseline_reward", float("nan"))) for s in samples])
        self._token_scores = (self._turn_token_scores(samples, tuple(flat.response_mask.shape),
                                                      self.cfg.algorithm.turn_score_accept)
                              if self.cfg.algorithm.turn_score_coef > 0 else None)
        minis = split_mini_batches(flat.group_sizes, lc.mini_batches)
        plans = [self._plan(flat, rows) for rows in minis]
        mode = lc.off_policy.mode
        reuse_prox = (len(minis) == 1 and lc.ppo_epochs == 1 and not self._has_dropout
                      and not (kc.enable and kc.mode == "reward"))
        need_prox = mode != "bypass" and not reuse_prox

        t_prox = time.perf_counter()
        logp_prox = self._logprobs(self.engine, flat, plans) if need_prox else None
        logp_ref = self._logprobs(self.ref_model, flat, plans) if self.ref_model is not None else None
        if kc.enable and kc.mode == "reward":  # the penalty needs every row before advantages
            logp_ref = self._all_reduce(logp_ref)
            logp_prox = self._all_reduce(logp_prox) if logp_prox is not None else None
        prox_s = time.perf_counter() - t_prox
        anchor = logp_prox if logp_prox is not None else flat.behaviour_logprobs
        advantages, extra = self._advantages(flat, anchor, logp_ref)

        temp = self.cfg.rollout.temperature
        norm_length = float(lc.norm_length or self.cfg.data.max_response_length)  # Dr.GRPO: a constant budget
        metric_parts: list[dict[str, torch.Tensor]] = []
        grad_norms: list[float] = []
        lrs: list[float] = []
        skipped = 0
        padded = micro = 0
        for _epoch in range(lc.ppo_epochs):
            for plan in plans:
                my_rows = [i for mb_rows in plan for i in mb_rows]
                tok, seqs = flat.response_mask[my_rows].sum(), (flat.response_mask[my_rows].sum(1) > 0).sum()
                glob = self._all_reduce(torch.tensor([float(tok), float(seqs)], dtype=torch.float64))
                g_tok, g_seq = max(float(glob[0]), 1.0), max(float(glob[1]), 1.0)
                for mb_rows in plan:
                    mb = collate(flat, mb_rows, self.pad_id).to(self.device)
                    logits = self._forward_logits(self.engine, mb)
                    logp = logprobs_from_logits(logits, self._labels(mb), temp)
                    if lc.entropy_coef > 0:
                        entropy = entropy_from_logits(logits, temp)
                    else:
                        with torch.no_grad():
                            entropy = entropy_from_logits(logits.detach(), temp)

                    prox = logp.detach() if reuse_prox and mode != "bypass" else self._rows(logp_prox, mb)
                    loss, m = policy_loss(
                        logp, prox, self._rows(flat.behaviour_logprobs, mb), self._rows(advantages, mb), mb.response_mask,
                        lc, logp_ref=self._rows(logp_ref, mb), entropy=entropy, kl_coef=self.kl_ctl.value,
                        global_num_tokens=g_tok, global_num_seqs=g_seq, norm_length=norm_length)
                    if mb.is_dummy:
                        loss = loss * 0.0
                    self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
                    metric_parts.append({k: v.detach().cpu() for k, v in m.items()})
                    padded += mb.padded_tokens
                    micro += 1
                lrs.append(float(self.scheduler.get_last_lr()[0]))
                applied, norm = self._optimizer_step()
                skipped += 0 if applied else 1
                if norm is not None and math.isfinite(norm):
                    grad_norms.append(norm)
        self.version += 1
        if kc.enable and kc.type == "adaptive":
            kl_now = extra.get("train/kl_penalty")
            if kl_now is None:
                part = self._all_reduce(sum_metrics(metric_parts)["loss/kl"].clone())
                kl_now = float(part[0] / max(float(part[1]), 1e-12))
            self.kl_ctl.update(kl_now, flat.num_samples)

        # metrics: [sum, count] pairs summed over micro-batches and ranks
        summed = self._all_reduce(stack_metrics(sum_metrics(metric_parts)))
        out = finalize_metrics(unstack_metrics(summed))
        mask = flat.response_mask
        real_tokens = int(flat.prompt_lengths.sum() + flat.response_lengths.sum())
        lag = (self.version - 1 - flat.token_versions.float()) * mask
        step_s = time.perf_counter() - t0
        counts = self._all_reduce(torch.tensor([float(padded), float(micro)], dtype=torch.float64))
        out.update(extra)
        out.update({
            "train/version": float(self.version),
            "train/optimizer_steps": float(self.optim_steps),
            "train/skipped_steps": float(skipped),
            "train/skipped_steps_total": float(self.skipped_steps),
            "train/grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
            "train/lr": lrs[-1] if lrs else float("nan"),
            "train/kl_coef": float(self.kl_ctl.value),
            "train/reward_mean": float(flat.rewards.mean()),
            "train/advantage_abs_mean": float((advantages.abs() * mask).sum() / mask.sum().clamp_min(1)),
            "train/version_lag_mean": float(lag.sum() / mask.sum().clamp_min(1)),
            "train/response_length_mean": float(flat.response_lengths.mean()),
            "train/num_samples": float(flat.num_samples),
            "perf/learner_step_s": step_s,
            "perf/train_tokens": float(real_tokens),
            "perf/trained_tokens": float(mask.sum()),
            "perf/train_tokens_per_s": real_tokens * lc.ppo_epochs / step_s,
            "perf/prox_ref_s": prox_s,
            "perf/micro_batches": float(counts[1]),
            "perf/padding_frac": 1.0 - real_tokens * lc.ppo_epochs / max(float(counts[0]), 1.0),
        })
        return out

    def _rows(self, t: torch.Tensor | None, mb: MicroBatch) -> torch.Tensor | None:
        """Rows of a [N, T] batch tensor for a micro-batch, on the device (zeros for a dummy)."""
        if t is None:
            return None
        if mb.is_dummy:
            return torch.zeros_like(mb.response_mask)
        return t[mb.indices, : mb.response_len].to(self.device)

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
        if zero3 and not getattr(self, "_export_warmed", False):
            # the first gather after deepspeed.initialize under ZeRO-3 can return uninitialised
            # storage (NaN logprobs in the engines); one forward first, on every rank (collective)
            with torch.no_grad():
                module(input_ids=torch.full((1, 1), int(self.pad_id), device=self.device), use_cache=False)
            self._export_warmed = True
        persistent = set(module.state_dict().keys())
        items: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
        items += [(n, b) for n, b in module.named_buffers() if n in persistent]
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

    def _emit_bucket(self, bucket: list[tuple[str, torch.Tensor]], zero3: bool) -> Iterator[list[tuple[str, torch.Tensor]]]:
        if not zero3:
            yield [(n, t.detach()) for n, t in bucket]
            return
        params = [t for _, t in bucket if hasattr(t, "ds_id")]
        with self._ds.zero.GatheredParameters(params, modifier_rank=None):
            out = [(n, t.detach().clone()) for n, t in bucket]
        yield out

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
