"""The start-ups that `build_topology` runs in the background (weight store, verifier service) are
handed to the topology after a failed step, so its shutdown stops them (asyncrl.job.topology)."""

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
    topology._collect_started({"weight store": _done(store), "verifier": _done(verifier)}, topo)
    assert topo.weight_store is store and topo.verifier is verifier and stopped == []


def test_a_failed_verifier_start_stops_serve_and_a_failed_store_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    stopped: list[bool] = []
    monkeypatch.setattr(topology, "_stop_serve", lambda: stopped.append(True))
    topo = _topo()
    topology._collect_started({"weight store": _done(error=RuntimeError("store")),
                               "verifier": _done(error=RuntimeError("probe"))}, topo)
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
    topology._collect_started({"learner": _done(group)}, topo)
    assert topo.learner is group and topo.learner_placement is None
    topo = _topo()
    topo.learner_placement = placement
    topology._collect_started({"learner": _done(error=RuntimeError("deepspeed"))}, topo)
    assert topo.learner is None and topo.learner_placement is placement
