"""The buffer's durable log under damage and a full disk, with real files and real ZeroMQ: a flipped
bit in the middle of the log loses only that record's group, which recovery names (offset, seq,
prompt uid), and keeps every intact record after it; a full disk (the log's write calls answered
ENOSPC, as a full file system answers them) is a named condition: the push is answered
`disk_full` and not kept in memory either (what the buffer holds equals what a restart recovers),
no ticket is granted meanwhile (`buffer/disk_full` = 1), and pushes resume once space is back;
a recovery on a full disk serves what it recovered and says what space the compaction needs;
group commit: pushes that arrive together share one fsync and none is acknowledged before it."""

from __future__ import annotations

import errno
import logging
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


def test_pushes_that_arrive_together_share_one_fsync_and_are_acked_after_it(tmp_path: Path) -> None:
    cfg = BufferConfig(max_staleness=1, capacity_groups=256)
    server = ReplayBufferServer(cfg, batch_size=64, log_path=str(tmp_path / "b.wal"))
    client = BufferClient(server.start(), secret=cfg.secret, reply_grace_s=10.0)
    real_deliver = server._deliver
    acked_before_fsync = []

    def deliver(sock, ident, rid, msg, extra):  # the moment an acknowledgement leaves
        if isinstance(msg, PushReply) and msg.status == "stored" and server.log._dirty:
            acked_before_fsync.append(msg)
        return real_deliver(sock, ident, rid, msg, extra)

    server._deliver = deliver
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
