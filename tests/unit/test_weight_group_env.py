"""The NCCL environment of the weight group, checkable without a GPU: NCCL_CUMEM_ENABLE is
aligned to the sender's value (set when unset, a loud error naming both values when it differs);
the error-handling mode is set only around the group's construction; `wait_work` enforces its
deadline on a collective that never completes (a fake Work: no GPU here) and re-raises a failed
one's error."""

from __future__ import annotations

import logging
import os
import time

import pytest

from asyncrl.weights import group as w


def test_cumem_set_when_unset_and_loud_when_different(monkeypatch, caplog):
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    assert w.align_nccl_cumem("1") == "1" and os.environ["NCCL_CUMEM_ENABLE"] == "1"
    assert w.align_nccl_cumem(None) == "1"  # already set, plan without a value: keep, and no error
    with caplog.at_level(logging.ERROR):
        assert w.align_nccl_cumem("0") == "1"
    assert "NCCL_CUMEM_ENABLE=1 here but 0" in caplog.text


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
