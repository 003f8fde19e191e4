"""Faults for the weight-receive tests, injected through the receiver's seam (`RoundHook`) so that
the real round breaks where a real one can: an element flipped on the wire, a stream cut after a
bucket, a load that silently left a wrong value. Plain torch at import (no vLLM): a receiver in
any process can take it. The functions at the end run inside a vLLM engine's worker, passed as
callables to `collective_rpc` (which calls them with the worker; on CPU the engine core and its
worker run in the test process): they arm faults on every receiver of the worker, on both
weight paths, and read the model's parameters back."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from asyncrl.weights.receiver import RoundHook
from asyncrl.weights.wire import NamedTensor, sample_index

KINDS = ("corrupt_wire", "fail_mid_stream", "readback")


class InjectedFaults(RoundHook):
    """Armed faults, each spent when it fires:
    - "corrupt_wire": the next bucket to arrive gets one element +1 where the fingerprint looks;
    - "fail_mid_stream": the next round breaks right after its loader took a bucket (the first);
    - "readback" (count n): each of the next n loads adds 1 to `model.norm.weight` afterwards."""

    def __init__(self, *kinds: str) -> None:
        self.armed = dict.fromkeys(KINDS, 0)
        for kind in kinds:
            self.arm(kind)

    def arm(self, kind: str, count: int = 1) -> None:
        if kind not in self.armed:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(KINDS)}")
        self.armed[kind] = count

    def _fire(self, kind: str) -> bool:
        if self.armed[kind] <= 0:
            return False
        self.armed[kind] -= 1
        return True

    def bucket_arrived(self, index: int, views: list[NamedTensor]) -> None:
        if self._fire("corrupt_wire"):
            name, view = views[0]
            view.view(-1)[int(sample_index(name, view.numel())[0])] += 1

    def bucket_loaded(self, index: int) -> None:
        if self._fire("fail_mid_stream"):
            raise RuntimeError(f"injected failure after bucket {index}")

    def model_loaded(self, model: Any) -> None:
        if self._fire("readback"):
            with torch.no_grad():
                dict(model.named_parameters())["model.norm.weight"].view(-1)[:].add_(1.0)


def _worker(wrapper: Any) -> Any:
    """The worker a `collective_rpc` callable runs on (vLLM hands it its worker wrapper)."""
    return getattr(wrapper, "worker", wrapper)


def inject_fault(wrapper: Any, kind: str, count: int = 1) -> None:
    """Arm `kind` (`InjectedFaults`) in the worker's one `InjectedFaults`, the round hook of every
    receiver it has and will make: the worker extension's and the native transfer engine's."""
    from asyncrl.actors.worker_extension import AsyncrlTransferEngine

    worker = _worker(wrapper)
    faults = worker.__dict__.get("asyncrl_round_hook")
    if not isinstance(faults, InjectedFaults):
        faults = worker.asyncrl_round_hook = InjectedFaults()
    receivers = list(worker.__dict__.get("_asyncrl_receivers", {}).values())
    engine = getattr(worker, "weight_transfer_engine", None)
    if isinstance(engine, AsyncrlTransferEngine):
        engine.round_hook = faults
        receivers += engine.receivers.values()
    for receiver in receivers:
        receiver.hook = faults
    faults.arm(kind, count)


def param_digests(wrapper: Any) -> dict[str, str]:
    """SHA-256 of every parameter's bytes (is the model bit-identical to a version)."""
    model = _worker(wrapper).model_runner.get_model()
    return {n: hashlib.sha256(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, p in model.named_parameters()}


def param_sums(wrapper: Any) -> dict[str, float]:
    """Sum of every parameter (did the update reach the model at all)."""
    return {n: float(p.detach().double().sum()) for n, p in _worker(wrapper).model_runner.get_model().named_parameters()}
