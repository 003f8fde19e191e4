"""The driver's own per-step keys (asyncrl.job.step_metrics), by hand: the staleness of the trained batch
(per batch, under `train/` — the buffer's `buffer/staleness_mean` is over the run), the step's
phases and the run's totals, and the lengths of trained vs dropped groups."""

from __future__ import annotations

import pytest

from asyncrl.job.step_metrics import GroupLengths, StepClock, batch_metrics


def _meta(index: int, rewards: list[float], tokens: list[int], version: str = "v1") -> dict:
    return {"prompt_index": index, "rewards": rewards, "tokens": tokens, "bytes": 100, "num_turns": [1] * len(rewards),
            "reward_parts": [{"overall": r} for r in rewards], "verifier_versions": [version]}


def test_the_batch_staleness_is_per_batch_and_sized_by_the_bound():
    metas = [_meta(3, [1.0, 0.0], [4, 6]), _meta(1, [1.0, 1.0], [2, 2], "v2")]
    m = batch_metrics(metas, lags=[0, 2], max_staleness=1)
    # lags 0 and 2: hist has max(2, bound 1) + 1 = 3 bins -> [1, 0, 1]; mean (0 + 2) / 2 = 1.0
    assert m["buffer/staleness_hist"] == [1, 0, 1]
    assert m["train/staleness_mean"] == 1.0 and m["buffer/staleness_max"] == 2
    assert m["reward/overall"] == 0.75  # (1 + 0 + 1 + 1) / 4 samples
    assert m["train/groups"] == 2 and m["train/prompt_indices"] == [1, 3]
    assert m["verifier/versions_in_batch"] == "v1,v2"
    # one writer per key: what the learner reports is not written here
    assert "train/reward_mean" not in m and "train/samples" not in m and "buffer/staleness_mean" not in m


def test_the_step_clock_splits_the_step_and_adds_up_the_run():
    clock = StepClock()
    metas = [_meta(0, [1.0, 1.0], [4, 6])]
    sync = {"report": {"seconds": 0.5}, "dropped": ["r1"], "actors": {"r0": {"fingerprint_mismatch": 2}}}
    m = clock.perf(metas, wait_s=1.0, train_s=2.0, sync_s=1.0, sync=sync, actors=3)
    # step = 1 + 2 + 1 = 4 s; idle = wait / step = 0.25; 4 + 6 = 10 policy tokens in 4 s -> 2.5 /s
    assert m["perf/step_s"] == 4.0 and m["perf/learner_idle_ratio"] == 0.25
    assert m["perf/policy_tokens"] == 10 and m["perf/policy_tokens_per_s"] == 2.5
    assert m["perf/weight_broadcast_s"] == 0.5 and m["perf/weight_sync_dropped"] == 1
    assert m["weights/fingerprint_mismatch"] == 2 and m["perf/rollout_actors"] == 3
    again = clock.perf(metas, wait_s=0.0, train_s=1.0, sync_s=1.0, sync={}, actors=3)
    assert again["perf/driver_bytes"] == 0.0  # nothing encoded by this process between the two steps
    s = clock.summary(wall_s=10.0)
    assert s["trained_tokens"] == 20 and s["trained_tokens_per_s"] == 2.0
    assert (s["learner_wait_s"], s["train_s"], s["weight_sync_s"]) == (1.0, 3.0, 2.0)


def test_group_lengths_compare_trained_and_dropped_groups():
    lengths = GroupLengths()
    lengths.add([_meta(0, [1.0, 1.0], [4, 6]), _meta(1, [1.0, 1.0], [10, 10])], dropped_lengths=[30.0])
    m = lengths.metrics()
    # trained: mean tokens per sample 5 and 10 -> mean 7.5, median 7.5, p90 = 5 + 0.9 * 5 = 9.5
    assert (m["train/group_len_mean"], m["train/group_len_p50"]) == (7.5, 7.5)
    assert m["train/group_len_p90"] == pytest.approx(9.5)
    assert m["train/group_len_count"] == 2.0 and m["buffer/dropped_len_mean"] == 30.0
    assert GroupLengths().metrics() == {"train/group_len_count": 0.0, "buffer/dropped_len_count": 0.0}
