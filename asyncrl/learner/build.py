"""Builders of one learner rank: the process group, the policy (and its frozen reference), the
optimizer with its LR schedule, and the DeepSpeed engine that wraps them. `learner.py` holds the
training step; everything here runs once per rank at start-up (or after a reconfigure).

Contracts: `init_distributed` sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK
before DeepSpeed is imported, so its accelerator is chosen by DS_ACCELERATOR; `load_policy` loads
the policy in the training dtype in train mode (gradient checkpointing needs it) and, for a VL
policy, freezes the vision tower (with `model.lora.enable`, wraps it in a PEFT LoRA model) BEFORE
the optimizer is built so the optimizer holds only trainable parameters; `build_engine` returns an
engine whose DeepSpeed config has nominal batch
sizes of 1 per micro-step: the learner owns micro-batching and calls `engine.step()` itself
(unmanaged gradient accumulation). The LR schedule advances per optimizer step, with warmup
factor (s + 1) / warmup so the first step does not run at LR 0 (both depart from Guided-GRPO:
docs/guided_grpo.md#bug-lr-per-step).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from asyncrl.config import Config, LearnerConfig
from asyncrl.learner.ops import pin_toolchain

__all__ = ["build_ds_config", "lr_factor", "Distributed", "init_distributed", "PolicyModels", "load_policy",
           "apply_lora", "refuse_cpu_moe_sync", "TrainEngine", "build_engine"]


def build_ds_config(lc: LearnerConfig, world_size: int, precision: str) -> dict[str, Any]:
    """DeepSpeed config from `learner.*`. Batch sizes are nominal (1 per micro-step): the learner
    owns micro-batching and calls `engine.step()` itself (unmanaged gradient accumulation)."""
    zero: dict[str, Any] = {"stage": lc.zero_stage}
    if lc.zero_stage == 3:
        # unmanaged accumulation takes overlap_comm from stage 2 up (DeepSpeed asserts
        # partition_gradients, i.e. stage >= 2, though its message says "stage 2")
        zero.update(overlap_comm=True, stage3_param_persistence_threshold=0, stage3_max_live_parameters=int(1e9),
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
        # bf16 under ZeRO: accumulate the micro-batches' gradients in fp32 (DeepSpeed's default is
        # the model's dtype, which rounds every partial sum to 8 bits of mantissa); stage 0 has no
        # such buffer (DeepSpeed refuses the mix there)
        **({"data_types": {"grad_accum_dtype": "fp32"}} if precision == "bf16" and lc.zero_stage >= 1 else {}),
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


# ----------------------------------------------------------------------------------- process group
@dataclass
class Distributed:
    """This rank's place in the DeepSpeed job."""

    deepspeed: Any  # the imported module (imported after DS_ACCELERATOR is set)
    dist: Any  # torch.distributed
    device: torch.device
    cpu_group: Any  # gloo group for small host-side collectives on GPU jobs; None on CPU jobs


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, on_gpu: bool) -> Distributed:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr,
                      MASTER_PORT=str(master_port), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_gpu else "cpu")
    pin_toolchain()  # one ninja for every process: no JIT op rebuild between environments (ops.py)
    import deepspeed  # after DS_ACCELERATOR is set
    import torch.distributed as dist

    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", auto_mpi_discovery=False,
                                   verbose=False, timeout=timedelta(minutes=30), rank=rank, world_size=world_size)
    # gloo group for small host-side collectives (counts, metrics) also on GPU jobs
    cpu_group = dist.new_group(backend="gloo") if on_gpu else None
    return Distributed(deepspeed, dist, device, cpu_group)


# ------------------------------------------------------------------------------------------ models
@dataclass
class PolicyModels:
    """The policy to train, its tokenizer, and what the forward needs to know about it."""

    model: Any
    tokenizer: Any
    pad_id: int
    vocab_size: int
    has_dropout: bool
    ref_model: Any = None  # frozen initial weights when `learner.kl.enable`
    is_vl: bool = False
    vl: Any = None  # multimodal.VLInputBuilder for a VL policy
    vl_bias: dict[int, float] = field(default_factory=dict)  # the sampler's placeholder ban
    ref_adapter_off: bool = False  # LoRA + KL: the reference is `model` with its adapter disabled


def refuse_hybrid_lora(model: Any) -> None:
    """LoRA on a policy with Gated DeltaNet layers (Qwen3.5, Qwen3-Next) is refused, by name: the
    default targets (q/k/v/o and the MLP) would adapt only its full-attention layers (1 in 4), and
    vLLM 0.32 serves adapters on the fused linear-attention projections (`in_proj_qkvz` =
    in_proj_qkv + in_proj_z, `in_proj_ba` = in_proj_b + in_proj_a) only where its LoRA kernels run,
    which has not been run here (docs/models.md#qwen35)."""
    hybrid = sorted({n.split(".")[-2] for n, _ in model.named_parameters() if ".linear_attn." in n
                     and n.endswith(".weight") and n.split(".")[-2].startswith(("in_proj", "out_proj"))})
    if hybrid:
        raise ValueError("model.lora.enable with a hybrid linear-attention policy (Gated DeltaNet layers: "
                         f"{', '.join(hybrid)}): not supported; the default target modules would adapt only the "
                         "full-attention layers and vLLM's LoRA on the fused linear-attention projections has not "
                         "run here (docs/models.md#qwen35); train the full model (model.lora.enable=false)")


def refuse_cpu_moe_sync(model: Any, cfg: Config) -> None:
    """A Mixture-of-Experts policy with CPU rollout engines is refused, by name: vLLM 0.32's CPU build
    prepacks expert weights for its MoE kernel (`cpu_prepack_moe_weight`,
    vllm/model_executor/layers/fused_moe/experts/cpu_moe.py:208), and after an in-place reload its
    engine follows neither the previous experts nor the sent ones (seen on Qwen3.5-MoE:
    tests/integration/test_qwen3_5_engine.py); the read-back cannot see it (the fused expert tensors have
    no 1:1 checkpoint counterpart), so every sync would leave the engines silently on wrong experts."""
    if cfg.rollout.gpus_per_actor > 0 or cfg.rollout.num_actors == 0:
        return
    experts = {n.split(".mlp.experts.")[0] for n, _ in model.named_parameters() if ".mlp.experts." in n}
    if experts:
        raise ValueError(f"a Mixture-of-Experts policy ({len(experts)} expert layers) with CPU rollout engines "
                         "(rollout.gpus_per_actor=0): vLLM 0.32's CPU build does not take reloaded expert weights "
                         "(its CPU MoE kernel prepacks them: vllm/model_executor/layers/fused_moe/experts/cpu_moe.py:208), "
                         "so weight syncs would leave the engines on wrong experts; run the rollout on GPUs "
                         "(docs/models.md#qwen35)")


def apply_lora(model: Any, lora: Any, base_path: str) -> Any:
    """Wrap `model` in a PEFT LoRA model (`model.lora`): the base is frozen, only `lora_A` /
    `lora_B` train. `lora_B` starts at zero (PEFT's default), so version 0 is the base model exactly
    and engines serve it without an adapter."""
    from peft import LoraConfig, get_peft_model

    from asyncrl.weights.adapter import adapter_config

    refuse_hybrid_lora(model)
    conf = adapter_config(lora, base_path)
    peft_cfg = LoraConfig(r=conf["r"], lora_alpha=conf["lora_alpha"], lora_dropout=conf["lora_dropout"],
                          target_modules=conf["target_modules"], bias=conf["bias"], use_dora=conf["use_dora"],
                          modules_to_save=conf["modules_to_save"], task_type=conf["task_type"])
    return get_peft_model(model, peft_cfg)


def load_policy(cfg: Config, device: torch.device, dtype: torch.dtype) -> PolicyModels:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.vision import is_vl_config

    path = cfg.model.path
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or path,
                                              trust_remote_code=cfg.model.trust_remote_code)
    pad = tokenizer.pad_token_id
    pad_id = int(pad if pad is not None else tokenizer.eos_token_id or 0)
    load_kw = dict(dtype=dtype, trust_remote_code=cfg.model.trust_remote_code, **cfg.model.override_config)
    # ZeRO-3 partitions at deepspeed.initialize: each rank briefly holds the full model in host
    # memory (partition-on-load via transformers' HfDeepSpeedConfig would need `accelerate`)
    is_vl = is_vl_config(path)
    if is_vl:  # Qwen-VL: no AutoModelForCausalLM mapping in transformers 5
        from asyncrl.learner.multimodal import load_vl_model

        model = load_vl_model(path, **load_kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **load_kw)
    refuse_cpu_moe_sync(model, cfg)
    model.config.use_cache = False
    model.train()  # from_pretrained returns eval mode; gradient checkpointing needs train mode
    has_dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) or any(
        float(getattr(model.config, k, 0.0) or 0.0) > 0 for k in ("attention_dropout", "hidden_dropout"))
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = cfg.model.lora
    if lora.enable:  # before the optimizer and deepspeed.initialize: only the adapter is trainable
        model = apply_lora(model, lora, path)
        has_dropout = has_dropout or lora.dropout > 0
    out = PolicyModels(model=model, tokenizer=tokenizer, pad_id=pad_id, vocab_size=0, has_dropout=has_dropout,
                       is_vl=is_vl, ref_adapter_off=lora.enable and cfg.learner.kl.enable)
    if is_vl:
        from asyncrl.learner.multimodal import VLInputBuilder, freeze_vision_tower, load_vl_processor
        from asyncrl.vision import vision_logit_bias

        text_cfg = getattr(model.config, "text_config", model.config)
        out.vocab_size = int(getattr(model.config, "vocab_size", None) or text_cfg.vocab_size)
        if cfg.model.freeze_vision_tower:
            freeze_vision_tower(model)  # before the optimizer and deepspeed.initialize
        # the sampler's placeholder ban (-100 on image/video tokens), applied before the softmax here too
        out.vl_bias = vision_logit_bias(model.config)
        out.vl = VLInputBuilder(model, load_vl_processor(cfg.model.tokenizer_path or path))
    else:
        out.vocab_size = int(model.config.vocab_size)
    # with LoRA the reference is the policy with its adapter disabled (`ref_adapter_off`): no replica
    if cfg.learner.kl.enable and is_vl and not lora.enable:
        from asyncrl.learner.multimodal import load_vl_model

        out.ref_model = load_vl_model(path, **load_kw).to(device).eval()
        out.ref_model.requires_grad_(False)
    elif cfg.learner.kl.enable and not lora.enable:  # frozen initial weights (a replica per rank; not sharded)
        out.ref_model = AutoModelForCausalLM.from_pretrained(path, **load_kw).to(device).eval()
        out.ref_model.requires_grad_(False)
    return out


# ------------------------------------------------------------------------------- optimizer / engine
@dataclass
class TrainEngine:
    engine: Any  # deepspeed.DeepSpeedEngine
    scheduler: Any
    ds_config: dict[str, Any]
    total_optim_steps: int
    warmup_steps: int


def build_engine(deepspeed: Any, model: Any, cfg: Config, world_size: int, precision: str) -> TrainEngine:
    """AdamW over the trainable parameters (the vision tower excluded when frozen), the LR
    schedule per optimizer step, and `deepspeed.initialize` with `build_ds_config`."""
    lc, oc = cfg.learner, cfg.learner.optim
    ds_config = build_ds_config(lc, world_size, precision)
    params = [p for n, p in model.named_parameters()
              if p.requires_grad and not (cfg.model.freeze_vision_tower and "visual" in n)]
    optimizer = torch.optim.AdamW(params, lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps, weight_decay=oc.weight_decay)
    total = cfg.trainer.max_steps * lc.mini_batches * lc.ppo_epochs
    warmup = oc.warmup_steps if oc.warmup_steps is not None else int(oc.warmup_ratio * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total, warmup, oc.lr_scheduler, oc.min_lr_ratio))
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=ds_config)
    return TrainEngine(engine, scheduler, ds_config, total, warmup)
