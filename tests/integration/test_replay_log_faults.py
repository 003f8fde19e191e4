"""The buffer's durable log under damage and a full disk, with real files and real ZeroMQ: a flipped
bit in the middle of the log loses only that record's group, which recovery names (offset, seq,
prompt uid), and keeps every intact record after it; a full disk (the log's write calls answered
ENOSPC, as a full file system answers them) is a named condition: the push is answered
`disk_full` and not kept in memory either (what the buffer holds equals what a restart recovers),
no ticket is granted meanwhile (`buffer/disk_full` = 1), and pushes resume once space is back;
a recovery on a full disk serves what it recovered and says what space the compaction needs;
group commit: pushes that arrive together share one fsync and none is acknowledged before it, with
the fsync in line or on its own thread; with the sync thread, a held fsync (a fake that waits on an
event, real ZeroMQ and files around it) leaves the loop receiving and appending pushes while none
of them is acknowledged until the sync that covers it completes; a failed fsync acknowledges nothing
it covered (an `internal` error, counted) and the next sync makes the same records durable."""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path

import numpy as np
import pytest

from asyncrl.config import BufferConfig
from asyncrl.protocol import PushReply, decode, encode
from asyncrl.replay import BufferClient, BufferDiskFull, PushWindow, ReplayBufferServer
from asyncrl.replay import wal as wal_module
from asyncrl.replay.synthetic import synthetic_group

pytestmark = pytest.mark.integration
RNG = np.random.default_rng(5)


def group(version: int, index: int, tokens: int = 64):
    g = synthetic_group(RNG, prompt_uid=f"p/{index}", version=version, n=2, min_tokens=tokens, max_tokens=tokens)
    g.metadata["prompt_index"] = index
    return g


def buffer(log: Path, recover: bool = False, **kw) -> ReplayBufferServer:
    cfg = BufferConfig(max_staleness=1, capacity_groups=64, **kw)
    return ReplayBufferServer(cfg, batch_size=32, log_path=str(log), recover=recover)


class Disk:
    """The log's write calls with a quota of bytes: past it they write what fits and then fail with
    ENOSPC, as a full file system does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, free: int) -> None:
        self.free = free
        real_writev, real_write = wal_module._writev, wal_module._write

        def writev(fd, views):
            return self._take(sum(len(v) for v in views), lambda n: real_writev(fd, self._cut(views, n)))

        def write(fd, data):
            return self._take(len(data), lambda n: real_write(fd, memoryview(data)[:n]))

        monkeypatch.setattr(wal_module, "_writev", writev)
        monkeypatch.setattr(wal_module, "_write", write)

    @staticmethod
    def _cut(views, n):
        out = []
        for v in views:
            out.append(memoryview(v)[:n])
            n -= len(out[-1])
            if n <= 0:
                break
        return out

    def _take(self, size: int, do):
        if self.free <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = do(min(size, self.free))
        self.free -= n
        return n


def test_a_flipped_bit_loses_only_its_record_and_is_reported(tmp_path: Path, caplog) -> None:
    log = tmp_path / "b.wal"
    a = buffer(log)
    offsets = []
    with a._lock:
        for i in range(10):
            offsets.append(a.log.size)
            assert a.state.ingest(group(0, i), encode(group(0, i))) == "stored"
            a._durable(a.state.last_stored)
    a.log.close()
    data = bytearray(log.read_bytes())
    data[offsets[2] + 200] ^= 0x10  # one bit inside record 3 of 10 (a group record)
    log.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        b = buffer(log, recover=True)
    assert b.state.prompt_indices() == [0, 1, 3, 4, 5, 6, 7, 8, 9]  # the 7 intact records after it are kept
    assert b.log.torn_bytes == 0
    [bad] = b.log.damaged
    assert bad.offset == offsets[2] and bad.uid == "p/2" and bad.seq is not None
    assert b.log.lost == [(bad.seq, "p/2")]
    stats = b.stats()
    assert stats["buffer/log_damaged_records"] == 1 and stats["buffer/log_lost_groups"] == 1
    assert f"damaged record at offset {offsets[2]}" in caplog.text and "p/2" in caplog.text


def test_a_full_disk_refuses_pushes_by_name_and_pauses_admission(tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "b.wal"
    cfg = BufferConfig(max_staleness=1, capacity_groups=64)
    server = ReplayBufferServer(cfg, batch_size=32, log_path=str(log))
    client = BufferClient(server.start(), secret=cfg.secret, reply_grace_s=5.0)
    try:
        tickets = [client.acquire_ticket(1.0) for _ in range(12)]
        for i in range(9):
            assert client.push(group(0, i), tickets[i]).status == "stored"
        disk = Disk(monkeypatch, free=3000)  # less than one more group record
        with pytest.raises(BufferDiskFull, match="disk full"):
            client.push(group(0, 9), tickets[9])
        stats = client.stats()
        assert stats["buffer/disk_full"] == 1 and stats["buffer/refused/disk_full"] == 1
        assert stats["buffer/size_groups"] == 9  # what is in memory is what is durable
        assert client.acquire_ticket(0.3) is None  # admission paused while the log cannot be written
        with server._lock:
            assert set(server.state.in_flight) >= {9}  # the refused push's ticket is still the producer's
        disk.free = 10**9  # space is back: the same push goes through, with its ticket
        assert client.push(group(0, 9), tickets[9]).status == "stored"
        assert client.stats()["buffer/disk_full"] == 0
        assert client.acquire_ticket(1.0) is not None
        memory = client.stats()["buffer/size_groups"]
    finally:
        client.close()
        server.stop()
    restarted = buffer(log, recover=True)
    assert restarted.state.buffered == memory == 10
    assert restarted.state.prompt_indices() == list(range(10))


def test_recovery_on_a_full_disk_serves_what_it_recovered(tmp_path: Path, monkeypatch, caplog) -> None:
    log = tmp_path / "b.wal"
    a = buffer(log)
    with a._lock:
        for i in range(4):
            a.state.ingest(group(0, i), encode(group(0, i)))
            a._durable(a.state.last_stored)
    a.log.close()
    Disk(monkeypatch, free=0)
    with caplog.at_level(logging.WARNING):
        b = buffer(log, recover=True)  # its compaction cannot write: no raw OSError, a named condition
    assert b.disk_full and b.state.prompt_indices() == [0, 1, 2, 3]
    assert "bytes are free for the log" in caplog.text
    with b._lock:
        assert [decode(g.blob).prompt_uid for g in b.state.take(4)] == ["p/0", "p/1", "p/2", "p/3"]


def watch_acks(server: ReplayBufferServer) -> list:
    """Records every stored-push acknowledgement that leaves before the log position its pass had
    appended is durable (the pass's replies are queued with `_send`; `log.lsn` then is what they need)."""
    real_send, real_deliver, needs, early = server._send, server._deliver, {}, []

    def send(sock, ident, rid, msg, extra=(), on_fail=None):
        needs[rid] = server.log.lsn  # at least: the pass may append more before its sync (never less)
        return real_send(sock, ident, rid, msg, extra, on_fail)

    def deliver(sock, ident, rid, msg, extra):  # the moment an acknowledgement leaves
        if isinstance(msg, PushReply) and msg.status == "stored" and server.log.committed < needs[rid]:
            early.append(msg)
        return real_deliver(sock, ident, rid, msg, extra)

    server._send, server._deliver = send, deliver
    return early


@pytest.mark.parametrize("sync_thread", [True, False], ids=["sync-thread", "inline-fsync"])
def test_pushes_that_arrive_together_share_one_fsync_and_are_acked_after_it(tmp_path: Path, sync_thread) -> None:
    cfg = BufferConfig(max_staleness=1, capacity_groups=256, durable={"sync_thread": sync_thread})
    server = ReplayBufferServer(cfg, batch_size=64, log_path=str(tmp_path / "b.wal"))
    client = BufferClient(server.start(), secret=cfg.secret, reply_grace_s=10.0)
    acked_before_fsync = watch_acks(server)
    window = PushWindow(client, window=16)
    try:
        tickets = [client.acquire_ticket(1.0) for _ in range(64)]
        fsyncs0 = client.stats()["buffer/log_fsyncs"]
        pending = [window.submit(group(0, i), t) for i, t in enumerate(tickets)]
        assert [p.result(timeout=60).status for p in pending] == ["stored"] * 64
        fsyncs = client.stats()["buffer/log_fsyncs"] - fsyncs0
    finally:
        window.close()
        client.close()
        server.stop()
    assert not acked_before_fsync
    assert fsyncs < 64, f"{fsyncs} fsyncs for 64 pushes sent 16 at a time"
    assert buffer(tmp_path / "b.wal", recover=True).state.buffered == 64  # each acknowledged push is in the log


def test_the_loop_keeps_appending_during_a_sync_and_no_ack_leaves_before_its_sync(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """The sync thread's fsync is held on an event: the pushes sent meanwhile are received, checked
    and appended (the loop does not wait for the disk), none of them is acknowledged, and once the
    sync is let go they all are, sharing one more fsync."""
    import threading

    real_fsync, held, entered = wal_module._fsync, threading.Event(), threading.Event()
    gate = threading.Event()

    def fsync(fd):
        if held.is_set():
            entered.set()
            assert gate.wait(30), "the test never let the sync go"
        real_fsync(fd)

    monkeypatch.setattr(wal_module, "_fsync", fsync)
    cfg = BufferConfig(max_staleness=1, capacity_groups=64, durable={"sync_thread": True})
    server = ReplayBufferServer(cfg, batch_size=32, log_path=str(tmp_path / "b.wal"))
    client = BufferClient(server.start(), secret=cfg.secret, reply_grace_s=10.0)
    acked_before_fsync = watch_acks(server)
    window = PushWindow(client, window=8)
    try:
        tickets = [client.acquire_ticket(1.0) for _ in range(6)]  # granted and synced before the hold
        held.set()
        first = window.submit(group(0, 0), tickets[0])
        assert entered.wait(10), "the first push's sync never started"
        fsyncs0, lsn0 = server.log.fsyncs, server.log.lsn
        rest = [window.submit(group(0, i), tickets[i]) for i in range(1, 6)]
        deadline = time.monotonic() + 20
        while server.state.counters["ingested"] < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.state.counters["ingested"] == 6  # received and checked while the sync is held
        assert server.log.lsn >= lsn0 + 5  # ... and appended
        time.sleep(0.3)
        assert not first.done() and not any(r.done() for r in rest)  # nothing acknowledged before its sync
        held.clear()
        gate.set()
        assert [r.result(timeout=30).status for r in [first, *rest]] == ["stored"] * 6
        assert server.log.fsyncs - fsyncs0 <= 2  # the held sync finished, then one more for the five
    finally:
        gate.set()
        window.close()
        client.close()
        server.stop()
    assert not acked_before_fsync
    assert buffer(tmp_path / "b.wal", recover=True).state.buffered == 6


@pytest.mark.parametrize("sync_thread", [True, False], ids=["sync-thread", "inline-fsync"])
def test_a_failed_fsync_acknowledges_nothing_it_covered_and_the_next_one_does(tmp_path: Path, monkeypatch,
                                                                                 sync_thread) -> None:
    from asyncrl.replay import BufferRequestError

    real_fsync, fail = wal_module._fsync, [False]

    def fsync(fd):
        if fail[0]:
            fail[0] = False
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(wal_module, "_fsync", fsync)
    cfg = BufferConfig(max_staleness=1, capacity_groups=64, durable={"sync_thread": sync_thread})
    server = ReplayBufferServer(cfg, batch_size=32, log_path=str(tmp_path / "b.wal"))
    client = BufferClient(server.start(), secret=cfg.secret, reply_grace_s=5.0)
    try:
        tickets = [client.acquire_ticket(1.0) for _ in range(2)]
        fail[0] = True
        with pytest.raises(BufferRequestError, match="durable log commit failed"):
            client.push(group(0, 0), tickets[0])
        assert client.stats()["buffer/log_failures"] == 1
        assert client.push(group(0, 0), tickets[0]).status == "duplicate"  # stored once; synced by a later sync
        assert client.push(group(0, 1), tickets[1]).status == "stored"
    finally:
        client.close()
        server.stop()
    assert buffer(tmp_path / "b.wal", recover=True).state.prompt_indices() == [0, 1]
