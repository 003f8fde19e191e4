"""`python -m asyncrl.bench e2e --config X.yaml [--steps N] [--compare KEY]`: the real system, synchronous vs async.

Runs the full topology twice back to back in one invocation: first with `buffer.max_staleness=0`
(synchronous on-policy: the fleet only generates for the current version, so each step costs
rollout time R plus train+sync time T), then with the configured staleness (the fleet keeps
generating while the learner trains, so a step costs about max(R, T)). From the synchronous run,
R is the learner's wait for its batch per step and T the train+sync time per step, giving the ideal
speedup (R + T) / max(R, T); the measured speedup is the ratio of steady-state step rates.
Also reported per run: trained tokens/s, steps/s, learner and rollout idle ratios, weight-sync
seconds, the staleness histogram of trained groups, reward per wall-clock second, and the bytes
per step of the batch (fetched by learner rank 0) and through the driver (`perf/driver_bytes`:
sample bytes the driver process encoded or decoded; 0 on the straight data path).
Steady state skips the first warm-up steps (3; `--smoke` 1: engine warm-up, first admissions).
`--compare publish | weight_transfer` instead runs the configured job once per value of one key
(`AB_RUNS`: publish mode sync vs background; weight path extension vs native).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from asyncrl.bench.common import print_table
from asyncrl.config import Config


def measure(cfg: Config, steps: int, warmup: int, tag: str) -> dict[str, Any]:
    """One real run of `steps` learner steps; returns its steady-state figures."""
    from asyncrl.job.runtime import run

    cfg = cfg.model_copy(deep=True)
    cfg.trainer.max_steps = steps
    cfg.trainer.eval_before_after = False
    cfg.trainer.eval_every = -1
    cfg.trainer.save_every = -1
    cfg.trainer.logger = ["jsonl"]
    cfg.trainer.resume = "never"
    cfg.trainer.experiment_name = f"{cfg.trainer.experiment_name}-bench-{tag}"
    run_dir = cfg.run_path
    if (run_dir / "metrics.jsonl").exists():
        (run_dir / "metrics.jsonl").unlink()
    rc = run(cfg)
    if rc != 0:
        raise RuntimeError(f"e2e run {tag} exited with {rc}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return figures(rows, warmup, max_staleness=cfg.buffer.max_staleness, rollout_actors=cfg.rollout.num_actors)


def figures(rows: list[dict[str, Any]], warmup: int, *, max_staleness: int, rollout_actors: int) -> dict[str, Any]:
    """Steady-state figures of one run from its metrics.jsonl rows (one row per learner step).

    Steady wall time = time of the last row - time of the first steady row + that row's step
    time (so N steady steps span N step durations). R (rollout, per step) = the learner's mean
    wait for its batch; T (train + sync, per step) = mean step time - R."""
    steady = rows[warmup:] if len(rows) > warmup + 1 else rows
    wall = steady[-1]["time"] - steady[0]["time"] + steady[0].get("perf/step_s", 0.0)
    tokens = sum(r.get("perf/policy_tokens", r.get("perf/train_tokens", 0)) for r in steady)  # old runs: the old name
    hist: list[int] = []
    for r in rows:
        h = r.get("buffer/staleness_hist") or []
        hist = [a + b for a, b in zip(hist + [0] * (len(h) - len(hist)), list(h) + [0] * (len(hist) - len(h)))]
    mean = (lambda k: statistics.fmean(r.get(k, 0.0) for r in steady))  # noqa: E731
    wait = mean("perf/batch_wait_s")
    step_s = mean("perf/step_s")
    return {
        "max_staleness": max_staleness, "rollout_actors": rollout_actors, "steps": len(rows),
        "steady_steps": len(steady), "steady_wall_s": wall, "steps_per_s": len(steady) / max(wall, 1e-9),
        "trained_tokens_per_s": tokens / max(wall, 1e-9), "step_s": step_s, "rollout_s_per_step": wait,
        "train_sync_s_per_step": step_s - wait, "learner_idle_ratio": mean("perf/learner_idle_ratio"),
        "rollout_idle_ratio": mean("perf/rollout_idle_ratio"), "weight_sync_s": mean("perf/weight_sync_s"),
        "staleness_hist": hist, "reward_mean": mean("rollout/reward_mean"),
        # sample bytes the driver encoded/decoded per step (None: a run from before the metric existed)
        "driver_bytes_per_step": mean("perf/driver_bytes") if any("perf/driver_bytes" in r for r in steady) else None,
        "batch_bytes_per_step": mean("perf/batch_bytes") if any("perf/batch_bytes" in r for r in steady) else None,
        "reward_per_s": mean("rollout/reward_mean") * len(steady) / max(wall, 1e-9),
    }


def summarize(sync: dict[str, Any], asyn: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """The e2e JSON from the two runs' figures: speedup = async steps/s / sync steps/s; ideal =
    (R + T) / max(R, T) with R, T per step of the synchronous run."""
    r, t = sync["rollout_s_per_step"], sync["train_sync_s_per_step"]
    ideal = (r + t) / max(max(r, t), 1e-9)
    speedup = asyn["steps_per_s"] / max(sync["steps_per_s"], 1e-9)
    return {"speedup": speedup, "ideal_speedup": ideal, "fraction_of_ideal": speedup / ideal if ideal else None,
            "sync": sync, "async": asyn, "steps": steps, "warmup": warmup,
            "latency_model": {"gen_overhead_s": 0.0,
                              "gen_tokens_per_s": sync["trained_tokens_per_s"] * sync["step_s"] / max(r, 1e-9)
                              if r > 0 else 0.0,
                              "train_tokens_per_s": sync["trained_tokens_per_s"] * sync["step_s"] / max(t, 1e-9)
                              if t > 0 else 0.0}}


# --compare <name>: the configured run once per value of one config key, back to back in
# one invocation (the first value is the baseline); step and weight-sync seconds per step.
AB_RUNS = {
    "publish": ("learner.weights.publish_mode", ("sync", "background"),
                "WeightStore publish inside the broadcast vs in the background"),
    "weight_transfer": ("rollout.weight_transfer", ("extension", "native"),
                        "weights into vLLM through the worker extension vs vLLM's native API"),
}


def run_ab(cfg: Config, steps: int, warmup: int, name: str) -> dict[str, Any]:
    key, values, title = AB_RUNS[name]
    *path, field = key.split(".")
    out: dict[str, Any] = {}
    for value in values:
        c = cfg.model_copy(deep=True)
        section = c
        for part in path:
            section = getattr(section, part)
        setattr(section, field, value)
        out[value] = measure(c, steps, warmup, f"{name}-{value}")
    base, other = values
    rows = [(f"{v} {k}", out[v][k]) for k in ("steps_per_s", "step_s", "weight_sync_s") for v in values]
    rows.append((f"{other} / {base} step rate", out[other]["steps_per_s"] / out[base]["steps_per_s"]))
    print_table(f"e2e: {title}", rows)
    return out


def add_args(parser: Any) -> None:
    parser.add_argument("--steps", type=int, help="learner steps per run (12; --smoke 3)")
    parser.add_argument("--compare", choices=sorted(AB_RUNS),
                        help="instead of sync vs async: the configured run once per value of this key (AB_RUNS)")


def run(cfg: Config, args: Any) -> dict[str, Any]:
    smoke = args.smoke
    steps = args.steps if args.steps is not None else 3 if smoke else 12
    warmup = 1 if smoke else 3
    if args.compare:
        return run_ab(cfg, steps, warmup, args.compare)
    staleness = max(1, cfg.buffer.max_staleness)
    sync_cfg = cfg.model_copy(deep=True)
    sync_cfg.buffer.max_staleness = 0
    async_cfg = cfg.model_copy(deep=True)
    async_cfg.buffer.max_staleness = staleness
    sync = measure(sync_cfg, steps, warmup, "sync")
    asyn = measure(async_cfg, steps, warmup, "async")
    result = summarize(sync, asyn, steps, warmup)
    speedup, ideal = result["speedup"], result["ideal_speedup"]
    rows = [("sync steps/s", sync["steps_per_s"]), ("async steps/s", asyn["steps_per_s"]),
            ("sync trained tok/s", sync["trained_tokens_per_s"]), ("async trained tok/s", asyn["trained_tokens_per_s"]),
            ("R rollout s/step (sync)", sync["rollout_s_per_step"]),
            ("T train+sync s/step (sync)", sync["train_sync_s_per_step"]),
            ("ideal speedup (R+T)/max(R,T)", ideal), ("measured speedup", speedup),
            ("fraction of ideal", speedup / ideal if ideal else float("nan")),
            ("learner idle ratio sync | async", f"{sync['learner_idle_ratio']:.3f} | {asyn['learner_idle_ratio']:.3f}"),
            ("driver bytes/step sync | async", f"{sync['driver_bytes_per_step']} | {asyn['driver_bytes_per_step']}"),
            ("batch bytes/step (fetched by learner rank 0) async", asyn["batch_bytes_per_step"]),
            ("async staleness hist", str(asyn["staleness_hist"]))]
    print_table(f"e2e: async (max_staleness={staleness}) vs sync (max_staleness=0)", rows)
    _plot(sync, asyn, Path(args.output))
    return result


def _plot(sync: dict[str, Any], asyn: dict[str, Any], out: Path) -> None:
    import time

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(["sync", "async"], [sync["trained_tokens_per_s"], asyn["trained_tokens_per_s"]], color=["grey", "C0"])
    axes[0].set_ylabel("trained tokens/s")
    h = asyn["staleness_hist"] or [0]
    axes[1].bar(range(len(h)), h)
    axes[1].set_xlabel("staleness of trained groups (async)")
    fig.tight_layout()
    fig.savefig(out / f"e2e-{time.strftime('%Y%m%d-%H%M%S')}.png", dpi=100)
    plt.close(fig)
