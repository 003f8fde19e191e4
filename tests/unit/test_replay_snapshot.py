"""Snapshots: a restored buffer equals the original (groups, order, counters, ticket ids); a process
killed in the middle of writing a new snapshot leaves the previous one intact and loadable; damaged
or truncated files are refused whole (never half loaded)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from asyncrl.protocol import encode
from asyncrl.replay.snapshot import SnapshotError, read_snapshot, write_snapshot
from asyncrl.replay.state import BufferState
from asyncrl.replay.synthetic import synthetic_group

MAX = 2**30


def filled_state(n: int = 6, tokens: int = 16) -> BufferState:
    rng = np.random.default_rng(0)
    st = BufferState(max_staleness=2, batch_size=2, capacity_groups=100, capacity_bytes=10**9)
    st.set_version(2)
    tickets = [st.grant() for _ in range(n + 1)]
    for i in range(n):
        g = synthetic_group(rng, prompt_uid=f"g{i}", version=i % 3, n=2, min_tokens=tokens, max_tokens=tokens)
        st.ingest(g, encode(g), ticket=tickets[i])
    st.take(2)
    return st


def save(st: BufferState, path: Path) -> None:
    write_snapshot(path, st.snapshot_header(), [g.blob for g in st.groups()])


def test_restore_equals_original(tmp_path: Path) -> None:
    st = filled_state()
    save(st, tmp_path / "buf.snap")
    header, blobs, groups = read_snapshot(tmp_path / "buf.snap", MAX)
    st2 = BufferState(max_staleness=2, batch_size=2, capacity_groups=100, capacity_bytes=10**9)
    st2.load(header, blobs)
    assert st2.stats(now=0)["buffer/consumed"] == st.stats(now=0)["buffer/consumed"] == 2
    for key in ("buffer/version", "buffer/size_groups", "buffer/size_mb", "buffer/ingested", "buffer/staleness/2"):
        assert st2.stats()[key] == st.stats()[key], key
    assert [bytes(g.blob) for g in st2.groups()] == [bytes(g.blob) for g in st.groups()]
    assert [g.prompt_uid for g in groups] == ["g1", "g4", "g2", "g5"]  # oldest version first
    # the unfinished ticket (6) is not in flight after restore; a late push with it is still accepted
    assert st2.in_flight == {} and st2.grant() == 7
    g = synthetic_group(np.random.default_rng(1), prompt_uid="late", version=2, n=2, min_tokens=8, max_tokens=8)
    assert st2.ingest(g, encode(g), ticket=6) == "stored" and st2.ingest(g, encode(g), ticket=0) == "duplicate"


def test_crash_while_writing_keeps_previous_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "buf.snap"
    save(filled_state(n=4), path)
    before = path.read_bytes()
    # A child process writes a large snapshot to the same path and is killed by SIGXFSZ once its
    # file reaches 64 KiB: a real crash in the middle of the write sequence.
    child = textwrap.dedent(f"""
        import resource, numpy as np
        from asyncrl.protocol import encode
        from asyncrl.replay.snapshot import write_snapshot
        from asyncrl.replay.synthetic import synthetic_group
        rng = np.random.default_rng(0)
        blobs = [encode(synthetic_group(rng, prompt_uid=str(i), version=0, n=2, min_tokens=2048, max_tokens=2048))
                 for i in range(8)]
        header = {{"version": 0, "consumed": 0, "next_ticket": 0, "unfinished_tickets": [], "counters": {{}},
                   "staleness_hist": {{}}, "groups": [{{"min_version": 0, "max_version": 0, "nbytes": len(b),
                   "stored_at": 0.0, "ticket": -1}} for b in blobs]}}
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        write_snapshot({str(path)!r}, header, blobs)
        print("finished")
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "finished" not in proc.stdout, proc.stderr
    leftovers = list(tmp_path.glob("buf.snap.tmp-*"))
    assert leftovers and leftovers[0].stat().st_size == 65536  # the half-written file
    assert path.read_bytes() == before
    header, blobs, groups = read_snapshot(path, MAX)
    assert len(groups) == 2
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        read_snapshot(leftovers[0], MAX)


def test_damaged_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "buf.snap"
    save(filled_state(), path)
    data = path.read_bytes()
    (tmp_path / "flip").write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    (tmp_path / "short").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk").write_bytes(b"not a snapshot at all")
    for name, needle in [("flip", "checksum"), ("short", "checksum"), ("junk", "bad magic"), ("missing", "cannot read")]:
        with pytest.raises(SnapshotError, match=needle):
            read_snapshot(tmp_path / name, MAX)
