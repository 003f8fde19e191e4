"""Proves the run directory is owned by one job (asyncrl.job.run_lock), with real processes: while a
process holds the lock a second one is refused with the holder's pid and host; once the holder is
SIGKILLed its lock is taken over with a line naming it; a released lock leaves no file behind; a lock
written on another host is refused by name; and `python -m asyncrl.launch` on a locked run directory
exits 2 naming the first job before anything starts (its config.resolved.json untouched)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.job.run_lock import LOCK_FILE, RunDirLocked, acquire, took_over_line

ROOT = Path(__file__).resolve().parents[2]


def _holder(run_dir: Path) -> subprocess.Popen[str]:
    """A process that takes the lock, says so, and sleeps."""
    code = textwrap.dedent(f"""
        import sys, time
        from asyncrl.job.run_lock import acquire
        lock = acquire({str(run_dir)!r})
        print("held", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_second_owner_refused_then_stale_lock_taken_over(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        with pytest.raises(RunDirLocked) as info:
            acquire(run)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in str(info.value)
        assert str(run) in str(info.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = acquire(run)  # the holder died without releasing
    assert f"pid {holder.pid}" in took_over_line(lock) and "which is gone" in took_over_line(lock)
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / LOCK_FILE).exists()
    again = acquire(run)
    assert took_over_line(again) == ""  # a released lock is no stale lock
    again.release()


def test_a_lock_from_another_host_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 4242, "host": "node-b", "started": 0}))
    with pytest.raises(RunDirLocked) as info:
        acquire(tmp_path)
    assert "pid 4242 on host node-b" in str(info.value) and "delete" in str(info.value)


def test_launch_on_a_locked_run_directory_exits_2_naming_the_first_job(tmp_path: Path) -> None:
    run = tmp_path / "quickstart"
    holder = _holder(run)
    (run / "config.resolved.json").write_text("first job's")
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([sys.executable, "-m", "asyncrl.launch", "-c", "configs/quickstart.yaml",
                               f"trainer.run_dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"is in use by the job of pid {holder.pid} on host {socket.gethostname()}" in proc.stderr, proc.stderr
    assert (run / "config.resolved.json").read_text() == "first job's"
