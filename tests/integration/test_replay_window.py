"""Pipelined pushes (`PushWindow`) against the real ZeroMQ server: with a window of k, k pushes of
one producer are outstanding at once and every group is acknowledged on its own; when the buffer
process is killed with a full window unanswered and restarted on the same port, the window sends
those pushes again with their tickets and every group is delivered to the learner exactly once
(none lost, none doubled); against a scripted server, "full", an error, silence and a buffer full
past its deadline each settle only their own group."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from replay_procs import SECRET, indexed_group, start_buffer_process

from asyncrl.config import BufferConfig
from asyncrl.replay import BufferClient, PushWindow, ReplayBufferServer

pytestmark = pytest.mark.integration
RNG = np.random.default_rng(0)


def group(index: int, version: int = 0):
    return indexed_group(RNG, index, version)


def test_window_keeps_several_pushes_in_flight_and_acks_each() -> None:
    cfg = BufferConfig(max_staleness=1)
    server = ReplayBufferServer(cfg, batch_size=8)
    client = BufferClient(server.start(), secret=cfg.secret, actor_id="rollout-0", reply_grace_s=5.0)
    learner = BufferClient(server.address, secret=cfg.secret, actor_id="learner", reply_grace_s=5.0)
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
    producer = BufferClient(address, secret=SECRET, actor_id="rollout-0", reply_grace_s=20.0)
    learner = BufferClient(address, secret=SECRET, actor_id="learner", reply_grace_s=20.0)
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


def test_window_answers_full_errors_and_silence_per_group() -> None:
    """The answers the real server cannot be made to give on demand, from a scripted ROUTER:
    "full" twice then stored; a first attempt left unanswered (sent again on a fresh socket with
    the same ticket, then stored); an error reply; a ticketless push left unanswered (fails, never
    resent: the server could not deduplicate it); a buffer that stays full past block_s."""
    import collections
    import threading

    import zmq

    from asyncrl.protocol import ErrorReply, PushReply, decode, encode
    from asyncrl.replay import BufferFull, BufferRequestError, BufferTimeout

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: collections.Counter[int] = collections.Counter()
    stop = threading.Event()

    def answer(ticket: int, n: int):  # n: this ticket's attempt number; None = stay silent
        return {1: PushReply("full") if n <= 2 else PushReply("stored"),
                2: None if n == 1 else PushReply("stored"),
                3: ErrorReply("bad_request", "scripted"),
                4: PushReply("full"),
                -1: None}.get(ticket, PushReply("stored"))

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(20):
                ident, rid, msg, _blob = router.recv_multipart()
                ticket = decode(msg).ticket
                seen[ticket] += 1
                reply = answer(ticket, seen[ticket])
                if reply is not None:
                    router.send_multipart([ident, rid, encode(reply)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = BufferClient(f"tcp://127.0.0.1:{port}", reply_grace_s=1.0)
    window = PushWindow(client, window=3, block_s=3.0, attempt_s=1.0)
    try:
        futures = {t: window.submit(b"frame", None if t == -1 else t) for t in (1, 2, 3, 4, -1, 5, 6)}
        outcome = {}
        for t, f in futures.items():
            try:
                outcome[t] = f.result(timeout=60).status
            except Exception as exc:  # noqa: BLE001 - the failure's type is the outcome
                outcome[t] = type(exc)
        assert outcome == {1: "stored", 2: "stored", 3: BufferRequestError, 4: BufferFull, -1: BufferTimeout,
                           5: "stored", 6: "stored"}
        assert seen[1] >= 3  # two "full", then stored
        assert seen[2] >= 2 and window.resent >= 1  # the silent first attempt was sent again
        assert seen[-1] == 1  # a ticketless push is never resent
    finally:
        window.close()
        stop.set()
        thread.join(5)
        client.close()
        router.close(0)
        ctx.term()
