"""Whether a job fits this machine's memory and its run directory's disk: preflight checks
(`asyncrl.checks.preflight` registers them in its order), estimated from the model's config by
`asyncrl.learner.memory` without loading it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.checks.models import ModelFiles
from asyncrl.checks.rows import Row

if TYPE_CHECKING:
    from asyncrl.config import Config


def memory_fit(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:
    """A CPU job on this machine (the embedded cluster) fits its memory: learner ranks, rollout
    engines and the WeightStore's two copies (current + next), estimated by `asyncrl.learner.memory` against 90% of the
    machine (Ray's memory monitor kills workers at 95%). A GPU job's per-GPU fit is estimated by
    scripts/gpu_check.py (S3); a joined cluster's nodes are not this machine."""
    if cfg.cluster.ray_address or cfg.learner.num_gpus > 0 or cfg.rollout.gpus_per_actor > 0:
        return []
    import psutil

    return memory_rows(cfg, models["policy"], psutil.virtual_memory().total)


def memory_rows(cfg: Config, policy: ModelFiles, machine_bytes: int) -> list[Row]:
    from asyncrl.learner import memory as mem

    shape = mem.shape_from_config(policy.text, cfg.model.path)
    samples = cfg.data.rollout_batch_size * cfg.rollout.n
    tokens = min(cfg.learner.micro_batch_tokens, samples * (cfg.data.max_prompt_length + cfg.data.max_response_length))
    adapter = mem.lora_params(policy.text, cfg.model.lora.rank, cfg.model.lora.target_modules) \
        if cfg.model.lora.enable else None
    rank = mem.rank_bytes(shape, ranks=cfg.learner_world_size, zero_stage=cfg.learner.zero_stage,
                          bf16=cfg.learner_precision == "bf16", micro_batch_tokens=tokens,
                          logit_tokens=min(tokens, samples * (cfg.data.max_response_length + 1)),
                          reference=cfg.learner.kl.enable, gpu=False, adapter_params=adapter)
    from asyncrl.weights.adapter import sync_kind
    from asyncrl.weights.store import shm_bytes_needed

    trainable = float(adapter) if adapter is not None else shape.params
    synced = trainable if adapter is not None and sync_kind(cfg) == "adapter" else shape.params
    churn = rank["parameters"] + rank["gradients"] + rank["optimizer (fp32 master + Adam moments)"]
    rank.update(mem.cpu_learner_extras(shape, trainable=trainable, churn_bytes=churn))
    sync_copy = (2 if cfg.learner_precision == "bf16" else 4) * synced  # the sender's HostArena, rank 0
    engine = mem.engine_host_bytes(shape, int(cfg.rollout.cpu_kvcache_gb * mem.GiB),
                                   round_bytes=sync_copy)  # a round receives what rank 0 syncs
    parts = {f"learner rank x{cfg.learner_world_size}": sum(rank.values()) * cfg.learner_world_size,
             "learner's weight-sync host copy (rank 0)": int(sync_copy),
             f"rollout engine x{cfg.rollout.num_actors}": sum(engine.values()) * cfg.rollout.num_actors,
             # the store holds the current version while the next one is put (object store): at 20 of
             # Qwen2.5-0.5B's layers, accepted with one copy counted, Ray's monitor killed an actor
             "weight store copy x2 (current + next)": shm_bytes_needed(int(sync_copy)),
             "driver and services": mem.CPU_RUNTIME_BYTES}
    budget = int(0.9 * machine_bytes)
    total = sum(parts.values())
    detail = (f"{mem.describe(parts, budget)}; one learner rank: "
              f"{mem.describe(rank, budget).split('(', 1)[1].rstrip(')')}")
    if total <= budget:
        return [Row("memory", True, f"{shape.params / 1e9:.2f}B parameters: {detail}")]
    return [Row("memory", False, f"{shape.params / 1e9:.2f}B parameters do not fit this machine: {detail}",
                "a smaller model, learner.zero_stage=0 (no DeepSpeed fp32 partition copies), learner.kl.enable="
                "false (no reference replica), fewer rollout.num_actors, or a machine with more memory")]



def checkpoint_estimate(cfg: Config, policy: ModelFiles) -> int:
    """Bytes of one job checkpoint of this policy (`asyncrl.learner.memory.checkpoint_bytes`)."""
    from asyncrl.learner import memory as mem

    shape = mem.shape_from_config(policy.text, cfg.model.path)
    adapter = mem.lora_params(policy.text, cfg.model.lora.rank, cfg.model.lora.target_modules) \
        if cfg.model.lora.enable else None
    return mem.checkpoint_bytes(shape.params, float(adapter) if adapter is not None else shape.params,
                                bf16=cfg.learner_precision == "bf16")


def disk_fit(cfg: Config, models: dict[str, ModelFiles]) -> list[Row]:
    """The run directory's filesystem holds the checkpoints this run keeps (the periodic ones, up
    to `trainer.save_limit`, and the final one): refused when not even one fits (the job would
    fail at its first checkpoint), said aloud when only some do. The driver's filesystem: in the
    embedded mode the learner writes there; on a joined cluster learner rank 0 writes the same
    `trainer.run_dir`, which must then be shared storage."""
    from asyncrl.learner.checkpoint import free_bytes

    try:
        one = checkpoint_estimate(cfg, models["policy"])
    except (KeyError, TypeError, ValueError):  # a config.json without a decoder's dimensions: no estimate
        return []
    t = cfg.trainer
    writes = 1 + (t.max_steps // t.save_every if t.max_steps and t.save_every > 0 else 0)
    kept = min(writes, t.save_limit) if t.save_limit > 0 else writes
    free = free_bytes(cfg.run_path)
    where = f"trainer.run_dir: {cfg.run_path} has {free / 1e9:.2f} GB free; one checkpoint takes ~{one / 1e9:.2f} GB"
    fix = "free space there, point trainer.run_dir elsewhere, or lower trainer.save_limit"
    if free < one:
        return [Row("disk", False, f"{where}: not even one fits", fix)]
    if free < one * kept:
        return [Row("disk", True, f"{where}: {int(free // one)} of the {kept} this run keeps fit "
                    "(a checkpoint that does not fit is skipped, said aloud)")]
    return [Row("disk", True, f"{where} ({kept} kept)")]
