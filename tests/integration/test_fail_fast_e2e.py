"""End to end through `python -m asyncrl.launch` on the quick-start world: a job whose outside world
is broken says what failed, fast, and leaves nothing running.

Proves: a reward plug-in that raises on every group stops the job with exit 3 and its own error (file,
line, function, message) within seconds of the first failures, not after `learner.batch_timeout_s`
with "is the rollout fleet alive?", and the error is on the console once, not once per group; a reward
plug-in that hangs is named as hung (`reward.call_timeout_s`) and no process of the job (engine core,
rollout worker with the hung call) is alive after the launcher exits; `learner.optim.lr=1e3` stops
with a named divergence error naming the last good checkpoint; a total outage of an HTTP verifier's
upstream is said on the console and stops the job with `VerifierOutage` after `verifier.outage_wait_s`,
nothing trained.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "assets" / "tiny-policy"
pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="quick-start policy not built")]

BASE = ["rollout.n=4", "data.rollout_batch_size=2", "rollout.cpus_per_actor=0.5", "learner.cpus_per_rank=0.5",
        "trainer.logger=[jsonl]", "learner.weights.timeout_s=30", "trainer.eval_before_after=false",
        "trainer.eval_every=-1", "rollout.groups_in_flight=2", "learner.batch_timeout_s=600"]


def launch(run_dir: Path, *overrides: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess[str], float]:
    """The launch's output and the seconds from its "rollout actors ... ready" line (training starts)
    to its exit (printed, for the note; not asserted: the machine is shared)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RAY_USAGE_STATS_ENABLED="0",
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "asyncrl.launch", "-c", "configs/quickstart.yaml", f"trainer.run_dir={run_dir}",
           *BASE, *overrides]
    popen = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(popen.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    lines, ready = [], None
    deadline = time.monotonic() + timeout
    for line in popen.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if ready is None and line.startswith("[asyncrl] rollout actors x") and " ready (" in line:
            ready = time.monotonic()
        assert time.monotonic() < deadline, "".join(lines)[-3000:]
    popen.wait(timeout=max(1.0, deadline - time.monotonic()))
    reader.join(timeout=10)
    took = time.monotonic() - (ready or time.monotonic())
    print(f"{run_dir}: exit {popen.returncode}, {took:.1f}s from the fleet's start to the exit")
    return subprocess.CompletedProcess(cmd, popen.returncode, "".join(lines), "".join(err)), took


def processes_of(run_dir: Path) -> list[str]:
    """Processes whose environment names this run directory (every process of the job has the role
    log directory `<run_dir>/<experiment>/logs` in its environment)."""
    found = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if any(str(run_dir) in v for v in p.environ().values()):
                found.append(f"{p.info['pid']} {p.info['name']}")
        except (psutil.Error, OSError):
            continue
    return found


def _plugin(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "bad_reward.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_a_reward_function_that_always_raises_stops_the_job_naming_it(tmp_path: Path) -> None:
    plugin = _plugin(tmp_path, """
        def score(items, **kwargs):
            return [{"overall": float(item["answer"])} for item in items]
    """)
    proc, _ = launch(tmp_path, "trainer.experiment_name=raises", "trainer.max_steps=3",
                     f"reward.function={plugin}:score", "reward.max_consecutive_failures=4")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert "RewardFunctionFailed" in out and f"failed at {plugin}:3 in " in out, out[-4000:]
    assert "KeyError: 'answer'" in out
    assert "is the rollout fleet alive" not in out
    assert out.count("KeyError: 'answer'") <= 4, out[-4000:]  # said once (+ the stop line), not per group
    time.sleep(2)
    assert processes_of(tmp_path) == []


def test_a_hung_reward_function_is_named_and_nothing_outlives_the_job(tmp_path: Path) -> None:
    plugin = _plugin(tmp_path, """
        import time
        def score(items, **kwargs):
            while True:
                time.sleep(0.1)
    """)
    proc, _ = launch(tmp_path, "trainer.experiment_name=hangs", "trainer.max_steps=3", f"reward.function={plugin}:score",
                     "reward.call_timeout_s=3", "reward.max_consecutive_failures=2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert f"reward function {plugin}:score did not return within reward.call_timeout_s=3s" in out, out[-4000:]
    time.sleep(2)
    assert processes_of(tmp_path) == []


def test_a_diverging_run_stops_with_a_named_error(tmp_path: Path) -> None:
    proc, _ = launch(tmp_path, "trainer.experiment_name=lr", "trainer.max_steps=12", "learner.optim.lr=1e3",
                     "learner.kl.enable=false", "trainer.save_every=1", "learner.max_nonfinite_steps=2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert "TrainingDiverged" in out and "last good checkpoint: " in out, out[-4000:]


def test_a_full_disk_during_a_run_pauses_then_ends_with_a_named_error(tmp_path: Path) -> None:
    """The run directory on a 256 MB tmpfs that the test fills after the first trained step (leaving
    ~1 MB): admission pauses with a line, and the job ends with DiskFull, exit 3, its emergency
    checkpoint written to `trainer.emergency_dir` (outside the full disk)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    spare = tmp_path / "spare"
    filled = threading.Event()

    def fill_after_first_step() -> None:
        metrics = mnt / "full" / "metrics.jsonl"
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.5)
        free = psutil.disk_usage(str(mnt)).free
        with open(mnt / "filler", "wb") as f:
            f.truncate(0)
            f.write(b"\0" * max(0, free - 2**20))
        filled.set()

    filler = threading.Thread(target=fill_after_first_step, daemon=True)
    filler.start()
    try:
        proc, _ = launch(mnt, "trainer.experiment_name=full", "trainer.max_steps=200", "trainer.save_every=-1",
                         "trainer.min_free_disk_mb=4", "trainer.disk_full_wait_s=15", f"trainer.emergency_dir={spare}")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    out = proc.stdout + proc.stderr
    assert filled.is_set(), out[-3000:]
    assert proc.returncode == 3, out[-4000:]
    assert "error: DiskFull: " in out, out[-4000:]
    assert "admission paused" in out or "failed on a full disk" in out
    ckpts = list((spare / "asyncrl-emergency" / "full").glob("step_*"))
    assert len(ckpts) == 1 and (ckpts[0] / "run_state.json").exists(), out[-3000:]
    assert f"emergency checkpoint written outside the run directory: {ckpts[0]}" in out


def test_a_failing_http_verifier_upstream_is_counted_and_never_trained(tmp_path: Path) -> None:
    """verifier.backend=http whose upstream answers every 4th request with 502 (no retries): about
    a quarter of the verifier calls fail. `verifier/error_rate` shows it within [0, 1], the groups whose
    conversations a verifier failure ended are re-run or re-issued (counted), and no trained
    sample ends with `verifier_error`."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    calls = {"n": 0}
    lock = threading.Lock()

    class Upstream(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with lock:
                calls["n"] += 1
                fail = calls["n"] % 4 == 0
            body = b'{"error": {"message": "upstream overloaded"}}' if fail else json.dumps(
                {"choices": [{"message": {"role": "assistant", "content": "###STOP###"}, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
            self.send_response(502 if fail else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc, _ = launch(tmp_path, "trainer.experiment_name=flaky", "trainer.max_steps=3", "verifier.backend=http",
                         f"verifier.http.base_url=http://127.0.0.1:{server.server_address[1]}/v1",
                         "verifier.http.max_retries=0", "verifier.client.max_retries=0",
                         "reward.max_consecutive_failures=0")
    finally:
        server.shutdown()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert calls["n"] > 10
    rows = [json.loads(line) for line in (tmp_path / "flaky" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "resumed_from" not in r]
    rates = [r["verifier/error_rate"] for r in rows]
    print("verifier/error_rate per step:", rates, "upstream calls:", calls["n"], "re-run conversations:",
          rows[-1].get("rollout/conversations_rerun_verifier_error"), "re-issued groups:",
          rows[-1].get("rollout/groups_reissued_verifier_error"))
    assert all(0.0 <= x <= 1.0 for x in rates) and max(rates) > 0.1, rates
    last = rows[-1]
    assert last["rollout/conversations_rerun_verifier_error"] + last["rollout/groups_reissued_verifier_error"] > 0
    assert all(r.get("rollout/finish_reason/verifier_error", 0) == 0 for r in rows)


def _upstream(answer) -> Any:
    """An OpenAI-compatible upstream on loopback; `answer()` -> True for a good reply, False for a 502."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    calls = {"n": 0}

    class Upstream(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            calls["n"] += 1
            ok = answer()
            body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "###STOP###"},
                                            "finish_reason": "stop"}],
                               "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode() if ok else \
                b'{"error": {"message": "upstream down"}}'
            self.send_response(200 if ok else 502)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    server.calls = calls  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_total_verifier_outage_is_said_and_stops_the_job_after_outage_wait_s(tmp_path: Path) -> None:
    """verifier.backend=http whose upstream answers until the first step is trained, then answers every
    call with 502 (a verifier that is down from the start is refused by the start-up probe instead):
    the console says the outage began (naming the back-end and the last error), nothing the verifier
    could not judge is trained, and after `verifier.outage_wait_s` the job stops with `VerifierOutage`,
    exit 3, instead of waiting out `learner.batch_timeout_s` (600 s here) and blaming the rollout fleet."""
    import json

    down = threading.Event()
    metrics = tmp_path / "outage" / "metrics.jsonl"

    def take_it_down_after_the_first_step() -> None:
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.5)
        down.set()

    threading.Thread(target=take_it_down_after_the_first_step, daemon=True).start()
    server = _upstream(lambda: not down.is_set())
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        proc, took = launch(tmp_path, "trainer.experiment_name=outage", "trainer.max_steps=50",
                            "trainer.save_every=-1", "verifier.backend=http", f"verifier.http.base_url={url}",
                            "verifier.http.max_retries=0", "verifier.client.max_retries=0", "verifier.outage_wait_s=30")
    finally:
        server.shutdown()
    out = proc.stdout + proc.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    rows = [r for r in rows if "train/version" in r or "verifier/error_rate" in r]
    print("upstream calls:", server.calls["n"], "steps logged:", len(rows), "verifier/error_rate per step:",
          [r.get("verifier/error_rate") for r in rows], f"; {took:.1f}s from the fleet's start to the exit")
    print("".join(line + "\n" for line in out.splitlines()
                  if "verifier outage" in line or "VerifierOutage" in line or line.startswith("stopping at")))
    assert down.is_set(), out[-4000:]
    assert proc.returncode == 3, out[-4000:]
    assert "verifier outage: all " in out and f"the http verifier at {url}" in out, out[-4000:]
    assert "error: VerifierOutage: " in out and "verifier.outage_wait_s=30" in out, out[-4000:]
    assert "is the rollout fleet alive" not in out
    assert 1 <= len(rows) < 50 and all(0.0 <= r.get("verifier/error_rate", 0.0) <= 1.0 for r in rows)
    assert all(r.get("rollout/finish_reason/verifier_error", 0) == 0 for r in rows)  # none trained
