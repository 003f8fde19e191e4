"""Proves a resume loses no prompt to a missing or damaged buffer snapshot
(asyncrl.job.resume_snapshot.restore_buffer, with a real Coordinator and real snapshot files): the prompts
the checkpoint's cursor lists as `buffered` are issued again, first, and the console says how many and
why (missing / damaged, by file name); an intact snapshot re-issues nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asyncrl.config import DataConfig
from asyncrl.job.coordinator import Coordinator
from asyncrl.job.resume_snapshot import restore_buffer
from asyncrl.protocol import encode
from asyncrl.replay.snapshot import read_snapshot, write_snapshot
from asyncrl.replay.state import BufferState
from asyncrl.replay.synthetic import synthetic_group

ROWS = [{"problem": f"Compute {i} + 1.", "answer": str(i + 1)} for i in range(10)]
CFG = DataConfig(shuffle=False).model_dump_json()
BUFFERED = [3, 4]  # what the checkpoint's cursor says the snapshot holds


def _snapshot(path: Path) -> None:
    st = BufferState(max_staleness=2, batch_size=2, capacity_groups=100, capacity_bytes=10**9)
    rng = np.random.default_rng(0)
    for i in BUFFERED:
        g = synthetic_group(rng, prompt_uid=f"g{i}", version=0, n=2, min_tokens=8, max_tokens=8)
        st.ingest(g, encode(g), ticket=st.grant())
    write_snapshot(path, st.snapshot_header(), [g.blob for g in st.groups()])


def _resume(tmp_path: Path, snapshot: Path) -> tuple[list[int], list[int]]:
    """(re-issued indices, the first prompts the resumed coordinator issues)."""
    coord = Coordinator(ROWS, CFG, stream_state=None, reissue=[], buffered=list(BUFFERED),
                        state_path=str(tmp_path / "coordinator.json"))
    held: list[int] = []

    def restore(path: str) -> int:
        _, _, groups = read_snapshot(path, 2**30)  # raises on a damaged file, as BufferHost.restore does
        held.extend(int(g.prompt_uid[1:]) for g in groups)
        return len(groups)

    lost = restore_buffer(snapshot, restore, lambda: list(held), coord.reissue_lost)
    first = [coord.next_prompt("a", f"r{i}")["index"] for i in range(len(lost))]
    return lost, first


def test_missing_snapshot_reissues_the_buffered_prompts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lost, first = _resume(tmp_path, tmp_path / "groups.snapshot")
    out = capsys.readouterr().out
    assert lost == first == BUFFERED
    assert f"buffer snapshot {tmp_path / 'groups.snapshot'} is missing" in out
    assert "2 prompt(s) the checkpoint lists as buffered are not in the buffer: issued again" in out


def test_damaged_snapshot_is_named_and_its_prompts_reissued(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    snap = tmp_path / "groups.snapshot"
    _snapshot(snap)
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snap.write_bytes(bytes(data))
    lost, first = _resume(tmp_path, snap)
    out = capsys.readouterr().out
    assert lost == first == BUFFERED
    assert f"buffer snapshot {snap} is damaged and was not loaded (" in out and "2 prompt(s)" in out


def test_intact_snapshot_reissues_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    snap = tmp_path / "groups.snapshot"
    _snapshot(snap)
    lost, _ = _resume(tmp_path, snap)
    assert lost == [] and "buffer restored from" in capsys.readouterr().out
