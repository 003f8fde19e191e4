"""A policy version as tensors for the weight wire: what `LearnerWorker` hands the weight sender
(`weights.sender.WeightSender.broadcast`) and the weight store.

Three kinds (`weights.adapter.sync_kind`, resolved once per job): full parameters under their HF
names, a LoRA policy merged into its base weights (PEFT's own `get_delta_weight`), or the LoRA
adapter alone. Under ZeRO-3 every rank iterates together (the gathers are collectives) and at most
one bucket is ever materialised in full.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from asyncrl.weights.adapter import is_adapter_param, peft_saved_name

__all__ = ["WeightExport", "hf_param_name", "split_fused_experts", "stores_per_expert"]


class WeightExport:
    """The export half of `LearnerWorker` (a mixin: it reads the worker's DeepSpeed engine)."""

    engine: Any
    cfg: Any
    lc: Any
    device: torch.device
    lora: bool
    pad_id: int
    sync_kind: str
    _ds: Any

    def export_named_tensors(self, bucket_bytes: int = 256 * 2**20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full parameters (HF names, training dtype) in buckets of about `bucket_bytes`.

        ZeRO-3: each bucket's parameters are gathered with `GatheredParameters` and copied out
        (clones), so at most one bucket is ever materialised in full; every rank must iterate to
        the end (the gathers are collectives) and every rank receives the same tensors. Other
        stages: the live parameters, valid until the next optimizer step (copy before that)."""
        module = self.engine.module
        zero3 = self.lc.zero_stage == 3
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # DeepSpeed >= 0.17.3 binds NCCL to the device at init
        self._warm_zero3_export()
        persistent = set(module.state_dict().keys())
        items: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
        items += [(n, b) for n, b in module.named_buffers() if n in persistent]
        if self.lora:  # merged: each base weight carries its adapter's delta (`_emit_bucket`)
            items = [(n, t) for n, t in items if not is_adapter_param(n)]
        from asyncrl.weights.names import checkpoint_name_map

        # the checkpoint's names, which the engine resolves (a text class on a multimodal checkpoint)
        rename = checkpoint_name_map(self.cfg.model.path, [hf_param_name(n) for n, _ in items])
        if rename("model.x") != "model.x":
            items = [(n if self.lora else rename(n), t) for n, t in items]
            self._checkpoint_rename = rename
        split = not self.lora and stores_per_expert(self.cfg.model.path)
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0

        def full_bytes(t: torch.Tensor) -> int:
            numel = t.ds_numel if hasattr(t, "ds_numel") else t.numel()
            return int(numel) * t.element_size()

        def emit(bucket: list[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
            for out in self._emit_bucket(bucket, zero3):
                yield split_fused_experts(out) if split else out

        for name, tensor in items:
            bucket.append((name, tensor))
            size += full_bytes(tensor)
            if size >= bucket_bytes:
                yield from emit(bucket)
                bucket, size = [], 0
        if bucket:
            yield from emit(bucket)

    def _warm_zero3_export(self) -> None:
        """The first gather after deepspeed.initialize under ZeRO-3 can return uninitialised
        storage (NaN logprobs in the engines): one forward first, on every rank (collective)."""
        if self.lc.zero_stage == 3 and not getattr(self, "_export_warmed", False):
            with torch.no_grad():
                self.engine.module(input_ids=torch.full((1, 1), int(self.pad_id), device=self.device), use_cache=False)
            self._export_warmed = True

    def _emit_bucket(self, bucket: list[tuple[str, torch.Tensor]], zero3: bool) -> Iterator[list[tuple[str, torch.Tensor]]]:
        if self.lora:
            yield self._merged_bucket(bucket, zero3)
            return
        if not zero3:
            yield [(n, t.detach()) for n, t in bucket]
            return
        params = [t for _, t in bucket if hasattr(t, "ds_id")]
        with self._ds.zero.GatheredParameters(params, modifier_rank=None):
            out = [(n, t.detach().clone()) for n, t in bucket]
        yield out

    def _merged_bucket(self, bucket: list[tuple[str, torch.Tensor]], zero3: bool) -> list[tuple[str, torch.Tensor]]:
        """A bucket of a LoRA policy under the base model's HF names, each adapted weight merged
        (W + scaling * B @ A, PEFT's own `get_delta_weight`, which knows each layer's layout).
        ZeRO-3: the bucket's base weights and their adapters are gathered together."""
        module = self.engine.module
        layers = {n: _lora_layer(module, n) for n, _ in bucket}
        params = [t for _, t in bucket]
        for layer in filter(None, layers.values()):
            params += [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
        with self._gathered([p for p in params if hasattr(p, "ds_id")] if zero3 else []):
            out = []
            for name, t in bucket:
                layer, value = layers[name], t.detach()
                if layer is not None:
                    value = value + layer.get_delta_weight("default").to(value.dtype)
                elif zero3:
                    value = value.clone()
                out.append((getattr(self, "_checkpoint_rename", str)(hf_param_name(name)), value))
        return out

    def _gathered(self, params: list[torch.Tensor]) -> Any:
        from contextlib import nullcontext

        return self._ds.zero.GatheredParameters(params, modifier_rank=None) if params else nullcontext()

    def export_adapter_tensors(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The LoRA adapter alone, one bucket of CPU copies under PEFT's saved names (what
        `adapter_model.safetensors` holds). ZeRO-3: gathered; every rank must iterate."""
        self._warm_zero3_export()
        params = [(n, p) for n, p in self.engine.module.named_parameters() if is_adapter_param(n)]
        with self._gathered([p for _, p in params if hasattr(p, "ds_id")] if self.lc.zero_stage == 3 else []):
            yield [(peft_saved_name(n), p.detach().to("cpu", copy=True)) for n, p in params]

    def export_sync_tensors(self, bucket_bytes: int = 256 * 2**20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """What one policy version is on the weight wire (`weights.adapter.sync_kind`): the
        adapter alone, or full weights (merged with the adapter under LoRA)."""
        if self.sync_kind == "adapter":
            return self.export_adapter_tensors()
        return self.export_named_tensors(bucket_bytes)


def hf_param_name(name: str) -> str:
    """A PEFT model's parameter name under the base model's HF name
    (`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` -> `model.layers.0.self_attn.q_proj.weight`)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _lora_layer(module: Any, name: str) -> Any:
    """The PEFT LoRA layer whose base weight is `name`, or None."""
    suffix = ".base_layer.weight"
    if not name.endswith(suffix):
        return None
    layer = module.get_submodule(name[: -len(suffix)])
    return layer if hasattr(layer, "get_delta_weight") and "default" in getattr(layer, "lora_A", {}) else None


def stores_per_expert(model_path: str) -> bool:
    """Whether the checkpoint at `model_path` keeps its MoE experts one by one
    (`...mlp.experts.0.gate_proj.weight`), the layout transformers 5 saves for Qwen2/Qwen3/Qwen3.5-MoE
    while its modules hold them fused (`...mlp.experts.gate_up_proj`, experts x 2I x H). Only the
    safetensors headers are read; no checkpoint or an unreadable one: False (names go as they are)."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = json.loads(index.read_text()).get("weight_map", {})
        elif (root / "model.safetensors").is_file():
            with safe_open(str(root / "model.safetensors"), "pt") as f:
                names = list(f.keys())
        else:
            return False
    except (OSError, ValueError):
        return False
    return any(".mlp.experts.0." in n for n in names)


def split_fused_experts(items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Fused expert tensors under the checkpoint's per-expert names, which the engine resolves
    (`reload_weights(..., is_checkpoint_format=True)` maps those onto its own fused MoE weights):
    `P.gate_up_proj` (E, 2I, H) -> `P.{e}.gate_proj.weight` = [e, :I] and `P.{e}.up_proj.weight` = [e, I:]
    (transformers concatenates gate then up), `P.down_proj` (E, H, I) -> `P.{e}.down_proj.weight` = [e].
    Views, no copies; every other tensor passes unchanged."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in items:
        if name.endswith(".mlp.experts.gate_up_proj") and t.dim() == 3:
            prefix, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out += [(f"{prefix}{e}.gate_proj.weight", t[e, :inter]), (f"{prefix}{e}.up_proj.weight", t[e, inter:])]
        elif name.endswith(".mlp.experts.down_proj") and t.dim() == 3:
            prefix = name.removesuffix("down_proj")
            out += [(f"{prefix}{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
        else:
            out.append((name, t))
    return out
