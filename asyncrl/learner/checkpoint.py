"""Checkpoint directories: atomic creation, newest-K retention, HF export, trainer state, RNG.

Layout of `runs/<exp>/checkpoints/step_N/` (N = learner step = policy version after the step):
```
deepspeed/            DeepSpeed engine state (module, optimizer, LR scheduler; one shard per rank)
hf/                   HF safetensors export + config + tokenizer (transformers / vLLM load it as is;
                      with `model.lora` the base merged with the adapter)
adapter/              `model.lora` only: the adapter in PEFT format (adapter_config.json +
                      adapter_model.safetensors; `python -m asyncrl.export` reads it)
trainer_state.json    step, version, LR scheduler, adaptive-KL controller, counters (rank 0)
rng/rank_<r>.json     python / numpy / torch (/ cuda) RNG state of every rank
buffer/               slot for the replay-buffer snapshot (filled by the lead before commit)
data_cursor.json      slot for the prompt stream's state (written by the lead before commit; absent
                      until then)
```
Guarantees
- Atomic: everything is written under `checkpoints/.tmp-step_N/` and renamed to `step_N` only when
  complete (`commit`); a crash leaves no `step_N` that is half written, and a leftover temporary
  directory is removed by the next `begin` of the same step. `latest_checkpoint` only ever sees
  complete ones.
- Retention (`save_limit` = K > 0): after the new checkpoint is renamed into place, the oldest
  complete ones beyond K are deleted; nothing is deleted before the new one is complete.
Departs from Guided-GRPO (docs/guided_grpo.md#checkpoints): per-step directories are `step_N` not
`global_step_N`; an HF export is always written; the adaptive-KL state and policy version are
saved (the original does not save them); pruning happens after, not before, the new save.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy and torch are imported where used: the launcher (resume, preflight's disk row) needs none
    import torch

__all__ = ["step_dir", "begin", "commit", "atomic_checkpoint", "latest_checkpoint", "list_checkpoints",
           "write_json", "read_json", "rng_state", "set_rng_state", "write_hf_export", "TRAINER_STATE",
           "ADAPTER_DIR"]

TRAINER_STATE = "trainer_state.json"
ADAPTER_DIR = "adapter"
"""`model.lora`: the adapter alone in PEFT format (`hf/` then holds the merged model)."""
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step_{int(step)}"


def _tmp_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f".tmp-step_{int(step)}"


def begin(root: str | os.PathLike[str], step: int) -> Path:
    """Fresh temporary directory for step N (with the `buffer/` slot). Call on one process only."""
    tmp = _tmp_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "buffer").mkdir(parents=True)
    (tmp / "rng").mkdir()
    return tmp


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints (renamed `step_N` directories), oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in r.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return sorted(found)


class CheckpointNoRoom(RuntimeError):
    """A checkpoint would not fit on its filesystem (checked before writing one)."""


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Free bytes on the filesystem that holds `path` (or would, once created)."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def dir_bytes(path: str | os.PathLike[str]) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def check_room(root: str | os.PathLike[str], estimate: int) -> None:
    """Raise CheckpointNoRoom (one line, naming the directory and both sizes) when the next
    checkpoint under `root` would not fit: it needs what the newest one there took, or
    `estimate` before the first. Writing it anyway fails half-way (torch's writer: "unexpected
    pos ...", a remote traceback) and leaves a partial temporary directory on a full disk."""
    newest = latest_checkpoint(root)
    need = dir_bytes(newest) if newest is not None else estimate
    free = free_bytes(root)
    if free < need:
        what = f"the newest ({newest.name}) took {need / 1e9:.2f} GB" if newest is not None else \
            f"one takes ~{need / 1e9:.2f} GB (estimated)"
        raise CheckpointNoRoom(f"no room for a checkpoint in {root}: {free / 1e9:.2f} GB free, {what}; "
                               "free space there, or set trainer.save_limit / trainer.run_dir")


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1][1] if ckpts else None


def commit(tmp: str | os.PathLike[str], save_limit: int = -1) -> Path:
    """Rename the temporary directory to `step_N` (atomic on one filesystem), then prune to the
    newest `save_limit` (-1 = keep all). Returns the final path."""
    tmp = Path(tmp)
    if not (tmp / TRAINER_STATE).is_file():
        raise RuntimeError(f"{tmp} has no {TRAINER_STATE}; refusing to commit an incomplete checkpoint")
    step = int(tmp.name.removeprefix(".tmp-step_"))
    final = step_dir(tmp.parent, step)
    if final.exists():  # re-saving the same step (e.g. final save after a periodic one)
        old = tmp.parent / f".old-step_{step}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    if save_limit > 0:
        for _, path in list_checkpoints(tmp.parent)[:-save_limit]:
            shutil.rmtree(path, ignore_errors=True)
    return final


@contextmanager
def atomic_checkpoint(root: str | os.PathLike[str], step: int, save_limit: int = -1):
    """Single-process helper: yields the temporary directory, commits it when the block succeeds
    (a failing block leaves only the temporary directory, removed by the next attempt)."""
    tmp = begin(root, step)
    yield tmp
    commit(tmp, save_limit)


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    part = p.with_name(p.name + ".part")
    part.write_text(json.dumps(obj, indent=2))
    part.replace(p)


def read_json(path: str | os.PathLike[str]) -> Any:
    return json.loads(Path(path).read_text())


# ------------------------------------------------------------------------------------------ RNG
def rng_state() -> dict[str, Any]:
    """JSON-able RNG state of python, numpy and torch (and CUDA when present)."""
    import numpy as np
    import torch

    py = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


# ------------------------------------------------------------------------------------ HF export
def write_hf_export(out: str | os.PathLike[str], buckets: Iterable[list[tuple[str, torch.Tensor]]],
                    model_config: Any, tokenizer: Any = None, shard_bytes: int = 2 * 2**30,
                    generation_config: Any = None) -> list[str]:
    """Write safetensors shards (+ index when > 1) with config and tokenizer from full-tensor
    buckets (as `LearnerWorker.export_named_tensors` yields); tensors are copied to CPU one shard
    at a time. Returns the tensor names written."""

    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cur: dict[str, torch.Tensor] = {}
    size = 0
    files: list[str] = []
    weight_map: dict[str, str] = {}
    dtype = None

    def flush() -> None:
        nonlocal cur, size
        if cur:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(cur, str(out / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in cur})
            cur, size = {}, 0

    for bucket in buckets:
        for name, tensor in bucket:
            t = tensor.detach().to("cpu", copy=True).contiguous()
            dtype = dtype or t.dtype
            cur[name] = t
            size += t.numel() * t.element_size()
            if size >= shard_bytes:
                flush()
    flush()
    if len(files) == 1:
        (out / files[0]).rename(out / "model.safetensors")
        weight_map = {k: "model.safetensors" for k in weight_map}
    else:
        total = sum((out / f).stat().st_size for f in files)
        write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    if dtype is not None:
        model_config.dtype = dtype
    model_config.save_pretrained(out)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return sorted(weight_map)
