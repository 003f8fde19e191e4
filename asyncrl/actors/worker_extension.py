"""The vLLM worker extension (`worker_extension_cls`) that loads broadcast weights into an engine.

It runs inside each engine worker (one weight-group member per tensor-parallel rank, since every
rank loads the full checkpoint-format tensors and shards them itself) around a plain
`asyncrl.weights.WeightReceiver`, and loads with vLLM's in-place, layer-wise
`model_runner.reload_weights(..., is_checkpoint_format=True)`, which also re-runs the CPU build's
weight repacking and handles fused/packed projections (qkv, gate_up) through the model's own
`load_weights`. Tied embeddings: the CPU build's repacked `lm_head` keeps the old embedding, so
the head stays out of the reload and is re-tied and re-packed after it (the input embedding, a
lookup, is not packed at all: the matrix is packed once per round). It lives with the engine, not
in `asyncrl.weights`, because every line of it is written against vLLM's private worker API.

Every round is verified twice: the sampled elements that arrived against the sender's
fingerprint (exact, in the receiver), and, after the load, the model's own parameters that keep a
checkpoint name and size against what arrived (`readback_mismatches`); a mismatch is status
"fingerprint_mismatch" with `touched` set.

Two ways in, one transport (`rollout.weight_transfer`):
- `extension` (default): `collective_rpc("asyncrl_receive_weights")` runs one whole round in the
  worker (receive, `model_runner.reload_weights`, verify).
- `native`: vLLM's own weight-transfer lifecycle (`WeightTransferConfig(backend="asyncrl")`;
  `init_weight_transfer_engine`, then per round `start_weight_update` / `update_weights` /
  `finish_weight_update`), with `AsyncrlTransferEngine` registered in vLLM's
  `WeightTransferEngineFactory` when this module is imported (vLLM imports the worker extension in
  every worker before it builds the model and its transfer engine). vLLM 0.32's own back-ends are
  not used: it has none for gloo (CPU), and its NCCL one receives over `PyNcclCommunicator` with
  no deadline and no abort, so a learner or peer that dies mid-broadcast would hang the worker. The
  registered engine moves the bytes with the same bounded `WeightReceiver` as the extension, so
  both paths keep every failure bound and check, and the native one runs in the CPU tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from asyncrl.small_machine.patches import vllm_embedding_packs_lazily
from asyncrl.small_machine.process import release_free_heap
from asyncrl.weights.phases import PhaseTimer, add_phase
from asyncrl.weights.receiver import RoundHook, WeightReceiver, readback_mismatches
from asyncrl.weights.wire import NamedTensor

log = logging.getLogger(__name__)


def load_into_vllm_model(model_runner: Any, weights: Iterator[NamedTensor], timer: PhaseTimer | None = None) -> None:
    """Load checkpoint-format (HF-named) tensors into a running vLLM model in place, with vLLM's
    layer-wise reload (the steps of vLLM 0.32's `model_runner.reload_weights`), which ALWAYS
    finalises. vLLM's own runs initialise / `model.load_weights` / finalise without a `finally`: a
    round that fails mid-stream leaves every layer in reload state, and the next reload's
    `initialize_layerwise_reload` skips such layers and keeps what they buffered. A fused projection
    (qkv_proj, gate_up_proj) that got its first part in the failed round then counts that part
    twice, is processed before its last parts arrive (their rows never written) and drops them as
    "excessive loading": silent corruption that the read-back check cannot see (fused parameters
    have no 1:1 name). Finalising after a failure processes the partial layers on what arrived, so
    the model is `touched` and the engine reloads a full version before generating
    (`PolicyEngine._paused`), as on the native path. A tied head stays out of the reload
    (`leave_tied_head_out`) and is re-tied after it."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    timer = timer if timer is not None else PhaseTimer()
    model = model_runner.get_model()
    initialize_layerwise_reload(model)
    leave_tied_head_out(model)
    try:
        model.load_weights(weights)
    finally:
        finalize_layerwise_reload(model, model_runner.model_config)
        with timer.span("retie"):  # inside the receiver's `load` span: counted apart from it
            retie_head(model)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
        getattr(model_runner, reset, lambda: None)()


def tied_head(model: Any) -> Any | None:
    """The model's `lm_head` where it shares the input embedding's matrix (None otherwise)."""
    config = getattr(model, "config", None)
    head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    if config is not None and getattr(config, "tie_word_embeddings", False) and head is not None \
            and hasattr(inner, "embed_tokens") and hasattr(head, "quant_method"):
        return head
    return None


def leave_tied_head_out(model: Any) -> None:
    """Right after `initialize_layerwise_reload`: give a tied head its parameter back and end its
    reload state. A checkpoint carries the shared matrix once, as `embed_tokens`, so the head's own
    layer-wise reload would receive nothing: vLLM would warn "Failed to load weights" at every
    finalise and put the same parameter back anyway. The head keeps the embedding's Parameter,
    which the embedding's reload refills in place; `retie_head` then rebuilds its kernel."""
    from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors, get_layerwise_info

    head = tied_head(model)
    if head is None:
        return
    info = get_layerwise_info(head)
    if info.can_load() and info.kernel_tensors is not None:
        _place_kernel_tensors(head, info)
        info.reset()


def retie_head(model: Any) -> None:
    """Tied embeddings: point `lm_head` at the (reloaded) embedding again and re-run its post-load
    processing (the CPU build packs the head's GEMM kernel from a copy of the matrix, so a reloaded
    embedding does not reach it otherwise). The input embedding itself is not packed
    (`asyncrl.small_machine.patches.vllm_embedding_packs_lazily`): the matrix is packed once."""
    head = tied_head(model)
    if head is not None:
        head.weight = model.model.embed_tokens.weight
        head.quant_method.process_weights_after_loading(head)


CPU_REPACKED_SUFFIXES = (".linear_attn.conv1d.weight",)
"""Parameters vLLM's CPU build repacks in place at load, keeping name and size but not layout, so
the element-wise read-back cannot compare them (the wire fingerprint still covers them): Gated
DeltaNet conv1d weights, packed for its C++ conv on AVX-512-BF16 / ARM-bf16 CPUs
(`vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py`, vLLM 0.32)."""


def verify_load(model: Any, receiver: WeightReceiver, result: dict[str, Any]) -> None:
    """After an "ok" round: what the model holds against what arrived (`readback_mismatches`);
    a mismatch turns `result` into status "fingerprint_mismatch" with `touched` set."""
    if result["status"] != "ok":
        return
    receiver.hook.model_loaded(model)
    t = time.perf_counter()
    bad, checked = readback_mismatches(model, receiver.samples)
    if bad and next(model.parameters()).device.type == "cpu":
        bad = [n for n in bad if not n.endswith(CPU_REPACKED_SUFFIXES)]
    readback_s = time.perf_counter() - t
    result.update(readback_checked=checked, readback_s=readback_s)
    add_phase(result, "readback", readback_s)
    if bad:
        log.error("weights: %d parameters differ from what arrived after the load (e.g. %s)", len(bad), bad[0])
        result.update(status="fingerprint_mismatch", fingerprint_mismatch=len(bad), touched=True)


def trim_after_round(result: dict[str, Any]) -> None:
    """The round's receive buffers (a whole version, buffered) and the reload's materialised layers
    are freed by now: hand that memory back to the system, so the engine's resident memory stays
    flat across reloads instead of keeping what the heap fragmented (phase `trim`)."""
    t = time.perf_counter()
    if release_free_heap():
        add_phase(result, "trim", time.perf_counter() - t)


def _receiver_device(device: Any) -> torch.device | None:
    return device if isinstance(device, torch.device) and device.type == "cuda" else None


class WeightReceiverExtension:
    """vLLM worker extension: `collective_rpc("asyncrl_receive_weights", args=(address, prefix,
    timeout_s))`. Members are named `{prefix}/tp{rank}`. Returns the receiver's result dict."""

    # the seam of every receiver this worker makes (`RoundHook`; this default does nothing); prefixed,
    # as every name here, because vLLM mixes this class into its own worker class
    asyncrl_round_hook: RoundHook = RoundHook()

    def _asyncrl_receiver(self, address: str, prefix: str, timeout_s: float) -> WeightReceiver:
        receivers = self.__dict__.setdefault("_asyncrl_receivers", {})
        key = (address, prefix)
        if key not in receivers:
            receivers[key] = WeightReceiver(address, f"{prefix}/tp{getattr(self, 'rank', 0)}", timeout_s,
                                            _receiver_device(getattr(self, "device", None)),
                                            hook=self.asyncrl_round_hook)
        return receivers[key]

    def asyncrl_receive_weights(self, address: str, prefix: str, timeout_s: float,
                                buffered: bool = True) -> dict[str, Any]:
        """Receive one round and load it; then verify what the model holds against what arrived
        (`readback_mismatches`). Result: the receiver's dict plus `touched` (the model may hold
        part of the round: the caller must reload a full version before generating) and
        `fingerprint_mismatch` (tensors whose sampled elements disagree)."""
        receiver = self._asyncrl_receiver(address, prefix, timeout_s)
        result = receiver.receive(lambda it: load_into_vllm_model(self.model_runner, it, receiver.timer),
                                  buffered=buffered)
        result.pop("tensors", None)
        verify_load(self.model_runner.get_model(), receiver, result)
        trim_after_round(result)
        return result

    def asyncrl_native_result(self) -> dict[str, Any]:
        """The native path's result of the round `finish_weight_update` just closed."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, AsyncrlTransferEngine):
            raise RuntimeError("rollout.weight_transfer=native needs the engine built with "
                               "WeightTransferConfig(backend='asyncrl')")
        return engine.take_result()

    def asyncrl_close_receiver(self, address: str, prefix: str) -> None:
        self.__dict__.get("_asyncrl_receivers", {}).pop((address, prefix), None)


# ---- the native path: vLLM's weight-transfer lifecycle over asyncrl's bounded weight group ----
NATIVE_BACKEND = "asyncrl"


@dataclass
class AsyncrlInitInfo(WeightTransferInitInfo):
    """`init_weight_transfer_engine` payload: the sender and this engine's member prefix (the
    worker's member id is `{prefix}/tp{rank}`, as on the extension path)."""

    address: str
    prefix: str
    timeout_s: float = 60.0


@dataclass
class AsyncrlUpdateInfo(AsyncrlInitInfo, WeightTransferUpdateInfo):
    """`update_weights` payload: which sender (an address not seen before joins it), the deadline
    of each wait, buffered vs streamed loading, and `close` to forget the sender after the round
    (the engine's one-shot loopback feeds)."""

    buffered: bool = True
    close: bool = False


class AsyncrlTransferEngine(WeightTransferEngine[AsyncrlInitInfo, AsyncrlUpdateInfo]):
    """One round = `start_weight_update` (vLLM's layer-wise reload: layers to the meta device,
    loaders wrapped) -> `update_weights` (one `WeightReceiver` round into `model.load_weights`) ->
    `finish_weight_update` (finalise the reload, re-tie a tied head, read-back check). A failed
    round never raises out of `update_weights`: it is recorded, so `finish_weight_update` still
    runs and puts the previous weights back into every layer that received nothing (a failed
    buffered round leaves the model exactly as it was; a failed streamed one is `touched`). The
    caller reads the round's result with the extension's `asyncrl_native_result`."""

    init_info_cls = AsyncrlInitInfo
    update_info_cls = AsyncrlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receivers: dict[tuple[str, str], WeightReceiver] = {}
        self.round_hook = RoundHook()  # the receivers' seam, as on the extension path
        self._round: tuple[WeightReceiver | None, dict[str, Any]] | None = None
        self._result: dict[str, Any] | None = None

    def _receiver(self, info: AsyncrlInitInfo) -> WeightReceiver:
        key = (info.address, info.prefix)
        if key not in self.receivers:
            self.receivers[key] = WeightReceiver(info.address, f"{info.prefix}/tp{self.parallel_config.rank}",
                                                 info.timeout_s, _receiver_device(self.device), hook=self.round_hook)
        return self.receivers[key]

    def init_transfer_engine(self, init_info: AsyncrlInitInfo) -> None:
        self._receiver(init_info)  # joining is lazy: the first round enrols the member

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._round, self._result = None, None
        initialize_layerwise_reload(self.model)
        leave_tied_head_out(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """The round, then the device synchronize the base class does, both guarded: an error out
        of either (a CUDA error from an earlier kernel surfaces at the synchronize) is recorded as
        a failed round, never raised. Raised, vLLM's worker would mark the update inactive, its
        `finish_weight_update` would refuse to run, and the layer-wise reload would never be
        finalised: every layer left on the meta device or half-loaded."""
        self.receive_weights(self.parse_update_info(update_info))
        try:
            self._synchronize()
        except Exception as exc:  # noqa: BLE001 - recorded; finish_weight_update still runs
            log.error("weights (native): device error after the round: %s", exc)
            receiver, result = self._round or (None, {})
            result.update(status="failed", error=f"{type(exc).__name__}: {exc}", touched=True)
            self._round = (receiver, result)

    def _synchronize(self) -> None:
        """Wait for the round's device work (the base class synchronises any accelerator; the CPU
        has none)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: AsyncrlUpdateInfo) -> None:
        receiver = None
        try:
            receiver = self._receiver(update_info)
            result = receiver.receive(self._load, timeout_s=update_info.timeout_s, buffered=update_info.buffered)
            result.pop("tensors", None)
        except Exception as exc:  # noqa: BLE001 - e.g. the sender's store is gone: a failed round
            log.warning("weights (native): round failed before any data: %s", exc)
            result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "touched": False}
        if update_info.close:
            self.receivers.pop((update_info.address, update_info.prefix), None)
        self._round = (receiver, result)

    def _load(self, weights: Iterator[NamedTensor]) -> None:
        try:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        except ImportError:  # pragma: no cover - not in every vLLM
            self.model.load_weights(weights)
            return
        with disable_mtp_completeness_check():  # a round carries checkpoint tensors only
            self.model.load_weights(weights)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        t_retie = time.perf_counter()
        retie_head(self.model)
        receiver, result = self._round or (None, {"status": "failed", "touched": False,
                                                  "error": "finish_weight_update without update_weights"})
        add_phase(result, "finalize", t_retie - t)
        add_phase(result, "retie", time.perf_counter() - t_retie)
        if receiver is not None:
            verify_load(self.model, receiver, result)
        trim_after_round(result)
        self._round, self._result = None, result

    def take_result(self) -> dict[str, Any]:
        result, self._result = self._result, None
        if result is None:
            raise RuntimeError("no finished weight round to report")
        return result

    def shutdown(self) -> None:
        self.receivers.clear()


def _register_native_engine() -> None:
    try:
        WeightTransferEngineFactory.register_engine(NATIVE_BACKEND, AsyncrlTransferEngine)
    except ValueError:  # already registered (the module was imported before in this process)
        pass


_register_native_engine()
vllm_embedding_packs_lazily()  # in every engine worker, before vLLM builds the model
