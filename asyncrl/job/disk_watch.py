"""A full disk during a run: pause, say so, and end with a named error only when it must.

- `DiskWatch.check()` (the driver, while it waits for batches and after every step) reads the free
  space of the run directory's filesystem. Below `trainer.min_free_disk_mb` it pauses admission (no
  new groups: their logs, checkpoints and metrics need the disk) with one console line, and resumes
  with another once twice that much is free again. It pauses the same way, with the line
  "admission paused (disk full)", while the replay buffer reports that its durable log cannot be
  written (`buffer/disk_full`: a quota, another filesystem, or the floor switched off), and resumes
  when the buffer can write again. A pause that lasts `trainer.disk_full_wait_s` ends the job with
  `DiskFull`.
- A write that failed on a full disk anywhere in the job (`is_disk_full`: ENOSPC or EDQUOT in the
  exception's chain, the replay buffer's named condition (`LogFull`, `BufferDiskFull`, an error
  reply coded `disk_full`), a Ray task's cause, or its text from a remote error) ends the job with `DiskFull`
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

ENOSPC_TEXT = ("[Errno 28]", "No space left on device", "[Errno 122]", "Disk quota exceeded")
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(JobStop):
    advice = "free space on the run directory's disk, then resume with trainer.resume=auto"


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether a full disk is behind `exc` (its cause/context chain, Ray's remote causes, or an error
    text carried over the wire, such as the replay buffer's reply to a push it could not log)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DiskFull) or (isinstance(exc, OSError) and exc.errno in FULL_ERRNOS):
            return True
        if _buffer_disk_full(exc) or getattr(exc, "disk_full", False) or any(t in str(exc) for t in ENOSPC_TEXT):
            return True
        exc = getattr(exc, "cause", None) if isinstance(getattr(exc, "cause", None), BaseException) else \
            (exc.__cause__ or exc.__context__)
    return False


def _buffer_disk_full(exc: BaseException) -> bool:
    """The replay buffer's named full-disk condition: its log's `LogFull` (ENOSPC, EDQUOT or EFBIG),
    a producer's `BufferDiskFull`, or any error reply coded `disk_full`."""
    from asyncrl.replay.client import BufferDiskFull, BufferRequestError
    from asyncrl.replay.wal import LogFull

    return isinstance(exc, (LogFull, BufferDiskFull)) or (
        isinstance(exc, BufferRequestError) and exc.code == "disk_full")


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
                 free: Callable[[Path], int] = free_bytes, echo: Callable[[str], None] = say,
                 buffer_log_full: Callable[[], bool] = lambda: False):
        """`buffer_log_full`: whether the replay buffer reports its durable log unwritable (`buffer/disk_full`)."""
        self.run_dir, self.min_free = run_dir, int(min_free_mb * 2**20)
        self.wait_s, self.set_admitting, self.free, self.echo = wait_s, set_admitting, free, echo
        self.buffer_log_full = buffer_log_full
        self.paused_at: float | None = None
        self.pauses = 0

    def check(self) -> None:
        free = self.free(self.run_dir) if self.min_free > 0 else None
        low = free is not None and free < self.min_free
        log_full = self.buffer_log_full()
        if self.paused_at is None:
            if low or log_full:
                self.paused_at = time.monotonic()
                self.pauses += 1
                self.set_admitting(False)
                what = (f"disk nearly full: {free / 2**20:.0f} MB free for {self.run_dir} (< trainer.min_free_disk_mb="
                        f"{self.min_free / 2**20:.0f})" if low and free is not None else
                        "the replay buffer's durable log cannot be written (buffer/disk_full)")
                self.echo(f"admission paused (disk full): {what}; no new groups until space is freed "
                          f"(the job ends after trainer.disk_full_wait_s={self.wait_s:.0f}s)")
            return
        if (free is None or free >= 2 * self.min_free) and not log_full:
            self.echo("disk space is back" + (f" ({free / 2**20:.0f} MB free)" if free is not None else "")
                      + ": admission resumed")
            self.paused_at = None
            self.set_admitting(True)
            return
        if time.monotonic() - self.paused_at >= self.wait_s:
            where = (f"the disk of {self.run_dir}" if free is not None and free < 2 * self.min_free
                     else "the replay buffer's durable log")
            raise DiskFull(f"{where} stayed full for {self.wait_s:.0f}s"
                           + (f" ({free / 2**20:.0f} MB free, trainer.min_free_disk_mb={self.min_free / 2**20:.0f})"
                              if free is not None else ""))

    @property
    def paused(self) -> bool:
        return self.paused_at is not None


def remove_partial(path: Path) -> None:
    """A partial temporary checkpoint left by a write that hit the full disk."""
    import shutil

    for tmp in path.glob(".tmp-step_*") if path.is_dir() else []:
        shutil.rmtree(tmp, ignore_errors=True)



def buffer_log_full(buffer: object) -> bool:
    """The replay buffer's `buffer/disk_full` gauge (a `BufferHost` actor handle); False when the
    buffer does not answer in time (ServiceWatch looks after a dead buffer)."""
    import ray

    try:
        return float(ray.get(buffer.stats.remote(), timeout=10).get("buffer/disk_full", 0.0)) >= 1.0  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a buffer restarting is not a full disk
        return False
