"""The live state of a job as a file: `<run_dir>/status.json`, rewritten atomically after every
learner step by the driver, read by `python -m asyncrl.ctl status` without joining the Ray cluster
(so it answers in well under a second, also while the job is busy or its cluster is slow).

Contract: the file is always a complete JSON object (written to a temporary file, then renamed);
`updated` is its wall-clock time, so a reader can tell a stale file (a job that died) from a live one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

STATUS_FILE = "status.json"
# The metrics of the latest step that a status carries under `latest` (what format_status shows).
STATUS_KEYS = ("rollout/reward_mean", "train/reward_mean", "reward/accuracy", "rollout/turns_mean", "perf/step_s",
               "perf/policy_tokens_per_s", "perf/learner_idle_ratio", "perf/rollout_idle_ratio", "buffer/size_groups",
               "train/staleness_mean", "perf/weight_sync_s", "verifier/version",
               "buffer/in_flight", "buffer/admission_used", "buffer/admission_limit", "buffer/staleness_max",
               "rollout/tokens_per_s", "verifier/latency_ms_p50", "verifier/latency_ms_p95", "verifier/error_rate")

PHASE_PREFIX = "perf/weight_sync/"  # the weight round by phase (asyncrl.job.step_metrics.weight_sync_phases)


def job_status(cfg: Any, fleet: Any, run_dir: Path, step: int, version: int, metrics: dict[str, Any], *,
               elapsed_s: float, eta_s: float | None) -> dict[str, Any]:
    """The status of a job after a learner step (`metrics`: that step's row)."""
    return {"step": step, "max_steps": cfg.trainer.max_steps, "rollout_actors": sorted(fleet.actors),
            "verifier_version": cfg.verifier.version, "run_dir": str(run_dir),
            "latest": {k: v for k, v in metrics.items() if k in STATUS_KEYS or k.startswith(PHASE_PREFIX)},
            "version": version,
            "elapsed_s": elapsed_s, "eta_s": eta_s, "actors": fleet.status(), "pid": os.getpid(),
            "updated": time.time()}


def write_status(run_dir: str | Path, status: dict[str, Any]) -> Path:
    path = Path(run_dir) / STATUS_FILE
    tmp = path.with_name(f".{STATUS_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**status, "updated": time.time()}, default=str))
    os.replace(tmp, path)
    return path


def read_status(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir) / STATUS_FILE
    if not path.exists():
        return None
    return json.loads(path.read_text())


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and spec:
        return format(value, spec)
    return str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def sync_phase_rows(latest: dict[str, Any], top: int = 5) -> list[tuple[str, str]]:
    """One row per side of the weight round: its seconds and its largest phases."""
    rows = []
    for side, label, whole in (("send", "  sender", "round"), ("recv", "  receiver", "round"),
                               ("engine", "  engine", "total")):
        phases = {k[len(PHASE_PREFIX) + len(side) + 1:-2]: v for k, v in latest.items()
                  if k.startswith(f"{PHASE_PREFIX}{side}_") and isinstance(v, (int, float))}
        total = phases.pop(whole, None)
        if total is None:
            continue
        big = sorted(((v, k) for k, v in phases.items() if v > 0), reverse=True)[:top]
        rows.append((label, f"{total:.2f} s: " + ", ".join(f"{k} {v:.2f}" for v, k in big)))
    return rows


def format_status(status: dict[str, Any], *, now: float | None = None, running: bool = True) -> str:
    """A readable table of `status` (the dict `write_status` wrote or the coordinator holds)."""
    now = time.time() if now is None else now
    from asyncrl.metrics import upgrade_row

    latest = upgrade_row(status.get("latest", {}))  # a status.json of an older job: the old key names
    age = now - status["updated"] if "updated" in status else None
    state = "running" if running else "not running"
    lines = [f"job      {status.get('run_dir', '-')}  [{state}; status {_duration(age)} old]",
             f"step     {status.get('step')}/{status.get('max_steps')}   policy version v{status.get('version', '-')}"
             f"   elapsed {_duration(status.get('elapsed_s'))}   ETA {_duration(status.get('eta_s'))}"]
    rows = [
        ("reward (rollout / trained)", f"{_fmt(latest.get('rollout/reward_mean'), '.3f')} / "
                                       f"{_fmt(latest.get('train/reward_mean'), '.3f')}"),
        ("accuracy (trained batch)", _fmt(latest.get("reward/accuracy"), ".3f")),
        ("turns per sample", _fmt(latest.get("rollout/turns_mean"), ".2f")),
        ("tokens/s (trained / rollout)", f"{_fmt(latest.get('perf/policy_tokens_per_s'), '.0f')} / "
                                         f"{_fmt(latest.get('rollout/tokens_per_s'), '.0f')}"),
        ("step time", _fmt(latest.get("perf/step_s"), ".2f") + " s"),
        ("idle (learner / rollout)", f"{_fmt(latest.get('perf/learner_idle_ratio'), '.2f')} / "
                                     f"{_fmt(latest.get('perf/rollout_idle_ratio'), '.2f')}"),
        ("buffer", f"{_fmt(latest.get('buffer/size_groups'))} group(s) queued, "
                   f"{_fmt(latest.get('buffer/in_flight'))} in flight, admission "
                   f"{_fmt(latest.get('buffer/admission_used'))}/{_fmt(latest.get('buffer/admission_limit'))}"),
        ("staleness (mean / max)", f"{_fmt(latest.get('train/staleness_mean'), '.2f')} / "
                                   f"{_fmt(latest.get('buffer/staleness_max'))}"),
        ("verifier", f"{status.get('verifier_version', '-')}   latency p50 "
                     f"{_fmt(latest.get('verifier/latency_ms_p50'), '.1f')} ms, p95 "
                     f"{_fmt(latest.get('verifier/latency_ms_p95'), '.1f')} ms, errors "
                     f"{_fmt(latest.get('verifier/error_rate'), '.3f')}"),
        ("weight sync", _fmt(latest.get("perf/weight_sync_s"), ".2f") + " s"),
        *sync_phase_rows(latest),
    ]
    width = max(len(k) for k, _ in rows)
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    actors = status.get("actors") or {a: {} for a in status.get("rollout_actors", [])}
    if actors:
        lines.append(f"  {'actor':<12}{'state':<10}{'weights':>8}{'tok/s':>8}{'groups in flight':>18}")
        for aid, a in sorted(actors.items()):
            lines.append(f"  {aid:<12}{a.get('state', '-'):<10}{_fmt(a.get('version')):>8}"
                         f"{_fmt(a.get('tokens_per_s'), '.0f'):>8}{_fmt(a.get('groups_in_flight')):>18}")
    return "\n".join(lines)
