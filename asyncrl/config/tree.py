"""Nested-dict helpers shared by the loader and the Guided-GRPO converter: a config tree before
validation is plain dicts keyed by section, and dotted keys (`rollout.guide.max_turns`) address it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from asyncrl.config.sections import ConfigError

__all__ = ["set_dotted", "deep_merge", "read_yaml"]


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """`set_dotted(t, "a.b.c", v)` sets `t["a"]["b"]["c"] = v`, creating (or replacing non-dict)
    intermediate levels."""
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """A new tree: `update` over `base`, merging dicts level by level (other values replace)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping in a YAML file; ConfigError (naming the file) when it is missing, invalid or not
    a mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    return data
