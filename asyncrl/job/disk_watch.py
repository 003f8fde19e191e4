"""A full disk during a run: pause, say so, and end with a named error only when it must.

- `DiskWatch.check()` (the driver, while it waits for batches and after every step) reads the free
  space of the run directory's filesystem. Below `trainer.min_free_disk_mb` it pauses admission (no
  new groups: their logs, checkpoints and metrics need the disk) with one console line, and resumes
  with another once twice that much is free again. A pause that lasts `trainer.disk_full_wait_s`
  ends the job with `DiskFull`.
- A write that failed with ENOSPC anywhere in the job (`is_disk_full`: errno 28 in the exception's
  chain, a Ray task's cause, or its text from a remote error reply) ends the job with `DiskFull`
  at once: exit status 3, after an emergency checkpoint written ELSEWHERE (`emergency_root`:
  `trainer.emergency_dir`, default $TMPDIR), since the run directory has no room for one.
"""

from __future__ import annotations

import errno
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl.failure_watch import JobStop
from asyncrl.startup import say

ENOSPC_TEXT = ("[Errno 28]", "No space left on device")


class DiskFull(JobStop):
    advice = "free space on the run directory's disk, then resume with trainer.resume=auto"


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether a full disk is behind `exc` (its cause/context chain, Ray's remote causes, or an error
    text carried over the wire, such as the replay buffer's reply to a push it could not log)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DiskFull) or (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
            return True
        if getattr(exc, "disk_full", False) or any(t in str(exc) for t in ENOSPC_TEXT):
            return True
        exc = getattr(exc, "cause", None) if isinstance(getattr(exc, "cause", None), BaseException) else \
            (exc.__cause__ or exc.__context__)
    return False


def emergency_root(configured: str | None, run_dir: Path) -> Path:
    """Where the emergency checkpoint of a full disk goes: `trainer.emergency_dir`, else $TMPDIR, as
    `<dir>/asyncrl-emergency/<run name>/`."""
    base = Path(configured) if configured else Path(tempfile.gettempdir())
    return base / "asyncrl-emergency" / run_dir.name


def free_bytes(path: Path) -> int:
    from asyncrl.learner.checkpoint import free_bytes as free

    return free(path)


class DiskWatch:
    """Admission paused while the run's disk is below `min_free_mb`; `DiskFull` after `wait_s` of it."""

    def __init__(self, run_dir: Path, min_free_mb: float, wait_s: float, set_admitting: Callable[[bool], None],
                 free: Callable[[Path], int] = free_bytes, echo: Callable[[str], None] = say):
        self.run_dir, self.min_free = run_dir, int(min_free_mb * 2**20)
        self.wait_s, self.set_admitting, self.free, self.echo = wait_s, set_admitting, free, echo
        self.paused_at: float | None = None
        self.pauses = 0

    def check(self) -> None:
        if self.min_free <= 0:
            return
        free = self.free(self.run_dir)
        if self.paused_at is None:
            if free < self.min_free:
                self.paused_at = time.monotonic()
                self.pauses += 1
                self.set_admitting(False)
                self.echo(f"disk nearly full: {free / 2**20:.0f} MB free for {self.run_dir} (< trainer.min_free_disk_mb="
                          f"{self.min_free / 2**20:.0f}); admission paused: no new groups until space is freed "
                          f"(the job ends after trainer.disk_full_wait_s={self.wait_s:.0f}s)")
            return
        if free >= 2 * self.min_free:
            self.echo(f"disk space is back ({free / 2**20:.0f} MB free): admission resumed")
            self.paused_at = None
            self.set_admitting(True)
            return
        if time.monotonic() - self.paused_at >= self.wait_s:
            raise DiskFull(f"the disk of {self.run_dir} stayed full for {self.wait_s:.0f}s "
                           f"({free / 2**20:.0f} MB free, trainer.min_free_disk_mb={self.min_free / 2**20:.0f})")

    @property
    def paused(self) -> bool:
        return self.paused_at is not None


def remove_partial(path: Path) -> None:
    """A partial temporary checkpoint left by a write that hit the full disk."""
    import shutil

    for tmp in path.glob(".tmp-step_*") if path.is_dir() else []:
        shutil.rmtree(tmp, ignore_errors=True)

