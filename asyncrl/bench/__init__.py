"""`python -m asyncrl.bench SCENARIO --config X.yaml [overrides] [--output DIR] [--smoke]`.

Every scenario is a module `asyncrl.bench.<scenario>` (dashes become underscores) with
`run(cfg, args) -> dict`; the dict is printed as a table and written as
`<scenario>-<timestamp>.json` under `--output` (default `bench/`) with the machine it ran on.
Component scenarios put `ratio` (measured / bare baseline, both measured in the same run) at the
top level; `e2e` puts `speedup` and `ideal_speedup`.
"""
