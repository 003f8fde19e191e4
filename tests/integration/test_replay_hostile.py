"""The replay buffer's socket under hostile input, over real ZeroMQ (a peer speaking the documented
wire format with pyzmq): admin requests (snapshot, restore, set-version) are refused by name and
write no file; non-finite or huge numbers (timeouts, batch sizes, versions, tickets) are refused,
counted per reason, and the buffer keeps serving; poisoned groups (token ids outside the vocabulary,
positive or infinite log-probs, absurd versions) are refused and counted; a hostile peer's parked
requests delay neither the learner's batch nor an actor's ticket; an exception in the socket loop
is survived (counted) instead of killing the thread; requests without the job's HMAC are refused."""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from asyncrl.config import BufferConfig
from asyncrl.protocol import (
    Ack,
    BatchReply,
    BatchRequest,
    ErrorReply,
    Push,
    RestoreRequest,
    SetVersion,
    SnapshotRequest,
    TicketReply,
    TicketRequest,
    VersionReached,
    decode,
    encode,
)
from asyncrl.replay import BufferClient, BufferRequestError, ReplayBufferServer
from asyncrl.replay.auth import sign
from asyncrl.replay.synthetic import synthetic_group

pytestmark = pytest.mark.integration
RNG = np.random.default_rng(3)


def small_group(version: int, uid: str, tokens: int = 16):
    return synthetic_group(RNG, prompt_uid=uid, version=version, n=2, min_tokens=tokens, max_tokens=tokens)


class Peer:
    """A raw DEALER that signs its requests with the job's secret (an authenticated but hostile
    member) unless `secret` is None (a stranger)."""

    def __init__(self, address: str, secret: str | None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.secret = secret
        self.rid = 0

    def send(self, msg, *extra: bytes) -> bytes:
        self.rid += 1
        rid = struct.pack("<Q", self.rid)
        frames = [rid, encode(msg), *extra]
        self.sock.send_multipart(sign(frames, self.secret) if self.secret is not None else frames)
        return rid

    def reply(self, timeout_s: float = 5.0):
        assert self.sock.poll(int(timeout_s * 1000)), "no reply"
        frames = self.sock.recv_multipart()
        return decode(frames[1])

    def ask(self, msg, *extra: bytes):
        self.send(msg, *extra)
        return self.reply()

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def serve(**kw) -> tuple[ReplayBufferServer, BufferClient, str]:
    batch_size = kw.pop("batch_size", 2)
    vocab = kw.pop("vocab_size", None)
    cfg = BufferConfig(**kw)
    server = ReplayBufferServer(cfg, batch_size=batch_size, vocab_size=vocab)
    return server, BufferClient(server.start(), secret=cfg.secret, reply_grace_s=5.0), cfg.secret


def test_admin_requests_over_the_socket_are_refused_and_write_nothing(tmp_path: Path) -> None:
    server, client, secret = serve(max_staleness=1)
    peer = Peer(server.address, secret)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    try:
        client.push(small_group(0, "a"), client.acquire_ticket(1.0))
        for msg in (SnapshotRequest(str(victim)), SnapshotRequest(str(tmp_path / "new" / "x.snap")),
                    RestoreRequest(str(victim)), SetVersion(10**9), SetVersion(-10**9)):
            reply = peer.ask(msg)
            assert isinstance(reply, ErrorReply) and reply.code == "forbidden", reply
            assert type(msg).__name__ in reply.message
        assert victim.read_text() == "precious" and not (tmp_path / "new").exists()
        stats = client.stats()
        assert stats["buffer/refused/admin"] == 5
        assert stats["buffer/version"] == 0 and stats["buffer/size_groups"] == 1  # nothing dropped
        # the in-process (Ray actor) path still works, inside the run directory it is given
        server.run_dir = str(tmp_path)
        assert server.snapshot(str(tmp_path / "ok.snap")) == 1
        with pytest.raises(ValueError, match="outside the run directory"):
            server.snapshot("/tmp/elsewhere.snap")
    finally:
        peer.close()
        client.close()
        server.stop()


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0, 1e6])
def test_unbounded_timeouts_are_refused_and_the_buffer_keeps_serving(bad: float) -> None:
    server, client, secret = serve(max_staleness=1, max_wait_s=60.0)
    peer = Peer(server.address, secret)
    try:
        for msg in (TicketRequest("evil", bad), BatchRequest(1, 0, bad)):
            reply = peer.ask(msg)
            assert isinstance(reply, ErrorReply) and reply.code == "out_of_range", reply
            assert "timeout_s" in reply.message
        # the socket thread is alive: a normal round trip still works
        t = client.acquire_ticket(1.0)
        assert client.push(small_group(0, "ok"), t).status == "stored"
        assert [g.prompt_uid for g in client.get_batch(1, 0, 1.0)] == ["ok"]
        assert client.stats()["buffer/refused/timeout"] == 2
    finally:
        peer.close()
        client.close()
        server.stop()


def test_huge_batch_sizes_versions_and_tickets_are_refused() -> None:
    server, client, secret = serve(max_staleness=1, capacity_groups=64)
    peer = Peer(server.address, secret)
    try:
        cases = [(BatchRequest(10**6, 0, 1.0), "num_groups"), (BatchRequest(65, 0, 1.0), "num_groups"),
                 (BatchRequest(0, 0, 1.0), "num_groups"), (BatchRequest(1, 10**9, 1.0), "version"),
                 (BatchRequest(1, -5, 1.0), "version"), (BatchRequest(1, 0, 1.0, ahead=10**6), "ahead"),
                 (Push(-7), "ticket"), (VersionReached(10**9), "version"), (VersionReached(-1), "version")]
        for msg, name in cases:
            reply = peer.ask(msg, encode(small_group(0, "x"))) if isinstance(msg, Push) else peer.ask(msg)
            assert isinstance(reply, ErrorReply) and reply.code == "out_of_range", (msg, reply)
            assert name in reply.message, (msg, reply.message)
        stats = client.stats()
        assert stats["buffer/refused/num_groups"] == 3 and stats["buffer/refused/version"] == 4
        assert stats["buffer/version"] == 0
        client.set_version(3)  # the learner moves forward ...
        assert isinstance(peer.ask(VersionReached(1)), Ack)  # ... and a lower version never moves it back
        assert client.stats()["buffer/version"] == 3
        assert client.push(small_group(3, "ok")).status == "stored"
    finally:
        peer.close()
        client.close()
        server.stop()


def _poisoned(kind: str):
    g = small_group(0, f"poison-{kind}")
    s = g.samples[0]
    on = s.response_mask.astype(bool)
    if kind == "negative_id":
        s.response_ids = s.response_ids.copy()
        s.response_ids[0] = -5
    elif kind == "huge_id":
        s.prompt_ids = s.prompt_ids.copy()
        s.prompt_ids[0] = 2**31 - 1
    elif kind in ("pos_inf", "neg_inf", "positive"):
        lp = s.behaviour_logprobs.copy()
        lp[np.flatnonzero(on)[0]] = {"pos_inf": np.inf, "neg_inf": -np.inf, "positive": 0.5}[kind]
        s.behaviour_logprobs = lp
    elif kind == "version":
        for x in g.samples:
            x.token_versions = np.where(x.response_mask.astype(bool), 2**30, -1).astype(np.int32)
        g.min_version = g.max_version = 2**30
    return g


@pytest.mark.parametrize("kind,reason", [("negative_id", "token_id"), ("huge_id", "token_id"),
                                         ("pos_inf", "logprob"), ("neg_inf", "logprob"),
                                         ("positive", "logprob"), ("version", "version")])
def test_poisoned_groups_are_refused_and_counted(kind: str, reason: str) -> None:
    server, client, _ = serve(max_staleness=1, vocab_size=150_000)
    try:
        with pytest.raises(BufferRequestError, match="out_of_range"):
            client.push(_poisoned(kind))
        stats = client.stats()
        assert stats[f"buffer/refused/{reason}"] == 1 and stats["buffer/size_groups"] == 0
        assert client.push(small_group(0, "clean")).status == "stored"
    finally:
        client.close()
        server.stop()


def test_a_hostile_peers_parked_requests_do_not_delay_the_learner_or_an_actor() -> None:
    server, client, secret = serve(max_staleness=0, batch_size=2, capacity_groups=64, max_wait_s=600.0)
    hostile = [Peer(server.address, secret) for _ in range(3)]
    learner = BufferClient(server.address, secret=secret, actor_id="learner", reply_grace_s=5.0)
    try:
        for p in hostile:  # each parks a batch request it cannot get before the learner's
            p.send(BatchRequest(64, 0, 500.0))
        for i in range(60):  # and one of them piles up ticket requests under many actor ids
            hostile[0].send(TicketRequest(f"hostile-{i}", 500.0))
        time.sleep(0.3)
        granted = []
        while hostile[0].sock.poll(100):  # it took what admission there was (2 slots), was told busy beyond its cap
            reply = decode(hostile[0].sock.recv_multipart()[1])
            assert isinstance(reply, (TicketReply, ErrorReply)), reply
            if isinstance(reply, TicketReply):
                granted.append(reply.ticket)
        assert sorted(granted) == [0, 1]
        stats = client.stats()
        assert stats["buffer/waiting_ticket_requests"] == 16  # a cap per connection (2 granted at once, 16 wait)
        assert stats["buffer/refused/busy"] == 60 - 2 - 16
        assert stats["buffer/waiting_batch_requests"] == 3
        # two untracked pushes (a producer that holds no ticket), then the learner's small batch
        for i in range(2):
            assert client.push(small_group(0, f"g{i}")).status == "stored"
        got = learner.get_batch(2, 0, timeout_s=5.0)
        assert sorted(g.prompt_uid for g in got) == ["g0", "g1"]
        # served ahead of them: the three hostile batch requests parked before it still wait
        assert client.stats()["buffer/waiting_batch_requests"] == 3, "the learner waited behind the hostile peers"
        # an actor's ticket request is served in its turn, not after the hostile connection's 16
        learner.set_version(1)  # limit (1+0+1)*2 = 4: consumed 2 + the hostile's 2 in flight -> none free
        waiter = BufferClient(server.address, secret=secret, actor_id="actor-0", reply_grace_s=5.0)
        result: list[int | None] = []
        thread = threading.Thread(target=lambda: result.append(waiter.acquire_ticket(5.0)))
        thread.start()
        time.sleep(0.3)  # the actor's request is parked behind the hostile ones
        with server._lock:
            for t in granted:  # two slots free up
                server.state.release(t)
        thread.join(10)
        assert result and result[0] is not None, "the actor's ticket went to the hostile connection's requests"
        # in its turn: of the two freed slots at most one went to the hostile connection's 16 waiting requests
        assert client.stats()["buffer/waiting_ticket_requests"] >= 15
        waiter.close()
    finally:
        for p in hostile:
            p.close()
        learner.close()
        client.close()
        server.stop()


def test_an_exception_in_the_socket_loop_does_not_kill_it() -> None:
    server, client, _ = serve(max_staleness=1)
    real = server._serve_waiters
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real(*a, **kw)

    server._serve_waiters = flaky
    try:
        for i in range(5):
            assert client.push(small_group(0, f"p{i}")).status == "stored"
            client.stats()
        assert calls["n"] >= 3
        stats = client.stats()
        assert stats["buffer/loop_errors"] >= 1 and server.healthy()
    finally:
        client.close()
        server.stop()


def test_requests_without_the_jobs_secret_are_refused() -> None:
    server, client, secret = serve(max_staleness=1)
    stranger, forger = Peer(server.address, None), Peer(server.address, "0" * 64)
    try:
        for p in (stranger, forger):
            reply = p.ask(TicketRequest("stranger", 0.0))
            assert isinstance(reply, ErrorReply) and reply.code == "unauthenticated", reply
        outsider = BufferClient(server.address, reply_grace_s=2.0)  # a client without the secret
        with pytest.raises(BufferRequestError, match="unauthenticated"):
            outsider.acquire_ticket(0.0)
        outsider.close()
        assert client.stats()["buffer/refused/unauthenticated"] == 3
        assert client.acquire_ticket(0.1) == 0  # nothing was granted to the strangers
        assert isinstance(Peer(server.address, secret).ask(TicketRequest("m", 0.0)), TicketReply)
        assert not isinstance(Peer(server.address, secret).ask(SetVersion(1)), (Ack, BatchReply))
    finally:
        stranger.close()
        forger.close()
        client.close()
        server.stop()
