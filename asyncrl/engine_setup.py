"""How a vLLM engine is built in this job, for the policy's engines (`actors/`) and the verifier's
replicas (`serve/`) alike: the environment it is built under (`engine_env`, `apply_engine_env`) and,
on CPU, its engine-core process forked from the building process instead of spawned
(`engine_core_forked`). No role owns it: both roles build engines the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


def engine_env(gpus: float, in_process: bool | None) -> dict[str, str]:
    """Environment a vLLM engine (policy or verifier) is built under. `in_process` (None = derived:
    True on CPU) keeps vLLM's model worker inside its engine-core process (UniProcExecutor):
    vLLM's CPU build otherwise forces a separate worker process talking to the engine core over a
    shared-memory queue whose readers busy-poll (sched_yield) for a second after every message,
    which on a small CPU machine steals the cores the learner needs (2-core quick start: steps
    2.64 -> 2.36 s, engine build 26 -> 14 s; BENCHMARKS.md).

    On CPU also `TORCH_COMPILE_DISABLE=1` (unless the environment already sets it): with
    `enforce_eager` vLLM compiles no model code, but its sampler still `torch.compile`s one helper
    (`batched_count_greater_than`, the sampled token's rank, computed whenever logprobs are asked
    for) with inductor on the engine's first step: Dynamo tracing, inductor, a g++ probe and three
    `python -c` subprocesses, ~1.5 CPU-s and ~1.9 s of the first batch on the 2-core machine, while
    eager runs it as fast (64 sequences: 0.17-0.19 s per batch either way; BENCHMARKS.md).

    On GPU nothing is set: vLLM already runs a one-GPU engine in-process, needs its worker
    processes for tensor parallelism, and its compiled kernels pay off there."""
    if gpus > 0:
        return {}
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if in_process is False else "0",
            "TORCH_COMPILE_DISABLE": os.environ.get("TORCH_COMPILE_DISABLE", "1")}


def apply_engine_env(env: dict[str, str]) -> None:
    """Put `engine_env`'s variables into this process's environment (read by vLLM when it builds the
    engine config, and inherited by its engine-core process). torch reads `TORCH_COMPILE_DISABLE`
    once, when `torch._dynamo.config` is imported (vLLM's import already did that), so the switch
    is also set on that module; a forked engine core inherits it, a spawned one reads the variable."""
    os.environ.update(env)
    dynamo = sys.modules.get("torch._dynamo.config")
    if dynamo is not None and "TORCH_COMPILE_DISABLE" in env:
        dynamo.disable = env["TORCH_COMPILE_DISABLE"] == "1"



# ---- building the engine-core process by fork (CPU) ------------------------------------------
_FORKING_ENGINE_CORE = False  # True only while `engine_core_forked` builds an engine (read by the fork hooks)
_AFTER_FORK_IN_PARENT: Callable[[], None] | None = None  # `engine_core_forked`'s `after_fork`, run once


def _close_inherited_sockets() -> None:
    """In a process just forked from a Ray worker: close this process's copies of the sockets the
    parent holds (Ray's raylet, GCS and object-store connections, the engine client's ZeroMQ
    sockets). The parent's connections stay open (closing a copy sends nothing); without this the
    raylet would not see the actor's own death until the engine core died too (it learns of a
    worker's death when the worker's socket closes), and actor restarts would wait on it."""
    global _FORKING_ENGINE_CORE
    if not _FORKING_ENGINE_CORE:
        return
    _FORKING_ENGINE_CORE = False
    import stat

    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2:
            continue
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:  # the directory's own descriptor, closed since listing
            pass


def _run_after_fork_in_parent() -> None:
    """In the parent, once the engine core is forked: the build's `after_fork` callback (once)."""
    global _AFTER_FORK_IN_PARENT
    callback, _AFTER_FORK_IN_PARENT = _AFTER_FORK_IN_PARENT, None
    if _FORKING_ENGINE_CORE and callback is not None:
        callback()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_sockets, after_in_parent=_run_after_fork_in_parent)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


@contextlib.contextmanager
def engine_core_forked(enabled: bool, after_fork: Callable[[], None] | None = None) -> Iterator[bool]:
    """Build an `AsyncLLM` whose engine-core process is forked from this one, not spawned.

    vLLM spawns the engine core from a Ray actor (`_maybe_force_spawn`: "In a Ray actor and can only
    be spawned") and on CPU (its platform sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` when the engine
    config is created, for its executor's worker processes and OpenMP), and a spawned engine core
    imports torch and vLLM again: 5-7 s of a 2-core machine, on the first step's critical path, while
    the learner is starting beside it. A fork inherits the imported modules. Use it around the
    engine's construction from an already created config (`AsyncLLM.from_vllm_config`). What makes a
    fork from a Ray worker safe here:
    - the child runs only vLLM's engine core (`EngineCoreProc.run_engine_core`, which installs its
      own SIGTERM/SIGINT handlers) and never calls Ray: the CPU build with the model worker in the
      same process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `engine_env`) has no executor processes;
    - the child closes its copies of the parent's sockets at once (`_close_inherited_sockets`), so
      Ray still sees the actor's own death when it dies;
    - nothing CUDA: `enabled` must be False on GPU (a forked CUDA context is unusable; vLLM then
      spawns, as it would anyway);
    - no OpenMP thread team in the parent: a child forked after libgomp started its threads hangs in
      its first parallel region. This process must run torch on one thread (`OMP_NUM_THREADS=1`,
      which the job's runtime env sets for every actor; the model runs in the engine core, which
      sets its own thread count); otherwise the engine core is spawned, with a log line saying why;
    - the interpreter's own fork handling (import lock, logging locks) covers the Python side.
    `enabled=False` changes nothing. Yields whether the engine core will be forked. Only the
    engine-core process is forked: the environment variable is restored after the build.

    `after_fork` (optional): work to run beside the engine core's build that must not be inherited
    by a forked child, such as a thread (a child forked while another thread holds a lock, e.g. a
    module's import lock, would hang on it): called in this process right after the fork, or at
    once when the engine core is spawned instead. It must return quickly (start a thread)."""
    global _FORKING_ENGINE_CORE, _AFTER_FORK_IN_PARENT
    if enabled and (threads := _torch_threads()) != 1:
        log.info("vLLM engine core spawned, not forked: this process runs torch on %d threads (a fork "
                 "after OpenMP has started its threads hangs in the child); OMP_NUM_THREADS=1 allows it", threads)
        enabled = False
    if not enabled:
        if after_fork is not None:
            after_fork()
        yield False
        return
    from asyncrl.small_machine.patches import vllm_forks_in_ray_actor

    saved_method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    _FORKING_ENGINE_CORE = True
    _AFTER_FORK_IN_PARENT = after_fork
    try:
        with vllm_forks_in_ray_actor():  # else vLLM's `get_mp_context` turns the fork back into a spawn
            yield True
    finally:
        _FORKING_ENGINE_CORE = False
        _AFTER_FORK_IN_PARENT = None  # a build that failed before its fork: nothing to run beside it
        if saved_method is None:
            os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
        else:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = saved_method


