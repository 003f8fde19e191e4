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
