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
   GPUs (the recipe's engine shape, kept).

A count the rule cannot serve (fewer than one learner GPU plus one engine, or an engine that does
not fit a node) is a ConfigError naming the keys; asyncrl's own keys (`learner.num_gpus`,
`rollout.num_actors`, `rollout.gpus_per_actor`, `verifier.num_replicas`) override the result.
The fields are the existing resource fields of `asyncrl.config.roles`; nothing here adds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.config.sections import ConfigError

if TYPE_CHECKING:
    from asyncrl.config.schema import Config

__all__ = ["RoleSplit", "split_roles", "role_table", "roles_gpus"]


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


def roles_gpus(cfg: Config) -> dict[str, float]:
    """GPUs each role of a resolved config asks for (the verifier only when it runs a model here)."""
    verifier = 0.0
    if cfg.rollout.guide.enable and cfg.verifier.backend == "vllm":
        verifier = cfg.verifier.num_replicas * cfg.verifier.gpus_per_replica
    return {"learner": float(cfg.learner.num_gpus),
            "rollout": float(cfg.rollout.num_actors * cfg.rollout.gpus_per_actor), "verifier": verifier}


def role_table(cfg: Config, recipe_gpus: int | None) -> str:
    """The printed table (role, GPUs, per unit) of a resolved config, with the recipe's total."""
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
    return "\n".join(lines)
