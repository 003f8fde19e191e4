"""Weight broadcast from learner rank 0 to the rollout engines, with a watchdog and a fallback.

Wire format (shared with `asyncrl.actors.weight_receiver`): the named tensors are packed into
flat per-dtype buckets of about `bucket_mb`; each bucket travels as ONE collective
(`broadcast`, root = learner rank 0), never one per parameter. Its manifest
(`{"dtype", "numel", "params": [[name, shape, offset], ...]}`) and the version travel through the
rendezvous TCPStore as JSON, so NCCL and gloo groups carry only tensor bytes and no pickle is on
the path.

Membership protocol (all keys in the sender's TCPStore, which is also the rendezvous):
- generation g: the sender writes `g{g}/plan` (members -> ranks 1..n, backend), sets `gen = g`;
  each member sets `g{g}/ready/{id}`; members missing after `timeout_s` are dropped, the
  generation is aborted (`g{g}/built = abort`) and g+1 is planned without them; otherwise
  `built = go` and everyone builds the process group `PrefixStore("asyncrl_w/g{g}")`.
- round r of generation g: each member sets `g{g}/r{r}/enter/{id}` when it is ready to receive;
  members that have not entered within `timeout_s` are dropped, the round is aborted and the group
  rebuilt for the rest. Then `start = go`, the buckets flow, every member acks `g{g}/r{r}/ack/{id}`.
- every collective has a deadline the sender and the receivers enforce themselves (`wait_work`
  polls `work.is_completed()`, so it holds on NCCL, whose `wait()` does not block, as on gloo).
  Receivers heartbeat (`.../alive/{id}`) while they wait inside a round and write
  `.../progress/{id}` only once a bucket's data has arrived. When a collective fails or passes its
  deadline the sender retires the group without blocking (`abort_group`), drops the members that
  fell silent within a short grace (else the lowest progress), sets `.../abort` and the end header
  (`failed`), and rebuilds the group without them at the next broadcast; the dropped member's
  process, or its restart under the same id, sees `g{g}/out/{id}` and re-feeds from the store.
- NCCL: the group is built with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (a timeout aborts the
  communicator, never the process) and a backstop timeout later than every deadline above;
  NCCL_CUMEM_ENABLE travels in the plan so both sides use the same value; `set_device` before
  the sends and the exporter's gathers.
- integrity: the end header carries a fingerprint of every tensor (float64 sum and |sum| of 64
  elements at indices fixed by the tensor's name), so a receiver checks what arrived exactly.
- a dropped member that calls `receive` again asks to rejoin (`joinreq/{n}`); the sender takes it
  back at the next broadcast (a new generation). Scaling uses the same `rebuild(members)`.
Guarantee: no sender call blocks longer than about `timeout_s` per bucket plus a second of
grace whatever the members do; every member that acks a round holds exactly the broadcast
tensors (fingerprint-checked); every `publish_every`-th version is also published (a host copy
taken at broadcast time) to the `WeightStore` named Ray actor for late joiners, restarts and
dropped members, by default from a background thread (`publish_mode`), in version order.

Departure from Guided-GRPO (EasyR1/verl): there the rollout shares the learner's GPUs and weights
move in-process; asyncrl's rollout fleet is separate, so weights move over the network.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import warnings
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.addresses import bind_and_advertise, bind_first, candidate_ports

log = logging.getLogger(__name__)

PREFIX = "asyncrl_w"
NamedTensor = tuple[str, torch.Tensor]
WeightsInput = Iterable["NamedTensor | list[NamedTensor]"]

_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
            torch.int8, torch.uint8, torch.bool)}


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


def _flatten(items: WeightsInput) -> Iterator[NamedTensor]:
    """Accept (name, tensor) pairs or buckets (lists) of them, as `export_named_tensors` yields."""
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield item
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], dict):
            yield from unpack_bucket(*item)  # an already packed (manifest, flat) bucket
        else:
            yield from item


def pack_buckets(items: WeightsInput, bucket_bytes: int) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    """Pack named tensors into flat per-dtype buckets of about `bucket_bytes` (a larger tensor gets
    its own bucket). Yields `(manifest, flat)`; `flat` is on the tensors' device, contiguous.
    Tensors are consumed lazily so a ZeRO-3 exporter never holds more than a bucket or two."""
    pending: dict[torch.dtype, list[NamedTensor]] = {}
    sizes: dict[torch.dtype, int] = {}

    def emit(dtype: torch.dtype) -> tuple[dict[str, Any], torch.Tensor]:
        group = pending.pop(dtype)
        sizes.pop(dtype)
        params, offset = [], 0
        for name, t in group:
            params.append([name, list(t.shape), offset])
            offset += t.numel()
        flat = torch.cat([t.detach().reshape(-1) for _, t in group]) if len(group) > 1 \
            else group[0][1].detach().reshape(-1).contiguous()
        return {"dtype": str(dtype).removeprefix("torch."), "numel": offset, "params": params}, flat

    for name, tensor in _flatten(items):
        dtype = tensor.dtype
        pending.setdefault(dtype, []).append((name, tensor))
        sizes[dtype] = sizes.get(dtype, 0) + tensor.numel() * tensor.element_size()
        if sizes[dtype] >= bucket_bytes:
            yield emit(dtype)
    for dtype in list(pending):
        yield emit(dtype)


def unpack_bucket(manifest: dict[str, Any], flat: torch.Tensor) -> list[NamedTensor]:
    """Views of `flat` named and shaped by `manifest` (no copy)."""
    out = []
    for name, shape, offset in manifest["params"]:
        numel = 1
        for s in shape:
            numel *= s
        out.append((name, flat[offset:offset + numel].view(shape)))
    return out


# ---- integrity fingerprint -------------------------------------------------------------------
FINGERPRINT_SAMPLES = 64
_INDEX_CACHE: dict[tuple[str, int], torch.Tensor] = {}


def sample_index(name: str, numel: int, k: int = FINGERPRINT_SAMPLES) -> torch.Tensor:
    """The fixed random element indices sampled from parameter `name` (seeded by the name alone,
    so the learner, every receiver and every engine pick the same elements)."""
    key = (name, numel)
    idx = _INDEX_CACHE.get(key)
    if idx is None:
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        idx = _INDEX_CACHE[key] = torch.randint(0, numel, (min(k, numel),), generator=g)
    return idx


def sample_values(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The sampled elements of `tensor` (its own dtype, on the CPU): what fingerprints compare."""
    flat = tensor.detach().reshape(-1)
    return flat[sample_index(name, flat.numel()).to(flat.device)].cpu()


def fingerprint_of(samples: torch.Tensor) -> list[float]:
    """[sum, sum of |x|] of sampled elements in float64; equal inputs give bit-equal outputs."""
    v = samples.double()
    return [float(v.sum()), float(v.abs().sum())]


def bucket_fingerprint(manifest: dict[str, Any], flat: torch.Tensor) -> dict[str, list[float]]:
    """Fingerprint of every tensor of one packed bucket (one device-to-host copy per bucket)."""
    views = unpack_bucket(manifest, flat)
    if not views:
        return {}
    picked = torch.cat([v.reshape(-1)[sample_index(n, v.numel()).to(v.device)] for n, v in views]).cpu()
    out, at = {}, 0
    for n, v in views:
        k = min(FINGERPRINT_SAMPLES, v.numel())
        out[n] = fingerprint_of(picked[at:at + k])
        at += k
    return out


def fingerprint_mismatches(expected: dict[str, list[float]], got: dict[str, list[float]]) -> list[str]:
    """Names whose fingerprints differ (or that are missing from `got`); exact comparison, since
    both sides sum the same elements of the same dtype in the same order."""
    return [n for n, fp in expected.items() if got.get(n) != fp]


def make_store(host: str, port: int, *, is_master: bool, timeout_s: float) -> dist.TCPStore:
    # wait_for_workers=False: the master must not block until a fixed world of clients joins.
    return dist.TCPStore(host, port, None, is_master, timedelta(seconds=timeout_s), wait_for_workers=False)


class CollectiveTimeout(RuntimeError):
    """A weight-group collective did not complete by its deadline."""


def backstop_timeout(timeout_s: float) -> timedelta:
    """The process group's own timeout: later than every deadline asyncrl enforces itself, so
    gloo's and NCCL's watchdogs never fire first (they are the backstop, not the mechanism)."""
    return timedelta(seconds=4 * timeout_s + 30)


# NCCL environment of the weight group. TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): a
# timed-out collective aborts its communicator but never tears the process down (torch's default,
# 3, kills the process, i.e. the learner). NCCL_CUMEM_ENABLE must agree between the learner and
# the vLLM workers (mismatched values give errors or OOM); the sender's value travels in the plan.
NCCL_ERROR_HANDLING = "2"
CUMEM_DEFAULT = "0"


@contextmanager
def _scoped_env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def align_nccl_cumem(value: str | None) -> str:
    """Make this process's NCCL_CUMEM_ENABLE equal to `value` (the sender's); set it if unset,
    warn loudly if it was set differently (NCCL reads it once, at its first communicator)."""
    value = value if value is not None else CUMEM_DEFAULT
    mine = os.environ.get("NCCL_CUMEM_ENABLE")
    if mine is None:
        os.environ["NCCL_CUMEM_ENABLE"] = value
    elif mine != value:
        log.error("weight sync: NCCL_CUMEM_ENABLE=%s here but %s on the other side of the weight group; "
                  "NCCL may fail or run out of memory: set the same value on the learner and the rollout "
                  "workers", mine, value)
    return os.environ["NCCL_CUMEM_ENABLE"]


def make_group(store: dist.Store, generation: int, rank: int, world: int, backend: str,
               timeout_s: float, device: torch.device | None = None) -> dist.ProcessGroup:
    """A process group made only for weights, over `PrefixStore(asyncrl_w/g{generation})`.
    Its own timeout is `backstop_timeout`; callers bound every collective with `wait_work`."""
    prefixed = dist.PrefixStore(f"{PREFIX}/g{generation}/pg", store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = backstop_timeout(timeout_s)
        if device is not None:
            torch.cuda.set_device(device)
        with _scoped_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": NCCL_ERROR_HANDLING}):  # read by the constructor
            return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    return dist.ProcessGroupGloo(prefixed, rank, world, backstop_timeout(timeout_s))


def wait_work(work: Any, deadline: float, tick: Any = None, tick_every_s: float = 0.2) -> None:
    """Wait for a collective until `deadline` (time.monotonic), polling `work.is_completed()`,
    so the bound holds on NCCL too (whose `wait()` does not block without
    TORCH_NCCL_BLOCKING_WAIT) and on gloo alike. `tick()` runs about every `tick_every_s` while
    waiting (receivers heartbeat there and may raise to give up early). Raises CollectiveTimeout
    at the deadline; the collective's own error otherwise comes out of the final `wait()`."""
    delay, next_tick = 2e-5, time.monotonic() + tick_every_s
    while not work.is_completed():
        now = time.monotonic()
        if now >= deadline:
            raise CollectiveTimeout("weight collective passed its deadline")
        if tick is not None and now >= next_tick:
            tick()
            next_tick = now + tick_every_s
        time.sleep(delay)
        delay = min(2 * delay, 1e-3)
    work.wait()  # re-raises a failed collective; on NCCL the current stream now waits for it


_GRAVEYARD: list[tuple[float, Any]] = []  # (release time, gloo group) kept alive until then
_GRAVEYARD_LOCK = threading.Lock()


def abort_group(pg: Any, backstop_s: float = 0.0) -> None:
    """Retire a weight group without blocking the caller. NCCL: `abort()` in a reaper thread
    (frees kernels stuck on a dead peer). Gloo: its abort and its destructor both block the
    whole process (the GIL is held) until a hung collective reaches the group's own timeout, so
    the group is parked and released only after `backstop_s`, when nothing can hang any more."""
    now = time.monotonic()
    with _GRAVEYARD_LOCK:
        _GRAVEYARD[:] = [(t, g) for t, g in _GRAVEYARD if t > now]
        if pg is not None and not isinstance(pg, dist.ProcessGroupNCCL if dist.is_nccl_available() else ()):
            _GRAVEYARD.append((now + backstop_s, pg))
            return
    if pg is None:
        return

    def reap(group: Any) -> None:
        try:
            group.abort()
        except Exception:  # noqa: BLE001 - best effort on a group we are discarding
            log.debug("weight sync: abort of a weight group failed", exc_info=True)

    threading.Thread(target=reap, args=(pg,), name="asyncrl-weight-group-reaper", daemon=True).start()


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


@dataclass
class BroadcastReport:
    version: int
    seconds: float
    bytes: int
    buckets: int
    members: list[str]
    acked: list[str]
    dropped: list[str] = field(default_factory=list)
    rebuilds: int = 0
    published: bool = False
    publish_wait_s: float = 0.0
    """Seconds broadcast() spent handing the store copy over (background: waiting for the
    previous publish, if still running; sync: the whole publish)."""
    failed_at: int | None = None
    failure_handling_s: float | None = None
    """A failed round: seconds from the failure to the culprits being dropped."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class WeightSender:
    """Rank-0 side of the weight group. Not thread-safe; one broadcast at a time.

    `cfg` is a `WeightSyncConfig` (bucket_mb, backend, timeout_s, host). `port=0` picks a free
    port; `address` is what receivers connect to. `publish=True` also puts a CPU copy of every
    broadcast into the `WeightStore` actor (needs `ray.init` first)."""

    def __init__(self, cfg: Any, port: int = 0, *, publish: bool = False, store_name: str = "WeightStore",
                 members: Iterable[str] = (), port_range: str | None = None) -> None:
        self.backend = resolve_backend(cfg.backend)
        bucket_mb = cfg.bucket_mb
        if self.backend == "gloo":  # small buckets pipeline far better on gloo (see WeightSyncConfig)
            bucket_mb = min(bucket_mb, getattr(cfg, "gloo_bucket_mb", bucket_mb))
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.timeout_s = float(cfg.timeout_s)
        # Receivers are told this process's node address (asyncrl.addresses), never a wildcard.
        # (torch's master TCPStore listens on every interface whatever the host.)
        bind, self.host = bind_and_advertise(cfg.host)
        ports = candidate_ports(port or getattr(cfg, "port", 0), port_range)
        self.store = bind_first(ports, lambda p: make_store(bind, p, is_master=True, timeout_s=self.timeout_s),
                                "weight rendezvous (learner.weights)", self.host)
        self.port = self.store.port
        self.publish = publish
        self.store_name = store_name
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
        self.generation = 0
        self.members: list[str] = list(members)
        self.pg: dist.ProcessGroup | None = None
        self.group_members: list[str] = []
        self.seq = 0
        self.dropped_total = 0
        self.dropped_ids: list[str] = []
        self.drop_log: list[tuple[float, str, str]] = []  # (wall time, member, why)
        self._joinreq_seen = 0
        self._dirty = True
        self.nccl_cumem = align_nccl_cumem(os.environ.get("NCCL_CUMEM_ENABLE")) if self.backend == "nccl" else None
        # publishing: "background" puts the store copy from a thread (the next step does not wait
        # for it), "sync" inside broadcast(); every `publish_every`-th broadcast is published.
        self.publish_mode = getattr(cfg, "publish_mode", "background")
        self.publish_every = max(1, int(getattr(cfg, "publish_every", 1)))
        self.publish_fn = publish_weights  # (buckets, version, store_name) -> None; tests swap it
        self._publisher: threading.Thread | None = None
        self.publish_errors = 0
        self.last_publish: dict[str, Any] = {}
        self._broadcasts = 0
        self.store.set(f"{PREFIX}/gen", "0")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ---- membership -------------------------------------------------------------------------
    def add_receivers(self, ids: Iterable[str]) -> None:
        """Schedule members to join; the group is rebuilt at the next broadcast (or `rebuild`)."""
        for i in ids:
            if i not in self.members:
                self.members.append(i)
        self._dirty = True

    def remove_receivers(self, ids: Iterable[str]) -> None:
        drop = set(ids)
        self._mark_out(drop)
        self.members = [m for m in self.members if m not in drop]
        self._dirty = True

    def _mark_out(self, ids: Iterable[str]) -> None:
        """Tell (re)started processes with these ids that the current generation's plan no
        longer holds them (it is rebuilt lazily, at the next broadcast)."""
        for i in ids:
            self.store.set(f"{PREFIX}/g{self.generation}/out/{i}", "1")

    def _drop(self, ids: Iterable[str], why: str) -> list[str]:
        ids = [i for i in ids if i in self.members]
        for i in ids:
            log.warning("weight sync: dropping member %s (%s); it must catch up from the WeightStore", i, why)
        self._mark_out(ids)
        self.members = [m for m in self.members if m not in ids]
        self.dropped_total += len(ids)
        self.dropped_ids.extend(ids)
        self.drop_log.extend((time.time(), i, why) for i in ids)
        self._dirty = True
        return ids

    def _absorb_join_requests(self) -> None:
        n = self.store.add(f"{PREFIX}/joinreq_n", 0)
        for k in range(self._joinreq_seen + 1, n + 1):
            member = self.store.get(f"{PREFIX}/joinreq/{k}").decode()
            if member not in self.members:
                log.info("weight sync: member %s asked to (re)join", member)
                self.members.append(member)
                self._dirty = True
        self._joinreq_seen = n

    def _wait_keys(self, keys: dict[str, str], deadline: float) -> list[str]:
        """Return the ids whose key is still missing at `deadline` (polls the store)."""
        if not keys:
            return []
        try:  # event-driven: returns as soon as every key exists
            self.store.wait(list(keys.values()), timedelta(seconds=max(0.001, deadline - time.monotonic())))
            return []
        except Exception:  # noqa: BLE001 - a timeout: find out who is missing
            pass
        missing = dict(keys)
        while missing:
            for member, key in list(missing.items()):
                if self.store.check([key]):
                    del missing[member]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        return list(missing)

    def rebuild(self, members: Iterable[str] | None = None) -> list[str]:
        """(Re)build the group for `members` (default: the current list); members that do not
        join within `timeout_s` are dropped. Returns the members of the new group."""
        if members is not None:
            self.members = list(dict.fromkeys(members))
        while True:
            self._destroy_group()
            self.generation += 1
            g, members_now = self.generation, list(self.members)
            plan = {"members": members_now, "backend": self.backend, "world": len(members_now) + 1,
                    "nccl_cumem": self.nccl_cumem}
            self.store.set(f"{PREFIX}/g{g}/plan", json.dumps(plan))
            self.store.set(f"{PREFIX}/gen", str(g))
            if g > 1:  # members already waiting for the old group's next round: move on
                self.store.set(f"{PREFIX}/g{g - 1}/r{self.seq + 1}/start", json.dumps({"go": False}))
            self.seq = 0
            if not members_now:
                self.group_members, self._dirty = [], False
                return []
            missing = self._wait_keys({m: f"{PREFIX}/g{g}/ready/{m}" for m in members_now},
                                      time.monotonic() + self.timeout_s)
            if missing:
                self._drop(missing, "did not join the weight group")
                self.store.set(f"{PREFIX}/g{g}/built", "abort")
                continue
            self.store.set(f"{PREFIX}/g{g}/built", "go")
            self.pg = make_group(self.store, g, 0, len(members_now) + 1, self.backend, self.timeout_s, self.device)
            self.group_members, self._dirty = members_now, False
            return members_now

    def _destroy_group(self) -> None:
        abort_group(self.pg, backstop_timeout(self.timeout_s).total_seconds())
        self.pg = None

    # ---- broadcast --------------------------------------------------------------------------
    def broadcast(self, weights: WeightsInput, version: int) -> BroadcastReport:
        """Broadcast `weights` ((name, tensor) pairs, or buckets of them) as `version` to every
        member; returns a report (who acked, who was dropped, seconds). Never raises for a
        member's failure; the iterator is always consumed to the end (ZeRO-3 gathers are
        collective across learner ranks)."""
        t0 = time.perf_counter()
        dropped_before = self.dropped_total
        self.store.set(f"{PREFIX}/announce", str(version))
        self._absorb_join_requests()
        rebuilds = 0
        start_round = False
        while not start_round:
            if self._dirty:
                self.rebuild()
                rebuilds += 1
            if not self.group_members:
                break
            self.seq += 1
            rk = f"{PREFIX}/g{self.generation}/r{self.seq}"
            missing = self._wait_keys({m: f"{rk}/enter/{m}" for m in self.group_members},
                                      time.monotonic() + self.timeout_s)
            if missing:
                self._drop(missing, "did not enter the weight round")
                # waiting members see the abort and wait for a generation newer than this one
                self.store.set(f"{rk}/start", json.dumps({"go": False}))
                continue
            self.store.set(f"{rk}/start", json.dumps({"go": True, "version": version}))
            start_round = True

        members = list(self.group_members)
        self._broadcasts += 1
        publishing = self.publish and (self._broadcasts - 1) % self.publish_every == 0
        store_copy: list[tuple[dict[str, Any], torch.Tensor]] | None = [] if publishing else None
        fingerprint: dict[str, list[float]] = {}
        nbytes = nbuckets = 0
        failed_at: int | None = None
        work = None  # the collective of the previous bucket (the Work object holds its tensor)
        bucket_deadline = 0.0
        rk = f"{PREFIX}/g{self.generation}/r{self.seq}"
        if self.device is not None:
            torch.cuda.set_device(self.device)  # before the exporter's gathers and our sends
        for i, (manifest, flat) in enumerate(pack_buckets(weights, self.bucket_bytes)):
            nbytes += flat.numel() * flat.element_size()
            nbuckets += 1
            if self.device is not None and flat.device != self.device:
                flat = flat.to(self.device)
            if store_copy is not None:
                store_copy.append((manifest, host_copy(flat)))
            if not members or failed_at is not None:
                continue
            fingerprint.update(bucket_fingerprint(manifest, flat))
            on_wire = i - 1
            try:
                if work is not None:  # overlap: pack bucket i while bucket i-1 is on the wire
                    wait_work(work, bucket_deadline)
                on_wire = i
                self.store.set(f"{rk}/h{i}", json.dumps(manifest))
                work = self.pg.broadcast([flat], dist.BroadcastOptions())  # root 0 by default
                bucket_deadline = time.monotonic() + self.timeout_s
            except Exception as exc:  # noqa: BLE001 - the watchdog path
                failed_at, work = on_wire, None
                log.warning("weight sync: broadcast of bucket %d failed: %s", on_wire, exc)
        if members and failed_at is None:
            try:
                if work is not None:
                    wait_work(work, bucket_deadline)
            except Exception as exc:  # noqa: BLE001
                failed_at = nbuckets - 1
                log.warning("weight sync: last bucket failed: %s", exc)
        acked: list[str] = []
        failed_s = None
        if members:
            if failed_at is not None:
                # abort first (NCCL: frees the stuck kernels), then find who stopped responding
                # while the live members still heartbeat, then tell them the round is over
                t_fail = time.monotonic()
                self._destroy_group()
                missing = self._unresponsive(members, rk)
                self.store.set(f"{rk}/abort", "1")
                failed_s = time.monotonic() - t_fail
            end = {"end": True, "version": version, "buckets": nbuckets, "failed": failed_at is not None,
                   "fingerprint": fingerprint}
            # after a failure, members that got bucket `failed_at` wait for header failed_at + 1
            self.store.set(f"{rk}/h{nbuckets if failed_at is None else failed_at + 1}", json.dumps(end))
            if failed_at is None:
                missing = self._wait_keys({m: f"{rk}/ack/{m}" for m in members}, time.monotonic() + self.timeout_s)
                missing += [m for m in members if m not in missing and self.store.get(f"{rk}/ack/{m}") != b"1"]  # nacks
                acked = [m for m in members if m not in missing]
            if missing:
                self._drop(missing, "hung in the weight broadcast" if failed_at is not None else "did not ack")
            if failed_at is not None:
                self._dirty = True  # the group is broken for everyone; rebuild next time
        report = BroadcastReport(version=version, seconds=0.0, bytes=nbytes, buckets=nbuckets, members=members,
                                 acked=acked, dropped=list(self.dropped_ids[dropped_before:]), rebuilds=rebuilds)
        report.failed_at, report.failure_handling_s = failed_at, failed_s
        if store_copy is not None:
            tp = time.perf_counter()
            self._start_publish(store_copy, version)
            report.published, report.publish_wait_s = True, time.perf_counter() - tp
        report.seconds = time.perf_counter() - t0
        return report

    # ---- publishing -------------------------------------------------------------------------
    def _start_publish(self, buckets: list[tuple[dict[str, Any], torch.Tensor]], version: int) -> None:
        """Publish `buckets` as `version`: in a background thread (at most one in flight; a new
        one first waits for the previous, so versions reach the store in order) or inline."""
        self.flush()
        pinned = bool(buckets) and torch.cuda.is_available() and buckets[0][1].is_pinned()
        ready = torch.cuda.Event() if pinned else None
        if ready is not None:
            ready.record()  # the pinned copies were queued on this stream

        def run() -> None:
            t = time.perf_counter()
            try:
                if ready is not None:
                    ready.synchronize()
                self.publish_fn(buckets, version, self.store_name)
                self.last_publish = {"version": version, "seconds": time.perf_counter() - t}
            except Exception:  # noqa: BLE001 - a lost publish leaves the previous version in the store
                self.publish_errors += 1
                log.exception("weight sync: publishing version %d to the weight store failed", version)

        if self.publish_mode == "sync":
            run()
            return
        self._publisher = threading.Thread(target=run, name=f"asyncrl-publish-v{version}", daemon=True)
        self._publisher.start()

    def flush(self) -> None:
        """Wait until the background publish in flight (if any) has reached the store."""
        if self._publisher is not None:
            self._publisher.join()
            self._publisher = None

    def _unresponsive(self, members: list[str], rk: str, grace_s: float | None = None) -> list[str]:
        """Members that stopped taking part in round `rk`: no heartbeat within `grace_s` (live
        receivers heartbeat every ~0.2 s while they wait, also inside a stuck collective). If
        every member is alive the slowest ones (lowest progress) are the culprits."""
        grace_s = min(1.0, self.timeout_s) if grace_s is None else grace_s
        before = {m: self.store.add(f"{rk}/alive/{m}", 0) for m in members}
        deadline = time.monotonic() + grace_s
        quiet = set(members)
        while quiet and time.monotonic() < deadline:
            time.sleep(0.02)
            quiet = {m for m in quiet if self.store.add(f"{rk}/alive/{m}", 0) == before[m]}
        return [m for m in members if m in quiet] or self._laggards(members, rk)

    def _laggards(self, members: list[str], rk: str) -> list[str]:
        progress = {}
        for m in members:
            key = f"{rk}/progress/{m}"
            progress[m] = int(self.store.get(key)) if self.store.check([key]) else -1
        low = min(progress.values())
        return [m for m, p in progress.items() if p == low] if low < max(progress.values()) or low < 0 else list(members)

    def close(self) -> None:
        self.flush()
        self._destroy_group()


# ---- object-store path -----------------------------------------------------------------------
class WeightStore:
    """Named Ray actor holding the newest published weights (an ObjectRef to a CPU copy, by
    version). Ray's serialization is fine here: it never leaves the cluster."""

    def __init__(self) -> None:
        self.version = -1
        self.ref: Any = None

    def put(self, version: int, refs: list[Any]) -> int:
        if version >= self.version:
            self.version, self.ref = version, refs[0]
        return self.version

    def latest(self) -> tuple[int, list[Any]]:
        return self.version, [self.ref] if self.ref is not None else []


def get_weight_store(name: str = "WeightStore") -> Any:
    """The named store actor (created on first use; detached, so it outlives a restarted
    learner and is only removed with the cluster or `ray.kill`)."""
    import ray

    return ray.remote(num_cpus=0)(WeightStore).options(
        name=name, get_if_exists=True, lifetime="detached").remote()


def host_copy(flat: torch.Tensor) -> torch.Tensor:
    """A host copy of a bucket for the store: a plain copy on the CPU; from a GPU, a pinned
    buffer filled asynchronously on the current stream (the publisher waits on an event)."""
    if flat.device.type != "cuda":
        return flat.to("cpu", copy=True)
    buf = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    buf.copy_(flat, non_blocking=True)
    return buf


def publish_weights(buckets: list[tuple[dict[str, Any], torch.Tensor]], version: int,
                    name: str = "WeightStore") -> None:
    """Put a CPU copy of packed buckets into the object store and register it under `version`."""
    import ray

    payload = [(m, t.contiguous().view(torch.uint8).numpy()) for m, t in buckets]
    ref = ray.put(payload)
    ray.get(get_weight_store(name).put.remote(version, [ref]))


def fetch_weights(name: str = "WeightStore", min_version: int = -1, timeout_s: float = 60.0
                  ) -> tuple[int, list[tuple[dict[str, Any], torch.Tensor]]] | None:
    """The newest published buckets `(version, [(manifest, flat)])`, or None if nothing newer
    than `min_version` has been published."""
    import ray

    version, refs = ray.get(get_weight_store(name).latest.remote(), timeout=timeout_s)
    if version < 0 or version <= min_version:
        return None
    payload = ray.get(refs[0], timeout=timeout_s)
    with warnings.catch_warnings():  # zero-copy views of read-only object-store memory; only read
        warnings.simplefilter("ignore", UserWarning)
        return version, [(m, torch.from_numpy(a).view(dtype_from_name(m["dtype"]))) for m, a in payload]
