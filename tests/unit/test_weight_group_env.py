"""The NCCL environment of the weight group, checkable without a GPU: one NCCL_CUMEM_ENABLE for the
whole job (the launcher's value, else "0", in the job's runtime_env and every learner rank's env),
and a disagreement message naming every member that differs;
the error-handling mode is set only around the group's construction; `wait_work` enforces its
deadline on a collective that never completes (a fake Work: no GPU here) and re-raises a failed
one's error."""

from __future__ import annotations

import os
import time

import pytest

from asyncrl.weights import group as w
from asyncrl.weights import nccl_env


def test_one_cumem_value_for_the_whole_job(monkeypatch):
    # The launcher's value, else the default, in the job's runtime_env (every Ray process) and in
    # every learner rank's own environment (DeepSpeed creates its first communicator there).
    from asyncrl.cluster import job_runtime_env
    from asyncrl.config import Config
    from asyncrl.learner.group import rank_env

    cfg = Config()
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    assert nccl_env.job_nccl_env() == {"NCCL_CUMEM_ENABLE": nccl_env.CUMEM_DEFAULT}
    assert job_runtime_env(cfg)["env_vars"]["NCCL_CUMEM_ENABLE"] == rank_env(cfg)["NCCL_CUMEM_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    assert job_runtime_env(cfg)["env_vars"]["NCCL_CUMEM_ENABLE"] == rank_env(cfg)["NCCL_CUMEM_ENABLE"] == "1"


def test_cumem_mismatch_names_every_member_that_disagrees():
    assert nccl_env.cumem_mismatch("0", {"a/tp0": "0", "b/tp0": "0"}, "learner rank 0") is None
    assert nccl_env.cumem_mismatch(None, {"a/tp0": None}, "learner rank 0") is None
    msg = nccl_env.cumem_mismatch("0", {"a/tp0": "0", "b/tp0": "1", "c/tp1": None}, "learner rank 0")
    assert "NCCL_CUMEM_ENABLE=0 on learner rank 0 but b/tp0=1, c/tp1=unset" in msg
    assert "a/tp0" not in msg


def test_error_handling_env_is_scoped(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    with w._scoped_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": w.NCCL_ERROR_HANDLING}):
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: never tear down
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


class FakeWork:  # labelled fake: stands in for an NCCL Work, whose wait() does not block
    def __init__(self, done_after: float | None, error: Exception | None = None) -> None:
        self.t0, self.done_after, self.error = time.monotonic(), done_after, error

    def is_completed(self) -> bool:
        return self.done_after is not None and time.monotonic() - self.t0 >= self.done_after

    def wait(self) -> bool:
        if self.error:
            raise self.error
        return True


def test_wait_work_deadline_ticks_and_errors():
    ticks = []
    with pytest.raises(w.CollectiveTimeout):
        w.wait_work(FakeWork(None), time.monotonic() + 0.3, tick=lambda: ticks.append(1), tick_every_s=0.05)
    assert len(ticks) >= 2  # receivers heartbeat while they wait
    w.wait_work(FakeWork(0.05), time.monotonic() + 5)  # completes: returns
    with pytest.raises(RuntimeError, match="peer gone"):
        w.wait_work(FakeWork(0.0, RuntimeError("peer gone")), time.monotonic() + 5)
    assert w.backstop_timeout(60).total_seconds() > 60 + 1  # the group's own timeout fires after ours
