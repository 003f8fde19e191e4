"""`PhaseTimer`: where one weight round's time goes, phase by phase, on both sides of the wire.

Phases are exclusive slices of the round's own timeline: a span opened inside another (the
exporter's gathers inside `pack_buckets`, the receiver's wire wait inside a streaming loader) is
subtracted from the outer one, so the phases of a round add up to the round (`other` = what no
span covered: bookkeeping between spans, the Python around them).

On a GPU the work of some phases (pack, store copy, fingerprint, the receive-side copies) is
queued on a CUDA stream: the host returns at once and the device time shows up later, in
whichever wait comes next. Those spans are opened with `device=True`: with a CUDA device they
record a pair of CUDA events on the current stream, and the phase reports the events' elapsed
time (resolved once, at `seconds()`, with one synchronize) instead of the host's launch time.
Waits for remote parties (members entering, the collective, acks, headers) are host time on
every device: that is what the round waits for. On a GPU the phases therefore need not add up
exactly (device work can overlap a host wait); `other` is clipped at 0.

The event type is a parameter so that the same bookkeeping runs in the CPU tests with a stand-in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# Phase names, in round order; each side's report carries these keys (seconds) plus `other` and `round`.
SENDER_PHASES = ("open", "publish_wait", "export", "pack", "store_copy", "fingerprint", "wire", "end", "ack_wait",
                 "publish")
"""open: announce, join requests, members entering the round (and a rebuild); publish_wait: the
previous store copy still being published (the arena is reused); export: the learner's
gather/export of the tensors; pack: flattening them into buckets (and host-to-device); store_copy:
the WeightStore's host copy; fingerprint: sampling the integrity fingerprint; wire: bucket headers
and the collectives; end: the end header; ack_wait: waiting for every member's ack; publish:
handing the store copy to the publisher."""
RECEIVER_PHASES = ("enter", "header_wait", "wire", "sample", "load", "retie", "check", "ack", "finalize", "readback",
                   "trim")
"""enter: joining the generation and waiting for the round to start; header_wait: polling each
bucket's header; wire: the bucket's buffer and its collective; sample: the fingerprint's elements
of what arrived; load: the engine taking the tensors (vLLM's reload); retie: a tied head re-pointed
at the reloaded embedding and re-processed (the CPU build repacks it); check: the wire fingerprint;
ack; finalize: the native path's `finish_weight_update` (finalise the layer-wise reload, re-tie);
readback: the loaded model's parameters against what arrived; trim: the engine giving the round's
freed buffers back to the system (`asyncrl.small_machine.process.release_free_heap`)."""
ENGINE_PHASES = ("pause", "round", "recover", "reset_cache", "resume")
"""The engine around a round (`PolicyEngine._paused`, plus `total`): pausing generation, the
round (the receiver's phases happen inside it, in the worker), reloading the store's version after
a failed round, resetting the prefix cache, resuming."""


class PhaseTimer:
    """Exclusive seconds by phase for one round. `device`: a CUDA device turns `device=True`
    spans into CUDA-event timings; `event_factory` builds the events (default `torch.cuda.Event`)."""

    def __init__(self, device: torch.device | None = None,
                 event_factory: Callable[[], Any] | None = None) -> None:
        self.t0 = time.perf_counter()
        self.host: dict[str, float] = {}
        self._stack: list[list[Any]] = []  # [name, start, time spent in nested spans]
        self._events: list[tuple[str, Any, Any]] = []
        use_events = device is not None and torch.device(device).type == "cuda"
        if use_events and event_factory is None:
            event_factory = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        self._event_factory = event_factory if use_events else None
        self.ended: float | None = None

    @property
    def uses_events(self) -> bool:
        return self._event_factory is not None

    @contextmanager
    def span(self, name: str, *, device: bool = False) -> Iterator[None]:
        """Time the block as phase `name` (added to what the phase already has)."""
        ev = None
        if device and self._event_factory is not None:
            ev = (self._event_factory(), self._event_factory())
            ev[0].record()
        frame = [name, time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            elapsed = time.perf_counter() - frame[1]
            self.host[name] = self.host.get(name, 0.0) + elapsed - frame[2]
            if self._stack:
                self._stack[-1][2] += elapsed
            if ev is not None:
                ev[1].record()
                self._events.append((name, *ev))

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` measured elsewhere (e.g. by another process) as phase `name`."""
        self.host[name] = self.host.get(name, 0.0) + float(seconds)

    def timed_iter(self, name: str, items: Iterable[Any], *, device: bool = False) -> Iterator[Any]:
        """`items`, with the time spent producing each one counted as phase `name`."""
        it = iter(items)
        while True:
            with self.span(name, device=device):
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item

    def end(self) -> None:
        """The round is over (its seconds stop here)."""
        self.ended = time.perf_counter()

    def seconds(self) -> dict[str, float]:
        """Phase -> seconds, plus `round` (start to `end()`, or to now) and `other` (the round
        minus every phase, >= 0). Device-timed phases report their CUDA events' time."""
        out = dict(self.host)
        if self._events:
            self._events[-1][2].synchronize()
            device: dict[str, float] = {}
            for name, start, stop in self._events:
                device[name] = device.get(name, 0.0) + start.elapsed_time(stop) / 1e3
            out.update(device)
        total = (self.ended if self.ended is not None else time.perf_counter()) - self.t0
        out["other"] = max(0.0, total - sum(out.values()))
        out["round"] = total
        return out


def merge_phases(*parts: dict[str, float] | None) -> dict[str, float]:
    """Phases of several timers of one round, summed by name (e.g. a receiver's and the worker's)."""
    out: dict[str, float] = {}
    for part in parts:
        for k, v in (part or {}).items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


def add_phase(result: dict[str, Any], name: str, seconds: float) -> None:
    """Count `seconds` spent after a receiver's round (finalize, readback) into its result's
    `phases`, the round included, so the phases still add up."""
    phases = result.setdefault("phases", {})
    phases[name] = phases.get(name, 0.0) + seconds
    phases["round"] = phases.get("round", 0.0) + seconds
