"""Faults for the weight-receive tests, injected through the receiver's seam (`RoundHook`) so that
the real round breaks where a real one can: an element flipped on the wire, a stream cut after a
bucket, a load that silently left a wrong value. Plain torch (no vLLM): a receiver in any process
can take it; `fault_extension.py` arms it inside a vLLM engine's worker."""

from __future__ import annotations

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

