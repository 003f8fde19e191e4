"""Reward plug-ins written for Guided-GRPO, loaded unchanged, and the validation of every reward
function's output.

Follows the original (docs/guided_grpo.md#rewards): `reward.function = path/to/file.py[:fn]` (function
`main` when no colon), the file imported by path, `reward.kwargs` bound as keyword arguments,
`reward.type = batch` (list of RewardInput dicts in, list of score dicts out) or `sequential`
(one dict in, one dict out); RewardInput keys `response`, `response_length`, `ground_truth` and,
when the rollout produced it, `verifier_hallucination_score`.

Departs: every failure names the file and the function (import error, missing function, an
exception inside it, a wrong return shape), and a score dict without a numeric `overall` is an
error rather than a silent zero. Whatever the plug-in's type, `load_reward_function` returns a
function in the batch convention, so callers have one calling convention.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

__all__ = ["RewardFunctionError", "BatchReward", "load_reward_function", "reward_inputs", "validate_scores"]

BatchReward = Callable[[list[dict[str, Any]]], list[dict[str, float]]]


class RewardFunctionError(RuntimeError):
    """A reward function could not be loaded, raised, or returned something unusable."""


def parse_spec(spec: str) -> tuple[Path, str]:
    """`path/to/file.py[:fn]` -> (path, fn); fn defaults to `main` as in Guided-GRPO."""
    path, sep, fn = spec.rpartition(":")
    if not sep or not fn or "/" in fn or fn.endswith(".py"):
        path, fn = spec, "main"
    return Path(path).expanduser(), fn


def _import_file(path: Path, where: str) -> Any:
    if not path.is_file():
        raise RewardFunctionError(f"reward function {where}: no such file {path}")
    resolved = path.resolve()
    name = "asyncrl_reward_plugin_" + hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise RewardFunctionError(f"reward function {where}: cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses/pickling inside the plug-in need it registered
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise RewardFunctionError(f"reward function {where}: importing {path} failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
    return module


REQUIRED_KEYS = ("response", "response_length", "ground_truth")


def reward_inputs(items: Any) -> list[dict[str, Any]]:
    """Check and copy items into Guided-GRPO RewardInput dicts. `verifier_hallucination_score` is
    kept only when not None (the original passes it only when the rollout produced it); other
    keys pass through. Raises ValueError naming the item and key."""
    out = []
    for i, item in enumerate(items):
        for key in REQUIRED_KEYS:
            if key not in item:
                raise ValueError(f"reward input {i} has no {key!r} (keys: {sorted(item)})")
        x = dict(item)
        if x.get("verifier_hallucination_score", 0) is None:
            del x["verifier_hallucination_score"]
        out.append(x)
    return out


def validate_scores(scores: Any, n: int, where: str) -> list[dict[str, float]]:
    """Check a batch result: a list of `n` mappings, each with a finite numeric `overall`; every
    other value numeric (they are logged as `reward/<key>`). Returns plain float dicts."""
    if not isinstance(scores, (list, tuple)):
        raise RewardFunctionError(f"reward function {where} returned {type(scores).__name__}, expected a list "
                                  f"of {n} dicts (is reward.type right?)")
    if len(scores) != n:
        raise RewardFunctionError(f"reward function {where} returned {len(scores)} scores for {n} inputs")
    out = []
    for i, s in enumerate(scores):
        if not isinstance(s, Mapping):
            raise RewardFunctionError(f"reward function {where}: score {i} is {type(s).__name__}, expected a dict")
        if "overall" not in s:
            raise RewardFunctionError(f"reward function {where}: score {i} has no 'overall' key "
                                      f"(keys: {sorted(s)})")
        row: dict[str, float] = {}
        for key, value in s.items():
            try:
                row[str(key)] = float(value)
            except (TypeError, ValueError):
                raise RewardFunctionError(f"reward function {where}: score {i} key {key!r} is not a number "
                                          f"({value!r})") from None
        if not math.isfinite(row["overall"]):
            raise RewardFunctionError(f"reward function {where}: score {i} overall is {row['overall']}")
        out.append(row)
    return out


def load_reward_function(spec: str, type: Literal["batch", "sequential"] = "batch",
                         kwargs: Mapping[str, Any] | None = None) -> BatchReward:
    """Load `path/to/file.py[:fn]` and return `f(items) -> list[dict]` (batch convention, inputs
    checked by `reward_inputs`, kwargs bound, output validated). Raises `RewardFunctionError` naming the file and function."""
    if type not in ("batch", "sequential"):
        raise ValueError(f"reward type must be 'batch' or 'sequential', got {type!r}")
    path, fn_name = parse_spec(spec)
    where = f"{path}:{fn_name}"
    module = _import_file(path, where)
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        public = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        raise RewardFunctionError(f"reward function {where}: {path} has no function {fn_name!r} "
                                  f"(callables: {', '.join(public) or 'none'})")
    bound = dict(kwargs or {})

    def call(items: list[dict[str, Any]]) -> list[dict[str, float]]:
        inputs = reward_inputs(items)
        if not inputs:
            return []
        try:
            if type == "batch":
                result = fn(inputs, **bound)
            else:
                result = [fn(x, **bound) for x in inputs]
        except RewardFunctionError:
            raise
        except Exception as exc:
            raise RewardFunctionError(f"reward function {where} raised {type_name(exc)}: {exc}") from exc
        return validate_scores(result, len(inputs), where)

    call.__name__ = fn_name
    call.__qualname__ = where
    call.where = where  # type: ignore[attr-defined]
    return call


def type_name(exc: BaseException) -> str:
    return type(exc).__name__
