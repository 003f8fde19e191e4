"""Proves asyncrl.reaper with real processes: a recorded process that ignores SIGTERM (as a worker
stuck in a reward call may) and its forked child (as vLLM's engine core) are both ended by `reap`
and named; a record whose pid now belongs to another process (start time differs) is left alone;
the records are consumed; a process records itself and its descendants with `record()`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

from asyncrl.reaper import reap, record

STUBBORN = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(child.pid, flush=True)
    time.sleep(300)
""")


def test_reap_ends_a_stubborn_process_and_its_child(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        record(tmp_path, "rollout actor rollout-0", pids=[parent.pid, child_pid])
        record(tmp_path, "reused pid", pids=[bystander.pid])
        entry = json.loads((tmp_path / f"{bystander.pid}.json").read_text())
        (tmp_path / f"{bystander.pid}.json").write_text(json.dumps({**entry, "create_time": entry["create_time"] - 50}))
        ended = reap(tmp_path, grace_s=1.0)
        parent.wait(timeout=10)
        assert sorted(ended) == sorted([f"rollout actor rollout-0 (pid {parent.pid})",
                                        f"rollout actor rollout-0 (pid {child_pid})"])
        assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE
        assert bystander.poll() is None  # not the job's process: untouched
        assert list(tmp_path.glob("*.json")) == []
        assert reap(tmp_path) == []
    finally:
        for p in (parent, bystander):
            p.kill()
            p.wait()


def test_record_takes_this_process_and_its_descendants(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        pids = record(tmp_path, "rollout actor r")
        assert child.pid in pids and psutil.Process().pid in pids
        roles = {json.loads(p.read_text())["role"] for p in tmp_path.glob("*.json")}
        assert "rollout actor r" in roles and any(r.startswith("rollout actor r's child ") for r in roles)
    finally:
        child.kill()
        child.wait()
