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
    out.update(turn_accuracy_metrics(metas))
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


def turn_accuracy_metrics(metas: list[dict[str, Any]]) -> dict[str, float]:
    """How the trained samples were solved: with the final answer in their first policy turn
    (`train/one_turn_accuracy`) or over several turns (`train/multi_turn_accuracy`: step by step
    and/or after the verifier's guidance; the turn count does not tell the two apart). The raw
    reward counts both as 1, so a policy that learns to need fewer turns improves while
    `train/reward_mean` stays flat; these two show it. Empty when the reward has no `accuracy` part."""
    pairs = [(rp["accuracy"] >= 1.0, t) for m in metas for rp, t in zip(m["reward_parts"], m["num_turns"])
             if "accuracy" in rp]
    if not pairs:
        return {}
    return {"train/one_turn_accuracy": sum(ok and t <= 1 for ok, t in pairs) / len(pairs),
            "train/multi_turn_accuracy": sum(ok and t > 1 for ok, t in pairs) / len(pairs)}


class StepClock:
    """The step's phases as the driver timed them (batch wait, learner, weight sync) and what went
    through, as `perf/` keys; and the run's totals of the same (summary.json)."""

    def __init__(self) -> None:
        self.totals = {"trained_tokens": 0, "learner_wait_s": 0.0, "train_s": 0.0, "sync_s": 0.0}
        self.driver_bytes_seen = 0  # Group/Sample bytes through this process's codec, at the previous step

    def perf(self, metas: list[dict[str, Any]], *, wait_s: float, train_s: float, sync_s: float,
             sync: dict[str, Any], actors: int) -> dict[str, Any]:
        """`perf/policy_tokens` are the batch's policy (response) tokens, per step."""
        from asyncrl.protocol import codec_counts

        tokens = int(sum(sum(m["tokens"]) for m in metas))
        for key, value in (("learner_wait_s", wait_s), ("train_s", train_s), ("sync_s", sync_s),
                           ("trained_tokens", tokens)):
            self.totals[key] += value
        codec = codec_counts()  # sample bytes encoded or decoded by this (driver) process: 0 by design
        driver_bytes = codec["encoded_bytes"] + codec["decoded_bytes"]
        delta, self.driver_bytes_seen = driver_bytes - self.driver_bytes_seen, driver_bytes
        step_s = wait_s + train_s + sync_s
        report = sync.get("report") or {}
        return {
            "perf/step_s": step_s,
            "perf/batch_wait_s": wait_s,
            "perf/train_s": train_s,
            "perf/weight_sync_s": sync_s,
            "perf/weight_broadcast_s": float(report.get("seconds", 0.0)),
            "perf/learner_idle_ratio": min(1.0, wait_s / max(step_s, 1e-9)),
            "perf/policy_tokens": tokens,
            "perf/policy_tokens_per_s": tokens / max(step_s, 1e-9),
            "perf/batch_bytes": float(sum(m["bytes"] for m in metas)),
            "perf/driver_bytes": float(delta),
            "perf/rollout_actors": actors,
            "perf/weight_sync_dropped": len(sync.get("dropped", [])),
            # parameters whose sampled fingerprint differed after a load (each was re-fed from the store)
            "weights/fingerprint_mismatch": sum(int(r.get("fingerprint_mismatch") or 0)
                                                for r in (sync.get("actors") or {}).values() if isinstance(r, dict)),
            **weight_sync_phases(sync),
        }

    def summary(self, wall_s: float) -> dict[str, Any]:
        """The run's totals for summary.json."""
        t = self.totals
        return {"wall_s": wall_s, "trained_tokens": t["trained_tokens"],
                "trained_tokens_per_s": t["trained_tokens"] / max(wall_s, 1e-9),
                "learner_wait_s": t["learner_wait_s"], "train_s": t["train_s"], "weight_sync_s": t["sync_s"]}


def weight_sync_phases(sync: dict[str, Any]) -> dict[str, float]:
    """`perf/weight_sync/{side}_{phase}_s`: the round by phase (`asyncrl.weights.phases`) on the
    sender (`send_`), and on the receiver and engine of the slowest actor (`recv_`, `engine_`: the
    one the step waited for). Each side also has `other_s` (time no phase covered) and `round_s`."""
    report = sync.get("report") or {}
    sides = [("send", report.get("phases"))]
    actors = [r for r in (sync.get("actors") or {}).values() if isinstance(r, dict) and r.get("phases")]
    if actors:
        slowest = max(actors, key=lambda r: float(r.get("seconds") or 0.0))
        sides += [("recv", slowest.get("phases")), ("engine", slowest.get("engine_phases"))]
    return {f"perf/weight_sync/{side}_{name}_s": float(sec) for side, phases in sides
            for name, sec in (phases or {}).items()}


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
