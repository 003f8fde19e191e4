"""`python -m asyncrl.launch --config X.yaml [key.sub=value ...]`: run an asyncrl training job.

A Guided-GRPO recipe runs with only the module changed:
`python -m asyncrl.launch config=examples/config.yaml worker.actor.model.model_path=... [asyncrl keys]`
(asyncrl.cli: the original's overrides are converted with its YAML; asyncrl's keys follow and win).

The config is parsed and validated before anything heavy is imported, so `--help`,
`--print-config` and config errors answer at once (exit status 2 for a config error). A config
that trains by epochs (`trainer.total_epochs`, `max_steps` null) gets its step count once the
training rows are loaded, printed before the job starts.
"""

from __future__ import annotations

import argparse
import sys

from asyncrl.cli import add_config_args, config_from_args, fail


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl.launch",
        description="Train a policy with asynchronous guided GRPO (rollout fleet + replay buffer + learner).",
    )
    add_config_args(parser)
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="every process's output on the console (default: asyncrl's lines only, the rest in "
                             "<run_dir>/logs/; same as ASYNCRL_VERBOSE=1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    cfg = config_from_args(args, require_files=not args.print_config)
    if args.print_config:
        if cfg.trainer.max_steps is None:
            print(f"note: trainer.max_steps is derived at launch: {cfg.trainer.total_epochs} epochs x "
                  f"(rows of {cfg.data.train_files} // data.rollout_batch_size {cfg.data.rollout_batch_size})",
                  file=sys.stderr)
        print(cfg.to_json())
        return 0
    if cfg.trainer.eval_before_after and not cfg.data.test_files:
        print("note: no before/after evaluation (data.test_files is empty; name a test split, or data.val_files's "
              "spec to evaluate on the validation rows)", file=sys.stderr)
    if cfg.trainer.max_steps is None:
        from asyncrl.data import derive_max_steps  # loads the rows (datasets, the tokenizer)

        try:
            print(derive_max_steps(cfg), file=sys.stderr)
        except ValueError as exc:
            fail(str(exc))
    if args.verbose:
        import os

        from asyncrl.logs import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"
    from asyncrl.job.runtime import run  # heavy imports (ray, torch) start here

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
