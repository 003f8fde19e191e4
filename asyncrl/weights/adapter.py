"""The adapter payload of the weight wire (`model.lora`): what a version is when the learner trains
a LoRA adapter, and how it becomes a PEFT-format directory that vLLM loads.

A version is the adapter alone: the `lora_A` / `lora_B` matrices under PEFT's saved names
(`base_model.model.<module>.lora_A.weight`, the adapter name dropped, exactly as
`peft.get_peft_model_state_dict` writes them). They travel over the same weight group, with the
same buckets, fingerprints, membership rounds and `WeightStore` copy as full weights; only the
receiving end differs: the engine writes them to a directory (`write_adapter_dir`, atomic) and
loads that as a new LoRA. Why the wire and not a file the learner writes into /dev/shm: the
engines may sit on other nodes, and the wire already carries the integrity and late-joiner
guarantees; an adapter is small enough that the extra write on the receiving side costs
milliseconds (docs/benchmarks.md, "LoRA").

`sync_kind` decides, the same way on the learner and on every engine, what a version is:
`full` (no LoRA), `adapter`, or `merged` (base + adapter merged into full weights, for an
architecture vLLM cannot serve with LoRA, or when asked). Pure torch + safetensors; vLLM is
imported only to ask whether it serves an architecture with LoRA.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # torch only in annotations: the launcher's preflight (sync_kind) must not import it
    import torch

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
SyncKind = Literal["full", "adapter", "merged"]


def peft_saved_name(param_name: str, adapter: str = "default") -> str:
    """A PEFT model's parameter name as PEFT saves it: `...q_proj.lora_A.default.weight` ->
    `...q_proj.lora_A.weight`."""
    return param_name.replace(f".{adapter}.", ".")


def is_adapter_param(param_name: str) -> bool:
    return ".lora_A." in param_name or ".lora_B." in param_name


def adapter_config(lora: Any, base_model: str) -> dict[str, Any]:
    """The `adapter_config.json` of a `model.lora` section (PEFT's LoRA keys; what vLLM's
    `PEFTHelper` and `peft.PeftModel.from_pretrained` read)."""
    from peft import LoraConfig

    cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                     target_modules=list(lora.target_modules), bias=lora.bias, use_dora=lora.use_dora,
                     modules_to_save=list(lora.modules_to_save) or None, task_type="CAUSAL_LM",
                     base_model_name_or_path=base_model)
    out = cfg.to_dict()
    out["target_modules"] = sorted(out["target_modules"])  # a set in PEFT: JSON needs a list
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in out.items()}


def write_adapter_dir(root: str | os.PathLike[str], name: str, tensors: Iterable[tuple[str, torch.Tensor]],
                      config: dict[str, Any]) -> Path:
    """Write a PEFT-format adapter directory `root/name` atomically (written under `.tmp-name`,
    renamed when complete, so a reader never sees half an adapter). Returns its path."""
    from safetensors.torch import save_file

    root = Path(root)
    final, tmp = root / name, root / f".tmp-{name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    state = {n: t.detach().to("cpu").contiguous() for n, t in tensors}
    save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def read_adapter_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / ADAPTER_WEIGHTS))


def fast_local_dir() -> str:
    """Where engines keep their adapter directories: /dev/shm (memory) when writable, else the
    temporary directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else os.environ.get("TMPDIR", "/tmp")


# ------------------------------------------------------------------------------- sync decision
def model_architectures(model_path: str) -> list[str]:
    cfg = Path(model_path) / "config.json"
    if not cfg.is_file():
        return []
    return list(json.loads(cfg.read_text()).get("architectures") or [])


@cache
def vllm_serves_lora(architecture: str) -> bool:
    """Whether vLLM's model class for `architecture` implements LoRA (`SupportsLoRA`)."""
    from vllm.model_executor.models.interfaces import supports_lora

    from asyncrl.small_machine.patches import vllm_model_class

    cls = vllm_model_class(architecture)
    return cls is not None and bool(supports_lora(cls))


def sync_kind(cfg: Any, *, warn: bool = False) -> SyncKind:
    """What a policy version is on the wire for this job (`model.lora.sync`): the same answer on
    the learner and on every engine. `auto` picks `adapter` when vLLM serves the model's
    architecture with LoRA, else `merged`; `warn` logs that fallback (once per process)."""
    lora = cfg.model.lora
    if not lora.enable:
        return "full"
    if lora.sync != "auto":
        return lora.sync
    archs = model_architectures(cfg.model.path)
    if archs and all(vllm_serves_lora(a) for a in archs):
        return "adapter"
    if warn:
        _warn_merged_fallback(cfg.model.path, ", ".join(archs) or "unknown architecture")
    return "merged"


@cache
def _warn_merged_fallback(path: str, archs: str) -> None:
    log.warning("model.lora: vLLM cannot serve %s (%s) with LoRA; every version is synced as merged full "
                "weights (base + adapter) instead of the adapter alone", path, archs)
