"""The replay buffer's bookkeeping, without sockets: admission tickets, the staleness bound, oldest-first
delivery, capacity, dynamic-sampling filter, counters and stats. Single-threaded; the server holds a lock.

Rules (AReaL's admission rule, asyncrl's hard bound):
- Admission: a ticket is granted while ``consumed + buffered + in_flight < (v + max_staleness + 1) * B``
  (v = learner version, B = groups per learner step). Groups dropped (stale or filtered) leave the
  sum, so their slots are re-granted and replacement work is generated.
- Tickets of dead or stuck producers do not leak: each ticket is a lease of ``ticket_lease_s``; an
  expired ticket frees its slot (counted ``buffer/tickets_expired``). A group pushed later with an
  expired ticket is still accepted (counted ``buffer/late_pushes``): work is not thrown away, and the
  hard bound below still holds.
- Drift pacing (``buffer.staleness=drift``): the admission rule uses ``admission_staleness`` <=
  ``max_staleness`` instead, lowered by one while the learner's measured drift KL(mu || pi_prox)
  per sequence is
  over its budget and raised by one while it is under half of it (`observe_drift`). It paces what
  is generated; nothing already generated is dropped for it, and delivery keeps the hard bound.
- Hard bound: a group with ``v - min_version > max_staleness`` is never delivered; it is dropped and
  counted (``buffer/dropped_stale``) at ingest, when v changes, and before every delivery. Groups
  dropped or filtered at ingest are never stored, so they are not in ``ingested``:
  ``ingested == consumed + buffered + (dropped_stale - dropped_stale_at_ingest)``.
- Order: oldest policy version first (``min_version``, then arrival). Each group is delivered once;
  a ticket's group is stored once (a retried push with the same ticket answers ``duplicate``; so
  does a push with a released ticket). Tickets still unfinished at snapshot time are restored as
  expired: their slot is free, a late push with them is accepted.
- Groups already stale at ingest or rejected by the DAPO filter (mean reward outside (low, high))
  are answered ``stale``/``filtered``, counted, and their ticket is done.
- Capacity: at most ``capacity_groups`` groups and ``capacity_bytes`` bytes; beyond, a push is
  answered ``full`` and nothing is stored (its ticket stays in flight so the producer can retry).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.protocol import Group
from asyncrl.replay.mix import GroupMix, difficulty_bucket


class UnknownTicket(ValueError):
    """A push or release names a ticket this buffer never granted."""


@dataclass(slots=True)
class StoredGroup:
    """A buffered group: its encoded frame (forwarded as is, never re-encoded) and what the rules need."""

    seq: int
    min_version: int
    max_version: int
    blob: Any  # bytes-like (bytes, memoryview, zmq.Frame buffer)
    nbytes: int
    stored_at: float  # time.time()
    ticket: int = -1
    prompt_index: int = -1  # the coordinator's draw index (metadata["prompt_index"]), -1 if absent
    length: float = 0.0  # mean policy tokens per sample (length statistics of dropped vs trained)
    difficulty: str = ""  # `asyncrl.replay.mix.difficulty_bucket` (generated vs delivered counts)
    uid: str = ""  # the group's prompt uid (names it in reports of a damaged log record)


@dataclass(slots=True)
class _Lease:
    granted_at: float
    expires_at: float
    actor_id: str


COUNTERS = ("ingested", "consumed", "dropped_stale", "dropped_filtered", "rejected_malformed",
            "rejected_full", "rejected_oversized", "rejected_schema", "rejected_unknown_ticket",
            "duplicates", "late_pushes", "untracked_pushes", "tickets_granted", "tickets_released",
            "tickets_expired", "tickets_timed_out", "reply_failures", "requeued", "filter_missing_key",
            "internal_errors", "restarts", "recovered_groups", "dropped_stale_at_ingest", "loop_errors",
            "log_damaged_records", "log_lost_groups", "log_failures")
# Requests and groups refused by a bound or a rule, by reason (`buffer/refused/<reason>`).
REFUSALS = ("admin", "timeout", "num_groups", "ahead", "version", "ticket", "token_id", "logprob",
            "unauthenticated", "busy", "disk_full")
COUNTERS += tuple(f"refused/{r}" for r in REFUSALS)


class BufferState:
    def __init__(self, *, max_staleness: int, batch_size: int, capacity_groups: int, capacity_bytes: int,
                 ticket_lease_s: float = 1800.0, filter_enable: bool = False, filter_key: str = "overall",
                 filter_low: float = 0.01, filter_high: float = 0.99) -> None:
        if batch_size <= 0 or max_staleness < 0:
            raise ValueError("batch_size must be > 0 and max_staleness >= 0")
        self.max_staleness, self.batch_size = max_staleness, batch_size
        self.admission_staleness = max_staleness  # drift pacing moves it within [0, max_staleness]
        self.capacity_groups, self.capacity_bytes = capacity_groups, capacity_bytes
        self.ticket_lease_s = ticket_lease_s
        self.filter = (filter_enable, filter_key, filter_low, filter_high)
        self.version = 0
        self.consumed = 0
        self.bytes = 0
        self.next_ticket = 0
        self._heap: list[tuple[int, int, StoredGroup]] = []
        self._seq = itertools.count()
        self.in_flight: dict[int, _Lease] = {}
        self._expired: set[int] = set()  # tickets whose lease ran out; a late push is still accepted
        self.counters: Counter[str] = Counter({k: 0 for k in COUNTERS})
        self.staleness_hist: Counter[int] = Counter()
        self._ingest_times: deque[float] = deque(maxlen=4096)
        self._serve_times: deque[float] = deque(maxlen=4096)
        self._waits: dict[str, deque[float]] = {"ticket": deque(maxlen=2048), "batch": deque(maxlen=2048),
                                                "age": deque(maxlen=2048)}
        self._started = time.time()
        self.last_stored: StoredGroup | None = None  # the group the latest `ingest` stored
        self._undo: tuple[int, _Lease | None, bool, str] | None = None  # how to take `last_stored` back
        self.mutations = 0  # bumped by every change the durable log must record
        self._removed: list[int] = []  # seqs taken or dropped since the last durable record
        self.dropped_prompts: list[tuple[int, float]] = []  # (prompt index, length) of stale drops, not yet re-issued
        self.mix = GroupMix()  # groups by kind x difficulty / length (buffer/mix/...)

    # ------------------------------------------------------------------------------ admission
    @property
    def buffered(self) -> int:
        return len(self._heap)

    def admission_limit(self) -> int:
        return (self.version + self.admission_staleness + 1) * self.batch_size

    def observe_drift(self, drift: float, budget: float) -> int:
        """One step's measured drift (KL(mu || pi_prox) per trained sequence) against `budget`:
        admission_staleness - 1 when over it, + 1 when under half of it (the gap keeps it from
        flapping on noise), within [0, max_staleness]. Returns the new value."""
        if drift > budget:
            self.admission_staleness = max(0, self.admission_staleness - 1)
        elif drift < budget / 2:
            self.admission_staleness = min(self.max_staleness, self.admission_staleness + 1)
        return self.admission_staleness

    def can_admit(self) -> bool:
        return self.consumed + self.buffered + len(self.in_flight) < self.admission_limit()

    def grant(self, actor_id: str = "", now: float | None = None) -> int | None:
        now = time.time() if now is None else now
        self.expire(now)
        if not self.can_admit():
            return None
        ticket = self.next_ticket
        self.next_ticket += 1
        self.in_flight[ticket] = _Lease(now, now + self.ticket_lease_s, actor_id)
        self.counters["tickets_granted"] += 1
        self.mutations += 1
        return ticket

    def release(self, ticket: int) -> bool:
        """Frees an abandoned ticket's slot. False if it was not in flight (already used/expired)."""
        if not 0 <= ticket < self.next_ticket:
            raise UnknownTicket(f"ticket {ticket} was never granted")
        self._expired.discard(ticket)
        if self.in_flight.pop(ticket, None) is None:
            return False
        self.counters["tickets_released"] += 1
        self.mutations += 1
        return True

    def release_actor(self, actor_id: str) -> int:
        """Frees every ticket leased to `actor_id` (a dead producer whose prompts are re-issued)."""
        held = [t for t, lease in self.in_flight.items() if lease.actor_id == actor_id]
        for t in held:
            self.release(t)
        return len(held)

    def expire(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        dead = [t for t, lease in self.in_flight.items() if lease.expires_at <= now]
        for t in dead:
            del self.in_flight[t]
            self._expired.add(t)
        self.counters["tickets_expired"] += len(dead)
        self.mutations += bool(dead)
        return len(dead)

    # ------------------------------------------------------------------------------ ingest
    def ingest(self, group: Group, blob: Any, ticket: int = -1, now: float | None = None) -> str:
        """Stores a validated group; returns the PushReply status (stored/duplicate/filtered/stale/full)."""
        now = time.time() if now is None else now
        if ticket >= self.next_ticket:
            self.counters["rejected_unknown_ticket"] += 1
            raise UnknownTicket(f"ticket {ticket} was never granted")
        if ticket >= 0 and ticket not in self.in_flight and ticket not in self._expired:
            self.counters["duplicates"] += 1
            return "duplicate"
        drop = "stale" if self.version - group.min_version > self.max_staleness else (
            None if self._keep(group) else "filtered")
        nbytes = len(blob)
        if drop is None and (self.buffered >= self.capacity_groups or self.bytes + nbytes > self.capacity_bytes):
            self.counters["rejected_full"] += 1
            return "full"
        lease, was_expired, how = None, False, "untracked_pushes"
        if ticket < 0:
            self.counters["untracked_pushes"] += 1
        elif (lease := self.in_flight.pop(ticket, None)) is None:
            was_expired, how = ticket in self._expired, "late_pushes"
            self._expired.discard(ticket)
            self.counters["late_pushes"] += 1
        else:
            how = ""
        self.mutations += 1
        index, length = _prompt_index(group), _group_length(group)
        difficulty = difficulty_bucket(group)
        self.mix.add("generated", difficulty, length)
        if drop is not None:
            self.counters["dropped_" + drop] += 1
            self.mix.add("dropped_" + drop, difficulty, length)
            if drop == "stale":  # counted in dropped_stale too; never part of `ingested`
                self.counters["dropped_stale_at_ingest"] += 1
                if index >= 0:
                    self.dropped_prompts.append((index, length))
            return drop
        sg = StoredGroup(next(self._seq), group.min_version, group.max_version, blob, nbytes, now, ticket,
                         index, length, difficulty, group.prompt_uid)
        heapq.heappush(self._heap, (sg.min_version, sg.seq, sg))
        self.last_stored = sg
        self._undo = (ticket, lease, was_expired, how)
        self.bytes += nbytes
        self.counters["ingested"] += 1
        self._ingest_times.append(now)
        return "stored"

    def unstore(self, sg: StoredGroup) -> None:
        """Takes back the group the latest `ingest` stored (its durable record could not be
        written): the buffer is as if the push never arrived, its ticket in flight again."""
        if sg is not self.last_stored or self._undo is None:
            raise ValueError("only the group stored by the latest ingest can be taken back")
        ticket, lease, was_expired, how = self._undo
        self._heap.remove((sg.min_version, sg.seq, sg))
        heapq.heapify(self._heap)
        self.bytes -= sg.nbytes
        self.counters["ingested"] -= 1
        if how:
            self.counters[how] -= 1
        if lease is not None:
            self.in_flight[ticket] = lease
        if was_expired:
            self._expired.add(ticket)
        self.mix.add("generated", sg.difficulty, sg.length, sign=-1)
        if self._ingest_times:
            self._ingest_times.pop()
        self.last_stored, self._undo = None, None
        self.mutations += 1

    def _keep(self, group: Group) -> bool:
        enable, key, low, high = self.filter
        if not enable:
            return True
        values = []
        for s in group.samples:
            if key in s.reward_parts:
                values.append(s.reward_parts[key])
            elif key in ("overall", "reward"):
                values.append(s.reward)
            else:
                self.counters["filter_missing_key"] += 1
                return True
        return low < float(np.mean(values)) < high

    # ------------------------------------------------------------------------------ delivery
    def set_version(self, version: int) -> int:
        """Sets the learner version v and drops what became stale; returns the number dropped."""
        self.mutations += int(version) != self.version
        self.version = int(version)
        return self.drop_stale()

    def drop_stale(self, at: int | None = None) -> int:
        """Drops the groups stale at version v (or at the later version `at` a prefetch trains at:
        learner versions only grow, so those groups can never be delivered)."""
        v = self.version if at is None else max(self.version, int(at))
        n = 0
        while self._heap and v - self._heap[0][0] > self.max_staleness:
            _, _, sg = heapq.heappop(self._heap)
            self.bytes -= sg.nbytes
            self._removed.append(sg.seq)
            if sg.prompt_index >= 0:
                self.dropped_prompts.append((sg.prompt_index, sg.length))
            self.mix.add("dropped_stale", sg.difficulty, sg.length)
            n += 1
        self.counters["dropped_stale"] += n
        self.mutations += bool(n)
        return n

    def take_dropped(self) -> list[tuple[int, float]]:
        """(prompt index, length) of every group dropped stale since the previous call: the
        coordinator re-issues these prompts, so a stale drop never skips a prompt."""
        out, self.dropped_prompts = self.dropped_prompts, []
        self.mutations += bool(out)
        return out

    def take(self, num_groups: int, now: float | None = None, at: int | None = None) -> list[StoredGroup]:
        """Pops up to num_groups groups, oldest version first, all within the staleness bound at
        v (or at the later version `at` they will be trained at, for a prefetch)."""
        now = time.time() if now is None else now
        v = self.version if at is None else max(self.version, int(at))
        self.drop_stale(v)
        out = [heapq.heappop(self._heap)[2] for _ in range(min(num_groups, len(self._heap)))]
        for sg in out:
            self.bytes -= sg.nbytes
            self._removed.append(sg.seq)
            self.staleness_hist[v - sg.min_version] += 1
            self.mix.add("delivered", sg.difficulty, sg.length)
            self._waits["age"].append(now - sg.stored_at)
            self._serve_times.append(now)
        self.consumed += len(out)
        self.counters["consumed"] += len(out)
        self.mutations += bool(out)
        return out

    def requeue(self, groups: list[StoredGroup]) -> None:
        """Undoes a `take` whose reply could not be sent (the groups were not delivered)."""
        requeued = {sg.seq for sg in groups}
        self._removed = [seq for seq in self._removed if seq not in requeued]
        self.mutations += bool(groups)
        for sg in groups:
            heapq.heappush(self._heap, (sg.min_version, sg.seq, sg))
            self.bytes += sg.nbytes
            self.staleness_hist[self.version - sg.min_version] -= 1
            self.mix.add("delivered", sg.difficulty, sg.length, sign=-1)
        self.consumed -= len(groups)
        self.counters["consumed"] -= len(groups)
        self.counters["requeued"] += len(groups)

    def groups(self) -> list[StoredGroup]:
        """Buffered groups in delivery order (for snapshots)."""
        return [sg for _, _, sg in sorted(self._heap)]

    def prompt_indices(self) -> list[int]:
        """Prompt indices of the buffered groups (what a buffer restart recovered)."""
        return sorted(sg.prompt_index for _, _, sg in self._heap if sg.prompt_index >= 0)

    def record_wait(self, kind: str, seconds: float) -> None:
        self._waits[kind].append(seconds)

    # ------------------------------------------------------------------------------ stats
    def stats(self, now: float | None = None, window_s: float = 30.0) -> dict[str, float]:
        """Flat `buffer/...` metrics: sizes, rates over the last window_s, counters, staleness
        histogram of delivered groups (`buffer/staleness/<lag>`), wait times."""
        now = time.time() if now is None else now
        out: dict[str, float] = {
            "buffer/size_groups": self.buffered, "buffer/size_mb": self.bytes / 2**20,
            "buffer/in_flight": len(self.in_flight), "buffer/version": self.version,
            "buffer/admission_limit": self.admission_limit(),
            "buffer/admission_staleness": float(self.admission_staleness),
            "buffer/admission_used": self.consumed + self.buffered + len(self.in_flight),
        }
        out.update({f"buffer/{k}": float(v) for k, v in sorted(self.counters.items())})
        out.update(self.mix.metrics())
        span = min(window_s, max(now - self._started, 1e-9))
        out["buffer/ingest_groups_per_s"] = sum(1 for t in self._ingest_times if now - t <= span) / span
        out["buffer/serve_groups_per_s"] = sum(1 for t in self._serve_times if now - t <= span) / span
        total = sum(self.staleness_hist.values())
        for lag in range(self.max_staleness + 1):
            out[f"buffer/staleness/{lag}"] = float(self.staleness_hist.get(lag, 0))
        out["buffer/staleness_mean"] = (sum(k * v for k, v in self.staleness_hist.items()) / total) if total else 0.0
        for kind, values in self._waits.items():
            arr = np.asarray(values, dtype=np.float64)
            name = {"ticket": "ticket_wait_s", "batch": "batch_wait_s", "age": "group_age_s"}[kind]
            out[f"buffer/{name}_mean"] = float(arr.mean()) if arr.size else 0.0
            out[f"buffer/{name}_p99"] = float(np.percentile(arr, 99)) if arr.size else 0.0
        return out

    # ------------------------------------------------------------------------------ snapshot
    def snapshot_header(self) -> dict[str, Any]:
        return {"version": self.version, "consumed": self.consumed, "next_ticket": self.next_ticket,
                "unfinished_tickets": sorted(set(self.in_flight) | self._expired),
                "counters": dict(self.counters), "staleness_hist": {str(k): v for k, v in self.staleness_hist.items()},
                "groups": [_meta(g) for g in self.groups()], "mix": self.mix.state()}

    def load(self, header: dict[str, Any], blobs: list[bytes]) -> None:
        """Replaces the whole state by a snapshot's (tickets in flight at snapshot time are not
        restored: their producers are gone; new ticket ids continue after the old ones)."""
        self.version, self.consumed = int(header["version"]), int(header["consumed"])
        self.next_ticket = int(header["next_ticket"])
        self.counters = Counter({k: 0 for k in COUNTERS})
        self.counters.update({str(k): int(v) for k, v in header["counters"].items()})
        self.staleness_hist = Counter({int(k): int(v) for k, v in header["staleness_hist"].items()})
        self.mix.restore(header.get("mix"))
        self.in_flight.clear()
        self._expired = {int(t) for t in header["unfinished_tickets"]}
        self._heap, self.bytes = [], 0
        for meta, blob in zip(header["groups"], blobs, strict=True):
            self._push_stored(meta, blob, next(self._seq))
        self.mutations += 1

    def _push_stored(self, meta: dict[str, Any], blob: Any, seq: int) -> None:
        sg = StoredGroup(seq, int(meta["min_version"]), int(meta["max_version"]), blob, len(blob),
                         float(meta["stored_at"]), int(meta["ticket"]), int(meta.get("prompt_index", -1)),
                         float(meta.get("length", 0.0)), str(meta.get("difficulty", "")), str(meta.get("uid", "")))
        heapq.heappush(self._heap, (sg.min_version, sg.seq, sg))
        self.bytes += sg.nbytes

    # ------------------------------------------------------------------------------ durable log
    def durable_header(self) -> dict[str, Any]:
        """What the durable log records after every change (asyncrl.replay.wal): the bookkeeping
        without the groups, the seqs of every live group (`live`: a damaged earlier record cannot
        resurrect a consumed group) and the seqs removed since the last logged header (kept until
        `logged` says the record was written)."""
        return {"version": self.version, "consumed": self.consumed, "next_ticket": self.next_ticket,
                "next_seq": self._next_seq(), "removed": list(self._removed),
                "live": sorted(sg.seq for _, _, sg in self._heap),
                "leases": [[t, lease.granted_at, lease.expires_at, lease.actor_id] for t, lease in self.in_flight.items()],
                "expired": sorted(self._expired), "counters": dict(self.counters),
                "staleness_hist": {str(k): v for k, v in self.staleness_hist.items()},
                "dropped_prompts": [list(d) for d in self.dropped_prompts], "mix": self.mix.state()}

    def logged(self, header: dict[str, Any]) -> None:
        """`header` (from `durable_header`) is in the log: forget the removals it recorded."""
        n = len(header["removed"])
        if self._removed[:n] == header["removed"]:
            del self._removed[:n]

    def group_meta(self, sg: StoredGroup) -> dict[str, Any]:
        return {**_meta(sg), "seq": sg.seq}

    def _next_seq(self) -> int:
        nxt = next(self._seq)
        self._seq = itertools.count(nxt)
        return nxt

    def recover(self, header: dict[str, Any], groups: list[tuple[dict[str, Any], Any]], *,
                lease_cap_s: float = 300.0, now: float | None = None) -> int:
        """Rebuilds the state a dead buffer process logged. Tickets it had leased stay leased (their
        producers are usually alive and push them), each for at most `lease_cap_s` more."""
        now = time.time() if now is None else now
        self.version, self.consumed = int(header["version"]), int(header["consumed"])
        self.next_ticket = int(header["next_ticket"])
        self.counters = Counter({k: 0 for k in COUNTERS})
        self.counters.update({str(k): int(v) for k, v in header["counters"].items()})
        self.staleness_hist = Counter({int(k): int(v) for k, v in header["staleness_hist"].items()})
        self.in_flight = {int(t): _Lease(float(g), min(float(e), now + lease_cap_s), str(a))
                          for t, g, e, a in header["leases"]}
        self._expired = {int(t) for t in header["expired"]}
        self.dropped_prompts = [(int(i), float(n)) for i, n in header.get("dropped_prompts", [])]
        self.mix.restore(header.get("mix"))
        self._heap, self.bytes = [], 0
        for meta, blob in groups:
            self._push_stored(meta, blob, int(meta["seq"]))
        self._seq = itertools.count(max([int(header["next_seq"])] + [int(m["seq"]) + 1 for m, _ in groups]))
        self._removed = []
        self.mutations += 1
        return len(groups)


def _meta(g: StoredGroup) -> dict[str, Any]:
    return {"min_version": g.min_version, "max_version": g.max_version, "nbytes": g.nbytes,
            "stored_at": g.stored_at, "ticket": g.ticket, "prompt_index": g.prompt_index, "length": g.length,
            "difficulty": g.difficulty, "uid": g.uid}


def _prompt_index(group: Group) -> int:
    try:
        return int(group.metadata.get("prompt_index", -1))
    except (TypeError, ValueError):
        return -1


def _group_length(group: Group) -> float:
    if not group.samples:
        return 0.0
    return float(sum(int(np.asarray(s.response_mask).sum()) for s in group.samples) / len(group.samples))
