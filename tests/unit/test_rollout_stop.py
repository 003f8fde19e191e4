"""How a rollout actor's loop ends (`RolloutWorker.stop`): its groups in flight finish first, or, at
the job's end (`abandon_in_flight`, what the trainer asks after its last step), are cancelled at
once, each releasing its admission ticket and handing its prompt back to the coordinator. The actor
is the plain class (no Ray); the coordinator and the buffer are recording stand-ins."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.actors.rollout import RolloutWorker
from asyncrl.config import Config


class Remote:
    """`obj.method.remote(*args)` of a Ray handle, answered at once and recorded."""

    def __init__(self, calls: list, name: str, result=None) -> None:
        self.calls, self.name, self.result = calls, name, result

    async def _answer(self, *args):
        self.calls.append((self.name, *args))
        return self.result

    def remote(self, *args):
        return self._answer(*args)


class Coordinator:
    def __init__(self, calls: list) -> None:
        self.get_state = Remote(calls, "get_state", {"stopping": True})
        self.abandon = Remote(calls, "abandon")
        self.complete = Remote(calls, "complete")


class Buffer:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def release_ticket(self, ticket: int) -> None:
        self.calls.append(("release_ticket", ticket))


def _worker(group_s: float) -> tuple[RolloutWorker, list]:
    calls: list = []
    worker = RolloutWorker(Config().model_dump_json(), "rollout-0", "", "test")
    worker.coordinator, worker.buffer = Coordinator(calls), Buffer(calls)

    async def generate(prompt, ticket):  # a group: generation (group_s), then its push
        await asyncio.sleep(group_s)
        calls.append(("pushed", prompt["index"]))

    async def group(prompt, ticket):  # the real `_group`'s bookkeeping around a stand-in generation
        pushed = False
        try:
            await generate(prompt, ticket)
            pushed = True
        finally:
            if not pushed:
                await worker._zmq_call(worker.buffer.release_ticket, ticket)
                await worker.coordinator.abandon.remote(prompt["index"])

    worker._group = group
    return worker, calls


async def _stop_with_a_group_in_flight(worker: RolloutWorker, abandon: bool) -> None:
    task = asyncio.create_task(worker._group({"index": 7}, 11))
    worker._tasks.add(task)
    task.add_done_callback(worker._tasks.discard)
    await asyncio.sleep(0)
    worker.stop(abandon_in_flight=abandon)
    await worker.run()  # the coordinator says `stopping`: the loop ends at once, then drains


@pytest.mark.parametrize("abandon", [False, True])
def test_a_stopped_loop_finishes_or_abandons_its_groups_in_flight(abandon: bool) -> None:
    worker, calls = _worker(group_s=1.0)
    try:
        asyncio.run(_stop_with_a_group_in_flight(worker, abandon))
    finally:
        worker._zmq.shutdown(wait=False)
    if abandon:  # cancelled: its ticket released, its prompt re-issued by the coordinator
        assert ("release_ticket", 11) in calls and ("abandon", 7) in calls and ("pushed", 7) not in calls
    else:  # waited for: pushed, nothing abandoned
        assert ("pushed", 7) in calls and ("abandon", 7) not in calls
    assert not worker._tasks


def test_a_busy_loop_asks_the_coordinator_only_every_busy_state_s_and_stop_still_ends_it() -> None:
    """Every group slot generating: nothing to do but notice a stop, so the loop asks the coordinator
    for its state every BUSY_STATE_S (0.5 s), not on every 50 ms pass (it used to: ~20 calls a
    second); `stop()` still ends the loop within one pass."""
    from asyncrl.actors import rollout

    worker, calls = _worker(group_s=1.0)
    asked: list[float] = []
    state = {"stopping": False, "admitting": False, "version": 0}

    async def get_state():
        asked.append(time.monotonic())
        return state

    worker.coordinator.get_state.remote = get_state

    async def scenario() -> float:
        for i in range(worker.cfg.rollout.groups_in_flight):  # every slot busy for group_s
            task = asyncio.create_task(worker._group({"index": i}, i))
            worker._tasks.add(task)
            task.add_done_callback(worker._tasks.discard)
        loop = asyncio.create_task(worker.run())
        await asyncio.sleep(0.9)  # still busy
        worker.stop()
        t_stop = time.monotonic()
        await loop
        return time.monotonic() - t_stop

    t0 = time.monotonic()
    try:
        stop_s = asyncio.run(scenario())
    finally:
        worker._zmq.shutdown(wait=False)
    busy = [t - t0 for t in asked if t - t0 < 0.9]
    # at 0 and ~0.5 s (one BUSY_STATE_S later): 2, with room for one late pass; a loop asking on
    # every 50 ms pass would have asked ~18 times
    assert rollout.BUSY_STATE_S == 0.5 and 1 <= len(busy) <= 3, busy
    assert stop_s < 1.5  # the loop noticed `stop()` (then drained the two groups, ~0.1 s left)
    assert ("pushed", 0) in calls and ("pushed", 1) in calls and not worker._tasks
