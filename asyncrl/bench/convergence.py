"""`python -m asyncrl.bench convergence --config X.yaml [--full] [flags]`: does asynchrony pay in accuracy per wall second?

Real training runs of the whole system (`asyncrl.job.runtime.run`, as `e2e`), one after another (they
measure throughput), over a grid of `buffer.max_staleness` (η) × `learner.off_policy.mode` × seeds.
Every run evaluates greedily on the validation split every K learner steps (the trainer's own
evaluation) and on the test split at the end. The η = 0 run of a seed is the synchronous baseline,
measured in the same invocation. Per cell the JSON (and the printed table) holds:
- validation accuracy by learner step and by training wall second (wall time since the first step
  began, minus the time spent in validation evaluations; start-up excluded, it is the same for all);
- `time_to_sync_s`: the first training second at which the cell's validation accuracy reached the
  final validation accuracy of the same seed's η = 0 run (None = not reached), and its ratio to the
  η = 0 run's own time to that accuracy;
- the final test accuracy ± its binomial standard error, steps/s, the staleness histogram of
  trained groups and `train/mismatch_kl` (k3 estimate of KL(mu || pi_prox)) per step.
The summary averages cells over seeds (mean ± standard error across seeds).

At η = 0 the off-policy modes coincide: with one mini-batch and one epoch the learner takes
pi_prox = pi (detached), every trained token was sampled by the current weights (mu = pi_prox up to
engine/learner numerics), so `tis` (min(pi_prox/mu, cap)), `decoupled` (pi_prox/mu where <= cap)
and `none` (1) all weight every token by 1 up to that mismatch (logged: `train/mismatch_kl`,
`train/is_weight_mean`). So η = 0 is run once per seed (with the config's mode) and stands for every
mode; `--sync-all-modes` runs every mode at η = 0 as well.

Grid (flags, comma-separated): `--staleness` (default 0,1,2; `--full` 0,1,2,4),
`--modes` (none,tis,decoupled), `--seeds` (1,2; a seed sets data.seed, rollout.seed and
trainer.seed). Run size: `--steps` (100; `--full` 200; the quick start's policy changes its turn
habit between steps 50 and 100, so fewer steps compare noise), `--eval-every` (10; `--full` 20),
`--val-rows` (the first N validation rows, 100; `--full` all; a .jsonl validation file only),
`--test-rows` (the first N test rows, before and after training: 400; `--full` all).
Runs go seed by seed (the first seed's whole grid before the second's), η = 0 first.
`--reuse` takes a cell from its run directory when that holds a finished run of the same length
(an interrupted grid continues where it stopped; the figures are re-derived); `--reuse-only` runs
nothing and reports the finished cells (the others as not run).

A mode is an `off_policy.mode`, optionally with `+key=value` overrides of `learner.off_policy`
(validated, so a refused combination fails by name), e.g. `decoupled+lr_scale=ess`; a dotted key is a
config path, e.g. `decoupled+buffer.staleness=drift`.
`--variance` is the variance-control grid: η ∈ {0, 1, 2, 4, 8} × `VARIANCE_MODES` × seeds {1, 2},
the modes after the first (the baseline, `decoupled`) only at `--secondary-staleness`
(default 4,8: where staleness hurts; dropping their η = 1, 2 cells keeps the grid near 2 hours).
Every cell also reports its mean lag per trained token (`train/version_lag_mean`), drift
(`train/mismatch_kl` per token, `train/seq_mismatch_kl` per conversation), masked share (`train/is_clipped_frac`: every token the correction zeroed or
clipped; `train/m2po_masked_frac`, `train/drift_masked_frac`), ESS ((mean w)² / mean w² of the
sequence weights per step)
and LR factor (`train/lr_scale`), so a mode that did not hold shows why.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from asyncrl.bench.common import int_list, print_table, save_figure, str_list
from asyncrl.config import Config

ACC = "guided_accuracy"
# Per-run cost model for the printed estimate, from quick-start runs on an idle 2-core machine:
# start-up, seconds per learner step (asynchronous steps are faster, synchronous slower), greedy
# evaluation seconds per row. On a loaded machine every term grows, so the estimate is a floor.
EST_STARTUP_S, EST_STEP_S, EST_EVAL_ROW_S = 35.0, 2.3, 0.025
RETRIES = 1  # a failed run is started once more before the grid moves on
VARIANCE_MODES = ["decoupled", "m2po", "decoupled+lr_scale=ess", "decoupled+lag_decay=0.5",
                  "decoupled+seq_kl_budget=0.02", "decoupled+buffer.staleness=drift"]
"""`--variance`: the best mode of the previous grid, then one cell per variance control (0.02 sits
between the drift measured at lag 1, 0.004-0.012, and at lag 4, 0.03-0.09; it is also the default
`buffer.drift_budget`). Left out for time, runnable by `--modes`: `decoupled+lr_scale=lag`."""


def add_args(parser: Any) -> None:
    """The grid and run-size flags (module doc); a flag left out takes the default of the chosen grid."""
    parser.add_argument("--full", action="store_true",
                        help="the full grid and run size: η 0,1,2,4; 200 steps per run; all val/test rows")
    parser.add_argument("--variance", action="store_true",
                        help="η 0,1,2,4,8 x decoupled and the variance-controlling modes (VARIANCE_MODES)")
    parser.add_argument("--staleness", type=int_list, metavar="0,1,2",
                        help="buffer.max_staleness values η (0, the synchronous baseline, is always added)")
    parser.add_argument("--modes", type=mode_list, metavar="none,tis,decoupled",
                        help="off-policy mode specs: a learner.off_policy.mode, optionally +key=value overrides")
    parser.add_argument("--secondary-staleness", type=int_list, metavar="4,8",
                        help="run the modes after the first only at these η (default: --variance 4,8, else every η)")
    parser.add_argument("--seeds", type=int_list, metavar="1,2", help="seeds (data.seed, rollout.seed, trainer.seed)")
    parser.add_argument("--steps", type=int, help="learner steps per run (100; --full 200)")
    parser.add_argument("--eval-every", type=int, help="greedy validation every N steps (10; --full 20)")
    parser.add_argument("--val-rows", type=int, help="the first N validation rows; 0 = all (100; --full all)")
    parser.add_argument("--test-rows", type=int, help="the first N test rows, before and after; 0 = all (400; --full all)")
    parser.add_argument("--sync-all-modes", action="store_true", help="run every mode at η = 0 too (default: once per seed)")
    reuse = parser.add_mutually_exclusive_group()
    reuse.add_argument("--reuse", dest="reuse", action="store_const", const="finished",
                       help="take a cell from its run directory when that holds a finished run of the same length")
    reuse.add_argument("--reuse-only", dest="reuse", action="store_const", const="only",
                       help="run nothing: report the finished cells (the others as not run)")


def _pick(value: Any, default: Any) -> Any:
    """A flag's value, or the grid's default where the flag was not given."""
    return default if value is None else value


def mode_overrides(spec: str) -> dict[str, Any]:
    """`learner.off_policy` fields of a mode spec: `m2po` -> {mode: m2po};
    `decoupled+lr_scale=ess+lag_decay=0.5` -> {mode: decoupled, lr_scale: ess, lag_decay: 0.5}."""
    base, *extras = spec.split("+")
    out: dict[str, Any] = {"mode": base}
    for item in extras:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"mode spec {spec!r}: {item!r} is not key=value (a learner.off_policy field)")
        out[key] = json.loads(value) if value[:1].isdigit() or value in ("null", "true", "false") else value
    return out


def mode_list(text: str) -> list[str]:
    """`--modes`: comma-separated mode specs, each checked by `mode_overrides` before any run."""
    modes = str_list(text)
    for spec in modes:
        try:
            mode_overrides(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return modes


def plan(cfg: Config, args: Any) -> dict[str, Any]:
    """The grid and run size from the flags (`add_args`; the module doc has the defaults)."""
    smoke, full, variance = args.smoke, args.full, args.variance
    grid_default = [0, 1] if smoke else [0, 1, 2, 4, 8] if variance else [0, 1, 2, 4] if full else [0, 1, 2]
    staleness = list(_pick(args.staleness, grid_default))
    if 0 not in staleness:
        staleness = [0, *staleness]  # the synchronous baseline of every seed
    staleness = [0, *sorted({s for s in staleness if s != 0})]
    modes = list(_pick(args.modes, ["none", "tis"] if smoke else VARIANCE_MODES if variance
                       else ["none", "tis", "decoupled"]))
    secondary = list(_pick(args.secondary_staleness, [4, 8] if variance else []))
    seeds = list(_pick(args.seeds, [1] if smoke else [1, 2]))
    steps = _pick(args.steps, 2 if smoke else 200 if full else 100)
    eval_every = _pick(args.eval_every, 1 if smoke else 20 if full else 10)
    val_rows = _pick(args.val_rows, 8 if smoke else 0 if full else 100) or None
    test_rows = _pick(args.test_rows, 8 if smoke else 0 if full else 400) or None
    all_modes_sync = args.sync_all_modes
    runs = []
    for seed in seeds:
        for eta in staleness:
            for i, mode in enumerate(modes if (eta > 0 or all_modes_sync) else [cfg.learner.off_policy.mode]):
                if eta > 0 and i > 0 and secondary and eta not in secondary:
                    continue
                runs.append({"seed": seed, "max_staleness": eta, "mode": mode})
    return {"staleness": staleness, "modes": modes, "seeds": seeds, "steps": steps, "eval_every": eval_every,
            "val_rows": val_rows, "test_rows": test_rows, "sync_all_modes": all_modes_sync,
            "secondary_staleness": secondary, "reuse": args.reuse, "runs": runs}


def estimate_s(p: dict[str, Any], test_rows_total: int) -> float:
    evals = p["steps"] // max(p["eval_every"], 1)
    per_run = (EST_STARTUP_S + p["steps"] * EST_STEP_S
               + EST_EVAL_ROW_S * (evals * (p["val_rows"] or 200) + 2 * (p["test_rows"] or test_rows_total)))
    return per_run * len(p["runs"])


def _val_subset(cfg: Config, rows: int | None, out: Path) -> str:
    """The first `rows` validation rows as a .jsonl of their own (a smaller val set is faster)."""
    val = cfg.data.val_files
    if rows is None or not val.endswith(".jsonl") or not Path(val).is_file():
        return val
    lines = [ln for ln in Path(val).read_text().splitlines() if ln.strip()][:rows]
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"val_first{len(lines)}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path.resolve())


def cell_config(cfg: Config, cell: dict[str, Any], p: dict[str, Any], val_files: str) -> Config:
    """The config of one cell: η, the mode spec's overrides (validated), seed and run size."""
    c = cfg.model_copy(deep=True)
    c.buffer.max_staleness = cell["max_staleness"]
    overrides = mode_overrides(cell["mode"])
    c.learner.off_policy = type(c.learner.off_policy).model_validate(
        {**c.learner.off_policy.model_dump(), **{k: v for k, v in overrides.items() if "." not in k}})
    for path, value in overrides.items():  # a dotted key: its section re-validated with the value
        if "." in path:
            *parents, leaf = path.split(".")
            owner = c
            for name in parents[:-1]:
                owner = getattr(owner, name)
            section = getattr(owner, parents[-1])
            setattr(owner, parents[-1], type(section).model_validate({**section.model_dump(), leaf: value}))
    c.data.seed = c.rollout.seed = c.trainer.seed = cell["seed"]
    c.data.val_files = val_files
    c.trainer.max_steps = p["steps"]
    c.trainer.eval_every = p["eval_every"]
    c.trainer.eval_before_after = True  # the test evaluation at the end (and the one before)
    c.trainer.eval_limit = p["test_rows"] if p["test_rows"] else None
    c.trainer.save_every = -1
    c.trainer.logger = ["jsonl"]
    c.trainer.resume = "never"
    tag = cell["mode"].replace("+", "-").replace("=", "")
    c.trainer.experiment_name = (f"{cfg.trainer.experiment_name}-convergence-s{cell['max_staleness']}"
                                 f"-{tag}-seed{cell['seed']}")
    return c


def run_cell(cfg: Config, cell: dict[str, Any], p: dict[str, Any], val_files: str) -> dict[str, Any]:
    """One real training run; its curves and end figures (see `cell_figures`)."""
    from asyncrl.job.runtime import run

    c = cell_config(cfg, cell, p, val_files)
    run_dir = c.run_path
    t0 = time.time()
    if p["reuse"] and _finished(run_dir, p["steps"]):
        print(f"[convergence] reusing the finished run in {run_dir}", flush=True)
    elif p["reuse"] == "only":
        raise RuntimeError(f"not run (--reuse-only: no finished run in {run_dir})")
    else:
        for stale in ("metrics.jsonl", "summary.json"):
            (run_dir / stale).unlink(missing_ok=True)
        rc = run(c)
        if rc != 0:
            raise RuntimeError(f"run {c.trainer.experiment_name} exited with {rc}")
    wall = time.time() - t0
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    eval_s = {}
    for f in (run_dir / "samples").glob("eval_step_*.json"):
        eval_s[int(f.stem.rsplit("_", 1)[1])] = float(json.loads(f.read_text()).get("seconds", 0.0))
    return {**cell, "run_dir": str(run_dir), "invocation_wall_s": wall, **cell_figures(rows, summary, eval_s)}


def _finished(run_dir: Path, steps: int) -> bool:
    """A run directory holding a finished run of `steps` steps (for --reuse)."""
    try:
        return int(json.loads((run_dir / "summary.json").read_text()).get("steps", -1)) == steps
    except (OSError, ValueError):
        return False


def cell_figures(rows: list[dict[str, Any]], summary: dict[str, Any], eval_s: dict[int, float]) -> dict[str, Any]:
    """Curves and end figures of one run from its metrics.jsonl rows, summary.json and the seconds
    of each validation evaluation (by step). Training second of step k = end of step k - start of
    step 1 - seconds of the validation evaluations before step k."""
    train = {}
    for r in rows:
        if "perf/step_s" in r:
            train[int(r["step"])] = r
    steps = sorted(train)
    if not steps:
        raise RuntimeError("the run logged no training step")
    t_start = train[steps[0]]["time"] - train[steps[0]]["perf/step_s"]

    def train_s(step: int) -> float:
        return train[step]["time"] - t_start - sum(s for k, s in eval_s.items() if k < step)

    curve = []
    for r in rows:
        if f"eval/{ACC}" in r:
            k = int(r["step"])
            curve.append({"step": k, "train_s": train_s(k) if k in train else None, "accuracy": r[f"eval/{ACC}"]})
    after = summary.get("after") or {}
    before = summary.get("before") or {}
    total = train_s(steps[-1])
    mismatch = [[s, train[s].get("train/mismatch_kl")] for s in steps]
    return {
        "val_curve": curve,
        "final_val_accuracy": curve[-1]["accuracy"] if curve else None,
        "test_accuracy": after.get(ACC), "test_accuracy_se": after.get(f"{ACC}_se"),
        "test_accuracy_before": before.get(ACC), "test_rows": after.get("rows"),
        "steps": len(steps), "train_wall_s": total, "steps_per_s": len(steps) / max(total, 1e-9),
        "staleness_hist": summary.get("staleness_hist", []),
        "mismatch_kl": mismatch,
        "mismatch_kl_mean": _mean([m for _, m in mismatch if isinstance(m, (int, float))]),
        "is_weight_mean": _mean([train[s].get("train/is_weight_mean") for s in steps
                                 if isinstance(train[s].get("train/is_weight_mean"), (int, float))]),
        "trained_tokens_per_s": summary.get("trained_tokens_per_s"),
        "learner_idle_ratio": _mean([train[s].get("perf/learner_idle_ratio", 0.0) for s in steps]),
        **variance_figures([train[s] for s in steps]),
    }


def variance_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over a run's training rows of what explains a cell: lag, drift, masked shares, ESS,
    LR factor (None where the run did not log the key, e.g. no M2PO)."""
    def avg(key: str) -> float | None:
        return _mean([r[key] for r in rows if isinstance(r.get(key), (int, float))])

    ess = [r["train/seq_is_weight_mean"] ** 2 / r["train/seq_is_weight_sq_mean"] for r in rows
           if isinstance(r.get("train/seq_is_weight_sq_mean"), (int, float)) and r["train/seq_is_weight_sq_mean"] > 0
           and isinstance(r.get("train/seq_is_weight_mean"), (int, float))]
    return {"lag_mean": avg("train/version_lag_mean"), "seq_drift_mean": avg("train/seq_mismatch_kl"), "masked_frac": avg("train/is_clipped_frac"),
            "m2po_masked_frac": avg("train/m2po_masked_frac"), "drift_masked_frac": avg("train/drift_masked_frac"),
            "ess_mean": _mean(ess), "lr_scale_mean": avg("train/lr_scale"),
            "lag_weight_mean": avg("train/lag_weight_mean")}


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _se(xs: list[float]) -> float | None:
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None


def time_to(curve: list[dict[str, Any]], target: float | None) -> float | None:
    """First training second at which the validation accuracy is >= target (None: never)."""
    if target is None:
        return None
    for point in curve:
        if point["accuracy"] >= target - 1e-9 and point["train_s"] is not None:
            return point["train_s"]
    return None


def summarize(cells: list[dict[str, Any]], p: dict[str, Any]) -> dict[str, Any]:
    """Per-cell time-to-target against its seed's η = 0 run, then the grid averaged over seeds."""
    ok = [c for c in cells if "error" not in c]
    sync = {c["seed"]: c for c in ok if c["max_staleness"] == 0}
    for c in ok:
        base = sync.get(c["seed"])
        target = base["final_val_accuracy"] if base else None
        c["sync_target_val_accuracy"] = target
        c["time_to_sync_s"] = time_to(c["val_curve"], target)
        base_t = time_to(base["val_curve"], target) if base else None
        c["time_to_sync_ratio"] = (c["time_to_sync_s"] / base_t if c["time_to_sync_s"] is not None and base_t
                                   else None)
    table = []
    for eta in p["staleness"]:
        for mode in p["modes"]:
            mine = [c for c in ok if c["max_staleness"] == eta and (c["mode"] == mode or (eta == 0 and not p["sync_all_modes"]))]
            if not mine:
                continue
            tests = [c["test_accuracy"] for c in mine if isinstance(c["test_accuracy"], (int, float))]
            ratios = [c["time_to_sync_ratio"] for c in mine if c["time_to_sync_ratio"] is not None]
            table.append({
                "max_staleness": eta, "mode": mode if (eta > 0 or p["sync_all_modes"]) else "(any: η=0)",
                "seeds": [c["seed"] for c in mine],
                "test_accuracy_mean": _mean(tests), "test_accuracy_se_across_seeds": _se(tests),
                "test_accuracy_binomial_se": [c["test_accuracy_se"] for c in mine],
                "final_val_accuracy_mean": _mean([c["final_val_accuracy"] for c in mine
                                                  if c["final_val_accuracy"] is not None]),
                "reached_sync": f"{len(ratios)}/{len(mine)}",
                "time_to_sync_ratio_mean": _mean(ratios),
                "time_to_sync_s": [c["time_to_sync_s"] for c in mine],
                "steps_per_s_mean": _mean([c["steps_per_s"] for c in mine]),
                "mismatch_kl_mean": _mean([c["mismatch_kl_mean"] for c in mine if c["mismatch_kl_mean"] is not None]),
                **{key: _mean([c[key] for c in mine if c.get(key) is not None]) for key in VARIANCE_KEYS},
            })
            if eta == 0 and not p["sync_all_modes"]:
                break
    return {"grid": {k: v for k, v in p.items() if k != "runs"}, "cells": cells, "table": table,
            "failed_cells": len(cells) - len(ok)}


VARIANCE_KEYS = ("lag_mean", "seq_drift_mean", "masked_frac", "m2po_masked_frac", "drift_masked_frac", "ess_mean", "lr_scale_mean",
                 "lag_weight_mean")


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_grid(result: dict[str, Any]) -> None:
    width = max([12, *(len(str(r["mode"])) for r in result["table"])])
    print("\n== convergence (mean over seeds; time ratio = time to the η=0 run's final val accuracy ÷ η=0's) ==")
    print(f"  {'η':>2} {'mode':<{width}} {'seeds':<6} {'test acc':>9} {'± se':>6} {'val acc':>8} {'reached':>8} "
          f"{'time ×':>7} {'steps/s':>8} {'drift':>9} {'lag':>5} {'masked':>8} {'ESS':>6} {'lr ×':>5}")
    for r in result["table"]:
        print(f"  {r['max_staleness']:>2} {r['mode']:<{width}} {len(r['seeds']):<6} {_fmt(r['test_accuracy_mean']):>9} "
              f"{_fmt(r['test_accuracy_se_across_seeds']):>6} {_fmt(r['final_val_accuracy_mean']):>8} "
              f"{r['reached_sync']:>8} {_fmt(r['time_to_sync_ratio_mean'], '.2f'):>7} "
              f"{_fmt(r['steps_per_s_mean']):>8} {_fmt(r['seq_drift_mean'], '.2e'):>9} {_fmt(r['lag_mean'], '.2f'):>5} "
              f"{_fmt(r['masked_frac'], '.2e'):>8} {_fmt(r['ess_mean']):>6} {_fmt(r['lr_scale_mean'], '.2f'):>5}")
    print_cells(result["cells"], width)


def print_cells(cells: list[dict[str, Any]], width: int = 12) -> None:
    """One line per run: what the seed means hide (a mode that held on one seed only)."""
    print("\n== per run (drift = KL(mu || pi_prox) per conversation; masked = tokens the correction zeroed/clipped;"
          " m2po/drift = the shares those masks removed) ==")
    print(f"  {'η':>2} {'mode':<{width}} {'seed':>4} {'test acc':>9} {'val acc':>8} {'time ×':>7} {'drift':>9} "
          f"{'lag':>5} {'masked':>8} {'m2po':>8} {'drift m.':>8} {'ESS':>6} {'lr ×':>5}")
    for c in cells:
        if "error" in c:
            print(f"  {c['max_staleness']:>2} {c['mode']:<{width}} {c['seed']:>4} failed: {c['error'][:80]}")
            continue
        print(f"  {c['max_staleness']:>2} {c['mode']:<{width}} {c['seed']:>4} {_fmt(c['test_accuracy']):>9} "
              f"{_fmt(c['final_val_accuracy']):>8} {_fmt(c.get('time_to_sync_ratio'), '.2f'):>7} "
              f"{_fmt(c.get('seq_drift_mean'), '.2e'):>9} {_fmt(c.get('lag_mean'), '.2f'):>5} "
              f"{_fmt(c.get('masked_frac'), '.2e'):>8} {_fmt(c.get('m2po_masked_frac'), '.2e'):>8} "
              f"{_fmt(c.get('drift_masked_frac'), '.2e'):>8} {_fmt(c.get('ess_mean')):>6} "
              f"{_fmt(c.get('lr_scale_mean'), '.2f'):>5}")


def run(cfg: Config, args) -> dict[str, Any]:
    from asyncrl.data import load_rows

    out = Path(args.output)
    p = plan(cfg, args)
    test_total = len(load_rows(cfg.data.test_files, cfg.data)) if cfg.data.test_files else 0
    est = estimate_s(p, test_total)
    print_table("convergence plan", [
        ("runs (sequential)", len(p["runs"])), ("max_staleness", str(p["staleness"])), ("modes", str(p["modes"])),
        ("seeds", str(p["seeds"])), ("steps per run", p["steps"]), ("val eval every", p["eval_every"]),
        ("val rows", p["val_rows"] or "all"), ("test rows", p["test_rows"] or test_total),
        ("η=0 runs", "every mode" if p["sync_all_modes"] else f"one per seed ({cfg.learner.off_policy.mode})"),
        ("modes after the first at η", str(p["secondary_staleness"] or "every η")),
        ("estimated total", f"{est / 60:.0f} min (idle 2-core machine; slower when loaded)")])
    val_files = _val_subset(cfg, p["val_rows"], out)
    cells: list[dict[str, Any]] = []
    t0 = time.time()
    for i, cell in enumerate(p["runs"]):
        print(f"\n[convergence] run {i + 1}/{len(p['runs'])}: η={cell['max_staleness']} mode={cell['mode']} "
              f"seed={cell['seed']} ({(time.time() - t0) / 60:.1f} min elapsed)", flush=True)
        c, errors = None, []
        for _attempt in range(1 + RETRIES):  # a start-up failure on a loaded machine is retried once
            try:
                c = run_cell(cfg, cell, p, val_files)
                break
            except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
                errors.append(f"{type(exc).__name__}: {exc}")
                print(f"[convergence] run failed: {errors[-1]}", flush=True)
                if "--reuse-only" in errors[-1]:
                    break
        if c is None:
            cells.append({**cell, "error": errors[-1], "attempts": len(errors)})
            continue
        c["failed_attempts"] = errors
        cells.append(c)
        print(f"[convergence] η={c['max_staleness']} {c['mode']} seed {c['seed']}: val {_fmt(c['final_val_accuracy'])}, "
              f"test {_fmt(c['test_accuracy'])} ± {_fmt(c['test_accuracy_se'])}, {c['steps_per_s']:.3f} steps/s, "
              f"staleness {c['staleness_hist']}", flush=True)
        try:  # partial results survive an interrupted grid
            (out / "convergence-partial.json").write_text(json.dumps(summarize(cells, p), indent=2, default=float))
        except Exception as exc:  # noqa: BLE001 - the run directories keep everything; re-derive with REUSE
            print(f"[convergence] partial summary not written: {exc}", flush=True)
    result = summarize(cells, p)
    result["total_wall_s"] = time.time() - t0
    result["estimated_s"] = est
    print_grid(result)
    print(f"  total wall {result['total_wall_s'] / 60:.1f} min (estimated {est / 60:.0f} min)")
    try:
        result["plot"] = str(plot(result, out))
    except Exception as exc:  # noqa: BLE001 - the JSON is the result; a plot failure must not lose it
        print(f"plot not written: {exc}")
    return result


def plot(result: dict[str, Any], out: Path) -> Path:
    """One PNG: val accuracy vs step and vs training seconds, mismatch KL vs step (mean over seeds),
    staleness histograms, final test accuracy ± SE and steps/s per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in result["cells"] if "error" not in c]
    sync_all = result["grid"]["sync_all_modes"]
    keys = sorted({(c["max_staleness"], c["mode"] if c["max_staleness"] or sync_all else "sync") for c in cells})

    def members(key):
        return [c for c in cells if c["max_staleness"] == key[0] and (key[1] == "sync" or c["mode"] == key[1])]

    colors = {"sync": "black", "none": "C3", "tis": "C0", "decoupled": "C2", "mis": "C1", "rs": "C4"}
    styles = {0: "-", 1: "--", 2: ":", 4: "-.", 8: (0, (3, 1, 1, 1))}
    fig, ax = plt.subplots(2, 3, figsize=(14, 7.5))
    for key in keys:
        cs = members(key)
        label = "η=0 (sync)" if key[1] == "sync" else f"η={key[0]} {key[1]}"
        style = dict(color=colors.get(key[1], None), ls=styles.get(key[0], "-"), lw=1.4, label=label)
        steps = sorted({pt["step"] for c in cs for pt in c["val_curve"]})
        acc = [_mean([pt["accuracy"] for c in cs for pt in c["val_curve"] if pt["step"] == s]) for s in steps]
        secs = [_mean([pt["train_s"] for c in cs for pt in c["val_curve"] if pt["step"] == s and pt["train_s"]])
                for s in steps]
        ax[0, 0].plot(steps, acc, marker="o", ms=3, **style)
        ax[0, 1].plot(secs, acc, marker="o", ms=3, **style)
        msteps = sorted({s for c in cs for s, _ in c["mismatch_kl"]})
        mk = [_mean([m for c in cs for s2, m in c["mismatch_kl"] if s2 == s and m is not None]) for s in msteps]
        ax[0, 2].plot(msteps, mk, **style)
    ax[0, 0].set(xlabel="learner step", ylabel="val guided accuracy (greedy)", title="accuracy vs step")
    ax[0, 1].set(xlabel="training wall s (evals excluded)", title="accuracy vs wall time")
    ax[0, 2].set(xlabel="learner step", ylabel="train/mismatch_kl", yscale="symlog", title="KL(mu || pi_prox)")
    ax[0, 2].set_yscale("symlog", linthresh=1e-6)
    ax[0, 0].legend(fontsize=7)
    labels = [("sync" if k[1] == "sync" else f"{k[0]}/{k[1]}") for k in keys]
    tests = [_mean([c["test_accuracy"] for c in members(k) if c["test_accuracy"] is not None]) or 0 for k in keys]
    errs = [_se([c["test_accuracy"] for c in members(k) if c["test_accuracy"] is not None])
            or (members(k)[0]["test_accuracy_se"] or 0) for k in keys]
    ax[1, 0].bar(labels, tests, yerr=errs, color=[colors.get(k[1], "grey") for k in keys], capsize=3)
    lo = min(tests) if tests else 0
    ax[1, 0].set(ylim=(max(0.0, lo - 0.1), min(1.0, max(tests or [1]) + 0.05)), ylabel="final test accuracy",
                 title="test accuracy (± SE)")
    ax[1, 1].bar(labels, [_mean([c["steps_per_s"] for c in members(k)]) for k in keys],
                 color=[colors.get(k[1], "grey") for k in keys])
    ax[1, 1].set(ylabel="steps/s", title="training steps/s")
    for a in (ax[1, 0], ax[1, 1]):
        a.tick_params(axis="x", rotation=45, labelsize=7)
    for eta in sorted({k[0] for k in keys}):
        hist: list[int] = []
        for c in cells:
            if c["max_staleness"] == eta:
                h = list(c["staleness_hist"])
                hist = [a + b for a, b in zip(hist + [0] * (len(h) - len(hist)), h + [0] * (len(hist) - len(h)))]
        total = max(sum(hist), 1)
        ax[1, 2].plot(range(len(hist)), [h / total for h in hist], marker="o", ls=styles.get(eta, "-"),
                      color="black", label=f"η={eta}")
    ax[1, 2].set(xlabel="staleness of trained groups (versions)", ylabel="fraction", title="staleness")
    ax[1, 2].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out, "convergence")
