"""`python -m asyncrl.ctl` against a job that is gone (SIGKILLed launcher, dead Ray address) says so
at once instead of waiting for Ray's GCS timeouts."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("alive_pid", [False, True])
def test_ctl_on_a_stale_job_says_it_is_not_running(tmp_path: Path, alive_pid: bool) -> None:
    run = tmp_path / "run"
    run.mkdir()
    pid = 1 if alive_pid else _dead_pid()  # pid 1 exists: only the unreachable address tells
    (run / "job.json").write_text(json.dumps({"ray_address": f"127.0.0.1:{_closed_port()}", "namespace": "x",
                                              "coordinator": "coordinator", "pid": pid,
                                              "host": socket.gethostname(), "started": time.time() - 90}))
    proc = subprocess.run([sys.executable, "-m", "asyncrl.ctl", "status", "--run-dir", str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"the job of {run} is not running (last seen " in proc.stderr, proc.stderr
    assert ("has exited" in proc.stderr) != alive_pid
    assert "Timed out while waiting for GCS" not in proc.stderr + proc.stdout


def test_ctl_status_of_a_killed_job_shows_its_last_status_as_not_running(tmp_path: Path) -> None:
    """A SIGKILLed job leaves job.json and status.json behind: `ctl status` prints the last status
    it wrote, marked not running, and says why on stderr (exit 0: the table is still the answer)."""
    from asyncrl.job.status import write_status

    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({"ray_address": f"127.0.0.1:{_closed_port()}", "namespace": "x",
                                              "coordinator": "coordinator", "pid": _dead_pid(),
                                              "host": socket.gethostname(), "started": time.time() - 90}))
    write_status(run, {"run_dir": str(run), "step": 7, "max_steps": 10})
    proc = subprocess.run([sys.executable, "-m", "asyncrl.ctl", "status", "--run-dir", str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "not running" in proc.stdout and "7/10" in proc.stdout.replace(" ", "")
    assert f"the job of {run} is not running (last seen " in proc.stderr


def _silent_listener() -> socket.socket:
    """A port that accepts TCP connections and never answers: a dead job's Ray address that
    something else now uses."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


@pytest.mark.parametrize("case", ["pid_reused", "other_host"])
def test_ctl_answers_within_seconds_when_the_address_is_reused(tmp_path: Path, case: str) -> None:
    """A job that died without cleaning up: its address now accepts connections but is not its Ray
    cluster. Its launcher's pid reused by a later process is seen at once; a job of another host (pid
    not checkable) is given up on after ctl's connect deadline, not Ray's minutes of retries."""
    run = tmp_path / "run"
    run.mkdir()
    listener = _silent_listener()
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (run / "job.json").write_text(json.dumps({
            "ray_address": f"127.0.0.1:{listener.getsockname()[1]}", "namespace": "x", "coordinator": "coordinator",
            "pid": later.pid, "host": socket.gethostname() if case == "pid_reused" else "node-gone",
            "started": time.time() - 90}))
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "asyncrl.ctl", "stop", "--run-dir", str(run)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
    finally:
        later.kill()
        later.wait()
        listener.close()
    assert proc.returncode == 2, proc.stderr
    if case == "pid_reused":
        assert "that pid now belongs to a process started later" in proc.stderr, proc.stderr
    else:
        assert "no answer from its Ray address" in proc.stderr and "within 15s" in proc.stderr, proc.stderr
    assert took < 100, took  # generous for a loaded machine; Ray's own retries took >= 300 s
