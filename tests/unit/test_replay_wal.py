"""The buffer's durable log without sockets: a state rebuilt from the log equals the state that
wrote it (groups, tickets, counters, stale-dropped prompts); a torn or corrupted tail is cut off at
the last whole record; the log is compacted as groups are consumed; bad fsync policy is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asyncrl.config import BufferConfig
from asyncrl.protocol import decode
from asyncrl.replay.server import ReplayBufferServer
from asyncrl.replay.synthetic import synthetic_group
from asyncrl.replay.wal import BufferLog

RNG = np.random.default_rng(0)


def group(version: int, index: int, tokens: int = 8):
    g = synthetic_group(RNG, prompt_uid=f"p/{index}", version=version, n=2, min_tokens=tokens, max_tokens=tokens)
    g.metadata["prompt_index"] = index
    return g


def server(log: Path, recover: bool = False, **kw) -> ReplayBufferServer:
    return ReplayBufferServer(BufferConfig(max_staleness=1, **kw), batch_size=2, log_path=str(log), recover=recover)


def push(srv: ReplayBufferServer, g, ticket: int) -> str:
    """What the socket loop does for a Push: ingest, then log before acknowledging."""
    from asyncrl.protocol import encode

    with srv._lock:
        status = srv.state.ingest(g, encode(g), ticket)
        srv._durable(srv.state.last_stored if status == "stored" else None)
    return status


def grant(srv: ReplayBufferServer, actor: str = "a") -> int:
    with srv._lock:
        t = srv.state.grant(actor)
        srv._durable()
    return t


def test_recovered_state_equals_logged_state(tmp_path: Path) -> None:
    log = tmp_path / "b.wal"
    a = server(log)
    t = [grant(a, "rollout-0") for _ in range(4)]
    assert [push(a, group(0, i), t[i]) for i in range(3)] == ["stored"] * 3
    with a._lock:
        assert len(a.state.take(1)) == 1
        a._durable()
    a.set_version(2)  # p/1 and p/2 (min_version 0) are now stale: dropped, prompts reported
    b = server(log, recover=True)
    sa, sb = a.state, b.state
    assert sb.buffered == 0 and sb.consumed == 1 and sb.version == 2 and sb.next_ticket == 4
    assert set(sb.in_flight) == {3} and sb.in_flight[3].actor_id == "rollout-0"
    assert sb.counters["restarts"] == 1 and sb.counters["dropped_stale"] == 2
    assert {k: v for k, v in sb.counters.items() if k not in ("restarts", "recovered_groups")} == \
        {k: v for k, v in sa.counters.items() if k not in ("restarts", "recovered_groups")}
    assert [i for i, _ in b.take_dropped()] == [1, 2] and b.take_dropped() == []
    assert push(b, group(2, 3), 3) == "stored"  # the restored lease is honoured
    c = server(log, recover=True)
    assert c.state.prompt_indices() == [3] and c.state.counters["restarts"] == 2
    assert c.state.counters["recovered_groups"] == 1
    assert decode(c.state.take(1)[0].blob).prompt_uid == "p/3"


def test_torn_tail_is_cut_at_the_last_whole_record(tmp_path: Path) -> None:
    log = tmp_path / "b.wal"
    a = server(log)
    t = [grant(a) for _ in range(2)]
    push(a, group(0, 0), t[0])
    good = log.stat().st_size
    push(a, group(0, 1), t[1])
    data = log.read_bytes()
    log.write_bytes(data[: good + (len(data) - good) // 2])  # the second group's record half written
    b = server(log, recover=True)
    assert b.state.prompt_indices() == [0] and b.log.torn_bytes > 0
    assert 1 in b.state.in_flight  # its push was never acknowledged: the ticket is still the producer's
    # a flipped byte inside a record fails its checksum
    data = bytearray(log.read_bytes())
    data[-5] ^= 0xFF
    log.write_bytes(bytes(data))
    lg = BufferLog(log)
    _, groups = lg.replay()
    assert lg.torn_bytes > 0


def test_log_is_compacted_as_groups_are_consumed(tmp_path: Path) -> None:
    log = tmp_path / "b.wal"
    a = server(log, capacity_groups=1000)
    a.state.max_staleness = 10**6
    a.state.batch_size = 10**6
    for i in range(40):
        push(a, group(0, i, tokens=2048), grant(a))
    full = log.stat().st_size
    assert full > 1 << 20
    with a._lock:
        a.state.take(40)
        a._durable()
    assert log.stat().st_size < 4096  # drained: one state record left
    b = server(log, recover=True)
    assert b.state.buffered == 0 and b.state.consumed == 40


def test_bad_fsync_policy_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fsync"):
        BufferLog(tmp_path / "x", fsync="sometimes")
