"""The rollout fleet's bookkeeping without Ray: the fleet's metrics from the actors' (rates summed,
the rest averaged), the per-actor status, the repeated-failure stop, and scaling to the current size
(a no-op: no loop stopped, nobody withdrawn). Actor handles are never called in these paths."""

import pytest

from asyncrl.actors.fleet import RolloutFleet, merge_actor_stats
from asyncrl.config import Config
from asyncrl.startup import RepeatedFailure


class FakeLearner:  # the LearnerWeights side: records the membership calls
    def __init__(self):
        self.calls = []

    def add_receivers(self, members):
        self.calls.append(("add_receivers", members))

    def remove_receivers(self, members):
        self.calls.append(("remove_receivers", members))

    def broadcast_weights(self):
        return {}


def fleet(actors=("rollout-0", "rollout-1")):
    f = RolloutFleet(Config(), actor_cls=None, buffer_address="tcp://127.0.0.1:1", namespace="test",
                     coordinator=None, buffer=None, learner=FakeLearner())
    f.actors = {a: object() for a in actors}
    return f


def test_rates_add_up_over_the_actors_and_the_rest_is_averaged():
    merged = merge_actor_stats({
        "rollout-0": {"rollout/tokens_per_s": 100.0, "rollout/reward_mean": 0.5, "rollout/idle_ratio": 0.2,
                      "rollout/version": 3, "note": "text"},
        "rollout-1": {"rollout/tokens_per_s": 50.0, "rollout/reward_mean": 1.0, "rollout/idle_ratio": 0.4}})
    assert merged["rollout/tokens_per_s"] == 150.0  # 100 + 50
    assert merged["rollout/reward_mean"] == 0.75  # (0.5 + 1.0) / 2
    assert merged["rollout/version"] == 3  # only rollout-0 reports it
    assert merged["perf/rollout_idle_ratio"] == pytest.approx(0.3)  # (0.2 + 0.4) / 2
    assert "note" not in merged and merge_actor_stats({}) == {}


def test_status_shows_running_loops_and_the_latest_stats():
    f = fleet()
    f.loops = {"rollout-0": object()}
    f._stats = {"rollout-0": {"rollout/version": 4, "rollout/tokens_per_s": 12.0, "rollout/groups_in_flight": 2}}
    assert f.status() == {
        "rollout-0": {"state": "running", "version": 4, "tokens_per_s": 12.0, "groups_in_flight": 2},
        "rollout-1": {"state": "stopped", "version": None, "tokens_per_s": None, "groups_in_flight": None}}
    assert len(f) == 2 and f.running() == ["rollout-0"]


def test_the_same_error_max_identical_failures_times_in_a_row_stops_the_job():
    f = fleet()  # cluster.max_identical_failures = 3 by default
    err = ConnectionError("cannot reach tcp://10.0.0.7:5555 within 30.0s")
    f._count_failure("rollout-0", err)
    f._count_failure("rollout-0", ConnectionError("cannot reach tcp://10.0.0.7:5555 within 31.5s"))  # same signature
    with pytest.raises(RepeatedFailure, match=r"rollout-0 .* failed 3 times .*unreachable address: tcp://10.0.0.7:5555"):
        f._count_failure("rollout-0", err)


def test_a_different_error_or_a_trained_step_starts_the_count_again():
    f = fleet()
    for exc in (ValueError("a"), ValueError("b"), ValueError("a"), ValueError("a")):
        f._count_failure("rollout-0", exc)  # a, b, a, a: at most two in a row
    f.forget_failures()
    f._count_failure("rollout-0", ValueError("a"))
    f._count_failure("rollout-0", ValueError("a"))
    assert f._failures == {"rollout-0": ("ValueError: a", 2)}


def test_scaling_to_the_current_size_changes_nothing():
    f = fleet()
    loops = {"rollout-0": object(), "rollout-1": object()}
    f.loops = dict(loops)
    assert f.scale(2, timeout=1.0) == {"ok": True, "removed": [], "actors": ["rollout-0", "rollout-1"]}
    assert f.loops == loops  # every loop still running
    assert f.learner.calls == [("remove_receivers", [])]
