"""Process-level tuning for a machine where every process of a job shares a few cores: the cyclic
garbage collector paused during heavy imports (`gc_paused`), and scheduling priority given to the
job's critical path (the rollout engines niced, the learner raised once built, the launcher's row
loader between them). On a GPU machine none of this is applied (`asyncrl.small_machine`).
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused(enabled: bool = True) -> Iterator[None]:
    """Python's cyclic garbage collector off inside (restored as it was on exit). For a process's
    imports of torch, transformers and vLLM: they allocate millions of objects, each allocation
    burst triggers a collection, and a full collection walks every object allocated so far; import
    creates almost no garbage. `import vllm` + `AsyncLLM` on the 2-core machine: 12.5-14.0 CPU-s
    with the collector, 11.1-11.7 without (alternating, 3 each). Keep it around imports and
    configuration only: a process forked inside would inherit the collector off for its whole life
    (the rollout actor leaves it before vLLM forks its engine core)."""
    if not enabled:
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()



def renice(nice: int | None) -> None:
    """Set this process's niceness to `nice` (absolute, so a restart does not add up; only ever
    raised, which needs no privilege); None leaves it."""
    if nice is not None and nice > os.nice(0):
        os.nice(nice - os.nice(0))


def renice_children(nice: int | None) -> None:
    """`renice` for this process's descendants (the engine core vLLM spawned inherited the
    niceness this process had then)."""
    import psutil

    if nice is None:
        return
    for child in psutil.Process().children(recursive=True):
        try:
            if nice > child.nice():
                child.nice(nice)
        except psutil.Error:  # gone, or not ours to change
            continue



def yield_while_building() -> bool:
    """A CPU learner builds at the lowest priority (niceness 19) where it may raise it again
    afterwards (`raise_priority`: root or CAP_SYS_NICE), so the engine builds, which the first step
    waits for longer, go first: on the 2-core quick start the learner is ready seconds before the
    engine. Where it may not, nothing changes (a learner left at 19 would lose to the engines for
    the whole job). Linux niceness is per thread: this is the calling thread, which builds and then
    trains. Returns whether it yielded."""
    now = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, now - 1)  # the permission `raise_priority` will need
    except OSError:
        return False
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    return True


def raise_priority() -> None:
    """A CPU learner shares its cores with the rollout engines (niced by `rollout.cpu_nice`): undo
    the niceness Ray starts its workers at (15; 19 during the build, `yield_while_building`), where
    the process may (root or CAP_SYS_NICE), so the learner, the job's critical path, is scheduled
    first. Elsewhere nothing changes. Called once the learner is built: during start-up the engine
    builds are the critical path (the rollout actors renice themselves only after theirs)."""
    try:
        os.nice(-os.nice(0))
    except OSError:
        pass



def set_thread_niceness(nice: int) -> None:
    """Give the calling thread (Linux: niceness is per thread) the niceness `nice`; elsewhere, or
    without the permission, nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


def release_free_heap() -> bool:
    """Give the memory glibc's heap holds free back to the system (`malloc_trim(0)`), e.g. once a
    weight round's receive buffers are freed: glibc raises its mmap threshold to the size of the
    largest block freed (up to 32 MiB), so a round's bucket-sized buffers come from the heap, and
    what they leave behind stays resident (an engine then grows a little with every reload).
    Returns whether it ran (glibc only)."""
    import ctypes
    import ctypes.util

    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is None:
        return False
    trim(0)
    return True


_LIBC: object | None = None
