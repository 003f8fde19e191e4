"""`WeightSender`: rank 0's side of the weight group (protocol in the `asyncrl.weights` package
docstring).

Guarantee: no sender call blocks longer than about `timeout_s` per bucket plus a second of
grace whatever the members do; every member that acks a round holds exactly the broadcast
tensors (fingerprint-checked); every `publish_every`-th version is also published (a host copy
taken at broadcast time) to the `WeightStore` for late joiners, restarts and dropped members, by
default from a background thread (`publish_mode`), in version order.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.addresses import bind_and_advertise, bind_first, candidate_ports
from asyncrl.weights.group import (
    NcclEnvMismatch,
    abort_group,
    backstop_timeout,
    connect_group,
    group_store,
    join_member,
    make_group,
    master_store,
    resolve_backend,
    wait_work,
)
from asyncrl.weights.nccl_env import cumem_mismatch, nccl_cumem
from asyncrl.weights.phases import PhaseTimer
from asyncrl.weights.store import STORE_NAME, HostArena, publish_weights
from asyncrl.weights.wire import PREFIX, WeightsInput, bucket_fingerprint, pack_buckets

log = logging.getLogger(__name__)


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
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds by phase (`asyncrl.weights.phases.SENDER_PHASES`, plus `other` and `round`)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Sent:
    """What `_send_buckets` put on the wire: sizes for the report, the fingerprint the members
    check, and the first bucket that failed (None: every bucket arrived)."""

    nbytes: int = 0
    nbuckets: int = 0
    fingerprint: dict[str, list[float]] = field(default_factory=dict)
    failed_at: int | None = None


class WeightSender:
    """Rank-0 side of the weight group. Not thread-safe; one broadcast at a time.

    `store_copy_overlap` (default True): the WeightStore's copy of a bucket is taken after the
    bucket's broadcast is posted, beside its wire time; False takes it before (the benchmark's A/B).

    `cfg` is a `WeightSyncConfig` (bucket_mb, backend, timeout_s, host). `port=0` picks a free
    port; `address` is what receivers connect to. `publish=True` also puts a CPU copy of every
    broadcast into the `WeightStore` actor (`asyncrl.weights.store`; started by the topology)."""

    def __init__(self, cfg: Any, port: int = 0, *, publish: bool = False, store_name: str = STORE_NAME,
                 members: Iterable[str] = (), port_range: str | None = None) -> None:
        self.backend = resolve_backend(cfg.backend)
        bucket_mb = cfg.bucket_mb
        if self.backend == "gloo":  # small buckets pipeline far better on gloo (see WeightSyncConfig)
            bucket_mb = min(bucket_mb, getattr(cfg, "gloo_bucket_mb", bucket_mb))
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.timeout_s = float(cfg.timeout_s)
        # Receivers are told this process's node address (asyncrl.addresses), never a wildcard; the
        # store listens on the configured interface only (loopback by default).
        bind, self.host = bind_and_advertise(cfg.host)
        ports = candidate_ports(port or getattr(cfg, "port", 0), port_range)
        self.store, self._listen_socket = bind_first(
            ports, lambda p: master_store(bind, p, self.timeout_s), "weight rendezvous (learner.weights)", self.host)
        self.port = self.store.port
        # the job's secret: (re)join requests must be signed with it (None: any request is taken)
        self.secret: str | None = getattr(cfg, "secret", None) or None
        self.rejected_joins = 0
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
        self.nccl_cumem = nccl_cumem()  # fixed for this process: NCCL read it at the learner's first communicator
        # publishing: "background" puts the store copy from a thread (the next step does not wait
        # for it), "sync" inside broadcast(); every `publish_every`-th broadcast is published.
        self.publish_mode = getattr(cfg, "publish_mode", "background")
        self.publish_every = max(1, int(getattr(cfg, "publish_every", 1)))
        self.publish_fn = publish_weights  # (buckets, version, store_name) -> None; tests swap it
        self.store_copy_overlap = True
        self._publisher: threading.Thread | None = None
        self.publish_errors = 0
        self.last_publish: dict[str, Any] = {}
        self._broadcasts = 0
        # the store copy's host memory: one buffer the size of a version, page-locked on a GPU
        self.arena = HostArena(pin=self.device is not None)
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
        """Takes the (re)join requests signed with the job's secret; others are ignored (counted in
        `rejected_joins`, logged), so a stranger's request costs no wait."""
        n = self.store.add(f"{PREFIX}/joinreq_n", 0)
        for k in range(self._joinreq_seen + 1, n + 1):
            key = f"{PREFIX}/joinreq/{k}"
            if not self.store.check([key]):  # counted but never written: nothing to take
                continue
            member = join_member(self.secret, k, self.store.get(key))
            if member is None:
                self.rejected_joins += 1
                log.warning("weight sync: ignored join request %d: not signed with the job's secret", k)
                continue
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
            self._check_cumem(g, members_now)
            self.store.set(f"{PREFIX}/g{g}/built", "go")
            try:
                self.pg = self._connect(g, members_now)
            except Exception as exc:  # noqa: BLE001 - a member died between joining and connecting
                log.warning("weight sync: generation %d did not connect: %s", g, exc)
                ck = f"{PREFIX}/g{g}/connect"
                missing = self._unresponsive(members_now, ck)
                self.store.set(f"{ck}/abort", "1")
                self._drop(missing, "did not connect to the weight group")
                continue
            self.group_members, self._dirty = members_now, False
            return members_now

    def _check_cumem(self, g: int, members: list[str]) -> None:
        """NCCL only: every member joined with this process's NCCL_CUMEM_ENABLE (each writes its
        own into its ready key), else the generation is aborted and NcclEnvMismatch raised: a
        configuration error that would break every round, so the job stops naming the members."""
        if self.backend != "nccl":
            return
        theirs = {m: json.loads(self.store.get(f"{PREFIX}/g{g}/ready/{m}")).get("nccl_cumem") for m in members}
        problem = cumem_mismatch(self.nccl_cumem, theirs, "learner rank 0")
        if problem:
            self.store.set(f"{PREFIX}/g{g}/built", "abort")
            raise NcclEnvMismatch(problem)

    def _connect(self, g: int, members: list[str]) -> dist.ProcessGroup:
        """Build generation g's group and run its first collective within `timeout_s` (NCCL creates
        its communicator there; a member that died after joining must not hold the learner)."""
        backstop = backstop_timeout(self.timeout_s).total_seconds()
        return connect_group(
            lambda: make_group(group_store(self.host, self.port, self.timeout_s), g, 0, len(members) + 1,
                               self.backend, self.timeout_s, self.device),
            self.device, time.monotonic() + self.timeout_s, backstop)

    def _destroy_group(self) -> None:
        abort_group(self.pg, backstop_timeout(self.timeout_s).total_seconds())
        self.pg = None

    # ---- broadcast --------------------------------------------------------------------------
    def broadcast(self, weights: WeightsInput, version: int) -> BroadcastReport:
        """Broadcast `weights` ((name, tensor) pairs, or buckets of them) as `version` to every
        member; returns a report (who acked, who was dropped, seconds). Never raises for a
        member's failure; the iterator is always consumed to the end (ZeRO-3 gathers are
        collective across learner ranks)."""
        timer = PhaseTimer(self.device)
        t0 = timer.t0
        dropped_before = self.dropped_total
        self.store.set(f"{PREFIX}/announce", str(version))
        self._absorb_join_requests()
        rebuilds = self._start_round(version)
        timer.add("open", time.perf_counter() - t0)
        members = list(self.group_members)
        self._broadcasts += 1
        publishing = self.publish and (self._broadcasts - 1) % self.publish_every == 0
        with timer.span("publish_wait"):
            publish_wait_s = self._begin_store_copy() if publishing else 0.0
        store_copy: list[tuple[dict[str, Any], torch.Tensor]] | None = [] if publishing else None
        rk = f"{PREFIX}/g{self.generation}/r{self.seq}"
        sent = self._send_buckets(weights, members, rk, store_copy, timer)
        acked, failed_s = self._end_round(members, rk, version, sent, timer) if members else ([], None)
        report = BroadcastReport(version=version, seconds=0.0, bytes=sent.nbytes, buckets=sent.nbuckets,
                                 members=members, acked=acked, rebuilds=rebuilds,
                                 dropped=list(self.dropped_ids[dropped_before:]))
        report.failed_at, report.failure_handling_s = sent.failed_at, failed_s
        if store_copy is not None:
            with timer.span("publish"):
                tp = time.perf_counter()
                self._start_publish(store_copy, version)
                report.published, report.publish_wait_s = True, publish_wait_s + time.perf_counter() - tp
        timer.end()
        report.phases = timer.seconds()
        report.seconds = time.perf_counter() - t0
        return report

    def _start_round(self, version: int) -> int:
        """Opens round `self.seq` once every member has entered it, dropping the members that did
        not within `timeout_s` (and trying again with the rest, rebuilding the group first if a
        drop left it dirty); the waiting members see an aborted round and wait for a newer
        generation. Returns the number of rebuilds; with no members left, no round is opened."""
        rebuilds = 0
        while True:
            if self._dirty:
                self.rebuild()
                rebuilds += 1
            if not self.group_members:
                return rebuilds
            self.seq += 1
            rk = f"{PREFIX}/g{self.generation}/r{self.seq}"
            missing = self._wait_keys({m: f"{rk}/enter/{m}" for m in self.group_members},
                                      time.monotonic() + self.timeout_s)
            if not missing:
                self.store.set(f"{rk}/start", json.dumps({"go": True, "version": version}))
                return rebuilds
            self._drop(missing, "did not enter the weight round")
            self.store.set(f"{rk}/start", json.dumps({"go": False}))

    def _begin_store_copy(self) -> float:
        """The host arena is reused for every published version, so the previous version must be
        in the store before this one's copy starts; returns the seconds spent waiting for it."""
        tw = time.perf_counter()
        self.flush()
        publish_wait_s = time.perf_counter() - tw
        self.arena.begin()
        return publish_wait_s

    def _send_buckets(self, weights: WeightsInput, members: list[str], rk: str,
                      store_copy: list[tuple[dict[str, Any], torch.Tensor]] | None,
                      timer: PhaseTimer | None = None) -> _Sent:
        """Packs and broadcasts the buckets, bucket i packed while bucket i-1 is on the wire, each
        under its own `timeout_s` deadline. After a failure (or with no members) the remaining
        buckets are still packed, and copied for the store, but not sent: the iterator must be
        consumed to the end (ZeRO-3 gathers are collective across learner ranks). The store copy
        of a bucket is taken after its broadcast is posted, so it overlaps the bucket's wire time
        instead of delaying it. `timer` gets the phases export / pack / store_copy / fingerprint / wire."""
        timer = timer if timer is not None else PhaseTimer(self.device)
        sent = _Sent()
        work = None  # the collective of the previous bucket (the Work object holds its tensor)
        bucket_deadline = 0.0
        if self.device is not None:
            torch.cuda.set_device(self.device)  # before the exporter's gathers and our sends
        # export = time inside the exporter's iterator; pack = the rest of pack_buckets (exclusive spans)
        buckets = timer.timed_iter("pack", pack_buckets(timer.timed_iter("export", weights), self.bucket_bytes),
                                   device=True)
        side = torch.cuda.Stream(self.device) if self.device is not None and store_copy is not None else None
        for i, (manifest, flat) in enumerate(buckets):
            sent.nbytes += flat.numel() * flat.element_size()
            sent.nbuckets += 1
            if self.device is not None and flat.device != self.device:
                with timer.span("pack", device=True):
                    flat = flat.to(self.device)
            if store_copy is not None and not self.store_copy_overlap:  # the copy before the bucket goes out
                with timer.span("store_copy", device=True):
                    store_copy.append((manifest, self.arena.copy(flat)))
            if members and sent.failed_at is None:
                work, bucket_deadline = self._send_bucket(i, manifest, flat, work, bucket_deadline, rk, sent, timer)
            if store_copy is not None and self.store_copy_overlap:  # after it is posted: beside its wire time
                with timer.span("store_copy", device=True):
                    store_copy.append((manifest, self._store_copy(flat, side)))
        if side is not None:  # the publisher's ready event is recorded on the current stream
            torch.cuda.current_stream(self.device).wait_stream(side)
        if members and sent.failed_at is None:
            try:
                if work is not None:
                    with timer.span("wire"):
                        wait_work(work, bucket_deadline)
            except Exception as exc:  # noqa: BLE001
                sent.failed_at = sent.nbuckets - 1
                log.warning("weight sync: last bucket failed: %s", exc)
        return sent

    def _send_bucket(self, i: int, manifest: dict[str, Any], flat: torch.Tensor, work: Any, deadline: float,
                     rk: str, sent: _Sent, timer: PhaseTimer) -> tuple[Any, float]:
        """Fingerprint bucket i, wait for bucket i-1's collective, write i's header and post its
        broadcast; returns (its Work, its deadline). A failure marks `sent.failed_at`."""
        with timer.span("fingerprint", device=True):
            sent.fingerprint.update(bucket_fingerprint(manifest, flat))
        on_wire = i - 1
        try:
            with timer.span("wire"):
                if work is not None:  # overlap: pack bucket i while bucket i-1 is on the wire
                    wait_work(work, deadline)
                on_wire = i
                self.store.set(f"{rk}/h{i}", json.dumps(manifest))
                work = self.pg.broadcast([flat], dist.BroadcastOptions())  # root 0 by default
                return work, time.monotonic() + self.timeout_s
        except Exception as exc:  # noqa: BLE001 - the watchdog path
            sent.failed_at = on_wire
            log.warning("weight sync: broadcast of bucket %d failed: %s", on_wire, exc)
            return None, 0.0

    def _store_copy(self, flat: torch.Tensor, side: torch.cuda.Stream | None) -> torch.Tensor:
        """The WeightStore's host copy of a bucket already posted to the wire (the collective only
        reads it). On a GPU it is queued on a side stream, so neither the next bucket's packing nor
        the broadcast waits behind the device-to-host copy."""
        if side is None:
            return self.arena.copy(flat)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            out = self.arena.copy(flat)
        flat.record_stream(side)
        return out

    def _end_round(
        self, members: list[str], rk: str, version: int, sent: _Sent, timer: PhaseTimer | None = None
    ) -> tuple[list[str], float | None]:
        """Closes the round with its end header (bucket count, fingerprint), then collects the
        acks; members that nack or do not ack in `timeout_s` are dropped. After a failed bucket
        the group is aborted first (NCCL: frees the stuck kernels) and the members that stopped
        heartbeating are dropped as the culprits. Returns (acked members, seconds from the
        failure to the culprits being dropped, or None)."""
        failed_at = sent.failed_at
        acked: list[str] = []
        missing: list[str] = []
        failed_s = None
        if failed_at is not None:
            # find who stopped responding while the live members still heartbeat, then tell them
            # the round is over
            t_fail = time.monotonic()
            self._destroy_group()
            missing = self._unresponsive(members, rk)
            self.store.set(f"{rk}/abort", "1")
            failed_s = time.monotonic() - t_fail
        end = {"end": True, "version": version, "buckets": sent.nbuckets, "failed": failed_at is not None,
               "fingerprint": sent.fingerprint}
        timer = timer if timer is not None else PhaseTimer()
        # after a failure, members that got bucket `failed_at` wait for header failed_at + 1
        with timer.span("end"):
            self.store.set(f"{rk}/h{sent.nbuckets if failed_at is None else failed_at + 1}", json.dumps(end))
        if failed_at is None:
            with timer.span("ack_wait"):
                missing = self._wait_keys({m: f"{rk}/ack/{m}" for m in members},
                                          time.monotonic() + self.timeout_s)
                # nacks
                missing += [m for m in members if m not in missing and self.store.get(f"{rk}/ack/{m}") != b"1"]
            acked = [m for m in members if m not in missing]
        if missing:
            self._drop(missing, "hung in the weight broadcast" if failed_at is not None else "did not ack")
        if failed_at is not None:
            self._dirty = True  # the group is broken for everyone; rebuild next time
        return acked, failed_s

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
        self.arena.close()

