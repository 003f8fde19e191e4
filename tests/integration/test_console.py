"""A short real job (`python -m asyncrl.launch` on the quick-start topology: Ray, Ray Serve rule
verifier, 2 vLLM CPU engines, ZeroMQ buffer, DeepSpeed learner) as a new user sees it.

Proves: the console carries asyncrl's story only (start-up lines with timings, the log path once,
progress, the summary, the report path) and no per-request or third-party line; the role files
under <run_dir>/logs/ hold what was moved (Serve's per-request lines, vLLM's and DeepSpeed's
start-up output); the run wrote report.html and status.json, and `asyncrl.ctl status` prints the
status as a table without joining Ray. The verbose variant (everything on the console) is `slow`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "assets" / "tiny-policy"
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="quick-start policy not built")]

ARGS = ["rollout.n=4", "data.rollout_batch_size=2", "verifier.port=0", "trainer.logger=[jsonl]",
        "trainer.max_steps=3", "trainer.eval_limit=4", "trainer.eval_every=0", "learner.weights.timeout_s=30",
        "rollout.num_actors=2", "rollout.cpus_per_actor=0.5"]  # two actors: both roles' log files are checked
THIRD_PARTY = re.compile(r"CALL chat|verifier_Verifier|ServeReplica|ProxyActor|ServeController|No CUDA runtime|"
                         r"Triton|WARNING \d\d-\d\d|Loading weights|DeepSpeed|RotaryEmbedding|\(RolloutWorker|"
                         r"\(LearnerActor|Generating train split|core_worker\.cc")


def launch(run_dir: Path, *extra: str, verbose: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RAY_USAGE_STATS_ENABLED="0",
               TOKENIZERS_PARALLELISM="false")
    env.pop("ASYNCRL_VERBOSE", None)
    cmd = [sys.executable, "-m", "asyncrl.launch", "-c", "configs/quickstart.yaml", f"trainer.run_dir={run_dir}",
           "trainer.experiment_name=console", *ARGS, *extra] + (["--verbose"] if verbose else [])
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # a whole launch as a subprocess (~1.5-3 min); default-suite time budget
def test_quiet_console_and_logs_report_status(tmp_path: Path) -> None:
    proc = launch(tmp_path)
    console = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 0, "\n".join(console[-60:])
    run = tmp_path / "console"
    leaked = [line for line in console if THIRD_PARTY.search(line)]
    assert leaked == [], leaked[:10]
    # The story: every console line is asyncrl's (start-up, progress, evaluation, summary block).
    assert any(line.startswith("[asyncrl] logs: ") and str(run / "logs") in line for line in console)
    for needle in ("[asyncrl] rollout actors x2 ready", "[asyncrl] step 3/3", "asyncrl run summary",
                   "[asyncrl] report: "):
        assert any(needle in line for line in console), needle
    assert len(console) < 60, len(console)
    # What was moved off the console is in the files.
    logs = run / "logs"
    requests = sum(p.read_text().count("CALL chat") for p in (logs / "serve").glob("replica_verifier_*.log"))
    assert requests > 0
    for role in ("rollout-0", "rollout-1"):
        text = (logs / f"{role}.log").read_text()
        assert "EngineCore" in text or "vllm" in text.lower(), role
    assert "DeepSpeed" in (logs / "learner-0.log").read_text() or "deepspeed" in (logs / "learner-0.log").read_text()
    driver = (logs / "driver.log").read_text()
    assert "Started Serve" in driver and "[asyncrl] step 3/3" in driver
    # The report and the status file.
    html = (run / "report.html").read_text()
    assert 'id="viewer"' in html and "data:image/png;base64," in html
    status = json.loads((run / "status.json").read_text())
    assert status["step"] == 3 and status["max_steps"] == 3 and set(status["actors"]) == {"rollout-0", "rollout-1"}
    table = subprocess.run([sys.executable, "-c", "import sys; from asyncrl.ctl import main; rc = main(sys.argv[1:]);"
                            " assert 'ray' not in sys.modules; sys.exit(rc)", "status", "--run-dir", str(run)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "step     3/3" in table.stdout and "rollout-0" in table.stdout and "not running" in table.stdout


@pytest.mark.slow
def test_verbose_restores_everything_on_the_console(tmp_path: Path) -> None:
    proc = launch(tmp_path, "trainer.max_steps=1", "trainer.eval_before_after=false", "cluster.startup_timeout_s=900",
                  verbose=True)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]
    assert "CALL chat" in console and "(RolloutWorker" in console
    assert not (tmp_path / "console" / "logs").exists()
