"""Proves the job's own stop rules (asyncrl.failure_watch) on the counters the rollout actors report:
one console line per distinct reward failure however often it repeats, a fatal reward report stops
with the function's own error; a verifier outage (every call in a window failed) and its end are one
line each, and an outage that lasts `verifier.outage_wait_s` stops the job with `VerifierOutage` naming
the back-end, the time and the last error (a shorter one does not; 0 waits forever); re-issued
verifier-error groups are said once; N non-finite learner steps in a row stop
with a named divergence error naming the newest checkpoint written before the streak (a finite step
in between resets the count); and `stop_named` exits 3 with an `error:` line and no checkpoint of
diverged weights."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from asyncrl.failure_watch import (
    DivergenceWatch,
    FailureWatch,
    RewardFunctionFailed,
    TrainingDiverged,
    VerifierOutage,
    nonfinite_step,
    stop_named,
)
from asyncrl.job.recovery import Progress

ERR = "reward function /r.py:main failed at /r.py:3 in main: KeyError: 'x'"


def _reward(count: int, fatal: str | None = None) -> dict:
    return {"reward": {"kinds": [{"error": ERR, "count": count}], "fatal": fatal}}


def test_one_line_per_distinct_reward_failure_then_a_named_stop() -> None:
    lines: list[str] = []
    watch = FailureWatch(fleet=None, echo=lines.append)
    for n in range(1, 200):  # 199 failed groups on two actors: printed once
        watch.observe({"rollout-0": _reward(n), "rollout-1": _reward(n)})
    assert len(lines) == 1 and ERR in lines[0] and "rollout-0" in lines[0]
    with pytest.raises(RewardFunctionFailed) as info:
        watch.observe({"rollout-0": _reward(200, fatal=f"failed on 8 groups in a row: {ERR}")})
    assert ERR in str(info.value) and "rollout-0" in str(info.value)
    assert watch.counted() == f"200x {ERR}"


def test_verifier_outage_and_recovery_are_one_line_each() -> None:
    lines: list[str] = []
    watch = FailureWatch(fleet=None, echo=lines.append)

    def v(calls: int, errors: int, reissued: int = 0) -> dict:
        return {"a": {"verifier": {"calls": calls, "errors": errors, "last_error": "upstream HTTP 502"},
                      "groups_reissued_verifier_error": reissued}}

    watch.observe(v(10, 1))  # a few errors: no outage
    assert lines == []
    watch.observe(v(20, 5, reissued=1))
    assert len(lines) == 1 and "re-issued, not trained" in lines[0]
    watch.observe(v(30, 15, reissued=3))  # every call of the window failed
    watch.observe(v(40, 25, reissued=5))
    assert len(lines) == 2 and "verifier outage: all 10" in lines[1] and "upstream HTTP 502" in lines[1]
    watch.observe(v(50, 26, reissued=5))
    assert len(lines) == 3 and "answers again (9/10" in lines[2]


def _verifier(calls: int, errors: int) -> dict:
    return {"a": {"verifier": {"calls": calls, "errors": errors, "last_error": "upstream HTTP 502"}}}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_an_outage_longer_than_outage_wait_s_stops_the_job_naming_the_verifier() -> None:
    lines: list[str] = []
    clock = Clock()
    watch = FailureWatch(fleet=None, echo=lines.append, outage_wait_s=60, verifier="the http verifier at http://v/v1",
                         clock=clock)
    watch.observe(_verifier(10, 10))  # the outage begins
    assert watch.outage and "http://v/v1" in lines[0] and "verifier.outage_wait_s=60s" in lines[0]
    calls = 10
    for n in range(5):  # 50 s more: windows of failures, and windows where no call ended (still an outage)
        clock.t += 10
        calls += 10 if n % 2 == 0 else 0
        watch.observe(_verifier(calls, calls))
    assert len(lines) == 1 and watch.outage
    clock.t += 10
    with pytest.raises(VerifierOutage) as info:
        watch.observe(_verifier(calls + 10, calls + 10))
    msg = str(info.value)
    assert "the http verifier at http://v/v1 failed every call for 60s" in msg and "upstream HTTP 502" in msg


def test_a_shorter_outage_is_ridden_out_and_zero_waits_forever() -> None:
    lines: list[str] = []
    clock = Clock()
    watch = FailureWatch(fleet=None, echo=lines.append, outage_wait_s=60, clock=clock)
    watch.observe(_verifier(10, 10))
    clock.t += 59
    watch.observe(_verifier(20, 19))  # it answers again one second before the limit
    assert not watch.outage and "after 59s of outage" in lines[1]
    clock.t += 100
    watch.observe(_verifier(30, 29))  # a later outage is timed from its own start
    watch.observe(_verifier(40, 39))
    forever = FailureWatch(fleet=None, echo=lines.append, outage_wait_s=0, clock=clock)
    forever.observe(_verifier(10, 10))
    clock.t += 10**6
    forever.observe(_verifier(20, 20))
    assert forever.outage


def _metrics(norm: float, skipped: float = 1.0, loss: float = 0.1) -> dict:
    return {"train/grad_norm": norm, "train/skipped_steps": skipped, "loss/pg": loss}


def test_nonfinite_step_rule() -> None:
    assert nonfinite_step(_metrics(math.nan))
    assert nonfinite_step(_metrics(1.0, skipped=0.0, loss=math.inf))
    assert not nonfinite_step(_metrics(3.0, skipped=1.0))  # one of its optimizer steps trained
    assert not nonfinite_step(_metrics(0.5, skipped=0.0))


def test_divergence_stops_after_n_in_a_row_naming_the_last_good_checkpoint(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step_2").mkdir(parents=True)
    watch = DivergenceWatch(3, ckpts)
    watch.observe(3, _metrics(math.nan))
    watch.observe(4, _metrics(math.nan))
    watch.observe(5, _metrics(0.7, skipped=0))  # a finite step resets the streak
    watch.observe(6, _metrics(math.nan))
    (ckpts / "step_7").mkdir()  # written during the streak: not a good one
    watch.observe(7, _metrics(math.nan))
    with pytest.raises(TrainingDiverged) as info:
        watch.observe(8, _metrics(math.nan))
    msg = str(info.value)
    assert "3 learner steps in a row (up to step 8)" in msg and f"last good checkpoint: {ckpts / 'step_2'}" in msg


def test_stop_named_exits_3_without_checkpointing_diverged_weights(tmp_path: Path, capsys) -> None:
    class Logger:
        closed = False

        def close(self) -> None:
            self.closed = True

    saved = []
    logger = Logger()
    code = stop_named(TrainingDiverged("training diverged: x"), tmp_path, Progress(step=4, version=4), logger,
                      lambda: saved.append(1))
    out = capsys.readouterr().out + capsys.readouterr().err
    assert code == 3 and saved == [] and logger.closed
    assert "error: TrainingDiverged: training diverged: x" in out
    assert "TrainingDiverged" in (tmp_path / "error.log").read_text()
    code = stop_named(RewardFunctionFailed("r"), tmp_path, Progress(step=4, version=4), logger, lambda: saved.append(1))
    assert code == 3 and saved == [1]
