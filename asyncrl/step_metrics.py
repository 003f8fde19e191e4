"""The driver's own metric keys of a learner step (the learner, buffer, fleet and coordinator
write theirs; docs/metrics.md lists every key with its one writer, tests/unit/test_metric_writers.py
holds the two against each other).

Each function here writes keys nobody else writes: what the trained batch was made of (from its
groups' metadata, `learner.feed.group_meta`), how long the step's phases took as the driver saw
them, and the lengths of trained vs stale-dropped groups over the run.
"""

from __future__ import annotations

from typing import Any


def batch_metrics(metas: list[dict[str, Any]], lags: list[int], max_staleness: int) -> dict[str, Any]:
    """What the learner trained on this step: groups, rewards by part, turns, the staleness of its
    groups (per batch; the buffer's `buffer/staleness_mean` is over the run), verifier versions."""
    n = sum(len(m["rewards"]) for m in metas)
    out: dict[str, Any] = {"train/groups": len(metas)}
    if not n:
        return out
    parts: dict[str, list[float]] = {}
    for m in metas:
        for rp in m["reward_parts"]:
            for k, v in rp.items():
                parts.setdefault(k, []).append(float(v))
    for k, vs in parts.items():
        out[f"reward/{k}"] = sum(vs) / len(vs)
    out["train/turns_mean"] = sum(t for m in metas for t in m["num_turns"]) / n
    hist = [0] * (max(max(lags, default=0), max_staleness) + 1)
    for lag in lags:
        hist[lag] += 1
    out["buffer/staleness_hist"] = hist
    out["train/staleness_mean"] = sum(lags) / max(len(lags), 1)
    out["buffer/staleness_max"] = max(lags, default=0)
    versions = sorted({v for m in metas for v in m["verifier_versions"]})
    out["verifier/versions_in_batch"] = ",".join(versions)
    out["train/prompt_indices"] = sorted(m["prompt_index"] for m in metas)
    return out


def step_perf(*, wait_s: float, train_s: float, sync_s: float, policy_tokens: int, batch_bytes: float,
              driver_bytes: float, actors: int, sync: dict[str, Any]) -> dict[str, Any]:
    """The step's phases as the driver timed them (batch wait, learner, weight sync) and what went
    through: `perf/policy_tokens` are the batch's policy (response) tokens, per step."""
    step_s = wait_s + train_s + sync_s
    report = sync.get("report") or {}
    return {
        "perf/step_s": step_s,
        "perf/batch_wait_s": wait_s,
        "perf/train_s": train_s,
        "perf/weight_sync_s": sync_s,
        "perf/weight_broadcast_s": float(report.get("seconds", 0.0)),
        "perf/learner_idle_ratio": min(1.0, wait_s / max(step_s, 1e-9)),
        "perf/policy_tokens": policy_tokens,
        "perf/policy_tokens_per_s": policy_tokens / max(step_s, 1e-9),
        "perf/batch_bytes": batch_bytes,
        "perf/driver_bytes": driver_bytes,
        "perf/rollout_actors": actors,
        "perf/weight_sync_dropped": len(sync.get("dropped", [])),
        # parameters whose sampled fingerprint differed after a load (each was re-fed from the store)
        "weights/fingerprint_mismatch": sum(int(r.get("fingerprint_mismatch") or 0)
                                            for r in (sync.get("actors") or {}).values() if isinstance(r, dict)),
    }


class GroupLengths:
    """Length (mean policy tokens per sample) of trained vs stale-dropped groups, over the run (the
    newest 20000 of each): a drop policy that favours short prompts shows up as dropped lengths
    above trained ones."""

    KEEP = 20000

    def __init__(self) -> None:
        self.trained: list[float] = []
        self.dropped: list[float] = []

    def add(self, metas: list[dict[str, Any]], dropped_lengths: list[float]) -> None:
        self.trained = (self.trained + [sum(m["tokens"]) / (len(m["tokens"]) or 1) for m in metas])[-self.KEEP:]
        self.dropped = (self.dropped + [float(n) for n in dropped_lengths])[-self.KEEP:]

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {"train/group_len_count": float(len(self.trained)),
                               "buffer/dropped_len_count": float(len(self.dropped))}
        if self.trained:
            mean, p50, p90 = _spread(self.trained)
            out.update({"train/group_len_mean": mean, "train/group_len_p50": p50, "train/group_len_p90": p90})
        if self.dropped:
            mean, p50, p90 = _spread(self.dropped)
            out.update({"buffer/dropped_len_mean": mean, "buffer/dropped_len_p50": p50, "buffer/dropped_len_p90": p90})
        return out


def _spread(values: list[float]) -> tuple[float, float, float]:
    """Mean, median and 90th percentile."""
    import numpy as np

    p50, p90 = (float(q) for q in np.percentile(values, [50, 90]))
    return float(np.mean(values)), p50, p90
