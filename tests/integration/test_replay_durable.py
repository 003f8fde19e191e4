"""The replay buffer survives the death of its process: a server SIGKILLed while producers hold
tickets and groups are buffered is restarted on the same port from its durable log, and the same
clients (no reconnect code of their own) go on: every acknowledged group is delivered exactly once,
a push retried across the restart is stored once, counters continue (`restarts`,
`recovered_groups`), and a stale-dropped group's prompt is reported for re-issue."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from replay_procs import SECRET, indexed_group, start_buffer_process

from asyncrl.replay import BufferClient

pytestmark = pytest.mark.integration
RNG = np.random.default_rng(0)


def group(version: int, index: int):
    return indexed_group(RNG, index, version)


def start(tmp: Path, port: int, *, recover: bool, tag: str):
    return start_buffer_process(tmp, port, recover=recover, tag=tag, batch_size=2)


def test_sigkilled_buffer_restarts_on_same_port_and_loses_nothing(tmp_path: Path) -> None:
    proc, address = start(tmp_path, 0, recover=False, tag="a")
    port = int(address.rsplit(":", 1)[1])
    producer = BufferClient(address, secret=SECRET, actor_id="rollout-0", reply_grace_s=20.0)
    learner = BufferClient(address, secret=SECRET, actor_id="learner", reply_grace_s=20.0)
    try:
        tickets = [producer.acquire_ticket(1.0) for _ in range(4)]  # limit (0+1+1)*2 = 4
        for i, t in enumerate(tickets[:3]):
            assert producer.push(group(0, i), t).status == "stored"  # acknowledged: durable
        assert [g.prompt_uid for g in learner.get_batch(2, 0, timeout_s=2.0)] == ["p/0", "p/1"]
        os.kill(proc.pid, signal.SIGKILL)  # dies with p/2 buffered and ticket 3 in flight
        proc.wait(10)
        # The learner asks while the buffer is down; the restart answers the same request.
        got: list = []
        waiter = threading.Thread(target=lambda: got.extend(learner.get_batch(2, 1, timeout_s=15.0)))
        waiter.start()
        time.sleep(0.5)
        proc, again = start(tmp_path, port, recover=True, tag="b")
        assert again == address
        assert producer.push(group(1, 3), tickets[3]).status == "stored"  # the lease survived
        assert producer.push(group(1, 3), tickets[3]).status == "duplicate"  # a retried push is stored once
        waiter.join(30)
        assert sorted(g.prompt_uid for g in got) == ["p/2", "p/3"]
        stats = learner.stats()
        assert stats["buffer/restarts"] == 1 and stats["buffer/recovered_groups"] == 1
        assert stats["buffer/ingested"] == 4 and stats["buffer/consumed"] == 4 and stats["buffer/size_groups"] == 0
        assert stats["buffer/tickets_granted"] == 4
    finally:
        producer.close()
        learner.close()
        proc.kill()
        proc.wait(10)
