"""Nothing the job started lives longer than the job.

Ray ends the job's actors at shutdown, but not every process an actor starts: vLLM's engine core is
a forked child that outlives an actor killed with SIGKILL, and a worker whose process cannot exit
(a thread stuck in a reward call, a child ignoring SIGTERM) is left behind. So every rollout actor
records itself and its descendants in `<run_dir>/state/procs/` (`record`: pid, start time, role,
host), and the launcher, after Ray's shutdown, ends whatever of those is still alive on its host
(`reap`: a grace period to exit, then SIGTERM, then SIGKILL) and says so. A record is matched by pid AND
start time, so a pid reused by an unrelated process is never signalled.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

PROCS_DIR = Path("state") / "procs"


def record(directory: str | os.PathLike[str], role: str, pids: list[int] | None = None) -> list[int]:
    """Record `pids` (default: this process and all its descendants) as started by the job."""
    import psutil

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if pids is None:
        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
    else:
        procs = [psutil.Process(p) for p in pids]
    host = socket.gethostname()
    done = []
    for p in procs:
        try:
            name = role if pids is not None or p.pid == os.getpid() else f"{role}'s child {p.name()}"
            entry = {"pid": p.pid, "create_time": p.create_time(), "role": name, "host": host}
        except psutil.Error:
            continue
        (directory / f"{p.pid}.json").write_text(json.dumps(entry))
        done.append(p.pid)
    return done


def reap(directory: str | os.PathLike[str], grace_s: float = 3.0) -> list[str]:
    """End every recorded process of this host that is still alive (same pid and start time) and
    does not exit by itself within `grace_s`: SIGTERM, then SIGKILL after another `grace_s`. Returns
    "role (pid N)" of each one that had to be ended; the records go."""
    import psutil

    directory = Path(directory)
    if not directory.is_dir():
        return []
    host = socket.gethostname()
    alive: list[tuple[psutil.Process, str]] = []
    for path in sorted(directory.glob("*.json")):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if entry.get("host") != host:
            continue  # another node's: Ray's shutdown there, or that node's own cleanup
        path.unlink(missing_ok=True)
        if int(entry["pid"]) == os.getpid():
            continue
        try:
            proc = psutil.Process(int(entry["pid"]))
            if abs(proc.create_time() - float(entry["create_time"])) > 0.01:
                continue  # the pid was reused by a process the job did not start
            alive.append((proc, f"{entry['role']} (pid {proc.pid})"))
        except psutil.Error:
            continue
    if not alive:
        return []
    names = {p.pid: name for p, name in alive}
    _, left = psutil.wait_procs([p for p, _ in alive], timeout=grace_s)  # exiting on their own (Ray's shutdown)
    for p in left:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(left, timeout=grace_s)
    for p in still:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(still, timeout=grace_s)
    return [names[p.pid] for p in left]


def procs_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / PROCS_DIR
