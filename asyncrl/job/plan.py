"""The scheduler of a job's start-up: steps that are mostly waiting (a process start, a
deployment, a model build) begin in the background as soon as what they need exists, and the
topology waits for each in order when its result is needed.

`StartPlan` guarantees:
- every step is timed and announced (`starting X ...` / `X ready (Ns)`), and a step that fails
  raises `StartupError` naming it (`asyncrl.startup.step_timer`);
- a background start that has already failed stops the launch at the next step, not when its own
  wait comes (an unreachable HTTP verifier stops the launch before any engine is built), and so do
  training rows that did not load (`early_checks`);
- after any failure, the background starts still running are waited for (bounded) and what they
  started is handed to `adopt`, so the topology's shutdown stops it too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from asyncrl.startup import step_timer

__all__ = ["StartPlan"]


class StartPlan:
    """`begin` a step in the background, `wait` for it by name; `step` times one done in line."""

    def __init__(self, timeout_s: float, adopt: Callable[[str, Any | BaseException], None],
                 early_checks: list[Callable[[], None]] | None = None, workers: int = 3) -> None:
        self.timeout_s = timeout_s
        self.adopt = adopt  # (key, what its start returned or raised) after a failed start-up
        self.early_checks = list(early_checks or [])
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="asyncrl-start")
        self._pending: dict[str, tuple[str, Future]] = {}  # key -> (step name, its start)

    def begin(self, key: str, what: str, start: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Start step `what` in the background; `wait(key)` takes its result."""
        self._pending[key] = (what, self._pool.submit(start, *args, **kwargs))

    def wait(self, key: str) -> Any:
        """The result of the background step `key`, timed as that step."""
        what, future = self._pending[key]
        with self.step(what):
            result = future.result(timeout=self.timeout_s)
        del self._pending[key]  # kept until now: a failed wait still hands what it started to `adopt`
        return result

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """A step done in line; background starts that already failed are reported first."""
        self.check()
        with step_timer(what):
            yield

    def check(self) -> None:
        """Raise the failure of a background start that has already failed, or of an early check."""
        for what, future in list(self._pending.values()):
            if future.done() and future.exception() is not None:
                with step_timer(what):
                    future.result()
        for check in self.early_checks:
            check()

    @contextlib.contextmanager
    def stopping_on_failure(self, stop: Callable[[], None]) -> Iterator[StartPlan]:
        """Run the plan; on any failure hand every background start to `adopt`, then call `stop`."""
        try:
            yield self
        except BaseException:
            for key, (_, future) in self._pending.items():
                try:
                    self.adopt(key, future.result(timeout=60))
                except BaseException as exc:  # noqa: BLE001 - its own failure is not the one being reported
                    self.adopt(key, exc)
            stop()
            raise
        finally:
            self._pool.shutdown(wait=False)
