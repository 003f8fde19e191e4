"""`release_free_heap` gives memory that glibc's heap holds free back to the system: 200 MB of
heap blocks freed below a block still in use (so glibc cannot trim the heap's top itself) stay
resident until it runs, and leave once it has (the engine calls it after every weight round)."""

from __future__ import annotations

import ctypes
import ctypes.util

import psutil
import pytest

from asyncrl.small_machine.process import release_free_heap

libc_name = ctypes.util.find_library("c")


@pytest.mark.skipif(not libc_name, reason="needs glibc")
def test_freed_heap_blocks_leave_the_resident_set() -> None:
    libc = ctypes.CDLL(libc_name)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size, n = 100 * 1024, 2000  # below glibc's 128 KiB mmap threshold: heap blocks
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # resident
    pin = libc.malloc(size)  # above them: the heap's top stays in use
    rss = lambda: psutil.Process().memory_info().rss  # noqa: E731
    for b in blocks:
        libc.free(b)
    held = rss()
    assert release_free_heap() is True
    released = held - rss()
    libc.free(pin)
    assert released > 0.8 * size * n, f"only {released / 2**20:.0f} MiB of {size * n / 2**20:.0f} MiB released"
