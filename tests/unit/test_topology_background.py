"""The start-up plan (asyncrl.job.plan.StartPlan) and the topology's part in it: background starts
(weight store, learner, verifier service) are handed to the topology after a failed step, so its
shutdown stops them; a background start that failed stops the launch at the next step, named; a
step waits for its background start in order."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest

from asyncrl.config import Config
from asyncrl.job import topology


def _done(result: object = None, error: BaseException | None = None) -> Future:
    future: Future = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    return future


def _topo() -> topology.Topology:
    cfg = Config.model_validate({"model": {"path": "policy-dir"}, "rollout": {"max_num_batched_tokens": 2048}})
    return topology.Topology(cfg, Path("/nonexistent"), "ns")


def test_started_services_are_handed_to_the_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    stopped: list[bool] = []
    monkeypatch.setattr(topology, "_stop_serve", lambda: stopped.append(True))
    topo = _topo()
    store, verifier = object(), object()
    topo.adopt("weight store", store)
    topo.adopt("verifier", verifier)
    assert topo.weight_store is store and topo.verifier is verifier and stopped == []


def test_a_failed_verifier_start_stops_serve_and_a_failed_store_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    stopped: list[bool] = []
    monkeypatch.setattr(topology, "_stop_serve", lambda: stopped.append(True))
    topo = _topo()
    topo.adopt("weight store", RuntimeError("store"))
    topo.adopt("verifier", RuntimeError("probe"))
    # the probe failed after Serve may have started: stopped here, since the topology holds no handle
    assert topo.weight_store is None and topo.verifier is None and stopped == [True]


def test_a_learner_group_built_in_the_background_is_handed_over_with_its_placement() -> None:
    """The learner group builds from the placement step on; after a later step fails, the group
    (if it was built) is the topology's to shut down, and it owns its placement group (removed by
    its own shutdown, not a second time); a group that failed to build leaves the placement to the
    topology."""
    topo = _topo()
    topo.learner_placement = placement = object()
    group = object()
    topo.adopt("learner", group)
    assert topo.learner is group and topo.learner_placement is None
    topo = _topo()
    topo.learner_placement = placement
    topo.adopt("learner", RuntimeError("deepspeed"))
    assert topo.learner is None and topo.learner_placement is placement


def test_a_failed_background_start_stops_the_launch_at_the_next_step_with_its_name() -> None:
    import threading

    from asyncrl.job.plan import StartPlan
    from asyncrl.startup import StartupError

    adopted: dict[str, object] = {}
    stopped: list[bool] = []
    gate = threading.Event()
    ran: list[str] = []

    def unreachable() -> None:
        raise ConnectionError("http://verifier:9 refused")

    with pytest.raises(StartupError, match=r"verifier service.*refused"):
        plan = StartPlan(5.0, adopted.__setitem__)
        with plan.stopping_on_failure(lambda: stopped.append(True)):
            plan.begin("verifier", "verifier service (http)", unreachable)
            plan.begin("store", "weight store", lambda: gate.wait(5) and "store-handle")
            while not plan._pending["verifier"][1].done():
                pass
            gate.set()
            with plan.step("learner placement"):  # never runs: the verifier's failure comes first
                ran.append("placement")
    assert ran == [] and stopped == [True]
    assert adopted["store"] == "store-handle" and isinstance(adopted["verifier"], ConnectionError)


def test_wait_returns_background_results_and_an_early_check_stops_a_step() -> None:
    from asyncrl.job.plan import StartPlan
    from asyncrl.startup import StartupError

    calls: list[str] = []
    plan = StartPlan(5.0, lambda *_: None, early_checks=[lambda: calls.append("checked")])
    with plan.stopping_on_failure(lambda: None):
        plan.begin("store", "weight store", lambda: 42)
        assert plan.wait("store") == 42
    assert calls == ["checked"]

    def rows_failed() -> None:
        raise StartupError("data: rows.jsonl row 3 has no answer")

    plan = StartPlan(5.0, lambda *_: None, early_checks=[rows_failed])
    with pytest.raises(StartupError, match="row 3"), plan.stopping_on_failure(lambda: None), plan.step("coordinator"):
        calls.append("coordinator")
    assert "coordinator" not in calls
