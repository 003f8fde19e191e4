"""DeepSpeed's CPU comm op is built once and reused from any calling environment.

The learner's `init_distributed` is run in fresh processes started the two ways a user starts
asyncrl: as `.venv/bin/python` with the venv's bin directory absent from PATH (the Makefile, Ray
workers) and from an activated venv (its bin directory first on PATH). Before the toolchain was
pinned (asyncrl/learner/ops.py) the two found different `ninja` binaries, whose logs are
incompatible, and the second start rebuilt the op (~30 s). The op's ninja log and shared object
must be untouched by the second and third starts. And the cache is the venv's own: a second
checkout on the machine (CI beside a working copy) no longer rebuilds what the first built.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

_RUN = """
import sys
from asyncrl.learner.build import init_distributed
init_distributed(0, 1, "127.0.0.1", int(sys.argv[1]), on_gpu=False)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_learner_process(path: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}  # as a user's shell has it
    env.update(PATH=path, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _RUN, str(_free_port())], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def _op_state(build_dir: Path) -> tuple[str, float]:
    so = build_dir / "deepspeed_shm_comm.so"
    return (build_dir / ".ninja_log").read_text(), so.stat().st_mtime


def test_comm_op_not_rebuilt_across_environments():
    from torch.utils.cpp_extension import _get_build_directory

    from asyncrl.learner.ops import pin_toolchain

    pin_toolchain()  # what every learner process does before building: the venv's cache
    venv_bin = str(Path(sys.executable).parent)
    bare = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    activated = os.pathsep.join([venv_bin, bare])
    build_dir = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))
    if sys.prefix != sys.base_prefix:
        assert build_dir.is_relative_to(Path(sys.prefix)), f"op cache {build_dir} is shared beyond this venv"

    _start_learner_process(bare)  # builds the op if install did not (a dev checkout)
    before = _op_state(build_dir)
    _start_learner_process(activated)
    _start_learner_process(bare)
    assert _op_state(build_dir) == before, "the DeepSpeed CPU comm op was rebuilt by a second start"
