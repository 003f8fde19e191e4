"""Turn a reward setting into one batch function, and run it off the asyncio loop.

`build_reward_fn(cfg)` resolves `reward.function` (a built-in name or a plug-in file), binds
`reward.kwargs`, passes `reward.timeout_s` to the built-ins' graders, and wraps the result so
every input is checked (`reward_inputs`: required keys, a None hallucination score dropped as the
original never passes one) and every output validated (`overall` present and numeric). `score_samples` is the synchronous call;
`RewardScorer.score` / `score(...)` run it in a thread pool so a rollout actor's event loop keeps
driving the engine while answers are graded (grading is pure Python: it holds the GIL, so one
worker thread per actor is the default; more threads do not add throughput).

Plug-ins are not time-bounded by asyncrl (the original does not bound them either); built-ins bound
each symbolic comparison by `reward.timeout_s` (grading.py).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from asyncrl.rewards.builtin import BUILTIN_REWARDS
from asyncrl.rewards.plugins import BatchReward, load_reward_function, reward_inputs, validate_scores

__all__ = ["RewardScorer", "build_reward_fn", "load_reward", "score", "score_samples"]


def build_reward_fn(cfg: Any) -> BatchReward:
    """`cfg`: a `RewardConfig` (or any object with `function`, `type`, `kwargs`, `timeout_s`), a
    built-in name, a plug-in spec string, or already a batch callable (returned validated)."""
    if callable(cfg) and not isinstance(cfg, str):
        fn = cfg
        if getattr(fn, "where", None):
            return fn  # already built here
        where = getattr(fn, "__qualname__", repr(fn))

        def call_plain(items: list[dict[str, Any]]) -> list[dict[str, float]]:
            inputs = reward_inputs(items)
            return validate_scores(fn(inputs), len(inputs), where) if inputs else []

        call_plain.where = where  # type: ignore[attr-defined]
        return call_plain
    if isinstance(cfg, str):
        function, rtype, kwargs, timeout_s = cfg, "batch", {}, None
    else:
        function, rtype, kwargs, timeout_s = cfg.function, cfg.type, dict(cfg.kwargs), cfg.timeout_s
    if function not in BUILTIN_REWARDS:
        return load_reward_function(function, rtype, kwargs)
    builtin = BUILTIN_REWARDS[function]
    params = inspect.signature(builtin).parameters
    unknown = sorted(set(kwargs) - set(list(params)[1:]))
    if unknown:
        raise ValueError(f"reward '{function}': unknown kwargs {unknown}; accepted: {list(params)[1:]}")
    if timeout_s is not None and "timeout_s" in params:
        kwargs.setdefault("timeout_s", timeout_s)
    missing = [n for n, p in list(params.items())[1:] if p.default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        raise ValueError(f"reward '{function}' needs reward.kwargs {missing}")
    where = f"built-in:{function}"

    def call(items: list[dict[str, Any]]) -> list[dict[str, float]]:
        inputs = reward_inputs(items)
        return validate_scores(builtin(inputs, **kwargs), len(inputs), where) if inputs else []

    call.where = where  # type: ignore[attr-defined]
    return call


load_reward = build_reward_fn
"""Alias: `load_reward(cfg.reward) -> fn(reward_inputs) -> list[dict]`."""


def score_samples(fn_or_cfg: Any, items: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """Score a batch synchronously: one dict (`overall` + parts) per item, in order."""
    return build_reward_fn(fn_or_cfg)(list(items))


class RewardScorer:
    """A resolved reward function plus the worker thread(s) that run it off the event loop."""

    def __init__(self, fn_or_cfg: Any, max_workers: int = 1, executor: Executor | None = None):
        self.fn: Callable[[list[dict[str, Any]]], list[dict[str, float]]] = build_reward_fn(fn_or_cfg)
        self._own = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward")

    async def score(self, items: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
        """Score in the worker thread; the awaiting loop stays free."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, score_samples, self.fn, list(items))

    def close(self) -> None:
        if self._own:
            self._executor.shutdown(wait=False, cancel_futures=True)


async def score(fn_or_cfg: Any, items: Sequence[Mapping[str, Any]],
                executor: Executor | None = None) -> list[dict[str, float]]:
    """One-shot async scoring in `executor` (default: the loop's default thread pool). For a
    long-lived caller prefer one `RewardScorer`, which resolves the function once."""
    fn = build_reward_fn(fn_or_cfg)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, score_samples, fn, list(items))
