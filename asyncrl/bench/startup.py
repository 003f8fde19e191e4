"""`python -m asyncrl.bench startup`: where a launch's seconds go, from the process start to the first learner step.

Launches the job (`python -m asyncrl.launch`, a whole process, as a user does) `--launches` times for
each variant (`--variants guided,unguided`: the guided protocol on, and `rollout.guide.enable=false`),
each run `trainer.max_steps=2`, no evaluation, no checkpoints. Every console line is stamped with the
seconds since the process was started; from the launcher's own step lines (`starting X ...`,
`X ready (N s)`) and the first `step 1/` line it reports, per variant, the median of:

- `first_step_s`: launch -> the first learner step's line (the issue's figure: the first step is
  printed when it has finished, so this includes it);
- for every start-up component, when it was ready (seconds since launch) and its own step time;
- `engine_up_s`: the rollout actor's own report of its engine build;
- `launch_to_exit_s`;
- `cpu_s`: CPU seconds (user + system) each process of the job had used when the first step's line
  came, by role (the launcher, each Ray actor by class: a rollout actor with the engine core it
  forked, which keeps its title; Ray's own daemons) and in total: on a machine with few cores the sum, not the wall clock of any one part, sets the floor.
  Processes that ended before the first step are not counted.

The machine should be otherwise idle (2 cores here: anything else running moves every figure).
Results: `<output>/startup-<time>/startup.json` and one log per launch beside it.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.bench.common import print_table
from asyncrl.config import Config
from asyncrl.startup import READY_LINE

ENGINE_UP = re.compile(r"engine up in (?P<secs>[0-9.]+)s")
STEP_ONE = re.compile(r"^\[asyncrl\] step 1/")
FLEET_LAUNCHED = re.compile(r"^\[asyncrl\] rollout actors x\d+: engines building")


def add_args(parser: Any) -> None:
    parser.add_argument("--launches", type=int, default=3, help="launches per variant (the median is reported)")
    parser.add_argument("--variants", default="guided,unguided",
                        help="comma list of: guided (rollout.guide.enable=true), unguided (=false)")


def parse_console(lines: list[tuple[float, str]]) -> dict[str, Any]:
    """One launch's figures from its stamped console lines `(seconds since launch, text)`."""
    out: dict[str, Any] = {"components": {}, "first_step_s": None, "engine_up_s": None, "fleet_launched_s": None}
    for t, text in lines:
        text = text.rstrip()
        if m := READY_LINE.match(text):
            name = re.sub(r" \(.*", "", m["name"])  # "learner (1 rank(s), ZeRO-1)" -> "learner"
            out["components"][name] = {"ready_at_s": round(t, 2), "step_s": float(m["secs"])}
        elif (m := ENGINE_UP.search(text)) and out["engine_up_s"] is None:
            out["engine_up_s"] = float(m["secs"])
        elif FLEET_LAUNCHED.match(text) and out["fleet_launched_s"] is None:
            out["fleet_launched_s"] = round(t, 2)
        elif STEP_ONE.match(text) and out["first_step_s"] is None:
            out["first_step_s"] = round(t, 2)
    return out


def process_role(proc: Any) -> str:
    """A readable role for one process of the job: a Ray worker's title (`ray::RolloutWorker`), a
    Python daemon's script (`log_monitor.py`), else the executable's name (`raylet`)."""
    try:
        cmd = proc.cmdline()
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return proc.name()
    if cmd and cmd[0].startswith("ray::"):
        return re.split(r"[.\s]", cmd[0], maxsplit=1)[0]
    if cmd and Path(cmd[0]).name.startswith("python"):
        script = next((a for a in cmd[1:] if a.endswith(".py")), None)
        if script:
            return Path(script).name
        if "-m" in cmd[:-1]:
            return cmd[cmd.index("-m") + 1]
    return proc.name()


def cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds (user + system, each process's own: what its ended children used is not counted) of
    `pid` and every process below it, summed by `process_role`, largest first, with the total under `total`."""
    import psutil

    root = psutil.Process(pid)
    out: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            role = "launcher" if proc.pid == pid else process_role(proc)
        except psutil.Error:
            continue
        out[role] = out.get(role, 0.0) + t.user + t.system
    out = dict(sorted(((k, round(v, 2)) for k, v in out.items()), key=lambda kv: -kv[1]))
    out["total"] = round(sum(out.values()), 2)
    return out


def _launch(cfg_path: Path, overrides: list[str], log: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-u", "-m", "asyncrl.launch", "--config", str(cfg_path), *overrides]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[tuple[float, str]] = []
    cpu: dict[str, float] | None = None
    with open(log, "w") as f:
        assert proc.stdout is not None
        for text in proc.stdout:
            t = time.monotonic() - t0
            lines.append((t, text))
            f.write(f"{t:8.2f} {text}")
            if cpu is None and STEP_ONE.match(text):
                cpu = cpu_by_role(proc.pid)
    rc = proc.wait()
    result = parse_console(lines)
    result["launch_to_exit_s"] = round(time.monotonic() - t0, 2)
    result["rc"] = rc
    result["cpu_s"] = cpu or {}
    if rc != 0 or result["first_step_s"] is None:
        tail = "".join(text for _, text in lines[-25:])
        raise RuntimeError(f"launch exited {rc} without a first step (log {log}):\n{tail}")
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over launches: the headline figures and each component's ready time and step time."""
    def med(values: list[float | None]) -> float | None:
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 2) if values else None

    names = list(dict.fromkeys(n for r in runs for n in r["components"]))
    return {
        "first_step_s": med([r["first_step_s"] for r in runs]),
        "first_step_each_s": [r["first_step_s"] for r in runs],
        "engine_up_s": med([r["engine_up_s"] for r in runs]),
        "fleet_launched_s": med([r["fleet_launched_s"] for r in runs]),
        "launch_to_exit_s": med([r["launch_to_exit_s"] for r in runs]),
        "cpu_s": {n: med([r.get("cpu_s", {}).get(n) for r in runs])
                  for n in dict.fromkeys(n for r in runs for n in r.get("cpu_s", {}))},
        "components": {n: {"ready_at_s": med([r["components"].get(n, {}).get("ready_at_s") for r in runs]),
                           "step_s": med([r["components"].get(n, {}).get("step_s") for r in runs])}
                       for n in names},
    }


def run(cfg: Config, args: Any) -> dict[str, Any]:
    import yaml

    if args.launches < 1:
        raise ValueError(f"--launches must be at least 1, got {args.launches}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in ("guided", "unguided")]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; use guided and/or unguided")
    root = Path(args.output).resolve() / f"startup-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True, exist_ok=True)
    cfg_path = root / "config.yaml"  # only the keys that are set (a full dump reads as every key chosen)
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=True), sort_keys=False))
    launches = 1 if args.smoke else args.launches
    result: dict[str, Any] = {"launches": launches, "variants": {}, "output_dir": str(root)}
    for variant in variants:
        runs = []
        for i in range(launches):
            overrides = [f"rollout.guide.enable={'true' if variant == 'guided' else 'false'}",
                         "trainer.max_steps=2", "trainer.eval_before_after=false", "trainer.eval_every=-1",
                         "trainer.save_every=-1", "trainer.resume=never", f"trainer.run_dir={root / 'runs'}",
                         f"trainer.experiment_name={variant}-{i + 1}"]
            log = root / f"{variant}-{i + 1}.log"
            print(f"[bench startup] {variant} launch {i + 1}/{launches} (log {log}) ...", flush=True)
            one = _launch(cfg_path, overrides, log)
            print(f"[bench startup]   first step at {one['first_step_s']:.1f}s, exit at {one['launch_to_exit_s']:.1f}s",
                  flush=True)
            runs.append(one)
        summary = summarize(runs)
        result["variants"][variant] = {"summary": summary, "runs": runs}
        rows = [("launch -> first step (median; each)", f"{summary['first_step_s']}  {summary['first_step_each_s']}"),
                ("rollout fleet launched at", summary["fleet_launched_s"]),
                ("engine up (the actor's own figure)", summary["engine_up_s"]),
                ("launch -> exit", summary["launch_to_exit_s"])]
        rows += [(f"  {n}: ready at / its step", f"{c['ready_at_s']} / {c['step_s']}")
                 for n, c in summary["components"].items()]
        rows += [(f"  CPU-s by the first step: {n}", c) for n, c in summary["cpu_s"].items()]
        print_table(f"start-up, {variant} (seconds since launch, median of {launches})", rows)
    (root / "startup.json").write_text(json.dumps(result, indent=2))
    print(f"results: {root / 'startup.json'}")
    return result
