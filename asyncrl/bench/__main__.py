"""Entry point: dispatches to asyncrl.bench.<scenario>.run(cfg, args)."""

from __future__ import annotations

import argparse
import importlib
import sys

from asyncrl.cli import add_config_args, config_from_args

SCENARIOS = ["buffer", "weight-sync", "learner", "rollout", "e2e", "sweep", "simulate", "convergence", "trl"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.bench", description=__doc__)
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--output", default="bench", help="directory for JSON and plots")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: seconds, for tests")
    parser.add_argument("--full", action="store_true", help="convergence: the full grid (η 0,1,2,4; 200 steps per run)")
    add_config_args(parser)
    args = parser.parse_intermixed_args(argv)
    cfg = config_from_args(args, require_files=False)
    module = importlib.import_module(f"asyncrl.bench.{args.scenario.replace('-', '_')}")
    result = module.run(cfg, args)
    from asyncrl.bench.common import write_result

    path = write_result(args.scenario, result, args.output)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
