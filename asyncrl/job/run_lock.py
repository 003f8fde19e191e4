"""One job per run directory: `<run_dir>/job.lock`, held for the job's lifetime.

The lock is an advisory `flock` on the file, which the kernel releases when the holding process dies
however it dies (SIGKILL, OOM), plus the holder's pid, host and start time written inside it for the
message a second launch prints. So on one host:
- a second launch on a run directory whose job is alive fails with `RunDirLocked` naming that job
  (the launcher exits 2 before anything starts, nothing of the first job's is touched);
- a lock left by a job that died is taken over at once, with a line saying whose it was.
A lock written on another host (a shared filesystem, where `flock` may not reach across hosts) whose
holder cannot be checked from here is refused by name; delete the file once that job is known gone.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

LOCK_FILE = "job.lock"


class RunDirLocked(RuntimeError):
    """Another live job owns the run directory."""


class RunLock:
    """The held lock of one run directory (`acquire`); `release()` at the job's end."""

    def __init__(self, path: Path, fd: int, took_over: dict[str, Any] | None):
        self.path, self.fd, self.took_over = path, fd, took_over

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            self.path.unlink(missing_ok=True)  # unlinked while still held: no window for a stale read
        finally:
            os.close(self.fd)
            self.fd = -1


def _describe(holder: dict[str, Any]) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (started {when})"


def _read(fd: int) -> dict[str, Any]:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 65536) or b"{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def acquire(run_dir: str | os.PathLike[str]) -> RunLock:
    """Own `run_dir` (created if needed) for this process, or raise `RunDirLocked` naming the holder."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    here = socket.gethostname()
    for _ in range(3):  # a holder that releases (unlinks) between our open and flock: open the new file
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        previous = _read(fd)
        if previous.get("host") not in (None, here):
            os.close(fd)
            raise RunDirLocked(f"run directory {run_dir} is owned by the job of {_describe(previous)}: another host, "
                               f"whose process cannot be checked from here; if that job is gone, delete {path}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirLocked(f"run directory {run_dir} is in use by the job of {_describe(previous)}: "
                               "use another trainer.run_dir / trainer.experiment_name, or stop that job "
                               "(python -m asyncrl.ctl stop --run-dir ...)") from None
        try:
            same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same_file = False
        if not same_file:
            os.close(fd)
            continue
        previous = _read(fd)  # what the last holder wrote, read under the lock
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": here, "started": time.time()}).encode())
        os.fsync(fd)
        return RunLock(path, fd, previous or None)
    raise RunDirLocked(f"run directory {run_dir}: could not take {path} (it keeps being replaced)")


def took_over_line(lock: RunLock) -> str:
    """The line a launch says when it took over a lock left by a job that died ("" when none)."""
    if not lock.took_over:
        return ""
    return f"took over the run directory's lock left by the job of {_describe(lock.took_over)}, which is gone"
