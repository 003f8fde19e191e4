"""`python -m asyncrl.doctor --config X`: check a Ray cluster for a job before launching it
(resources, addresses reachable from every node, weight broadcast speed, /dev/shm, interfaces).
The checks live in `asyncrl.checks`; this is the entry point only."""

from __future__ import annotations

import argparse
import sys

from asyncrl.cli import add_config_args, config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.doctor", description="Check a Ray cluster for a job: "
                                     "resources, addresses reachable from every node, weight broadcast speed, "
                                     "/dev/shm, interfaces. Exit 1 on any ✘.")
    add_config_args(parser)
    parser.add_argument("--broadcast-mb", type=float, default=256.0,
                        help="cap of the dummy weight broadcast (MiB; the model's size when smaller)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound on each start-up wait")
    args = parser.parse_intermixed_args(argv)
    cfg = config_from_args(args, require_files=False)
    from asyncrl.checks.doctor import Doctor

    return Doctor(cfg, args.broadcast_mb, args.timeout_s).run()


if __name__ == "__main__":
    sys.exit(main())
