"""What the learner tests do to a `LearnerGroup` that a job never does: train a step on groups
the test holds (a job's ranks fetch theirs from the buffer), rebuild the ranks' engines from
another config in the same processes, and read every parameter back. The rank-side parts run
in the rank actors through Ray's `__ray_call__` (a callable run on the actor instance), so the
production actor carries no test method; this module is pickled by value for that, since the
Ray workers cannot import it by name."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import ray
from ray import cloudpickle

from asyncrl.config import Config
from asyncrl.protocol import encode

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def step(group: Any, groups: Sequence[Any]) -> dict[str, float]:
    """One step of every rank on `groups` (encoded here, put once in the object store, as rank 0
    shares a fetched batch); returns rank 0's metrics and advances `group.version`."""
    frames = ray.put([encode(g) for g in groups])
    metrics = ray.get([a.train_step.remote(frames) for a in group.actors], timeout=group.cfg.learner.batch_timeout_s)
    group.version = int(metrics[0]["train/version"])
    return metrics[0]


def reconfigure(group: Any, cfg: Config) -> None:
    """Rebuild the ranks' engines in the same processes (same world size and process group) from
    `cfg`, e.g. another ZeRO stage; the weights are reloaded from `cfg.model.path`."""
    if cfg.learner_world_size != group.world_size:
        raise ValueError("reconfigure keeps the world size")
    group._setup(cfg)


def _export_rank(actor: Any, bucket_bytes: int) -> dict[str, Any] | None:
    """On a rank actor: walk the export (its ZeRO-3 gathers are collectives: every rank walks);
    rank 0 returns {name: CPU tensor}."""
    worker = actor.worker
    out: dict[str, Any] = {}
    for bucket in worker.export_named_tensors(bucket_bytes):
        if worker.rank == 0:
            out.update({n: t.detach().to("cpu", copy=True) for n, t in bucket})
    return out if worker.rank == 0 else None


def export_state(group: Any, bucket_bytes: int = 64 * 2**20) -> dict[str, Any]:
    """Every full parameter as a CPU tensor under its HF name (rank 0's export)."""
    refs = [a.__ray_call__.remote(_export_rank, bucket_bytes) for a in group.actors]
    return ray.get(refs, timeout=group.cfg.learner.batch_timeout_s)[0]
