"""Shared command-line plumbing: parse `--config FILE key.sub=value ...` without heavy imports,
and turn configuration errors into a short message and exit status 2 (no traceback)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from asyncrl.config import Config, ConfigError, check_files, load_config


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file (defaults < file < overrides)")
    parser.add_argument(
        "--config-format", choices=["asyncrl", "guided_grpo"], default="asyncrl",
        help="read a YAML written for Guided-GRPO through asyncrl's key map (docs/config.md)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides, YAML values")


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def config_from_args(args: argparse.Namespace, require_files: bool = True) -> Config:
    try:
        if args.config_format == "guided_grpo":
            from asyncrl.config import from_guided_grpo

            if not args.config:
                fail("--config-format guided_grpo needs --config")
            cfg = from_guided_grpo(args.config, args.overrides)
            if cfg._unmapped_keys:
                print("note: Guided-GRPO keys with no asyncrl equivalent (ignored): "
                      + ", ".join(cfg._unmapped_keys), file=sys.stderr)
        else:
            cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        fail(str(exc))
    if require_files:
        missing = check_files(cfg)
        if missing:
            fail("invalid config: " + "; ".join(missing))
    return cfg
