"""Metric sinks: console, jsonl, TensorBoard and W&B, all fed the same flat dict of namespaced keys
(`rollout/…`, `verifier/…`, `buffer/…`, `train/…`, `loss/…`, `perf/…`).

Guarantees: one `metrics.jsonl` row per learner step, flushed at once (a killed run keeps every
finished step); non-scalar values (histograms such as `buffer/staleness_hist`) go to jsonl as lists
and to TensorBoard as histograms; W&B runs offline unless `WANDB_API_KEY` is set.

Every key has one writer and one meaning (docs/metrics.md; tests/unit/test_metric_writers.py checks
the table against the code). Keys renamed for that are in `RENAMED`: readers of a metrics.jsonl
written before the rename go through `upgrade_row` (kept for one release).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

# (new name, old name): the old key of rows written before each key got its one writer.
RENAMED = (
    ("perf/policy_tokens", "perf/train_tokens"),  # the driver's policy tokens per step (it overwrote the learner's)
    ("perf/policy_tokens_per_s", "perf/tokens_per_s"),
    ("train/staleness_mean", "buffer/staleness_mean"),  # per trained batch (the buffer's is over the run)
)


def upgrade_row(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row with the current names (a row of an older run also answers to the new ones)."""
    missing = {new: row[old] for new, old in RENAMED if new not in row and old in row}
    return {**row, **missing} if missing else row


def staleness_total(rows: list[dict[str, Any]]) -> list[int]:
    """The staleness histogram of every trained group of a run (the sum of the per-step ones)."""
    hist: list[int] = []
    for r in rows:
        h = r.get("buffer/staleness_hist")
        if isinstance(h, list):
            hist = [int(a) + int(b) for a, b in zip(hist + [0] * (len(h) - len(hist)), h + [0] * (len(hist) - len(h)))]
    return hist


def _scalar(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(float(value)):
        return float(value)
    return None


class MetricLogger:
    """Fan-out of one metrics dict per step to every configured sink."""

    def __init__(self, run_dir: Path, sinks: list[str], project: str, experiment: str, config: dict[str, Any]):
        self.run_dir = Path(run_dir)
        self.sinks = list(sinks)
        self.rows: list[dict[str, Any]] = []
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a") if "jsonl" in sinks else None
        self._tb = None
        self._wandb = None
        if "tensorboard" in sinks:
            self._tb = _TensorBoard(self.run_dir / "tensorboard")
        if "wandb" in sinks:
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(project=project, name=experiment, dir=str(self.run_dir), config=config,
                                     mode=mode, reinit=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "time": time.time(), **metrics}
        self.rows.append(row)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row, default=_json_default) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                s = _scalar(value)
                if s is not None:
                    self._tb.add_scalar(key, s, step)
                elif key.endswith("_hist") and isinstance(value, (list, tuple)) and value:
                    self._tb.add_counts(key, [float(c) for c in value], step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if _scalar(v) is not None}, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def effective_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The effective history of a `metrics.jsonl` that went through resumes: a `resumed_from` row
    at step K discards the rows logged before it for steps after K (they were trained again)."""
    out: list[dict[str, Any]] = []
    for row in rows:
        if "resumed_from" in row:
            out = [r for r in out if int(r.get("step", 0)) <= int(row.get("step", 0))]
        else:
            out.append(row)
    return out


class _TensorBoard:
    """TensorBoard event files written with the `tensorboard` package's own writer and protos (what
    `torch.utils.tensorboard.SummaryWriter` wraps; the launcher imports no torch, so that it starts
    fast): scalars, and per-lag counts as a histogram."""

    def __init__(self, log_dir: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self._histogram = Event, Summary, HistogramProto
        self._writer = EventFileWriter(str(log_dir))

    def _add(self, value: Any, step: int) -> None:
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=self._summary(value=[value])))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._add(self._summary.Value(tag=tag, simple_value=value), step)

    def add_counts(self, tag: str, counts: list[float], step: int) -> None:
        """`counts[k]` values equal to k (e.g. groups trained at staleness k): one bucket per k, with
        upper edge k + 0.5, and the exact min, max, number, sum and sum of squares."""
        present = [k for k, c in enumerate(counts) if c > 0] or [0]
        hist = self._histogram(min=float(present[0]), max=float(present[-1]), num=sum(counts),
                               sum=sum(k * c for k, c in enumerate(counts)),
                               sum_squares=sum(k * k * c for k, c in enumerate(counts)),
                               bucket_limit=[k + 0.5 for k in range(len(counts))], bucket=counts)
        self._add(self._summary.Value(tag=tag, histo=hist), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def progress_every(max_steps: int, lines: int = 25) -> int:
    """Steps between two progress lines when the console is not a terminal (after the first 5 steps,
    which are always shown): about `lines` lines per run. Every step is in metrics.jsonl; a terminal
    gets a progress bar instead."""
    return max(1, max_steps // max(1, lines))


class ProgressDisplay:
    """The console's view of the loop: a progress bar on a terminal, else a line per step for the
    first 5 steps, the last, and about 25 in between (`progress_every`). Every step is in metrics.jsonl."""

    def __init__(self, max_steps: int, start: int, stream: Any):
        self.max_steps = max_steps
        self.every = progress_every(max_steps)
        self.bar = None
        if stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=max_steps, initial=start, desc="train", dynamic_ncols=True, file=stream)

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        from asyncrl.startup import say

        line = format_console(step, self.max_steps, metrics)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(line.split(" | ", 1)[-1])
        elif step % self.every == 0 or step <= 5 or step == self.max_steps:
            say(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_console(step: int, max_steps: int, m: dict[str, Any]) -> str:
    """One plain log line (used when stdout is not a terminal)."""
    parts = [f"step {step}/{max_steps}"]
    for key, label, fmt in (
        ("rollout/reward_mean", "reward", "{:.3f}"),
        ("reward/accuracy", "acc", "{:.3f}"),
        ("rollout/turns_mean", "turns", "{:.2f}"),
        ("perf/policy_tokens_per_s", "tok/s", "{:.0f}"),
        ("train/staleness_mean", "stale", "{:.2f}"),
        ("loss/pg", "pg", "{:+.4f}"),
        ("perf/step_s", "step_s", "{:.1f}"),
    ):
        if key in m and _scalar(m[key]) is not None:
            parts.append(f"{label} " + fmt.format(m[key]))
    return " | ".join(parts)


def save_plots(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """PNG plots of a run: reward/accuracy, turns/tokens, staleness histogram, throughput/idle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [upgrade_row(r) for r in rows]
    steps = [r["step"] for r in rows]
    written = []

    def series(key: str) -> list[float]:
        return [r.get(key, float("nan")) if _scalar(r.get(key)) is not None else float("nan") for r in rows]

    panels = {
        "reward.png": ["rollout/reward_mean", "reward/accuracy", "eval/guided_accuracy"],
        "turns_tokens.png": ["rollout/turns_mean", "rollout/response_len_mean"],
        "throughput.png": ["perf/policy_tokens_per_s", "perf/learner_idle_ratio", "perf/rollout_idle_ratio"],
    }
    for name, keys in panels.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in keys:
            ys = series(key)
            if any(not math.isnan(y) for y in ys):
                ax.plot(steps, ys, marker=".", label=key)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    hist = staleness_total(rows)
    if hist:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar(range(len(hist)), hist)
        ax.set_xlabel("staleness (learner version - min group version)")
        ax.set_ylabel("groups trained")
        fig.tight_layout()
        path = out_dir / "staleness_hist.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
