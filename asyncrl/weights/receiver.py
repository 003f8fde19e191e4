"""`WeightReceiver`: one member's side of the weight broadcast (protocol in the `asyncrl.weights`
package docstring).

It is plain torch (usable from any process: engine workers, tests, benchmarks): it joins the
sender's current generation, enters a round, receives the flat per-dtype buckets (one collective
each) and hands the named tensors to a loader, then acks. It never blocks longer than `timeout_s`
per wait. A receiver that is not (or no longer) a member asks to rejoin and returns `not_member`;
the caller then catches up from the `WeightStore` copy.

By default all buckets are received before the first one is loaded (`buffered=True`), so a
failed or aborted broadcast leaves the loader's model untouched. Streaming (`buffered=False`: no
second copy of the model) hands buckets to the loader as they arrive; the result then says
`touched`, and the caller must reload a full version before using the model. Every round's
sampled elements are checked against the sender's fingerprint (exact); `readback_mismatches`
checks, after a load, what a model holds against what arrived.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch

from asyncrl.weights.group import (
    CollectiveTimeout,
    NcclEnvMismatch,
    abort_group,
    backstop_timeout,
    connect_group,
    group_store,
    join_request,
    make_group,
    make_store,
    wait_work,
)
from asyncrl.weights.nccl_env import cumem_mismatch, nccl_cumem
from asyncrl.weights.phases import PhaseTimer
from asyncrl.weights.wire import (
    PREFIX,
    NamedTensor,
    dtype_from_name,
    fingerprint_mismatches,
    fingerprint_of,
    sample_values,
    unpack_bucket,
)

log = logging.getLogger(__name__)
SECRET_ENV = "ASYNCRL_WEIGHTS_SECRET"


class ReceiveTimeout(RuntimeError):
    pass


class RoundHook:
    """A seam inside a receive round, called at the points where a real round can go wrong: a
    bucket arrives, the loader has taken it, a caller has loaded the round into its model. Every
    method does nothing here, and production receivers run with this default; the tests of the
    failure handling subclass it to break a round at a chosen point (a flipped element, a
    stream cut after a bucket, a load that left a wrong value) through the real code path."""

    def bucket_arrived(self, index: int, views: list[NamedTensor]) -> None:
        """Bucket `index` is here, before its elements are sampled for the wire check (`views`
        may be changed in place)."""

    def bucket_loaded(self, index: int) -> None:
        """The loader took bucket `index` (streamed: the model has it); raising breaks the round."""

    def model_loaded(self, model: Any) -> None:
        """A caller loaded the round into `model`, before checking it (`readback_mismatches`)."""


class RoundAborted(RuntimeError):
    """The sender gave up on the round (a member failed); the group is rebuilt."""


class WeightReceiver:
    """One member of the weight group. `address` = "host:port" of the sender's store."""

    def __init__(self, address: str, member_id: str, timeout_s: float = 60.0,
                 device: torch.device | str | None = None, hook: RoundHook | None = None,
                 secret: str | None = None) -> None:
        """`hook`: watches every round from the inside (`RoundHook`; the default does nothing).
        `secret`: the job's rendezvous secret, which signs a (re)join request (default: the
        `ASYNCRL_WEIGHTS_SECRET` environment variable the rollout actor sets for its engine)."""
        self.secret = secret if secret is not None else os.environ.get(SECRET_ENV) or None
        host, port = address.rsplit(":", 1)
        self.member_id = member_id
        self.timeout_s = float(timeout_s)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.host, self.port = host, int(port)
        self.store = make_store(host, self.port, is_master=False, timeout_s=self.timeout_s)
        self.generation = -1
        self.dead_generation = 0  # generations at or below this one are aborted/broken for us
        self.pg: Any = None
        self.buffer_device = torch.device("cpu")
        self.seq = 0
        self.version = -1
        self._requested_gen = -1
        self.samples = _Samples()  # sampled elements of the last round, by name
        self.timer = PhaseTimer(self.device)  # the phases of the current (or last) round
        self.hook = hook if hook is not None else RoundHook()

    # ---- small store helpers ----------------------------------------------------------------
    def _wait_get(self, key: str, deadline: float) -> bytes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ReceiveTimeout(key)
        try:
            self.store.wait([f"{PREFIX}/{key}"], timedelta(seconds=remaining))
        except Exception as exc:  # noqa: BLE001 - TCPStore raises a generic error on timeout
            raise ReceiveTimeout(key) from exc
        return self.store.get(f"{PREFIX}/{key}")

    def announced_version(self) -> int:
        """The newest version the sender has started to broadcast (-1 before the first)."""
        key = f"{PREFIX}/announce"
        return int(self.store.get(key)) if self.store.check([key]) else -1

    def _reset(self) -> None:
        self.dead_generation = max(self.dead_generation, self.generation)
        abort_group(self.pg, backstop_timeout(self.timeout_s).total_seconds())  # NCCL: frees a stuck kernel
        self.pg, self.generation = None, -1

    def _tick(self, rk: str) -> None:
        """Heartbeat while waiting inside a round (the sender drops members that fall silent),
        and give up at once when the sender has aborted the round."""
        self.store.add(f"{PREFIX}/{rk}/alive/{self.member_id}", 1)
        if self.store.check([f"{PREFIX}/{rk}/abort"]):
            raise RoundAborted(f"the sender aborted round {rk} (another member failed)")

    def _wait_header(self, rk: str, i: int, deadline: float) -> dict[str, Any]:
        """Poll for bucket header `i` (usually there already: the sender writes it as soon as
        bucket i-1 is through), heartbeating meanwhile."""
        key = f"{PREFIX}/{rk}/h{i}"
        delay, next_tick = 1e-4, time.monotonic() + 0.2
        while not self.store.check([key]):
            now = time.monotonic()
            if now >= deadline:
                raise ReceiveTimeout(key)
            if now >= next_tick:
                self._tick(rk)
                next_tick = now + 0.2
            time.sleep(delay)
            delay = min(2 * delay, 5e-3)
        return json.loads(self.store.get(key))

    def _join(self, deadline: float) -> bool:
        """Be a member of the current generation; False if the plan does not include us."""
        while True:
            g = int(self._wait_get("gen", deadline))
            if g == self.generation and self.pg is not None:
                return True
            if g <= self.dead_generation:
                if time.monotonic() > deadline:
                    raise ReceiveTimeout("new generation")
                time.sleep(0.005)
                continue
            plan = json.loads(self._wait_get(f"g{g}/plan", deadline))
            if self.member_id not in plan["members"] or self.store.check([f"{PREFIX}/g{g}/out/{self.member_id}"]):
                if self._requested_gen < 0:
                    # first time outside: ask to rejoin, and let the caller catch up from the store now
                    self._ask_to_join()
                    self._requested_gen = g
                    return False
                # a rejoin is pending: the sender takes us back at its next broadcast
                self.dead_generation = g
                continue
            self._requested_gen = -1
            nccl = plan["backend"] == "nccl"
            # our NCCL_CUMEM_ENABLE goes with the ready key: the sender refuses a group that disagrees
            self.store.set(f"{PREFIX}/g{g}/ready/{self.member_id}", json.dumps({"nccl_cumem": nccl_cumem()}))
            built = self._wait_get(f"g{g}/built", deadline)
            problem = nccl and cumem_mismatch(plan.get("nccl_cumem"), {self.member_id: nccl_cumem()}, "learner rank 0")
            if problem:
                raise NcclEnvMismatch(problem)
            if built != b"go":
                self.dead_generation = g
                continue
            if self._connect(g, plan, deadline):
                return True
            self.dead_generation = g

    def _ask_to_join(self) -> None:
        """Appends a (re)join request, signed with the job's secret."""
        n = self.store.add(f"{PREFIX}/joinreq_n", 1)
        self.store.set(f"{PREFIX}/joinreq/{n}", join_request(self.secret, n, self.member_id))

    def _connect(self, g: int, plan: dict[str, Any], deadline: float) -> bool:
        """Build generation g's group and its communicator (the first collective), heartbeating;
        False when the sender gave up on this generation (another member did not connect)."""
        rank = plan["members"].index(self.member_id) + 1
        nccl = plan["backend"] == "nccl"
        if nccl and self.device is not None:
            torch.cuda.set_device(self.device)
        self.buffer_device = self.device if nccl else torch.device("cpu")  # gloo: host buffers
        device = self.device if nccl else None
        try:
            self.pg = connect_group(
                lambda: make_group(group_store(self.host, self.port, self.timeout_s), g, rank, plan["world"],
                                   plan["backend"], self.timeout_s, device),
                device, deadline, backstop_timeout(self.timeout_s).total_seconds(),
                tick=lambda: self._tick(f"g{g}/connect"))
        except (RoundAborted, CollectiveTimeout, RuntimeError) as exc:
            log.warning("weight receiver %s: generation %d did not connect: %s", self.member_id, g, exc)
            self.pg = None
            if isinstance(exc, CollectiveTimeout):
                raise ReceiveTimeout(f"g{g}/connect") from exc
            return False
        self.generation, self.seq = g, 0
        return True

    # ---- receive ----------------------------------------------------------------------------
    def receive(self, load: Callable[[Iterator[NamedTensor]], Any] | None = None, *,
                timeout_s: float | None = None, buffered: bool = True) -> dict[str, Any]:
        """Take part in the next broadcast round. `load` gets an iterator of (name, tensor); with
        `load=None` the tensors are returned under "tensors" (a LoRA adapter). Returns a plain dict:
        status ("ok" | "not_member" | "timeout" | "failed"), version, seconds, bytes, and `phases`
        (seconds by `asyncrl.weights.phases.RECEIVER_PHASES`, plus `other` and `round`)."""
        self.timer = timer = PhaseTimer(self.device)
        t0 = timer.t0
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        result: dict[str, Any] = {"status": "ok", "version": self.version, "bytes": 0, "member": self.member_id}
        try:
            with timer.span("enter"):
                entered = self._enter_round(deadline)
        except ReceiveTimeout as exc:
            log.warning("weight receiver %s: timed out waiting for %s", self.member_id, exc)
            self._reset()
            result["status"] = "timeout"
            return result
        if entered is None:
            result["status"] = "not_member"
            return result
        seq, rk, start = entered
        # touched: the loader has seen tensors, so the model may hold part of this round
        stats: dict[str, Any] = {"bytes": 0, "end": None, "touched": False}
        self.samples = _Samples()
        try:
            tensors = self._take_round(self._buckets(rk, stats), stats, load, buffered)
        except Exception as exc:  # noqa: BLE001 - a failed round: report, reset, caller falls back
            self._fail_round(rk, exc)
            timer.end()
            result.update(status="failed", error=str(exc), seconds=time.perf_counter() - t0,
                          touched=stats["touched"], fingerprint_mismatch=getattr(exc, "mismatches", 0),
                          phases=timer.seconds())
            return result
        self.seq = seq
        self.version = int(start["version"])
        with timer.span("ack"):
            self.store.set(f"{PREFIX}/{rk}/ack/{self.member_id}", "1")
        timer.end()
        result.update(version=self.version, bytes=stats["bytes"], seconds=time.perf_counter() - t0,
                      touched=stats["touched"], fingerprint_mismatch=0, phases=timer.seconds())
        if load is None:
            result["tensors"] = tensors
        return result

    def _enter_round(self, deadline: float) -> tuple[int, str, dict[str, Any]] | None:
        """Join the current generation and enter its next round until the sender lets the round
        go; returns (seq, round key, the sender's start record), or None when not a member."""
        while True:
            if not self._join(deadline):
                return None
            seq = self.seq + 1
            rk = f"g{self.generation}/r{seq}"
            self.store.set(f"{PREFIX}/{rk}/enter/{self.member_id}", "1")
            start = json.loads(self._wait_get(f"{rk}/start", deadline))
            if start["go"]:
                return seq, rk, start
            self._reset()  # someone else was dropped: a new generation follows

    def _take_round(self, buckets: Iterator[list[NamedTensor]], stats: dict[str, Any],
                    load: Callable[[Iterator[NamedTensor]], Any] | None, buffered: bool) -> list[NamedTensor] | None:
        """Receive every bucket and hand the tensors to `load`: buffered, all of them after the
        round is complete and checked; streamed, as they arrive (then checked at the end).
        Raises on a failed or incomplete round; returns the tensors when buffered. Streamed, the
        bucket phases (header_wait, wire, sample) run inside `load` and are not counted twice."""
        timer = self.timer
        if buffered or load is None:
            tensors = [nt for bucket in buckets for nt in bucket]
            if stats["end"].get("failed"):
                raise RuntimeError("sender reported a failed broadcast")
            with timer.span("check"):
                self._check_wire(stats["end"])
            if load is not None:
                stats["touched"] = True
                with timer.span("load", device=True):
                    load(iter(tensors))
            return tensors
        stats["touched"] = True
        with timer.span("load", device=True):
            load(nt for bucket in buckets for nt in bucket)
        if stats["end"] is None or stats["end"].get("failed"):
            raise RuntimeError("broadcast incomplete")
        with timer.span("check"):
            self._check_wire(stats["end"])
        return None

    def _fail_round(self, rk: str, exc: Exception) -> None:
        """A failed round: nack it (the sender need not wait for our ack to drop us) and reset."""
        log.warning("weight receiver %s: round failed: %s", self.member_id, exc)
        try:
            self.store.set(f"{PREFIX}/{rk}/ack/{self.member_id}", "0")
        except Exception:  # noqa: BLE001 - the sender may be gone
            log.debug("weight receiver %s: nack not delivered", self.member_id, exc_info=True)
        self._reset()

    def _check_wire(self, end: dict[str, Any]) -> None:
        """The sampled elements that arrived equal the ones the sender sent (its fingerprint)."""
        got = {n: fingerprint_of(v) for n, v in self.samples.items()}
        bad = fingerprint_mismatches(end.get("fingerprint") or {}, got)
        if bad:
            exc = RuntimeError(f"fingerprint mismatch on {len(bad)} tensors received (e.g. {bad[0]})")
            exc.mismatches = len(bad)
            raise exc

    def _buckets(self, rk: str, stats: dict[str, Any]) -> Iterator[list[NamedTensor]]:
        # The sender decides who failed (its deadline is timeout_s per collective, then a short
        # heartbeat grace); ours is a backstop for a dead sender, so it comes later.
        patience = 2 * self.timeout_s + 2
        timer = self.timer
        i = 0
        while True:
            with timer.span("header_wait"):
                header = self._wait_header(rk, i, time.monotonic() + patience)
            if header.get("end"):
                stats["end"] = header
                return
            with timer.span("wire"):
                buf = torch.empty(header["numel"], dtype=dtype_from_name(header["dtype"]), device=self.buffer_device)
                wait_work(self.pg.broadcast([buf]), time.monotonic() + patience, tick=lambda: self._tick(rk))
                # progress only once the data is here (the sender's straggler search relies on it)
                self.store.set(f"{PREFIX}/{rk}/progress/{self.member_id}", str(i))
            stats["bytes"] += buf.numel() * buf.element_size()
            views = unpack_bucket(header, buf)
            self.hook.bucket_arrived(i, views)
            with timer.span("sample", device=True):
                for name, view in views:
                    self.samples[name] = sample_values(name, view)
                    self.samples.numels[name] = view.numel()
            yield views
            self.hook.bucket_loaded(i)
            i += 1

    def close(self) -> None:
        self.pg = None


_ANNOUNCE_STORES: dict[str, Any] = {}


def announced_version(address: str, timeout_s: float = 10.0) -> int:
    """The newest version the sender at `address` has started to broadcast (-1 before the
    first); a cheap store read, for a rollout actor deciding when to call its engine's update."""
    store = _ANNOUNCE_STORES.get(address)
    if store is None:
        host, port = address.rsplit(":", 1)
        store = _ANNOUNCE_STORES[address] = make_store(host, int(port), is_master=False, timeout_s=timeout_s)
    key = f"{PREFIX}/announce"
    return int(store.get(key)) if store.check([key]) else -1


def readback_mismatches(model: Any, samples: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    """Compare what the model now holds with what arrived, at the fingerprint's sampled
    elements: every model parameter that keeps its checkpoint name and size (norms, embeddings,
    untied heads, unfused projections; fused qkv/gate_up and tensor-parallel shards have no
    1:1 counterpart and are covered by the wire fingerprint only). The arrived values are cast to
    the parameter's dtype first, so the comparison is exact. Returns (mismatched names, checked)."""
    bad, checked = [], 0
    for name, p in model.named_parameters():
        got = samples.get(name)
        if got is None or p.is_meta:
            if got is not None:
                bad.append(name)  # left on the meta device: a half-finished reload
            continue
        if p.numel() != getattr(samples, "numels", {}).get(name, -1):
            continue  # a shard or a different layout: no element-wise counterpart
        checked += 1
        if not torch.equal(sample_values(name, p), got.to(p.dtype)):
            bad.append(name)
    return bad, checked


class _Samples(dict):
    """Sampled elements by name, plus the full size of each tensor they were drawn from."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: dict[str, int] = {}

