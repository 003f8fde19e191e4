"""Builds and runs the asynchronous topology (filled in by the end-to-end work)."""

from __future__ import annotations

import sys

from asyncrl.config import Config


def run(cfg: Config) -> int:
    run_dir = cfg.run_path
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.resolved.json").write_text(cfg.to_json())
    print(f"[launch] config validated; resolved config written to {run_dir / 'config.resolved.json'}")
    print("[launch] the training topology is not built yet (end-to-end issue); nothing to run.", file=sys.stderr)
    return 3
