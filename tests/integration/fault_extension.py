"""The vLLM worker extension the engine tests build their engine with
(`PolicyEngine(..., worker_extension="fault_extension.FaultInjectingExtension")`): asyncrl's own
`WeightReceiverExtension` plus what only tests call through `collective_rpc` — arming a fault
(`weight_faults.InjectedFaults`) on every receiver of the worker, on both weight paths, and
reading the model's parameters back. vLLM imports it by name in its engine-core process, which
inherits the test process's `sys.path`."""

from __future__ import annotations

import hashlib

import torch
from weight_faults import InjectedFaults

from asyncrl.actors.worker_extension import AsyncrlTransferEngine, WeightReceiverExtension


class FaultInjectingExtension(WeightReceiverExtension):
    def asyncrl_inject_fault(self, kind: str, count: int = 1) -> None:
        """Arm `kind` (see `InjectedFaults`) in this worker's one `InjectedFaults`, made the round
        hook of every receiver it has and will make: the extension's and the native engine's."""
        faults = self.__dict__.get("asyncrl_round_hook")
        if not isinstance(faults, InjectedFaults):
            faults = self.asyncrl_round_hook = InjectedFaults()
        receivers = list(self.__dict__.get("_asyncrl_receivers", {}).values())
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, AsyncrlTransferEngine):
            engine.round_hook = faults
            receivers += engine.receivers.values()
        for receiver in receivers:
            receiver.hook = faults
        faults.arm(kind, count)

    def asyncrl_param_digests(self) -> dict[str, str]:
        """SHA-256 of every parameter's bytes (is the model bit-identical to a version)."""
        return {n: hashlib.sha256(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                for n, p in self.model_runner.get_model().named_parameters()}

    def asyncrl_param_sums(self) -> dict[str, float]:
        """Sum of every parameter (did the update reach the model at all)."""
        return {n: float(p.detach().double().sum()) for n, p in self.model_runner.get_model().named_parameters()}
