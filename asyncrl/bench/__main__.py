"""Entry point: dispatches to asyncrl.bench.<scenario>.run(cfg, args).

Without `--config` a scenario runs on the quick start's config (configs/quickstart.yaml of the
source tree: the tiny policy in assets/), the one every scenario's defaults are sized for.
`python -m asyncrl.bench SCENARIO --help` shows that scenario's own description. Scenarios that
build engines from `model.path` first run the launcher's model checks (asyncrl.preflight): a config
the model cannot hold exits 2 with the keys named, before any engine starts.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path

from asyncrl.cli import add_config_args, config_from_args, fail

SCENARIOS = ["buffer", "weight-sync", "learner", "rollout", "e2e", "sweep", "simulate", "convergence", "trl", "scale"]
MODEL_SCENARIOS = ("rollout",)  # the others build no engine from model.path, or go through asyncrl.runtime.run
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def scenario_doc(scenario: str | None) -> str:
    """The scenario module's docstring, read without importing it (some import torch at once)."""
    if scenario not in SCENARIOS:
        return __doc__ or ""
    path = Path(__file__).with_name(f"{scenario.replace('-', '_')}.py")
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def build_parser(scenario: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.bench", description=scenario_doc(scenario),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--output", default="bench", help="directory for JSON and plots")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: seconds, for tests")
    parser.add_argument("--full", action="store_true", help="convergence: the full grid (η 0,1,2,4; 200 steps per run)")
    parser.add_argument("--variance", action="store_true",
                        help="convergence: η 0,1,2,4,8 x decoupled and the variance-controlling modes (issue 31's grid)")
    add_config_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = next((a for a in argv if a in SCENARIOS), None)
    args = build_parser(named).parse_intermixed_args(argv)
    if args.config is None:
        if not DEFAULT_CONFIG.is_file():
            fail(f"no --config given and the quick start's config {DEFAULT_CONFIG} is not here "
                 "(an installed package without the source tree): pass --config FILE")
        print(f"bench {args.scenario}: no --config, using the quick start's {DEFAULT_CONFIG}", flush=True)
        args.config = str(DEFAULT_CONFIG)
    cfg = config_from_args(args, require_files=False)
    if args.scenario in MODEL_SCENARIOS:
        from asyncrl.runtime import check_models

        if not check_models(cfg):
            return 2
    module = importlib.import_module(f"asyncrl.bench.{args.scenario.replace('-', '_')}")
    result = module.run(cfg, args)
    from asyncrl.bench.common import write_result

    path = write_result(args.scenario, result, args.output)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
