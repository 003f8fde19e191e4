"""Chaos: the stateful processes of a live quick-start-sized run are SIGKILLed while it trains, and
the run still finishes `trainer.max_steps` by itself (real Ray, Serve, vLLM CPU, ZeroMQ, DeepSpeed).

Default tier: the buffer host and the coordinator, once each. Slow tier: a rollout actor, the buffer
host, the coordinator, the verifier replica and a learner rank, in a seeded random order at seeded
random steps, one at a time with recovery in between, and the final evaluation compared with an
undisturbed run of the same length. Both assert exit 0, every step trained once (in the effective
history, after the learner's in-job rollback), no prompt trained twice and none skipped (every drawn prompt is trained, in the final
checkpoint's buffer snapshot, or in its cursor's re-issue list), buffer accounting closed across
the restart (ingested == consumed + buffered + dropped after storing; every stale drop re-issued), the staleness bound held, and the one
asyncrl line per death (recovering, not stopping).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.metrics import effective_rows
from asyncrl.replay.snapshot import read_snapshot

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "assets" / "tiny-policy"
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="quick-start policy not built")]

BASE = ["rollout.n=4", "data.rollout_batch_size=2", "rollout.cpus_per_actor=0.5", "learner.cpus_per_rank=0.5",
        "verifier.port=0", "trainer.logger=[jsonl]", "learner.weights.timeout_s=30", "rollout.num_actors=1",
        "trainer.eval_before_after=false"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
                "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"})
    return env


def _wait_for(path: Path, pattern: str, timeout: float, proc: subprocess.Popen) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and pattern in path.read_text():
            return time.time()
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"{pattern!r} not seen in {path} within {timeout}s:\n{path.read_text()[-4000:]}")


def _steps_logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _kill(run: Path, component: str) -> int:
    pid = int((run / "state" / f"{component}.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    return pid


def _descendant(root: int, needle: str) -> int:
    """A Ray worker of this job (the embedded cluster's processes descend from the launcher)."""
    import psutil

    for p in psutil.Process(root).children(recursive=True):
        try:
            if needle in " ".join(p.cmdline()):
                return p.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no process matching {needle!r} under pid {root}")


RECOVERED = {"buffer": "the replay buffer (BufferHost) on", "coordinator": "the coordinator on",
             "learner": "learner recovered in", "rollout": "restarted at weights", "verifier": None}


def _chaos_run(tmp_path: Path, steps: int, kills: list[tuple[str, int]], *extra: str) -> tuple[Path, str, list[str]]:
    """Launches a run and kills each component after its step (waiting for the recovery line and
    one more trained step in between); returns the run dir, the launcher's log and the timings."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log, run = tmp_path / "launch.log", tmp_path / "chaos"
    cmd = [sys.executable, "-m", "asyncrl.launch", "-c", "configs/quickstart.yaml", f"trainer.run_dir={tmp_path}",
           *BASE, "trainer.experiment_name=chaos", f"trainer.max_steps={steps}", *extra]
    timings = []
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            for component, after in kills:
                _wait_for(run / "metrics.jsonl", f'"step": {after},', 900, proc)
                seen, t_kill = log.read_text().count(RECOVERED[component] or "\0"), time.time()
                if component in ("buffer", "coordinator"):
                    _kill(run, component)
                elif component == "learner":
                    _kill(run, "learner_rank_0")
                else:
                    os.kill(_descendant(proc.pid, {"rollout": "RolloutWorker", "verifier": "ServeReplica:verifier"}
                                        [component]), signal.SIGKILL)
                if RECOVERED[component]:
                    deadline = time.time() + 600
                    while log.read_text().count(RECOVERED[component]) <= seen and time.time() < deadline:
                        assert proc.poll() is None, log.read_text()[-4000:]
                        time.sleep(0.5)
                at = _steps_logged(run)
                deadline = time.time() + 600
                while _steps_logged(run) <= at and time.time() < deadline:
                    assert proc.poll() is None, log.read_text()[-4000:]
                    time.sleep(0.25)
                timings.append(f"killed {component} after step {after}: next step logged {time.time() - t_kill:.1f} s later")
                print("chaos:", timings[-1])
            assert proc.wait(timeout=900) == 0, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    return run, log.read_text(), timings


def _check_history(run: Path, steps: int) -> list[dict]:
    raw = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = effective_rows(raw)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # every step once
    last = rows[-1]
    # nothing lost: every stored group was trained, is buffered, or was dropped stale after storing
    assert last["buffer/ingested"] == (last["buffer/consumed"] + last["buffer/size_groups"]
                                       + last["buffer/dropped_stale"] - last["buffer/dropped_stale_at_ingest"])
    # every drop explained: re-issued, or its prompt was pending re-issue already (lost with a dead process)
    assert last["buffer/reissued_stale"] + last["buffer/stale_already_pending"] == last["buffer/dropped_stale"]
    assert all(r["buffer/staleness_max"] <= 1 for r in rows)
    trained = [i for r in rows for i in r["train/prompt_indices"]]
    assert len(trained) == len(set(trained)) == steps * 2, "a prompt was trained twice"
    final = run / "checkpoints" / f"step_{steps}"
    cursor = json.loads((final / "data_cursor.json").read_text())
    _, _, buffered = read_snapshot(final / "buffer" / "groups.snapshot", 2**30)
    pending = set(cursor["reissue"]) | {int(g.metadata["prompt_index"]) for g in buffered}
    assert not pending & set(trained)
    stream = cursor["stream"]
    drawn = set(range(stream["cursor"]))  # draws 0..cursor-1
    assert drawn <= set(trained) | pending, f"prompts skipped: {sorted(drawn - set(trained) - pending)}"
    return rows


@pytest.mark.slow  # ~3 min of a whole job with kills; moved out of the default suite for its time budget
def test_chaos_buffer_host_and_coordinator_killed_once_each(tmp_path: Path) -> None:
    steps = 10
    run, text, _ = _chaos_run(tmp_path, steps, [("buffer", 2), ("coordinator", 4)])
    assert "died and was restarted by Ray" in text and "; stopping at step" not in text
    rows = _check_history(run, steps)
    assert rows[-1]["buffer/restarts"] == 1 and rows[-1]["coordinator/restarts"] == 1


@pytest.mark.slow
def test_chaos_every_stateful_process_killed_at_seeded_random_moments(tmp_path: Path) -> None:
    rng = random.Random(19)
    order = ["rollout", "buffer", "coordinator", "verifier", "learner"]
    rng.shuffle(order)
    steps, at, kills = 24, 2, []
    for component in order:
        at += rng.randint(2, 3)
        kills.append((component, at))
    evals = ("trainer.eval_before_after=true", "trainer.eval_limit=60", "trainer.save_every=4")
    run, text, timings = _chaos_run(tmp_path / "chaos", steps, kills, *evals)
    assert "; stopping at step" not in text
    rows = _check_history(run, steps)
    assert rows[-1]["buffer/restarts"] == 1 and rows[-1]["coordinator/restarts"] == 1
    calm, _, _ = _chaos_run(tmp_path / "calm", steps, [], *evals)
    disturbed = json.loads((run / "summary.json").read_text())["after"]
    undisturbed = json.loads((calm / "summary.json").read_text())["after"]
    a, b = disturbed["guided_accuracy"], undisturbed["guided_accuracy"]
    se = math.sqrt(max(a * (1 - a), b * (1 - b), 0.01) * 2 / 60)  # two independent 60-row accuracies
    assert abs(a - b) <= 3 * se, (a, b, timings)


@pytest.mark.slow
def test_a_service_that_cannot_come_back_stops_with_a_checkpoint_then_resumes(tmp_path: Path) -> None:
    """`cluster.max_restarts=0`: the killed buffer host stays dead, so the job stops: one asyncrl
    line naming it, a checkpoint of what is alive (learner + cursor, the buffer's prompts marked for
    re-issue), exit 3; `trainer.resume=auto` then finishes with a `resumed_from` row and every
    prompt trained once in the effective history."""
    log, run = tmp_path / "launch.log", tmp_path / "chaos"
    cmd = [sys.executable, "-m", "asyncrl.launch", "-c", "configs/quickstart.yaml", f"trainer.run_dir={tmp_path}",
           *BASE, "trainer.experiment_name=chaos", "trainer.max_steps=8", "cluster.max_restarts=0"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_for(run / "metrics.jsonl", '"step": 3,', 900, proc)
            _kill(run, "buffer")
            assert proc.wait(timeout=600) == 3, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("[asyncrl] the replay buffer (BufferHost) on"))
    assert "died" in line and "stopping at step" in line and "trainer.resume=auto" in line, line
    assert (run / "error.log").exists()
    stopped = max(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    assert stopped >= 3 and (run / "checkpoints" / f"step_{stopped}" / "data_cursor.json").exists()
    resumed = subprocess.run(cmd[:-1] + ["trainer.resume=auto"], cwd=ROOT, env=_env(), capture_output=True,
                             text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    raw = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in raw if "resumed_from" in r][0]["step"] == stopped
    _check_history(run, 8)
