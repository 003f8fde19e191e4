"""The vLLM worker extension (`worker_extension_cls`) that loads broadcast weights into an engine.

It runs inside each engine worker (one weight-group member per tensor-parallel rank, since every
rank loads the full checkpoint-format tensors and shards them itself) around a plain
`asyncrl.weights.WeightReceiver`, and loads with vLLM's in-place, layer-wise
`model_runner.reload_weights(..., is_checkpoint_format=True)`, which also re-runs the CPU build's
weight repacking and handles fused/packed projections (qkv, gate_up) through the model's own
`load_weights`. Tied embeddings: the CPU build's repacked `lm_head` keeps the old embedding, so
after every load we re-tie it and re-run its post-load processing. It lives with the engine, not
in `asyncrl.weights`, because every line of it is written against vLLM's private worker API.

Every round is verified twice: the sampled elements that arrived against the sender's
fingerprint (exact, in the receiver), and, after the load, the model's own parameters that keep a
checkpoint name and size against what arrived (`readback_mismatches`); a mismatch is status
"fingerprint_mismatch" with `touched` set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from asyncrl.weights.receiver import WeightReceiver, readback_mismatches
from asyncrl.weights.wire import NamedTensor

log = logging.getLogger(__name__)


def load_into_vllm_model(model_runner: Any, weights: Iterator[NamedTensor]) -> None:
    """Load checkpoint-format (HF-named) tensors into a running vLLM model in place."""
    model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    model = model_runner.get_model()
    config = getattr(model, "config", None)
    head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    if config is not None and getattr(config, "tie_word_embeddings", False) and head is not None \
            and hasattr(inner, "embed_tokens") and hasattr(head, "quant_method"):
        head.weight = inner.embed_tokens.weight  # re-tie (layer-wise reload may swap the Parameter)
        head.quant_method.process_weights_after_loading(head)  # CPU build: repack the head



class WeightReceiverExtension:
    """vLLM worker extension: `collective_rpc("asyncrl_receive_weights", args=(address, prefix,
    timeout_s))`. Members are named `{prefix}/tp{rank}`. Returns the receiver's result dict."""

    def _asyncrl_receiver(self, address: str, prefix: str, timeout_s: float) -> WeightReceiver:
        receivers = self.__dict__.setdefault("_asyncrl_receivers", {})
        key = (address, prefix)
        if key not in receivers:
            device = getattr(self, "device", None)
            device = device if isinstance(device, torch.device) and device.type == "cuda" else None
            receivers[key] = WeightReceiver(address, f"{prefix}/tp{getattr(self, 'rank', 0)}", timeout_s, device)
        return receivers[key]

    def asyncrl_receive_weights(self, address: str, prefix: str, timeout_s: float,
                                buffered: bool = True) -> dict[str, Any]:
        """Receive one round and load it; then verify what the model holds against what arrived
        (`readback_mismatches`). Result: the receiver's dict plus `touched` (the model may hold
        part of the round: the caller must reload a full version before generating) and
        `fingerprint_mismatch` (tensors whose sampled elements disagree)."""
        receiver = self._asyncrl_receiver(address, prefix, timeout_s)
        faults = self.__dict__.setdefault("_asyncrl_faults", {})
        if faults.get("receiver"):
            receiver.fault = faults.pop("receiver")
        result = receiver.receive(lambda it: load_into_vllm_model(self.model_runner, it), buffered=buffered)
        result.pop("tensors", None)
        if result["status"] == "ok":
            model = self.model_runner.get_model()
            if faults.get("readback", 0) > 0:  # tests: a load that silently left a wrong value
                faults["readback"] -= 1
                with torch.no_grad():
                    dict(model.named_parameters())["model.norm.weight"].view(-1)[:].add_(1.0)
            t = time.perf_counter()
            bad, checked = readback_mismatches(model, receiver.samples)
            result.update(readback_checked=checked, readback_s=time.perf_counter() - t)
            if bad:
                log.error("weights: %d parameters differ from what arrived after the load (e.g. %s)", len(bad), bad[0])
                result.update(status="fingerprint_mismatch", fingerprint_mismatch=len(bad), touched=True)
        return result

    def asyncrl_inject_fault(self, kind: str, count: int = 1) -> None:
        """Tests only: "fail_mid_stream" / "corrupt_wire" break the next received round;
        "readback" perturbs model.norm.weight after each of the next `count` loads."""
        faults = self.__dict__.setdefault("_asyncrl_faults", {})
        if kind == "readback":
            faults["readback"] = count
        else:
            faults["receiver"] = kind

    def asyncrl_close_receiver(self, address: str, prefix: str) -> None:
        self.__dict__.get("_asyncrl_receivers", {}).pop((address, prefix), None)

    def asyncrl_param_sums(self) -> dict[str, float]:
        """Sum of every parameter (tests: did the update reach the model at all)."""
        return {n: float(p.detach().double().sum()) for n, p in self.model_runner.get_model().named_parameters()}
