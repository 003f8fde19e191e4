"""Entry point: dispatches to asyncrl.bench.<scenario>.run(cfg, args).

Without `--config` a scenario runs on the quick start's config (configs/quickstart.yaml of the
source tree: the tiny policy in assets/), the one every scenario's defaults are sized for.
`python -m asyncrl.bench SCENARIO --help` shows that scenario's own description and its flags
(each scenario module's `add_args`: grid, run size and variants are flags, never environment
variables). Scenarios that build engines from `model.path` first run the launcher's model checks
(asyncrl.checks.preflight): a config the model cannot hold exits 2 with the keys named, before any engine starts.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

from asyncrl.cli import add_config_args, config_from_args, fail

SCENARIOS = ["buffer", "weight-sync", "learner", "rollout", "e2e", "sweep", "simulate", "convergence", "trl", "scale", "method",
             "startup"]
MODEL_SCENARIOS = ("rollout",)  # the others build no engine from model.path, or go through asyncrl.job.runtime.run
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
# The environment variables that once chose grids and sizes, and the flags that replaced them where
# the name does not simply turn into a flag (STEPS -> --steps).
GONE_ENV_PREFIX = "ASYNCRL_BENCH_"
GONE_ENV_FLAGS = {"E2E": "e2e --compare", "WEIGHT_SYNC": "weight-sync --lora-only", "REUSE": "--reuse or --reuse-only",
                  "ASYNCRL_TRL_THREADS": "trl --trl-threads"}


def scenario_doc(scenario: str | None) -> str:
    """The scenario module's docstring, read from its source without importing it."""
    if scenario not in SCENARIOS:
        return __doc__ or ""
    path = Path(__file__).with_name(f"{scenario.replace('-', '_')}.py")
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def scenario_module(scenario: str) -> ModuleType:
    return importlib.import_module(f"asyncrl.bench.{scenario.replace('-', '_')}")


def build_parser(scenario: str | None = None) -> argparse.ArgumentParser:
    """The common flags, plus the named scenario's own (its module's `add_args`, when it has one)."""
    parser = argparse.ArgumentParser(prog="python -m asyncrl.bench", description=scenario_doc(scenario),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--output", default="bench", help="directory for JSON and plots")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: seconds, for tests")
    parser.add_argument("--record", nargs="?", const="docs/results", default=None, metavar="DIR",
                        help="also keep the result as DIR/<scenario>-<machine>.json (default DIR: docs/results), "
                             "replacing the previous run's")
    add_config_args(parser)
    add_args = getattr(scenario_module(scenario), "add_args", None) if scenario in SCENARIOS else None
    if add_args is not None:
        add_args(parser.add_argument_group(f"{scenario} options"))
    return parser


def refuse_gone_env() -> None:
    """Exit 2 naming the flag when an old environment-variable option is still set: silently running
    the default grid instead of the asked one would cost hours."""
    for key in sorted(k for k in os.environ if k.startswith(GONE_ENV_PREFIX) or k in GONE_ENV_FLAGS):
        name = key.removeprefix(GONE_ENV_PREFIX)
        flag = GONE_ENV_FLAGS.get(name, "--" + name.lower().replace("_", "-"))
        fail(f"{key} is gone, use {flag} (`python -m asyncrl.bench SCENARIO --help` lists each scenario's flags)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    refuse_gone_env()
    named = next((a for a in argv if a in SCENARIOS), None)
    args = build_parser(named).parse_intermixed_args(argv)
    if args.smoke and args.record is not None:
        fail("--record keeps a result as the documentation's current figure; a --smoke run is not one")
    if args.config is None:
        if not DEFAULT_CONFIG.is_file():
            fail(f"no --config given and the quick start's config {DEFAULT_CONFIG} is not here "
                 "(an installed package without the source tree): pass --config FILE")
        print(f"bench {args.scenario}: no --config, using the quick start's {DEFAULT_CONFIG}", flush=True)
        args.config = str(DEFAULT_CONFIG)
    cfg = config_from_args(args, require_files=False)
    if args.scenario in MODEL_SCENARIOS:
        from asyncrl.job.runtime import check_models

        if not check_models(cfg):
            return 2
    result = scenario_module(args.scenario).run(cfg, args)
    from asyncrl.bench.common import record_result, write_result

    path = write_result(args.scenario, result, args.output)
    print(f"\nwrote {path}")
    if args.record is not None:
        print(f"recorded {record_result(path, args.record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
