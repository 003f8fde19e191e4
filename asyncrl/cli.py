"""Shared command-line plumbing: parse `--config FILE key.sub=value ...` without heavy imports,
and turn configuration errors into a short message and exit status 2 (no traceback).

A Guided-GRPO recipe runs with only the module changed: `config=X.yaml key=value ...` (the
original's command line), a `--config` YAML in the original's shape, or `--config-format
guided_grpo`, all through `asyncrl.config.load_guided_grpo`; the conversion summary (derived
values, the role split table, the grouped warnings) is printed once, on stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from asyncrl.config import Config, ConfigError, check_files, load_config


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file (defaults < file < overrides)")
    parser.add_argument(
        "--config-format", choices=["asyncrl", "guided_grpo"], default="asyncrl",
        help="read a YAML written for Guided-GRPO through asyncrl's key map (docs/config.md); also recognised "
             "from `config=X.yaml` or a YAML with a `worker:` section",
    )
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="dotted overrides, YAML values; after a Guided-GRPO recipe, the original's keys in "
                             "its meaning and asyncrl's own keys, which win")


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def recipe_source(args: argparse.Namespace) -> tuple[str | None, str | None, list[str]]:
    """(Guided-GRPO recipe path, asyncrl config path, the remaining overrides); one path at most is
    set. A recipe is `config=X.yaml` among the overrides (unless X is plainly an asyncrl config),
    `--config-format guided_grpo`, or a `--config` YAML in the original's shape."""
    from asyncrl.config.loading import is_guided_grpo_file
    from asyncrl.config.tree import read_yaml

    named = [o for o in args.overrides if o.startswith("config=")]
    rest = [o for o in args.overrides if not o.startswith("config=")]
    if len(named) > 1 or (named and args.config):
        raise ConfigError("give the recipe once: either config=X.yaml (Guided-GRPO's form) or --config X.yaml")
    path = named[0].split("=", 1)[1] if named else args.config
    if named and not path:
        raise ConfigError("config= names no file")
    if path is None:
        if args.config_format == "guided_grpo":
            raise ConfigError("--config-format guided_grpo needs --config (or config=X.yaml)")
        return None, None, rest
    if args.config_format == "guided_grpo" or is_guided_grpo_file(path):
        return path, None, rest
    if named and not set(read_yaml(path)) & _ASYNCRL_ONLY_SECTIONS:
        return path, None, rest  # the original's form: its converter names what is wrong
    return None, path, rest


_ASYNCRL_ONLY_SECTIONS = {"model", "rollout", "verifier", "buffer", "learner", "reward", "cluster"}


def config_from_args(args: argparse.Namespace, require_files: bool = True) -> Config:
    try:
        recipe, native_config, overrides = recipe_source(args)
        if recipe is not None:
            from asyncrl.config import load_guided_grpo
            from asyncrl.config.loading import split_recipe_overrides

            cfg, conv = load_guided_grpo(recipe, overrides)
            native = {item.split("=", 1)[0].strip() for item in split_recipe_overrides(overrides)[1]}
            print(conversion_summary(recipe, cfg, conv, native), file=sys.stderr)
        else:
            cfg = load_config(native_config, overrides)
    except ConfigError as exc:
        fail(str(exc))
    if require_files:
        missing = check_files(cfg)
        if not cfg.data.train_files:
            missing.insert(0, "data.train_files is empty: point it at the training rows (path[@split])")
        if missing:
            fail("invalid config: " + "; ".join(missing))
    return cfg


def conversion_summary(recipe: str, cfg: Config, conv: object, native: set[str] | frozenset[str] = frozenset()) -> str:
    """What the conversion of a recipe decided, for the user to read once: every derived value with
    its reason (or the asyncrl override in `native` that replaced it), the before/after evaluation,
    the role split table, the grouped warnings."""
    from asyncrl.config.guided_grpo import Conversion
    from asyncrl.config.role_split import role_table

    assert isinstance(conv, Conversion)
    lines = [f"Guided-GRPO recipe {recipe} converted (docs/guided_grpo.md#coming-from-guided-grpo):"]
    for key, why in conv.derived.items():
        value = cfg.model_dump(mode="json")
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        lines.append(f"  {key} = {value!r}  # " + ("your asyncrl override" if key in native else why))
    if cfg.trainer.eval_before_after and cfg.data.test_files:
        lines.append(f"before/after evaluation: on {cfg.data.test_files} (data.test_files)")
    else:
        lines.append("before/after evaluation: skipped (no data.test_files)")
    lines.append(f"asynchrony: buffer.max_staleness={cfg.buffer.max_staleness}, learner.off_policy.mode="
                 f"{cfg.learner.off_policy.mode} (the original is synchronous: buffer.max_staleness=0 reproduces it)")
    lines.append(role_table(cfg, conv.recipe_gpus or None, conv.tp_rule))
    message = conv.message()
    return "\n".join(lines + ([message] if message else []))
