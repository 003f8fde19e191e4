"""`python -m asyncrl.bench scale --config X.yaml model.path=DIR [overrides]`: the whole system at a real size.

Meant for a policy with a real model's dimensions (scripts/make_scale_policy.py builds one with
Qwen2.5-0.5B's, random weights, the quick start's tokenizer): it is the first place where
timeouts, copies, object-store puts and checkpoints cost what they will cost for real. Three jobs
through the launcher, each in its own process, with a small batch and no evaluation:
`extension` and `native` (the two weight paths; `--steps` learner steps each, default
3, ending with a checkpoint), then `resume` (from the first one's checkpoint, one more step).
Per job: seconds of every start-up step (the launcher's "X ready (Ns)" lines), seconds per learner
step, weight sync and broadcast per step, fingerprint mismatches, the checkpoint's bytes, the exit
status, and the peak resident memory of every role (learner ranks, rollout actors, vLLM engine
cores, the other Ray workers, the driver), sampled from the job's process tree every 0.2 s.
`ratio` = a bare gloo broadcast of the model's fp32 bytes between two processes (one flat
tensor, no packing, best of 3) / the extension run's mean weight-sync seconds.
Before anything starts, the launcher's memory guard (asyncrl.checks.preflight.memory_fit) refuses a
configuration this machine cannot hold, naming the components; `--smoke` runs 2 steps per job.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from asyncrl.bench.common import print_table
from asyncrl.config import Config
from asyncrl.learner.checkpoint import dir_bytes
from asyncrl.startup import READY_LINE

ROLES = (("learner", "LearnerActor"), ("rollout actor", "RolloutWorker"), ("vLLM engine core", "EngineCore"),
         ("replay buffer", "BufferHost"), ("coordinator", "Coordinator"), ("weight store", "WeightStore"))


def role_of(cmdline: str) -> str:
    """The job role of a process, from the title Ray and vLLM give their processes."""
    for role, marker in ROLES:
        if marker in cmdline:
            return role
    if "asyncrl.launch" in cmdline:
        return "driver"
    return "ray (other)"


class RssSampler:
    """Peak resident bytes per role of a process tree, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.pid, self.every_s = pid, every_s
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            now: dict[str, int] = {}
            for p in procs:
                try:
                    role = role_of(" ".join(p.cmdline()) or p.name())
                    now[role] = now.get(role, 0) + p.memory_info().rss
                except psutil.Error:
                    continue
            for role, rss in now.items():
                self.peak[role] = max(self.peak.get(role, 0), rss)
            self.peak["job total"] = max(self.peak.get("job total", 0), sum(now.values()))
            self._stop.wait(self.every_s)


def run_job(config: str, overrides: list[str], tag: str, run_root: Path) -> dict[str, Any]:
    """One job through `python -m asyncrl.launch`; retried once (and marked so) when Ray itself
    did not start, which on a loaded machine is the machine, not the job."""
    job = _run_job_once(config, overrides, tag, run_root / tag)
    if job["exit"] != 0 and "ray (embedded)" in job["tail"] and "failed to start" in job["tail"]:
        job = {**_run_job_once(config, overrides, tag, run_root / f"{tag}-retry"), "retried": True}
    return job


def _run_job_once(config: str, overrides: list[str], tag: str, run_dir: Path) -> dict[str, Any]:
    """One job through `python -m asyncrl.launch` in its own process; its figures."""
    argv = [sys.executable, "-m", "asyncrl.launch", "--config", config, *overrides, f"trainer.run_dir={run_dir}"]
    t0 = time.time()
    with launched(argv) as (proc, sampler):
        out, _ = proc.communicate()
    ready = [(m["name"], float(m["secs"])) for m in READY_LINE.finditer(out)]
    rows = []
    for path in run_dir.rglob("metrics.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    steps = [r for r in rows if "perf/step_s" in r]
    mean = (lambda k: statistics.fmean(r[k] for r in steps) if steps else None)  # noqa: E731
    ckpts = sorted(run_dir.rglob("checkpoints/step_*"))
    return {"tag": tag, "exit": proc.returncode, "wall_s": round(time.time() - t0, 1), "startup_s": dict(ready),
            "steps": len(steps), "step_s": mean("perf/step_s"), "train_s": mean("perf/train_s"),
            "weight_sync_s": mean("perf/weight_sync_s"), "weight_broadcast_s": mean("perf/weight_broadcast_s"),
            "fingerprint_mismatches": sum(int(r.get("weights/fingerprint_mismatch", 0)) for r in steps),
            "checkpoint": str(ckpts[-1]) if ckpts else None,
            "checkpoint_bytes": dir_bytes(ckpts[-1]) if ckpts else 0,
            "peak_rss_gib": {k: round(v / 2**30, 2) for k, v in sorted(sampler.peak.items())},
            "tail": out[-1500:] if proc.returncode else ""}


@contextmanager
def launched(argv: list[str]) -> Iterator[tuple[subprocess.Popen, RssSampler]]:
    """A job's process (stdout and stderr together) with its process tree's memory sampled."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with RssSampler(proc.pid) as sampler:
            yield proc, sampler
    finally:
        if proc.poll() is None:
            proc.kill()


def _bare_peer(port: int, nbytes: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=300), wait_for_workers=False)
    pg = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=300))
    buf = torch.empty(nbytes // 4, dtype=torch.float32)
    for _ in range(rounds):
        pg.broadcast([buf]).wait()


def bare_gloo_seconds(nbytes: int, rounds: int = 3) -> float:
    """Best of `rounds` flat gloo broadcasts of `nbytes` to one other process."""
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=300), wait_for_workers=False)
    peer = mp.get_context("spawn").Process(target=_bare_peer, args=(store.port, nbytes, rounds), daemon=True)
    peer.start()
    pg = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=300))
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        pg.broadcast([buf]).wait()
        best = min(best, time.perf_counter() - t)
    peer.join(60)
    return best


def add_args(parser: Any) -> None:
    parser.add_argument("--steps", type=int, help="learner steps per job (3; --smoke 2); resume adds one")


def run(cfg: Config, args: Any) -> dict[str, Any]:
    from asyncrl.learner.memory import shape_from_config

    steps = args.steps if args.steps is not None else 2 if args.smoke else 3
    shape = shape_from_config(json.loads((Path(cfg.model.path) / "config.json").read_text()), cfg.model.path)
    run_root = Path(args.output).resolve() / f"scale-runs-{time.strftime('%Y%m%d-%H%M%S')}"
    common = [*args.overrides, f"trainer.max_steps={steps}", "trainer.eval_before_after=false",
              "trainer.eval_every=-1", "trainer.save_every=-1", "trainer.logger=[jsonl]", "verifier.port=0"]
    jobs = [run_job(args.config, [*common, "rollout.weight_transfer=extension"], "extension", run_root),
            run_job(args.config, [*common, "rollout.weight_transfer=native"], "native", run_root)]
    checkpoint = next((j["checkpoint"] for j in jobs if j["checkpoint"]), None)
    if checkpoint:
        jobs.append(run_job(args.config, [*common, f"trainer.max_steps={steps + 1}", f"trainer.resume={checkpoint}"],
                            "resume", run_root))
    bare = bare_gloo_seconds(int(4 * shape.params))
    sync = jobs[0]["weight_sync_s"]
    result = {"model": cfg.model.path, "parameters": shape.params, "fp32_bytes": int(4 * shape.params),
              "steps_per_job": steps, "bare_gloo_broadcast_s": bare, "ratio": bare / sync if sync else None,
              "jobs": jobs}
    for j in jobs:
        print_table(f"scale: {j['tag']}", [(k, json.dumps(v) if isinstance(v, dict) else v)
                                          for k, v in j.items() if k not in ("tag", "tail")])
    print_table("scale: weight sync vs a bare gloo broadcast", [("fp32 bytes", result["fp32_bytes"]),
                                                                 ("bare gloo s", bare), ("ratio", result["ratio"])])
    return result
