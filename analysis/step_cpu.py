"""Where a training step's CPU goes: launch a job, and between two of its steps read every process's
CPU time (psutil, the launcher and all its descendants: Ray's daemons, the actors, vLLM's engine core)
and print core-seconds per step by process, with the job's median step figures over the same window.

    python analysis/step_cpu.py --config configs/quickstart.yaml --from-step 20 --to-step 65 \\
        rollout.guide.enable=false

On a machine with few cores the job is CPU-bound, so the total per step divided by the cores is a
floor for the step time, and the rows say which process to make cheaper (docs/benchmarks.md, "TRL":
where a single-turn step's CPU goes). Run it on an otherwise idle machine; compare runs interleaved."""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from asyncrl.bench.startup import process_role

PERF = ("perf/step_s", "perf/batch_wait_s", "perf/train_s", "perf/weight_sync_s", "perf/rollout_idle_ratio")


def cpu_by_role(root: psutil.Process) -> dict[str, float]:
    """CPU seconds of `root` and every process below it by role (`asyncrl.bench.startup.process_role`:
    a Ray worker's title, a daemon's script or executable), with vLLM's engine core, which is forked
    from the rollout actor and carries its title, counted on a row of its own."""
    procs = [root, *root.children(recursive=True)]
    roles = {proc.pid: "launcher" if proc is root else process_role(proc) for proc in procs}
    out: dict[str, float] = collections.defaultdict(float)
    for proc in procs:
        try:
            parent = roles.get(proc.ppid())
            t = proc.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        role = "vLLM engine core (forked)" if parent == "ray::RolloutWorker" else roles[proc.pid]
        out[role] += t.user + t.system
    return out


def last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--from-step", type=int, default=20, help="first step of the window (after warm-up)")
    ap.add_argument("--to-step", type=int, default=65, help="last step of the window")
    ap.add_argument("--run-dir", default=None, help="where the job writes (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = ap.parse_args(argv)
    if not 0 < args.from_step < args.to_step:
        ap.error("need 0 < --from-step < --to-step")
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="step-cpu-"))
    env = {"HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
           "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false", **os.environ}
    cmd = [sys.executable, "-m", "asyncrl.launch", "--config", args.config, f"trainer.max_steps={args.to_step + 3}",
           "trainer.eval_before_after=false", "trainer.eval_every=-1", "trainer.save_every=-1", "trainer.resume=never",
           f"trainer.run_dir={run_dir}", "trainer.experiment_name=step-cpu", *args.overrides]
    log = run_dir / "launch.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "step-cpu" / "metrics.jsonl"
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        root = psutil.Process(job.pid)
        marks: list[tuple[int, float, dict[str, float]]] = []
        print(f"[step-cpu] launched (log {log}); waiting for step {args.from_step} ...", flush=True)
        while job.poll() is None and len(marks) < 2:
            time.sleep(0.2)
            step = last_step(metrics)
            target = args.from_step if not marks else args.to_step
            if step >= target:
                marks.append((step, time.time(), cpu_by_role(root)))
                if len(marks) == 1:
                    print(f"[step-cpu] step {step}: window opened; waiting for step {args.to_step} ...", flush=True)
        code = job.wait()
    if len(marks) < 2:
        print(f"[step-cpu] the job ended (exit {code}) before step {args.to_step}; see {log}", file=sys.stderr)
        return 1
    (s0, t0, c0), (s1, t1, c1) = marks
    steps = s1 - s0
    wall = (t1 - t0) / steps
    rows = sorted(((name, (c1.get(name, 0.0) - c0.get(name, 0.0)) / steps) for name in c1), key=lambda r: -r[1])
    total = sum(v for _, v in rows)
    print(f"\nsteps {s0} -> {s1}: {wall:.3f} s per step (wall); CPU-seconds per step by process:")
    for name, v in rows:
        if v >= 0.002:
            print(f"  {name:28s} {v:7.3f}")
    print(f"  {'total':28s} {total:7.3f}  = {total / wall:.2f} of {psutil.cpu_count()} cores")
    steps_rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    window = [r for r in steps_rows if s0 < r["step"] <= s1]
    print("medians over the window: " + ", ".join(
        f"{k} {statistics.median(r[k] for r in window):.4f}" for k in PERF if all(k in r for r in window)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
