"""Pipelined pushes (`PushWindow`) against the real ZeroMQ server: with a window of k, k pushes of
one producer are outstanding at once and every group is acknowledged on its own; when the buffer
process is killed with a full window unanswered and restarted on the same port, the window sends
those pushes again with their tickets and every group is delivered to the learner exactly once
(none lost, none doubled)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from replay_procs import indexed_group, start_buffer_process

from asyncrl.config import BufferConfig
from asyncrl.replay import BufferClient, PushWindow, ReplayBufferServer

pytestmark = pytest.mark.integration
RNG = np.random.default_rng(0)


def group(index: int, version: int = 0):
    return indexed_group(RNG, index, version)


def test_window_keeps_several_pushes_in_flight_and_acks_each() -> None:
    server = ReplayBufferServer(BufferConfig(max_staleness=1), batch_size=8)
    client = BufferClient(server.start(), actor_id="rollout-0", reply_grace_s=5.0)
    learner = BufferClient(server.address, actor_id="learner", reply_grace_s=5.0)
    window = PushWindow(client, window=4)
    try:
        tickets = [client.acquire_ticket(1.0) for _ in range(12)]
        assert None not in tickets
        futures = [window.submit(group(i), t) for i, t in enumerate(tickets)]
        replies = [f.result(timeout=30) for f in futures]
        assert [r.status for r in replies] == ["stored"] * 12
        got = learner.get_batch(16, 0, timeout_s=1.0)
        assert sorted(int(g.metadata["prompt_index"]) for g in got) == list(range(12))
        assert 1 <= window.max_in_flight <= 4
    finally:
        window.close()
        client.close()
        learner.close()
        server.stop()


def start(tmp: Path, port: int, *, recover: bool, tag: str):
    return start_buffer_process(tmp, port, recover=recover, tag=tag, batch_size=4)


def test_server_restart_mid_window_loses_and_doubles_nothing(tmp_path: Path) -> None:
    proc, address = start(tmp_path, 0, recover=False, tag="a")
    port = int(address.rsplit(":", 1)[1])
    producer = BufferClient(address, actor_id="rollout-0", reply_grace_s=20.0)
    learner = BufferClient(address, actor_id="learner", reply_grace_s=20.0)
    window = PushWindow(producer, window=4, attempt_s=5.0)
    try:
        tickets = [producer.acquire_ticket(1.0) for _ in range(8)]  # limit (0+1+1)*4 = 8
        assert None not in tickets
        assert window.push(group(0), tickets[0]).status == "stored"  # acknowledged before the fault
        os.kill(proc.pid, signal.SIGSTOP)  # the server reads nothing more: the window fills unanswered
        futures = [window.submit(group(i), tickets[i]) for i in range(1, 8)]
        end = time.monotonic() + 10
        while window.max_in_flight < 4 and time.monotonic() < end:
            time.sleep(0.05)
        assert window.max_in_flight == 4  # four pushes outstanding at once
        assert not any(f.done() for f in futures)
        os.kill(proc.pid, signal.SIGKILL)  # dies with the window unanswered
        proc.wait(10)
        proc, again = start(tmp_path, port, recover=True, tag="b")
        assert again == address
        statuses = [f.result(timeout=60).status for f in futures]
        assert set(statuses) <= {"stored", "duplicate"}, statuses
        got = learner.get_batch(8, 0, timeout_s=5.0)
        indices = sorted(int(g.metadata["prompt_index"]) for g in got)
        assert indices == list(range(8)), indices  # every group once: none lost, none doubled
        assert window.resent >= 1
        stats = learner.stats()
        assert stats["buffer/ingested"] == 8 and stats["buffer/size_groups"] == 0
    finally:
        window.close()
        producer.close()
        learner.close()
        proc.kill()
        proc.wait(10)
