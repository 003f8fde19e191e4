"""The fleet's overlapped start on real Ray: `launch` returns while the actors' `start()` runs (the
driver starts the learner meanwhile), `join` reports and enrols them, and `shutdown` also removes
actors that were launched but never joined (a learner that failed to start must not leave engines
behind). The actor class is a stand-in for the rollout actor (which needs vLLM): the logic under
test is the fleet's, and the stand-in records what the fleet asked of it."""

from __future__ import annotations

import sys
import time
import uuid

import pytest

ray = pytest.importorskip("ray")

from asyncrl.actors.fleet import RolloutFleet  # noqa: E402
from asyncrl.config import Config  # noqa: E402


class StandIn:
    """Rollout actor stand-in: `start` takes `delay_s` (an engine build), `shutdown` is recorded."""

    def __init__(self, cfg_json: str, actor_id: str, buffer_address: str, namespace: str, buffer=None) -> None:
        self.actor_id = actor_id  # (`buffer`: the BufferHost a launch before the buffer listens asks for its address)
        self.closed = False

    def start(self, delay_s: float = 1.5) -> dict:
        time.sleep(delay_s)
        return {"actor_id": self.actor_id, "start_s": delay_s, "version": 0, "host": "127.0.0.1"}

    def weight_members(self) -> list[str]:
        return [f"{self.actor_id}/tp0"]

    def shutdown(self) -> bool:
        self.closed = True
        return True


class Learner:
    def __init__(self) -> None:
        self.members: list[str] = []

    def add_receivers(self, members: list[str]) -> None:
        self.members += members

    def remove_receivers(self, members: list[str]) -> None:
        self.members = [m for m in self.members if m not in members]

    def broadcast_weights(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def cluster():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this file
    ray.init(num_cpus=2, include_dashboard=False, namespace=f"test-fleet-{uuid.uuid4().hex[:8]}", log_to_driver=False)
    yield
    ray.shutdown()


def _fleet() -> RolloutFleet:
    cls = ray.remote(num_cpus=0)(StandIn)
    return RolloutFleet(Config(), cls, buffer_address="tcp://127.0.0.1:1", namespace="test",
                        coordinator=None, buffer=None, learner=None)


def test_launch_returns_before_the_engines_are_up_and_join_enrols(cluster) -> None:
    fleet = _fleet()
    pending = fleet.launch(2)
    assert sorted(pending) == ["rollout-0", "rollout-1"]
    assert fleet.actors == {}  # not running actors until joined
    ready, _ = ray.wait([start for _, start in pending.values()], num_returns=2, timeout=0)
    assert ready == []  # launch returned while every start() (1.5 s each) was still running
    fleet.learner = Learner()  # the learner exists only now, as in build_topology
    assert fleet.join(pending, timeout=60) == ["rollout-0", "rollout-1"]
    assert sorted(fleet.actors) == ["rollout-0", "rollout-1"]
    assert fleet.learner.members == ["rollout-0/tp0", "rollout-1/tp0"]
    fleet.shutdown()
    assert fleet.actors == {}


def test_shutdown_removes_launched_actors_that_were_never_joined(cluster) -> None:
    fleet = _fleet()
    pending = fleet.launch(2)
    actors = [a for a, _ in pending.values()]
    fleet.shutdown()  # e.g. the learner failed to start
    # ray.kill is asynchronous: a call queued right after it may still be served before the kill
    # lands (seen on a quiet machine), so each actor must be dead within 30 s, not at once.
    deadline = time.monotonic() + 30
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            while time.monotonic() < deadline:
                ray.get(actor.weight_members.remote(), timeout=30)
                time.sleep(0.2)
