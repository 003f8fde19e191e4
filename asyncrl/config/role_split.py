"""The role split: how a Guided-GRPO recipe's `trainer.nnodes x trainer.n_gpus_per_node` GPUs are
shared among asyncrl's decoupled roles (docs/guided_grpo.md#role-split).

The original colocates everything (every GPU holds an FSDP shard of the actor, the reference model
and a vLLM engine, and alternates between generating and training). asyncrl runs the roles side by
side, so the GPUs the recipe paid for are divided, all of them, by one rule:

1. verifier: when the guide runs a local verifier model (`worker.rollout.verifier.enable` without
   `use_http`), one replica of one GPU per 8 GPUs (at least one), since an 8B verifier fits one GPU
   and serves short replies (256 tokens); an HTTP verifier lives elsewhere and takes none;
2. learner: the largest power of two not above half of the rest, such that the rollout share that
   is left divides into whole engines. A power of two keeps ZeRO's shards and the per-rank batch
   even; at most half, because generation (long sampled responses, several turns) is the larger
   cost per sample of GRPO, and the learner waits for full batches;
3. rollout: everything else, as `rest / tensor_parallel_size` actors of `tensor_parallel_size`
   GPUs (the recipe's engine shape, kept where the rule can serve it).

**A TP that spans the node** (e.g. TP 2 on 2 GPUs, TP 8 on 8) leaves no GPU for the learner. The
original chose that TP for an engine colocated with FSDP shards; a decoupled engine needs TP only
for its weights and KV cache, so `split_for_model` narrows it (`narrow_tp`): the smallest power of
two dividing the recipe's TP (never wider than asked) at which one engine GPU holds

    weights / TP  +  ENGINE_OVERHEAD_GB  +  KV_SEQS x context x KV bytes per token / TP
        <=  GPU_MEMORY_GB x GPU_MEMORY_UTILIZATION           (80 GB x 0.9 = 72 GB)

and the rule above serves. Weights = parameters x dtype bytes from the model's config.json
(`asyncrl.config.model_size`); context = the original engine's (`worker.rollout.max_model_len`, else
prompt + response length); KV heads are replicated, not split, once TP exceeds them. The change is
stated in the grouped message ("changed meaning: rollout TP 8 -> 4 because ...") and the arithmetic
printed under the role split table. A model whose size cannot be known offline keeps the explicit
error, which lists the split the rule would choose for stated sizes (`REFERENCE_SIZES`).

A count the rule cannot serve (fewer than one learner GPU plus one engine, or an engine that does
not fit a node) is a ConfigError naming the keys; asyncrl's own keys (`learner.num_gpus`,
`rollout.num_actors`, `rollout.gpus_per_actor`, `verifier.num_replicas`) override the result.
The fields are the existing resource fields of `asyncrl.config.roles`; nothing here adds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.config.model_size import KNOWN_MODELS, ModelSize, model_size
from asyncrl.config.sections import ConfigError

if TYPE_CHECKING:
    from asyncrl.config.schema import Config

__all__ = ["RoleSplit", "split_roles", "split_for_model", "narrow_tp", "engine_kv_seqs", "role_table", "roles_gpus"]

GPU_MEMORY_GB = 80.0
"""Memory of one GPU the rule assumes: the original's recipes are written for 80 GB cards
(A100/H100 80GB). Another card: set the roles with asyncrl's keys."""
GPU_MEMORY_UTILIZATION = 0.9
"""Share of that memory an engine takes: asyncrl's default for a rollout actor that owns its GPUs
(`rollout_device_defaults`), not the original's 0.6 (shared with FSDP)."""
ENGINE_OVERHEAD_GB = 4.0
"""Per engine GPU, beside weights and KV cache: activations, CUDA graphs, NCCL buffers."""
KV_SEQS = 64
"""Sequences at full context the engine's KV cache must hold: asyncrl's default
`rollout.max_num_seqs`. GRPO responses are mostly shorter than the maximum, so the engine batches
more of them (up to the converter's 256); below this it would preempt even at its base batch."""
REFERENCE_SIZES = ("Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-14B-Base",
                   "Qwen/Qwen3-32B")
"""Shapes the unknown-size error uses to show the split for a stated size."""


@dataclass(frozen=True)
class RoleSplit:
    """GPUs per role of one recipe; `asyncrl_keys` is what the converter writes."""

    learner_gpus: int
    rollout_actors: int
    tensor_parallel_size: int
    verifier_replicas: int

    @property
    def asyncrl_keys(self) -> dict[str, int]:
        keys = {"learner.num_gpus": self.learner_gpus, "rollout.num_actors": self.rollout_actors,
                "rollout.gpus_per_actor": self.tensor_parallel_size}
        if self.verifier_replicas:
            keys |= {"verifier.num_replicas": self.verifier_replicas, "verifier.gpus_per_replica": 1}
        return keys


def split_roles(nnodes: int, gpus_per_node: int, tensor_parallel_size: int, local_verifier: bool) -> RoleSplit:
    """The split of `nnodes x gpus_per_node` GPUs by the module's rule (ConfigError if none)."""
    total = nnodes * gpus_per_node
    where = (f"trainer.nnodes x trainer.n_gpus_per_node = {nnodes} x {gpus_per_node} = {total} GPUs with "
             f"worker.rollout.tensor_parallel_size={tensor_parallel_size}")
    if tensor_parallel_size < 1:
        raise ConfigError(f"worker.rollout.tensor_parallel_size must be >= 1 (got {tensor_parallel_size})")
    if tensor_parallel_size > gpus_per_node:
        raise ConfigError(f"{where}: one rollout engine would span nodes; use a tensor_parallel_size that "
                          "fits trainer.n_gpus_per_node")
    verifier = max(1, total // 8) if local_verifier else 0
    rest = total - verifier
    learner = 1 << max(0, (rest // 2).bit_length() - 1) if rest >= 2 else 0
    while learner >= 1:
        rollout = rest - learner
        if rollout >= tensor_parallel_size and rollout % tensor_parallel_size == 0:
            return RoleSplit(learner, rollout // tensor_parallel_size, tensor_parallel_size, verifier)
        learner //= 2
    need = 1 + tensor_parallel_size + (1 if local_verifier else 0)
    raise ConfigError(
        f"{where}{' and a local verifier' if local_verifier else ''}: cannot be split into a learner (a power of "
        f"two, at most half) and whole rollout engines (at least {need} GPUs in all); change "
        "trainer.n_gpus_per_node or worker.rollout.tensor_parallel_size, or set the roles with asyncrl's keys "
        "(learner.num_gpus, rollout.num_actors, rollout.gpus_per_actor)")


def engine_kv_seqs(size: ModelSize, tp: int, context: int) -> tuple[float, str]:
    """(sequences of `context` tokens whose KV fits one engine GPU at tensor parallel `tp`, the
    arithmetic as one line)."""
    usable = GPU_MEMORY_GB * GPU_MEMORY_UTILIZATION
    weights = size.weight_bytes / tp / 1e9
    heads_per_gpu = -(-size.kv_heads // tp)  # KV heads replicate once TP exceeds them
    kv_token = size.kv_bytes_per_token * heads_per_gpu / size.kv_heads
    free = usable - weights - ENGINE_OVERHEAD_GB
    seqs = max(0.0, free * 1e9 / (kv_token * context)) if kv_token else float("inf")
    line = (f"TP {tp}: {GPU_MEMORY_GB:g} x {GPU_MEMORY_UTILIZATION:g} = {usable:g} GB - weights "
            f"{size.weight_bytes / 1e9:.1f}/{tp} = {weights:.1f} GB - overhead {ENGINE_OVERHEAD_GB:g} GB = {free:.1f} GB "
            f"for KV at {kv_token / 1024:.0f} KiB/token x {context} tokens = {seqs:.0f} sequences "
            f"({'>=' if seqs >= KV_SEQS else '<'} {KV_SEQS})")
    return seqs, line


def narrow_tp(size: ModelSize, recipe_tp: int, context: int) -> tuple[list[int], list[str]]:
    """The TPs the memory rule admits among the powers of two dividing `recipe_tp`, smallest
    first, and the arithmetic of each one tried."""
    admitted, lines = [], []
    for tp in (1 << k for k in range(recipe_tp.bit_length())):
        if recipe_tp % tp:
            continue
        seqs, line = engine_kv_seqs(size, tp, context)
        lines.append(line)
        if seqs >= KV_SEQS:
            admitted.append(tp)
    return admitted, lines


def split_for_model(nnodes: int, gpus_per_node: int, tensor_parallel_size: int, local_verifier: bool,
                    model: str, dtype: str | None, context: int) -> tuple[RoleSplit, list[str], str | None]:
    """`split_roles` with the recipe's TP when the rule serves it; else the TP narrowed for the
    model (module docstring). Returns (split, arithmetic lines for the launch table, the
    "changed meaning" text when the TP changed)."""
    size = model_size(model, dtype)
    head = (f"rollout TP rule (docs/role_split.md): {model}: {size.params / 1e9:.2f}B parameters x "
            f"{size.dtype_bytes} B = {size.weight_bytes / 1e9:.1f} GB of weights, KV "
            f"{size.kv_bytes_per_token / 1024:.0f} KiB/token [{size.source}]") if size else None
    try:
        split = split_roles(nnodes, gpus_per_node, tensor_parallel_size, local_verifier)
        return split, ([head, f"  the recipe's TP {tensor_parallel_size} is served as asked"] if head else []), None
    except ConfigError as exc:
        if "cannot be split" not in str(exc) or tensor_parallel_size == 1:
            raise
        refusal = exc
    if size is None:
        raise ConfigError(f"{refusal}. A decoupled engine needs a narrower TP only if the model fits it, but the size "
                          f"of {model!r} is unknown offline (no config.json there or in the Hugging Face cache, not "
                          "in asyncrl's known-model table); point worker.actor.model.model_path at a local copy. "
                          "For a stated size the rule would choose: "
                          + "; ".join(_reference_split(nnodes, gpus_per_node, tensor_parallel_size, local_verifier,
                                                       ref, dtype, context) for ref in REFERENCE_SIZES)) from None
    admitted, lines = narrow_tp(size, tensor_parallel_size, context)
    for tp in admitted:
        try:
            split = split_roles(nnodes, gpus_per_node, tp, local_verifier)
        except ConfigError:
            continue
        why = (f"rollout TP {tensor_parallel_size} -> {tp} because a decoupled engine needs TP only for its weights "
               f"and KV cache: {size.params / 1e9:.1f}B parameters ({size.weight_bytes / 1e9:.1f} GB) and the KV of "
               f"{KV_SEQS} sequences of {context} tokens fit {tp} GPU(s) of {GPU_MEMORY_GB:g} GB, and TP "
               f"{tensor_parallel_size} would leave the learner no GPU; the learner gets {split.learner_gpus}")
        return split, [head, *(f"  {ln}" for ln in lines), f"  -> TP {tp}, the smallest admitted that leaves the "
                               "learner whole GPUs"], why
    raise ConfigError(f"{refusal}; and no narrower TP serves {model} ({size.params / 1e9:.1f}B parameters): "
                      + "; ".join(lines)) from None


def _reference_split(nnodes: int, per_node: int, tp: int, local_verifier: bool, ref: str, dtype: str | None,
                     context: int) -> str:
    size = model_size(ref, dtype)
    assert size is not None and ref in KNOWN_MODELS
    for t in narrow_tp(size, tp, context)[0]:
        try:
            s = split_roles(nnodes, per_node, t, local_verifier)
        except ConfigError:
            continue
        return (f"{size.params / 1e9:.0f}B (as {ref}): TP {t}, learner {s.learner_gpus} GPU(s), "
                f"{s.rollout_actors} engine(s)")
    return f"{size.params / 1e9:.0f}B (as {ref}): none (needs TP {tp})"


def roles_gpus(cfg: Config) -> dict[str, float]:
    """GPUs each role of a resolved config asks for (the verifier only when it runs a model here)."""
    verifier = 0.0
    if cfg.rollout.guide.enable and cfg.verifier.backend == "vllm":
        verifier = cfg.verifier.num_replicas * cfg.verifier.gpus_per_replica
    return {"learner": float(cfg.learner.num_gpus),
            "rollout": float(cfg.rollout.num_actors * cfg.rollout.gpus_per_actor), "verifier": verifier}


def role_table(cfg: Config, recipe_gpus: int | None, tp_rule: list[str] | None = None) -> str:
    """The printed table (role, GPUs, per unit) of a resolved config, with the recipe's total and,
    when the model's size is known, the rollout TP rule's arithmetic (`split_for_model`)."""
    gpus = roles_gpus(cfg)
    lc, r, v = cfg.learner, cfg.rollout, cfg.verifier
    learner_unit = (f"{lc.num_gpus} rank(s) x 1 GPU, ZeRO-{lc.zero_stage}" if lc.num_gpus
                    else f"{lc.cpu_ranks} CPU rank(s)")
    rollout_unit = (f"{r.num_actors} actor(s) x {r.gpus_per_actor} GPU (tensor parallel {r.gpus_per_actor})"
                    if r.gpus_per_actor else f"{r.num_actors} actor(s) on CPU (vLLM CPU build)")
    if not cfg.rollout.guide.enable:
        verifier_unit = "not started (guide off)"
    elif v.backend == "vllm":
        verifier_unit = f"{v.num_replicas} replica(s) x {v.gpus_per_replica:g} GPU"
    else:
        verifier_unit = f"{v.backend} back-end, no GPU here"
    rows = [("learner", gpus["learner"], learner_unit), ("rollout", gpus["rollout"], rollout_unit),
            ("verifier", gpus["verifier"], verifier_unit)]
    used = sum(gpus.values())
    head = f"role split: {used:g} GPU(s)" + (f" of the recipe's {recipe_gpus}" if recipe_gpus is not None else "")
    lines = [head, f"  {'role':<9} {'GPUs':>5}  per unit"]
    lines += [f"  {name:<9} {n:>5g}  {unit}" for name, n, unit in rows]
    if tp_rule and r.gpus_per_actor:
        lines += [f"  {line}" for line in tp_rule]
    return "\n".join(lines)
