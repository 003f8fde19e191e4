"""Chaos: the stateful processes of a live quick-start-sized run are SIGKILLed while it trains, and
the run still finishes `trainer.max_steps` by itself (real Ray, Serve, vLLM CPU, ZeroMQ, DeepSpeed).

Default tier: the buffer host and the coordinator, once each. Asserts exit 0, every step trained
once, no prompt trained twice and none skipped (every drawn prompt is trained, in the final
checkpoint's buffer snapshot, or in its cursor's re-issue list), buffer accounting closed across
the restart (ingested == consumed + buffered + dropped), the staleness bound held, and the one
asyncrl line per death (recovering, not stopping).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def test_chaos_buffer_host_and_coordinator_killed_once_each(tmp_path: Path) -> None:
    log, run, steps = tmp_path / "launch.log", tmp_path / "chaos", 10
    cmd = [sys.executable, "-m", "asyncrl.launch", "-c", "configs/quickstart.yaml", f"trainer.run_dir={tmp_path}",
           *BASE, "trainer.experiment_name=chaos", f"trainer.max_steps={steps}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_for(log, f"step 2/{steps}", 600, proc)
            for component, line in (("buffer", "the replay buffer (BufferHost) on"), ("coordinator", "the coordinator on")):
                at, t_kill = _steps_logged(run), time.time()
                _kill(run, component)
                _wait_for(log, line, 300, proc)
                t_back = _wait_for(run / "metrics.jsonl", f'"step": {at + 1},', 300, proc)
                print(f"chaos: killed {component} after step {at}; step {at + 1} logged {t_back - t_kill:.1f} s later")
            assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert "died and was restarted by Ray" in text and "stopping" not in text
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    last = rows[-1]
    assert last["buffer/restarts"] == 1 and last["coordinator/restarts"] == 1
    assert last["buffer/ingested"] == (last["buffer/consumed"] + last["buffer/size_groups"]
                                       + last["buffer/dropped_stale"] + last["buffer/dropped_filtered"])
    assert all(r["buffer/staleness_max"] <= 1 for r in rows)
    trained = [i for r in rows for i in r["train/prompt_indices"]]
    assert len(trained) == len(set(trained)) == steps * 2, "a prompt was trained twice"
    final = run / "checkpoints" / f"step_{steps}"
    cursor = json.loads((final / "data_cursor.json").read_text())
    _, _, buffered = read_snapshot(final / "buffer" / "groups.snapshot", 2**30)
    in_snapshot = {int(g.metadata["prompt_index"]) for g in buffered}
    pending = set(cursor["reissue"]) | in_snapshot
    assert not pending & set(trained)
    stream = cursor["stream"]
    drawn = set(range(stream["cursor"])) | set(stream["skip"])
    assert drawn <= set(trained) | pending, f"prompts skipped: {sorted(drawn - set(trained) - pending)}"
