"""`python -m asyncrl.bench trl --config configs/quickstart.yaml`: asyncrl vs TRL's GRPOTrainer, side by side.

What a user would pick instead of asyncrl for a small job is Hugging Face TRL's `GRPOTrainer`
(plain GRPO, HF `generate`, one process). This benchmark trains both on the same task, policy,
reward and hyper-parameters, one after the other on the same machine, and scores both with the
same command (`python -m asyncrl.eval --solver-only` on the test split) at the same step counts:

1. asyncrl, guided protocol off (`rollout.guide.enable=false`: single-turn GRPO, the setting TRL
   has), launched as `python -m asyncrl.launch` in its own process: checkpoints every
   `trainer.save_every` steps (the full run: every max_steps/4);
2. TRL (`asyncrl.bench.trl_side`, its own process) with the mapped settings (the table is printed,
   with every way the two cannot be made equal);
3. `python -m asyncrl.eval --solver-only` on the initial policy and every checkpoint of both.

Reported: median seconds per learner step, launch-to-exit wall time, samples per second, the
solver-only accuracy curves (by step and by wall second since launch; plot `trl-curves.png`),
time to the same accuracy (the lower of the two final accuracies), each side's time from launch to
TRL's final accuracy, and whether the final accuracies agree within one standard error.
`--repeats N` runs the pair N times (the initial policy is scored once) and reports each run and
the spread (min / median / max) of every ratio: one run on this 2-core machine moved the ratios by
0.14-0.33. The guided mode has no TRL counterpart: the guided
figures of the newest quick-start run (`runs/quickstart/summary.json`), when present, are shown
beside it for reference.

TRL is an optional extra (`pip install -e '.[bench]'`, or `make bench-trl`); without it the
benchmark says so and exits. `--smoke`: 4 steps, 50 test rows (seconds to minutes, for tests).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.bench.common import print_table
from asyncrl.config import Config, load_config

# Differences that no setting removes (printed with the settings table).
UNEQUAL = [
    ("generation", "vLLM engines (rollout.num_actors actors), async, staleness <= buffer.max_staleness",
     "HF generate in the training process, on-policy"),
    ("prompt budget", "data.max_prompt_length (longer prompts are refused)",
     "none (GRPOConfig has no prompt limit; the task's prompts are all far shorter)"),
    ("off-policy correction", "learner.off_policy (behaviour logprobs from vLLM)", "none needed (on-policy)"),
    ("processes", "Ray driver, buffer, coordinator, actors (engines niced), learner (1 thread per rank)",
     "one, with every core (torch threads = CPU count; --trl-threads N pins it)"),
    ("sampling stream", "the coordinator's shuffled prompt stream (seeded)", "TRL's RepeatSampler (seeded)"),
    ("precision / kernels", "DeepSpeed CPU (fp32) learner, vLLM CPU kernels", "PyTorch fp32 (HF eager)"),
]


def _settings_rows(cfg: Config, trl: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    lc, r = cfg.learner, cfg.rollout
    return [
        ("policy", cfg.model.path, cfg.model.path),
        ("prompts per step (B)", cfg.data.rollout_batch_size,
         trl["per_device_train_batch_size"] // trl["num_generations"]),
        ("samples per prompt (G)", r.n, trl["num_generations"]),
        ("steps", cfg.trainer.max_steps, trl["max_steps"]),
        ("learning rate / schedule", f"{lc.optim.lr:g} {lc.optim.lr_scheduler}",
         f"{trl['learning_rate']:g} {trl['lr_scheduler_type']}"),
        ("weight decay / grad clip", f"{lc.optim.weight_decay:g} / {lc.max_grad_norm:g}",
         f"{trl['weight_decay']:g} / {trl['max_grad_norm']:g}"),
        ("KL coef (k3)", lc.kl.coef if lc.kl.enable else 0.0, trl["beta"]),
        ("clip eps low / high", f"{lc.clip_eps_low:g} / {lc.clip_eps_high:g}",
         f"{trl['epsilon']:g} / {trl['epsilon_high']:g}"),
        ("loss normalisation", lc.loss_avg_mode, trl["loss_type"]),
        ("advantage", f"{cfg.algorithm.adv_estimator}, std-normalised={cfg.algorithm.norm_adv_by_std}",
         f"group, scale_rewards={trl['scale_rewards']}"),
        ("temperature / top_p", f"{r.temperature:g} / {r.top_p:g}", f"{trl['temperature']:g} / {trl['top_p']:g}"),
        ("response budget (tokens)", cfg.data.max_response_length, trl["max_completion_length"]),
        ("reward", f"{cfg.reward.function} {cfg.reward.kwargs}", "the same function (asyncrl.rewards)"),
        ("checkpoint every", cfg.trainer.save_every, trl["save_steps"]),
    ]


def _python_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _timed(cmd: list[str], log: Path) -> float:
    """Run `cmd` with its output in `log`; its wall seconds. Raises with the log's tail on failure."""
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_python_env()).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with {rc} (log {log}):\n{tail}")
    return time.time() - t0


def _evaluate(model: str, cfg: Config, out: Path, limit: int) -> dict[str, float]:
    """Solver-only accuracy (and its standard error) of one checkpoint on the test split."""
    test = Path(cfg.data.test_files if isinstance(cfg.data.test_files, str) else cfg.data.test_files[0])
    cmd = [sys.executable, "-m", "asyncrl.eval", "--model", model, "--solver-only", "--data-dir", str(test.parent),
           "--split", test.stem, "--max-turns", str(cfg.rollout.guide.max_turns),
           "--max-tokens", str(cfg.data.max_response_length), "--max-prompt-length", str(cfg.data.max_prompt_length),
           "--output", str(out)]
    if limit:
        cmd += ["--limit", str(limit)]
    _timed(cmd, out.with_suffix(".log"))
    result = json.loads(out.read_text())
    return {"accuracy": float(result["solver_accuracy"]), "se": float(result.get("solver_accuracy_se", 0.0))}


def _time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    """Seconds since launch of the first checkpoint at or above `target` accuracy."""
    for point in curve:
        if point["accuracy"] >= target - 1e-12:
            return point["wall_s"]
    return None


def _asyncrl_side(cfg: Config, out: Path) -> dict[str, Any]:
    import yaml

    cfg_path = out / "asyncrl_config.yaml"
    # Only the keys that are set (by the user's file, the overrides or `_side_config`): a full dump
    # would set every default explicitly, which the preflight reads as the user's choice (vision
    # keys on a text model refused the launch: `make bench-trl` exited 2 before its first step).
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True), sort_keys=False))
    if load_config(cfg_path, []).model_dump() != cfg.model_dump():
        raise RuntimeError(f"{cfg_path} does not read back as the benchmark's config")
    t_launch = time.time()
    wall = _timed([sys.executable, "-m", "asyncrl.launch", "--config", str(cfg_path)], out / "asyncrl.log")
    run_dir = cfg.run_path
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_s" in r]
    saves = {}
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        step = int(ckpt.name.split("_")[1])
        saves[step] = {"path": str(ckpt / "hf"), "wall_s": (ckpt / "run_state.json").stat().st_mtime - t_launch}
    first = rows[0]["time"] - rows[0]["perf/step_s"] - t_launch
    return {"launch_to_exit_s": wall, "step_s": [float(r["perf/step_s"]) for r in rows],
            "train_s": rows[-1]["time"] - t_launch - first, "first_step_s": first, "saves": saves,
            "split": {k: statistics.median(float(r.get(k, 0.0)) for r in rows)
                      for k in ("perf/batch_wait_s", "perf/train_s", "perf/weight_sync_s")}}


def _trl_side(cfg: Config, out: Path, threads: int) -> dict[str, Any]:
    cfg_json = out / "trl_config.json"
    cfg_json.write_text(cfg.model_dump_json())
    wall = _timed([sys.executable, "-m", "asyncrl.bench.trl_side", "--config-json", str(cfg_json),
                   "--out", str(out / "trl"), "--threads", str(threads)], out / "trl.log")
    res = json.loads((out / "trl" / "trl_result.json").read_text())
    ends = res["step_end_s"]
    steps = [b - a for a, b in zip([res["t_first_step_s"]] + ends[:-1], ends, strict=True)]
    saves = {int(k): {"path": str(out / "trl" / f"checkpoint-{k}"), "wall_s": float(v)} for k, v in res["saves"].items()}
    return {"launch_to_exit_s": wall, "step_s": steps, "train_s": ends[-1] - res["t_first_step_s"],
            "first_step_s": res["t_first_step_s"], "saves": saves, "settings": res["settings"]}


def _side_summary(name: str, side: dict[str, Any], cfg: Config, warmup: int) -> dict[str, Any]:
    steady = side["step_s"][warmup:] or side["step_s"]
    samples = len(side["step_s"]) * cfg.data.rollout_batch_size * cfg.rollout.n
    final = side["curve"][-1]
    return {"side": name, "median_step_s": statistics.median(steady), "launch_to_exit_s": side["launch_to_exit_s"],
            "start_up_s": side["first_step_s"], "samples_per_s": samples / max(side["train_s"], 1e-9),
            "final_accuracy": final["accuracy"], "final_se": final["se"]}


def _plot(curves: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, curve in curves.items():
        a.errorbar([p["step"] for p in curve], [p["accuracy"] for p in curve], [p["se"] for p in curve],
                   marker="o", capsize=3, label=name)
        b.plot([p["wall_s"] for p in curve], [p["accuracy"] for p in curve], marker="o", label=name)
    a.set(xlabel="learner step", ylabel="solver-only accuracy (test)", title="accuracy by step")
    b.set(xlabel="seconds since launch", title="accuracy by wall time")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_args(parser: Any) -> None:
    parser.add_argument("--trl-threads", type=int, default=0,
                        help="torch threads of the TRL process; 0 = every core (what a user running it here gets)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the pair this many times, one after the other, and report the spread of the ratios")


def run(cfg: Config, args: Any) -> dict[str, Any]:
    if importlib.util.find_spec("trl") is None:
        message = ("TRL is not installed: this benchmark needs the optional `bench` extra "
                   "(pip install -e '.[bench]', or run `make bench-trl`, which installs it)")
        print(message)
        return {"skipped": message}
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    root = Path(args.output).resolve() / f"trl-{time.strftime('%Y%m%d-%H%M%S')}"
    smoke = bool(args.smoke)
    runs, initial = [], None
    for i in range(args.repeats):
        out = root if args.repeats == 1 else root / f"run{i + 1}"
        out.mkdir(parents=True, exist_ok=True)
        if args.repeats > 1:
            print(f"\n[bench trl] run {i + 1}/{args.repeats} ({out})", flush=True)
        result = _one_run(cfg, args, out, smoke, initial)
        initial = result["curves"]["asyncrl"][0]
        runs.append(result)
    if args.repeats == 1:
        return runs[0]
    spread = _spread(runs)
    print_table(f"spread over {args.repeats} runs (min / median / max)",
                [(k, " / ".join(_fmt(v) for v in (lo, mid, hi))) for k, (lo, mid, hi) in spread.items()])
    return {"repeats": args.repeats, "spread": spread, "runs": runs, "output_dir": str(root), "smoke": smoke}


def _spread(runs: list[dict[str, Any]]) -> dict[str, tuple[float, float, float]]:
    """min / median / max over the runs of every numeric ratio and per-side figure."""
    values: dict[str, list[float]] = {}
    for r in runs:
        for k, v in r["ratios"].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                values.setdefault(k, []).append(float(v))
        for side, summary in r["summaries"].items():
            for k in ("median_step_s", "launch_to_exit_s", "start_up_s", "final_accuracy", "time_to_trl_final_s"):
                if summary.get(k) is not None:
                    values.setdefault(f"{side} {k}", []).append(float(summary[k]))
    return {k: (min(v), statistics.median(v), max(v)) for k, v in values.items()}


def _one_run(cfg: Config, args: Any, out: Path, smoke: bool, initial: dict[str, Any] | None) -> dict[str, Any]:
    """One asyncrl run and one TRL run, both scored; `initial`: the initial policy's score, when known."""
    from asyncrl.bench.trl_side import trl_settings

    cfg = _side_config(cfg, out, smoke)
    steps = cfg.trainer.max_steps
    settings = trl_settings(cfg, str(out / "trl"))
    _print_settings(cfg, settings)

    print(f"\n[bench trl] asyncrl: {steps} steps (guided protocol off) ...", flush=True)
    sides = {"asyncrl": _asyncrl_side(cfg, out)}
    print(f"[bench trl] TRL GRPOTrainer: {steps} steps ...", flush=True)
    sides["trl"] = _trl_side(cfg, out, args.trl_threads)
    _score_checkpoints(sides, cfg, out, limit=50 if smoke else 0, initial=initial)
    summaries, ratios, target = _compare(sides, cfg, warmup=1 if smoke else 5)
    guided = _guided_reference()
    if guided:
        print_table("for reference: asyncrl guided quick start (no TRL counterpart)", list(guided.items()))
    curves = {name: side["curve"] for name, side in sides.items()}
    try:
        _plot(curves, out / "trl-curves.png")
        print(f"plot: {out / 'trl-curves.png'}")
    except Exception as exc:  # noqa: BLE001 - the plot is a convenience; the JSON has the numbers
        print(f"plot not written: {type(exc).__name__}: {exc}")
    return {"steps": steps, "target_accuracy": target, "summaries": summaries, "ratios": ratios, "curves": curves,
            "settings_trl": settings, "unequal": UNEQUAL, "guided_reference": guided, "output_dir": str(out),
            "smoke": smoke}


def _side_config(cfg: Config, out: Path, smoke: bool) -> Config:
    """The asyncrl side's config: single-turn GRPO (what TRL's GRPOTrainer does), checkpoints to score."""
    cfg = cfg.model_copy(deep=True)
    if smoke:
        cfg.trainer.max_steps = 4
    cfg.rollout.guide.enable = False
    cfg.trainer.save_every = 2 if smoke else max(1, cfg.trainer.max_steps // 4)
    cfg.trainer.save_limit = -1
    cfg.trainer.eval_before_after = False
    cfg.trainer.eval_every = -1
    cfg.trainer.logger = ["jsonl"]
    cfg.trainer.resume = "never"
    cfg.trainer.experiment_name = f"bench-trl-asyncrl-{out.name}"
    cfg.trainer.run_dir = str(out / "asyncrl_runs")
    cfg.rollout.guide = cfg.rollout.guide  # the sections changed above count as set (see _asyncrl_side)
    cfg.rollout, cfg.trainer = cfg.rollout, cfg.trainer
    return cfg


def _print_settings(cfg: Config, settings: dict[str, Any]) -> None:
    print("\n== settings: asyncrl | TRL GRPOTrainer ==")
    for key, a, t in _settings_rows(cfg, settings):
        print(f"  {key:26} {str(a):44} {t}")
    print("  cannot be made equal:")
    for key, a, t in UNEQUAL:
        print(f"    {key:24} asyncrl: {a}\n    {'':24} TRL:     {t}")


def _score_checkpoints(sides: dict[str, dict[str, Any]], cfg: Config, out: Path, limit: int,
                       initial: dict[str, Any] | None = None) -> None:
    """Each side's `curve`: solver accuracy of the initial policy (scored here unless `initial` gives
    it) and of every checkpoint it saved."""
    print("[bench trl] evaluating the initial policy and every checkpoint (solver-only, test split) ...", flush=True)
    if initial is None:
        initial = _evaluate(cfg.model.path, cfg, out / "eval_initial.json", limit)
    initial = {"accuracy": initial["accuracy"], "se": initial["se"]}
    for name, side in sides.items():
        side["curve"] = [{"step": 0, "wall_s": side["first_step_s"], **initial}]
        for step, save in sorted(side["saves"].items()):
            acc = _evaluate(save["path"], cfg, out / f"eval_{name}_{step}.json", limit)
            side["curve"].append({"step": step, "wall_s": save["wall_s"], **acc})
            print(f"  {name} step {step}: solver accuracy {acc['accuracy']:.3f} ± {acc['se']:.3f}", flush=True)


def _compare(sides: dict[str, dict[str, Any]], cfg: Config, warmup: int) -> tuple[dict, dict, float]:
    """Per-side summaries, the asyncrl/TRL ratios and the target accuracy (the lower final one); printed."""
    summaries = {name: _side_summary(name, side, cfg, warmup) for name, side in sides.items()}
    a, t = summaries["asyncrl"], summaries["trl"]
    target = min(a["final_accuracy"], t["final_accuracy"])
    for name, s in summaries.items():
        s["time_to_target_s"] = _time_to(sides[name]["curve"], target)
        s["time_to_trl_final_s"] = _time_to(sides[name]["curve"], t["final_accuracy"])
    se = math.sqrt(a["final_se"] ** 2 + t["final_se"] ** 2)
    reached = a["time_to_trl_final_s"]
    ratios = {"step_s_asyncrl_over_trl": a["median_step_s"] / max(t["median_step_s"], 1e-9),
              "launch_to_exit_asyncrl_over_trl": a["launch_to_exit_s"] / max(t["launch_to_exit_s"], 1e-9),
              "time_to_trl_final_asyncrl_over_trl": (None if reached is None else
                                                     reached / max(t["time_to_trl_final_s"], 1e-9)),
              "final_accuracy_diff": a["final_accuracy"] - t["final_accuracy"], "final_accuracy_diff_se": se,
              "same_accuracy_within_1se": abs(a["final_accuracy"] - t["final_accuracy"]) <= se}
    rows: list[tuple[str, Any]] = []
    for key in ("median_step_s", "launch_to_exit_s", "start_up_s", "samples_per_s", "final_accuracy", "final_se",
                "time_to_target_s", "time_to_trl_final_s"):
        rows.append((f"{key:18} asyncrl | TRL", f"{_fmt(a[key])} | {_fmt(t[key])}"))
    rows += [(k, v) for k, v in ratios.items()]
    rows.append(("asyncrl step split (median s)", ", ".join(f"{k.split('/')[1]} {v:.3f}"
                                                            for k, v in sides["asyncrl"]["split"].items())))
    print_table(f"asyncrl vs TRL GRPOTrainer ({cfg.trainer.max_steps} steps, target accuracy {target:.3f})", rows)
    return summaries, ratios, target


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def _guided_reference(path: str = "runs/quickstart/summary.json") -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        return {}
    s = json.loads(p.read_text())
    before, after = s.get("before", {}), s.get("after", {})
    return {"source": str(p), "steps": s.get("steps"), "wall_s": s.get("wall_s"),
            "guided_accuracy before -> after": f"{before.get('guided_accuracy')} -> {after.get('guided_accuracy')}",
            "solver_accuracy before -> after": f"{before.get('solver_accuracy')} -> {after.get('solver_accuracy')}"}
