"""The job's recovery bookkeeping (asyncrl.job.recovery), without Ray: which prompts a rolled-back
learner trains again, the `resumed_from` marker, the bounded memory of trained prompts, when a
learner death is recovered in the job, and the stop on any other failure (the step the learner
trained is logged, the emergency checkpoint is attempted, exit status 3)."""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.job.recovery import (
    RECENT_PROMPTS,
    LearnerRecovery,
    Progress,
    mark_resume,
    prompts_to_retrain,
    stop_on_failure,
)
from asyncrl.job.topology import Topology
from asyncrl.metrics import MetricLogger, effective_rows


def _cfg(tmp_path: Path, *overrides: str):
    return load_config("configs/quickstart.yaml", [f"trainer.run_dir={tmp_path}", "trainer.logger=[jsonl]", *overrides])


def test_the_rolled_back_steps_and_the_step_in_progress_are_trained_again():
    rows = [{"step": 1, "train/prompt_indices": [0, 1]}, {"step": 2, "train/prompt_indices": [2, 3]},
            {"step": 3, "train/prompt_indices": [4, -1]}]
    taken = [{"prompt_index": 7}, {"prompt_index": -1}]
    # back to the checkpoint of step 1: steps 2 and 3 and the batch in progress; -1 (synthetic) never
    assert prompts_to_retrain(rows, 1, taken) == [2, 3, 4, 7]
    assert prompts_to_retrain(rows, 3, []) == []


def test_the_trained_prompts_are_remembered_up_to_a_bound_newest_kept():
    p = Progress(step=0, version=0)
    p.mark_trained(list(range(RECENT_PROMPTS + 10)))
    assert len(p.trained_recent) == RECENT_PROMPTS
    assert 9 not in p.trained_recent and 10 in p.trained_recent and RECENT_PROMPTS + 9 in p.trained_recent


def test_a_resume_marker_counts_the_steps_trained_again(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in (1, 2, 3, 4):
            f.write(json.dumps({"step": step, "loss/pg": float(step)}) + "\n")
    mark_resume(tmp_path, 2, tmp_path / "checkpoints" / "step_2")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["resumed_from"].endswith("step_2") and rows[-1]["rolled_back_steps"] == 2  # steps 3, 4
    assert [r["step"] for r in effective_rows(rows)] == [1, 2]


def test_a_learner_death_is_recovered_only_while_allowed(tmp_path):
    topo = Topology(cfg=_cfg(tmp_path), run_dir=tmp_path, namespace="t")
    on = LearnerRecovery(_cfg(tmp_path, "cluster.max_restarts=1"), topo, fleet=None, run_dir=tmp_path)
    assert on.applies("learner rank 0") and not on.applies("the coordinator")
    on.recoveries = 1  # the one restart is spent
    assert not on.applies("learner rank 0")
    unbounded = LearnerRecovery(_cfg(tmp_path, "cluster.max_restarts=-1"), topo, fleet=None, run_dir=tmp_path)
    unbounded.recoveries = 100
    assert unbounded.applies("learner rank 1")
    off = LearnerRecovery(_cfg(tmp_path, "trainer.recover_learner=false"), topo, fleet=None, run_dir=tmp_path)
    assert not off.applies("learner rank 0")


def test_a_driver_failure_is_not_a_learner_recovery(tmp_path):
    topo = Topology(cfg=_cfg(tmp_path), run_dir=tmp_path, namespace="t")  # no services: the driver failed
    logger = MetricLogger(tmp_path, ["jsonl"], "p", "e", {})
    progress = Progress(step=3, version=3)
    assert LearnerRecovery(_cfg(tmp_path), topo, None, tmp_path).recover(ValueError("x"), progress, logger) is False
    assert (progress.step, progress.version) == (3, 3)
    logger.close()


def test_a_failure_logs_the_trained_step_tries_a_checkpoint_and_exits_3(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    topo = Topology(cfg=_cfg(tmp_path), run_dir=tmp_path, namespace="t")
    logger = MetricLogger(tmp_path, ["jsonl"], "p", "e", {})
    progress = Progress(step=4, version=4, pending_row={"loss/pg": 0.25})
    calls = []

    def checkpoint() -> Path:
        calls.append(progress.step)
        raise OSError("disk full")  # reported, not raised: the job is already failing

    rc = stop_on_failure(RuntimeError("boom"), topo, tmp_path, progress, logger, checkpoint)
    assert rc == 3 and calls == [5]  # the checkpoint is of step 5, which the learner trained
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["step"] == 5 and row["loss/pg"] == 0.25 and "died during this step" in row["error"]
    assert progress.pending_row is None
    assert "RuntimeError: boom" in (tmp_path / "error.log").read_text()
