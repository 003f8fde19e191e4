"""DeepSpeed's just-in-time C++ ops on a CPU learner: one toolchain, built once.

On the CPU accelerator `deepspeed.init_distributed` builds the shared-memory all-reduce op
(`deepspeed_shm_comm`) through torch's `cpp_extension.load`, which runs whatever `ninja` comes
first on PATH. A venv has two: the `ninja` wheel (1.13, `.ninja_log` format v7) in `.venv/bin`
and the system's (1.11, format v5). A process started as `.venv/bin/python` (the Makefile, Ray
workers) finds the system one; a process in an activated venv finds the wheel. Each ninja
discards a log written by the other version and rebuilds every object (the "two command hashes
alternating" seen in `.ninja_log`), a full rebuild on every switch between `make test`,
`make run` and an activated shell.

The second cause of rebuilds: torch keeps the build in one directory per user
(`~/.cache/torch_extensions/py311_cu130/deepspeed_shm_comm`), shared by every checkout on the
machine, and its ninja commands name the venv's absolute paths. Two checkouts (a fresh clone
beside a working copy, CI's `/check/...` beside `/work/...`) each rebuild what the other built,
whenever they alternate.

`pin_toolchain()` puts the interpreter's own bin directory first on PATH, so every process of
an install runs the same ninja, and keeps the extension cache inside the venv
(`<venv>/torch_extensions`, unless TORCH_EXTENSIONS_DIR is set), so each install reuses its
own; `python -m asyncrl.learner.ops` builds the op once at install time (scripts/install.sh)
with that same toolchain and cache.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

__all__ = ["pin_toolchain", "build_cpu_comm_op"]


def pin_toolchain() -> None:
    """Make the interpreter's bin directory (the venv's, holding the `ninja` wheel) first on PATH,
    and torch's extension cache the venv's own (`<venv>/torch_extensions`).

    Idempotent. An explicit TORCH_EXTENSIONS_DIR is kept; outside a venv the cache stays torch's
    default; PATH is left alone when that directory has no `ninja`."""
    if sys.prefix != sys.base_prefix:  # a venv: its own cache, never rebuilt by another checkout
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    bin_dir = str(Path(sys.executable).parent)
    if not (Path(bin_dir) / "ninja").exists():
        return
    path = os.environ.get("PATH", "").split(os.pathsep)
    if path and path[0] == bin_dir:
        return
    os.environ["PATH"] = os.pathsep.join([bin_dir] + [p for p in path if p and p != bin_dir])


def build_cpu_comm_op() -> float:
    """Build (or load from torch's extension cache) DeepSpeed's CPU shared-memory comm op with the
    pinned toolchain; returns the seconds it took (about 0.1 s when cached)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pin_toolchain()
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    t0 = time.perf_counter()
    ShareMemCommBuilder().load(verbose=False)
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"[install] DeepSpeed CPU comm op ready ({build_cpu_comm_op():.1f}s)")
