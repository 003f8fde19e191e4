"""The `WeightStore`: a named Ray actor holding the newest published weights (an ObjectRef to a
CPU copy of the packed buckets, by version), for late joiners, restarted actors and dropped
members.

Ownership: the topology starts it explicitly (`start_weight_store`) before the learner and shuts
it down with the job (`WeightStoreHandle.shutdown`). It is detached and found by name, so it
outlives a learner rebuilt after a failure: the rebuilt sender publishes into the same store and
engines keep fetching from it. Ray's serialization is fine here: the copy never leaves the cluster.
`publish_weights` needs a started store; `fetch_weights` answers None while nothing newer than
`min_version` has been published (including: no store).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from asyncrl.weights.wire import dtype_from_name

STORE_NAME = "WeightStore"


class WeightStore:
    """The store actor's body: the newest version and the ObjectRef of its buckets."""

    def __init__(self) -> None:
        self.version = -1
        self.ref: Any = None

    def put(self, version: int, refs: list[Any]) -> int:
        if version >= self.version:
            self.version, self.ref = version, refs[0]
        return self.version

    def latest(self) -> tuple[int, list[Any]]:
        return self.version, [self.ref] if self.ref is not None else []


class WeightStoreHandle:
    """The job's handle on its store: `actor` for calls, `shutdown()` to remove it."""

    def __init__(self, actor: Any, name: str, namespace: str | None) -> None:
        self.actor, self.name, self.namespace = actor, name, namespace

    def shutdown(self) -> None:
        """Kill the store actor (detached: without this it would outlive the job on a shared cluster)."""
        import ray

        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None


def start_weight_store(namespace: str | None = None, name: str = STORE_NAME) -> WeightStoreHandle:
    """Start the store actor (or take the one of that name already running in `namespace`, e.g.
    after a driver restart on the same cluster) and wait until it answers."""
    import ray

    actor = ray.remote(num_cpus=0)(WeightStore).options(
        name=name, namespace=namespace, get_if_exists=True, lifetime="detached").remote()
    ray.get(actor.latest.remote())
    return WeightStoreHandle(actor, name, namespace)


def find_weight_store(name: str = STORE_NAME) -> Any:
    """The running store actor of that name in this job's namespace, or None."""
    import ray

    try:
        return ray.get_actor(name)
    except ValueError:
        return None


def host_copy(flat: torch.Tensor) -> torch.Tensor:
    """A host copy of a bucket for the store: a plain copy on the CPU; from a GPU, a pinned
    buffer filled asynchronously on the current stream (the publisher waits on an event)."""
    if flat.device.type != "cuda":
        return flat.to("cpu", copy=True)
    buf = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    buf.copy_(flat, non_blocking=True)
    return buf



def publish_weights(buckets: list[tuple[dict[str, Any], torch.Tensor]], version: int,
                    name: str = STORE_NAME) -> None:
    """Put a CPU copy of packed buckets into the object store and register it under `version`."""
    import ray

    store = find_weight_store(name)
    if store is None:
        raise RuntimeError(f"no weight store named {name!r} is running: start it with start_weight_store()")
    payload = [(m, t.contiguous().view(torch.uint8).numpy()) for m, t in buckets]
    ref = ray.put(payload)
    ray.get(store.put.remote(version, [ref]))


def fetch_weights(name: str = STORE_NAME, min_version: int = -1, timeout_s: float = 60.0
                  ) -> tuple[int, list[tuple[dict[str, Any], torch.Tensor]]] | None:
    """The newest published buckets `(version, [(manifest, flat)])`, or None if nothing newer
    than `min_version` has been published (or no store runs)."""
    import ray

    store = find_weight_store(name)
    if store is None:
        return None
    version, refs = ray.get(store.latest.remote(), timeout=timeout_s)
    if version < 0 or version <= min_version:
        return None
    payload = ray.get(refs[0], timeout=timeout_s)
    with warnings.catch_warnings():  # zero-copy views of read-only object-store memory; only read
        warnings.simplefilter("ignore", UserWarning)
        return version, [(m, torch.from_numpy(a).view(dtype_from_name(m["dtype"]))) for m, a in payload]
