"""Loading a config: defaults < YAML file < dotted command-line overrides (`rollout.n=8`).

`load_config` turns pydantic's errors into one short message that names the full key path, the
expected type and the given value, and suggests the closest valid key for a typo. Guided-GRPO
YAMLs (`data.*`, `algorithm.*`, `worker.*`, `trainer.*`) load through `from_guided_grpo`, the one
route into the converter of `asyncrl.config.guided_grpo`: keys with no equivalent are reported
by name, with what to do where asyncrl removed the behaviour (docs/guided_grpo.md#config-keys).
"""

from __future__ import annotations

import difflib
import os
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from asyncrl.config.guided_grpo import convert_guided_grpo, describe_unmapped
from asyncrl.config.schema import Config
from asyncrl.config.sections import ConfigError
from asyncrl.config.tree import deep_merge, read_yaml, set_dotted

__all__ = ["build_config", "check_files", "from_guided_grpo", "load_config", "parse_overrides"]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["a.b=1", "c=[x, y]"]` -> nested dict; values are parsed as YAML scalars/lists."""
    tree: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key part")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {key}: cannot parse value {raw!r}: {exc}") from None
        set_dotted(tree, key, value)
    return tree


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the key at `loc` (for suggestions)."""
    model: Any = Config
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _format_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        key = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden":
            owner = _model_at(loc)
            hint = ""
            if owner is not None:
                close = difflib.get_close_matches(str(loc[-1]), list(owner.model_fields), n=1, cutoff=0.5)
                prefix = ".".join(str(p) for p in loc[:-1])
                if close:
                    hint = f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
                else:
                    hint = f"; valid keys here: {', '.join(owner.model_fields)}"
            lines.append(f"unknown key '{key}'{hint}")
        elif err["type"] == "value_error" and not loc:
            lines.append(str(err["msg"]).removeprefix("Value error, "))
        else:
            given = err.get("input")
            given_s = repr(given) if not isinstance(given, dict) else "a mapping"
            lines.append(f"'{key}': {err['msg']} (given: {given_s[:80]})")
    return f"invalid config ({source}):\n  " + "\n  ".join(lines)


def build_config(tree: dict[str, Any], source: str = "config") -> Config:
    """Validate a tree into a Config; ConfigError with one line per problem, naming `source`."""
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, source)) from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: list[str] | None = None,
    config_format: Literal["asyncrl", "guided_grpo"] = "asyncrl",
) -> Config:
    """Defaults < YAML file < dotted overrides. Raises ConfigError with a user-facing message.
    `config_format="guided_grpo"` reads the file as a Guided-GRPO YAML (`from_guided_grpo`)."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        if config_format == "guided_grpo":
            return from_guided_grpo(path, overrides)
        tree = read_yaml(path)
        source = str(path)
    if overrides:
        tree = deep_merge(tree, parse_overrides(overrides))
        source += " + overrides"
    return build_config(tree, source)


def check_files(cfg: Config) -> list[str]:
    """Names of files the config points at that do not exist (local-looking paths only: hub ids
    such as `Qwen/Qwen2.5-7B-Instruct` are resolved later by the component that loads them)."""

    def local(p: str) -> bool:
        head = p.split("@", 1)[0]
        return head.startswith((".", "/", "~")) or head.endswith((".json", ".jsonl", ".parquet")) or (
            Path(head.split("/", 1)[0]).exists() and "/" in head
        )

    missing = []
    named = {
        "data.train_files": cfg.data.train_files,
        "data.val_files": cfg.data.val_files,
        "data.test_files": cfg.data.test_files,
        "model.path": cfg.model.path,
        "model.tokenizer_path": cfg.model.tokenizer_path,
        "data.format_prompt": cfg.data.format_prompt if cfg.data.format_prompt and "." in cfg.data.format_prompt else None,
        "verifier.model_path": cfg.verifier.model_path if cfg.verifier.backend == "vllm" else None,
    }
    if ":" in cfg.reward.function or cfg.reward.function.endswith(".py"):
        named["reward.function"] = cfg.reward.function.rsplit(":", 1)[0]
    for key, value in named.items():
        if value and local(value):
            p = Path(os.path.expanduser(value.split("@", 1)[0]))
            if not p.exists():
                missing.append(f"{key}: no such file or directory: {p}")
    return missing


def from_guided_grpo(path_or_tree: str | os.PathLike[str] | dict[str, Any], overrides: list[str] | None = None,
                     strict: bool = False) -> Config:
    """Load a YAML written for Guided-GRPO (a path, or its already parsed tree), then apply asyncrl
    dotted overrides. Keys with no equivalent are reported by name in a warning (an error when
    `strict`), never dropped silently; they are also kept on the result (`_unmapped_keys`)."""
    tree = path_or_tree if isinstance(path_or_tree, dict) else read_yaml(path_or_tree)
    converted, unmapped = convert_guided_grpo(tree)
    if unmapped:
        msg = describe_unmapped(unmapped)
        if strict:
            raise ConfigError(msg)
        warnings.warn(msg, stacklevel=2)
    if overrides:
        converted = deep_merge(converted, parse_overrides(overrides))
    cfg = build_config(converted, "guided_grpo")
    cfg._unmapped_keys = unmapped
    return cfg
