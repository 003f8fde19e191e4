"""Loading a config: defaults < YAML file < dotted command-line overrides (`rollout.n=8`).

`load_config` turns pydantic's errors into one short message that names the full key path, the
expected type and the given value, and suggests the closest valid key for a typo. Guided-GRPO
recipes (`data.*`, `algorithm.*`, `worker.*`, `trainer.*`, with overrides in the original's
namespace) load through `load_guided_grpo`, the one route into the converter of
`asyncrl.config.guided_grpo`; asyncrl's own overrides follow and win.
"""

from __future__ import annotations

import difflib
import os
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from asyncrl.config.guided_grpo import (
    Conversion,
    convert_guided_grpo,
    is_guided_grpo_tree,
    is_original_key,
    suggest_original_key,
)
from asyncrl.config.role_split import roles_gpus
from asyncrl.config.schema import Config
from asyncrl.config.sections import ConfigError
from asyncrl.config.tree import deep_merge, read_yaml, set_dotted

__all__ = ["asyncrl_key_exists", "build_config", "check_files", "from_guided_grpo", "is_guided_grpo_file",
           "load_config", "load_guided_grpo", "parse_overrides", "recipe_tree", "split_recipe_overrides"]


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
    `config_format="guided_grpo"` reads the file as a Guided-GRPO recipe (`from_guided_grpo`)."""
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


def asyncrl_key_exists(key: str) -> bool:
    """Whether dotted `key` names a field of asyncrl's config (any sub-key of a dict-valued field)."""
    model: Any = Config
    for part in key.split("."):
        if model is None:
            return True  # inside a dict-valued field (cluster.resources, reward.kwargs, ...)
        field = model.model_fields.get(part)
        if field is None:
            return False
        ann = field.annotation
        model = next((c for c in (ann, *getattr(ann, "__args__", ()))
                      if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return True


def _asyncrl_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        sub = next((c for c in (field.annotation, *getattr(field.annotation, "__args__", ()))
                    if isinstance(c, type) and issubclass(c, BaseModel)), None)
        keys += _asyncrl_keys(sub, f"{prefix}{name}.") if sub else [prefix + name]
    return keys


def split_recipe_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    """Overrides after a Guided-GRPO recipe -> (those in the original's namespace, asyncrl's own).
    A key the original has is read in the original's meaning (converted with the recipe); any other
    key must be asyncrl's and wins over the conversion. A key in neither is a ConfigError that
    suggests the closest key, from the original's namespace first."""
    original, native, problems = [], [], []
    for item in items:
        key = item.split("=", 1)[0].strip()
        if is_original_key(key):
            original.append(item)
        elif asyncrl_key_exists(key):
            native.append(item)
        else:
            close = suggest_original_key(key)
            if close:
                problems.append(f"unknown key '{key}'; did you mean '{close}' (Guided-GRPO)?")
            else:
                hint = difflib.get_close_matches(key, _asyncrl_keys(), n=1, cutoff=0.6)
                problems.append(f"unknown key '{key}'" + (f"; did you mean '{hint[0]}'?" if hint else
                                                         " (neither a Guided-GRPO nor an asyncrl key)"))
    if problems:
        raise ConfigError("invalid overrides:\n  " + "\n  ".join(problems))
    return original, native


def recipe_tree(path_or_tree: str | os.PathLike[str] | dict[str, Any],
                overrides: list[str] | None = None) -> tuple[dict[str, Any], Conversion, list[str]]:
    """A Guided-GRPO recipe as an asyncrl config tree (before validation): the YAML (a path or its
    parsed tree), then the overrides in the original's namespace, converted together by
    `asyncrl.config.guided_grpo.convert_guided_grpo`, then asyncrl's own overrides, which win.
    Returns (tree, the Conversion, the asyncrl keys the overrides set)."""
    tree = path_or_tree if isinstance(path_or_tree, dict) else read_yaml(path_or_tree)
    original, native = split_recipe_overrides(list(overrides or []))
    if original:
        tree = deep_merge(tree, parse_overrides(original))
    native_keys = [item.split("=", 1)[0].strip() for item in native]
    conv = convert_guided_grpo(tree, fixed=frozenset(native_keys))
    return deep_merge(conv.tree, parse_overrides(native)), conv, native_keys


def load_guided_grpo(path_or_tree: str | os.PathLike[str] | dict[str, Any],
                     overrides: list[str] | None = None) -> tuple[Config, Conversion]:
    """The one route from a Guided-GRPO recipe to a Config (`recipe_tree`, validated). Returns the
    Config and the Conversion (derivations and grouped warnings, for the caller to show once).
    ConfigError names the key at fault."""
    tree, conv, _ = recipe_tree(path_or_tree, overrides)
    cfg = build_config(tree, "Guided-GRPO recipe" + (" + overrides" if overrides else ""))
    used = sum(roles_gpus(cfg).values())
    if conv.recipe_gpus and used > conv.recipe_gpus:
        raise ConfigError(f"the roles ask for {used:g} GPUs but the recipe has {conv.recipe_gpus} "
                          "(trainer.nnodes x trainer.n_gpus_per_node); lower learner.num_gpus / rollout.num_actors")
    cfg._unmapped_keys = conv.warned_keys
    return cfg, conv


def is_guided_grpo_file(path: str | os.PathLike[str]) -> bool:
    """Whether a YAML file is written in the original's shape (`is_guided_grpo_tree`)."""
    return is_guided_grpo_tree(read_yaml(path))


def from_guided_grpo(path_or_tree: str | os.PathLike[str] | dict[str, Any], overrides: list[str] | None = None,
                     strict: bool = False) -> Config:
    """Library form of `load_guided_grpo`: the keys asyncrl does not take as they are become one
    UserWarning (a ConfigError when `strict`), and are kept on the result (`_unmapped_keys`)."""
    cfg, conv = load_guided_grpo(path_or_tree, overrides)
    message = conv.message()
    if message:
        if strict:
            raise ConfigError(message)
        warnings.warn(message, stacklevel=2)
    return cfg
