"""The `WeightStore`: a named Ray actor holding the newest published weights (ObjectRefs to a
CPU copy of the packed buckets, by version), for late joiners, restarted actors and dropped
members.

Ownership: the topology starts it explicitly (`start_weight_store`) before the learner and shuts
it down with the job (`WeightStoreHandle.shutdown`). It is detached and found by name, so it
outlives a learner rebuilt after a failure: the rebuilt sender publishes into the same store and
engines keep fetching from it. The published BYTES outlive the learner too: a Ray object dies
with the process that `ray.put` it (its owner; Ray 2.60 has no `_owner=` to hand it over), so
the learner never puts them itself: `publish_weights` passes the buckets to the store in chunks
of about `CHUNK_BYTES` as call arguments (transient objects, freed once the call returns), and
the store `ray.put`s each chunk itself. A version becomes visible only when its last chunk is in
(`commit`), so a publisher that dies mid-way leaves the previous version in place.

Memory: the store holds the newest version, plus the one being published until it is committed
(`STORE_VERSIONS` versions), plus up to `IN_FLIGHT` chunks in transit, in the object store of its
node; a fetch copies one version into the fetching node's object store (`shm_bytes_needed`).
Ray's serialization is fine here: the copy never leaves the cluster. `publish_weights` needs a
started store; `fetch_weights` answers None while nothing newer than `min_version` has been
published (including: no store).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

STORE_NAME = "WeightStore"


STORE_VERSIONS = 2
"""Versions the store's node holds at the peak: the newest, and the next until it is committed."""
CHUNK_BYTES = 256 * 2**20
"""Bytes of buckets per `stage` call (one transient argument object each)."""
IN_FLIGHT = 2
"""`stage` calls a publisher keeps in flight (chunks in transit at once)."""


class WeightStore:
    """The store actor's body: the newest committed version and the ObjectRefs of its chunks,
    every one `ray.put` by this actor (so owned by it, not by the publisher)."""

    def __init__(self) -> None:
        self.version = -1
        self.refs: list[Any] = []
        self.staging: dict[int, list[Any]] = {}

    def stage(self, version: int, chunk: list[tuple[dict[str, Any], Any]]) -> int:
        """Take one chunk of `version`'s buckets (a list of (manifest, uint8 array)) and own a
        copy of it. Stale versions (older than the committed one) are ignored."""
        import ray

        if version > self.version:
            self.staging.setdefault(version, []).append(ray.put(chunk))
        return len(self.staging.get(version, []))

    def commit(self, version: int, chunks: int) -> int:
        """Make `version` the newest once all its `chunks` are staged; drops older staging."""
        staged = self.staging.pop(version, [])
        if version >= self.version and len(staged) == chunks:
            self.version, self.refs = version, staged
        for v in [v for v in self.staging if v <= self.version]:
            del self.staging[v]
        return self.version

    def latest(self) -> tuple[int, list[Any]]:
        return self.version, list(self.refs)


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


ALIGN = 64  # bytes; bucket offsets in the arena


def _page_locked(nbytes: int, pin: bool) -> torch.Tensor:
    """`nbytes` of host memory, page-locked with cudaHostRegister when `pin`: exactly that size.
    (`pin_memory=True` goes through torch's caching host allocator, which rounds every block up
    to a power of two and keeps it pinned for the life of the process.)"""
    import torch

    buf = torch.empty(nbytes, dtype=torch.uint8)
    if pin and nbytes:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (error {int(err)})")
    return buf


def _release(buf: torch.Tensor | None, pin: bool) -> None:
    import torch

    if buf is not None and pin and buf.numel():
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


class HostArena:
    """The host side of the store copy: ONE buffer the size of a version, reused by every
    published version (page-locked on GPU learners: device-to-host copies then run
    asynchronously at full speed). The first version learns the size (its buckets that do not
    fit go to exact-size overflow buffers); `begin()` of the next one grows the arena to it.
    The caller must not begin a version while a publish still reads the previous one
    (`WeightSender` flushes its publisher first). `pinned_bytes` = what is page-locked now."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.arena: torch.Tensor | None = None
        self.used = 0
        self.need = 0  # bytes of the largest version so far
        self.overflow: list[torch.Tensor] = []

    @property
    def pinned_bytes(self) -> int:
        if not self.pin:
            return 0
        return (self.arena.numel() if self.arena is not None else 0) + sum(b.numel() for b in self.overflow)

    def begin(self) -> None:
        """Start a version's copies at the arena's start (the previous version is published)."""
        for buf in self.overflow:
            _release(buf, self.pin)
        self.overflow = []
        if self.need > (self.arena.numel() if self.arena is not None else 0):
            _release(self.arena, self.pin)
            self.arena = None  # freed before the larger one is taken
            self.arena = _page_locked(self.need, self.pin)
        self.used = 0

    def copy(self, flat: torch.Tensor) -> torch.Tensor:
        """A host copy of one bucket, a view into the arena (or an overflow buffer); from a GPU
        the copy is queued on the current stream (the publisher waits on an event)."""
        nbytes = flat.numel() * flat.element_size()
        start = -(-self.used // ALIGN) * ALIGN  # every bucket starts aligned for any dtype's view
        self.need = max(self.need, start + nbytes)
        if self.arena is not None and start + nbytes <= self.arena.numel():
            raw = self.arena[start:start + nbytes]
        else:
            raw = _page_locked(nbytes, self.pin)
            self.overflow.append(raw)
        self.used = start + nbytes
        out = raw.view(flat.dtype).view(flat.shape)
        out.copy_(flat.detach(), non_blocking=flat.device.type == "cuda")
        return out

    def close(self) -> None:
        for buf in [self.arena, *self.overflow]:
            _release(buf, self.pin)
        self.arena, self.overflow = None, []



def chunked(buckets: list[tuple[dict[str, Any], torch.Tensor]], chunk_bytes: int = CHUNK_BYTES
            ) -> list[list[tuple[dict[str, Any], torch.Tensor]]]:
    """Consecutive buckets grouped into chunks of about `chunk_bytes` (a larger bucket alone)."""
    chunks: list[list[tuple[dict[str, Any], torch.Tensor]]] = []
    size = chunk_bytes
    for m, t in buckets:
        nbytes = t.numel() * t.element_size()
        if size + nbytes > chunk_bytes and (not chunks or chunks[-1]):
            chunks.append([])
            size = 0
        chunks[-1].append((m, t))
        size += nbytes
    return chunks


def publish_weights(buckets: list[tuple[dict[str, Any], torch.Tensor]], version: int,
                    name: str = STORE_NAME) -> None:
    """Hand a CPU copy of packed buckets to the store, chunk by chunk (the store owns what it
    keeps), and commit them as `version`."""
    import ray
    import torch

    store = find_weight_store(name)
    if store is None:
        raise RuntimeError(f"no weight store named {name!r} is running: start it with start_weight_store()")
    pending: list[Any] = []
    chunks = chunked(buckets)
    for chunk in chunks:
        if len(pending) >= IN_FLIGHT:
            ray.get(pending.pop(0))
        pending.append(store.stage.remote(version, [(m, t.contiguous().view(torch.uint8).numpy()) for m, t in chunk]))
    ray.get(pending)
    committed = ray.get(store.commit.remote(version, len(chunks)))
    if committed < version:
        raise RuntimeError(f"the weight store did not take version {version} (it holds {committed})")


def shm_bytes_needed(version_bytes: int) -> int:
    """Object-store bytes the weight store's node needs for versions of `version_bytes`: the
    newest and the next (`STORE_VERSIONS`) plus the chunks in transit."""
    return STORE_VERSIONS * version_bytes + IN_FLIGHT * CHUNK_BYTES


def fetch_weights(name: str = STORE_NAME, min_version: int = -1, timeout_s: float = 60.0
                  ) -> tuple[int, list[tuple[dict[str, Any], torch.Tensor]]] | None:
    """The newest published buckets `(version, [(manifest, flat)])`, or None if nothing newer
    than `min_version` has been published (or no store runs)."""
    import ray
    import torch

    from asyncrl.weights.wire import dtype_from_name

    store = find_weight_store(name)
    if store is None:
        return None
    version, refs = ray.get(store.latest.remote(), timeout=timeout_s)
    if version < 0 or version <= min_version:
        return None
    payload = [bucket for chunk in ray.get(refs, timeout=timeout_s) for bucket in chunk]
    with warnings.catch_warnings():  # zero-copy views of read-only object-store memory; only read
        warnings.simplefilter("ignore", UserWarning)
        return version, [(m, torch.from_numpy(a).view(dtype_from_name(m["dtype"]))) for m, a in payload]
