"""`RewardGuard`: every reward call of a rollout actor bounded, named when it fails, and tallied.

Guarantees
- Each call runs in its own daemon thread and is awaited for at most `reward.call_timeout_s`; a call
  that does not return by then fails with `RewardCallTimeout`, which names the function. A Python
  thread cannot be killed, so the hung one keeps running until the process ends; being a daemon
  thread it never holds the process's exit (a `ThreadPoolExecutor` worker is joined at interpreter
  exit, which kept a rollout worker with a hung reward call alive after its job had ended).
- A failure is a `RewardCallError` whose message names the function (`where`), the place in the code
  that raised (file, line, function: the deepest frame outside the standard library and site
  packages) and the exception. Distinct failures are keyed by (place, exception type): the actor
  logs the first of each kind with its traceback, and counts the rest.
- `fatal` is set once `max_consecutive_failures` calls in a row failed (0: never): the job reads it
  (`report()`, through the actor's `health()`) and stops with that message instead of waiting for a
  batch that cannot come.
"""

from __future__ import annotations

import asyncio
import sysconfig
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RewardCallError", "RewardCallTimeout", "RewardGuard", "origin_of"]

_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


class RewardCallError(RuntimeError):
    """A reward call that raised or returned something unusable; `key` groups failures of one kind."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


class RewardCallTimeout(RewardCallError):
    """A reward call that did not return within `reward.call_timeout_s`."""


def origin_of(exc: BaseException, prefer: str = "") -> str:
    """`file:line in function` of the code that raised `exc` (its root cause's traceback): the deepest
    frame in the file `prefer` (the plug-in's), else the deepest outside the standard library, site
    packages and asyncrl's reward plumbing, else the deepest frame; "" without a traceback."""
    frames = traceback.extract_tb(_root(exc).__traceback__)
    if not frames:
        return ""
    own = [f for f in frames if not f.filename.startswith(_LIBRARY_DIRS) and not f.filename.endswith(_PLUMBING)]
    mine = [f for f in frames if prefer and f.filename == prefer]
    f = (mine or own or frames)[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


def _root(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


_PLUMBING = tuple(f"asyncrl/rewards/{name}.py" for name in ("plugins", "scorer", "guard"))


@dataclass
class _Tally:
    calls: int = 0
    ok: int = 0
    failed: int = 0
    consecutive: int = 0
    hung: int = 0
    kinds: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> {"error": first message, "count"}
    fatal: str | None = None


class RewardGuard:
    """A batch reward function (`asyncrl.rewards.build_reward_fn`) called under a deadline."""

    def __init__(self, fn: Callable[[list[dict[str, Any]]], list[dict[str, float]]], call_timeout_s: float,
                 max_consecutive_failures: int = 0):
        self.fn = fn
        self.where = str(getattr(fn, "where", None) or getattr(fn, "__qualname__", repr(fn)))
        self.call_timeout_s = float(call_timeout_s)
        self.max_consecutive_failures = int(max_consecutive_failures)
        self.tally = _Tally()

    async def score_async(self, items: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
        """The scores of `items`, or `RewardCallError` / `RewardCallTimeout` (counted in `tally`)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self.tally.calls += 1

        def settle(result: Any, error: BaseException | None) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(result)

        def call() -> None:
            try:
                result, error = self.fn(list(items)), None
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting loop
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop closed meanwhile (actor shutting down)
                pass

        threading.Thread(target=call, name=f"reward-{self.tally.calls}", daemon=True).start()
        try:
            scores = await asyncio.wait_for(asyncio.shield(done), timeout=self.call_timeout_s)
        except TimeoutError:
            self.tally.hung += 1
            raise self._failed(RewardCallTimeout(
                f"reward function {self.where} did not return within reward.call_timeout_s="
                f"{self.call_timeout_s:g}s (hung; its thread is left behind)", key=f"timeout:{self.where}")) from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - named and counted, then raised as one kind
            where = origin_of(exc, prefer=self.where.rpartition(":")[0])
            root = _root(exc)  # a plug-in's own exception, not the wrapper that names the plug-in
            message = str(root) if root is exc and str(exc).startswith("reward function ") else \
                f"{type(root).__name__}: {root}"
            raise self._failed(RewardCallError(
                f"reward function {self.where} failed at {where or '?'}: {message}",
                key=f"{where}:{type(exc).__name__}")) from exc
        self.tally.ok += 1
        self.tally.consecutive = 0
        return scores

    def _failed(self, err: RewardCallError) -> RewardCallError:
        t = self.tally
        t.failed += 1
        t.consecutive += 1
        kind = t.kinds.setdefault(err.key, {"error": str(err), "count": 0})
        kind["count"] += 1
        err.first_of_kind = kind["count"] == 1  # type: ignore[attr-defined]
        if t.fatal is None and 0 < self.max_consecutive_failures <= t.consecutive:
            t.fatal = (f"the reward function failed on {t.consecutive} groups in a row "
                       f"(reward.max_consecutive_failures={self.max_consecutive_failures}): {err}")
        return err

    def report(self) -> dict[str, Any]:
        """Cumulative counters (JSON-able): calls, ok, failed, consecutive, hung, the distinct failure
        kinds with their first message and count, and the fatal message (None while the job may go on)."""
        t = self.tally
        return {"calls": t.calls, "ok": t.ok, "failed": t.failed, "consecutive": t.consecutive, "hung": t.hung,
                "kinds": [dict(v) for v in t.kinds.values()], "fatal": t.fatal}

