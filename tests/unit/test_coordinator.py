"""The coordinator's prompt accounting (plain class, no Ray): prompts held by a dead actor are
re-issued first, and a checkpointed cursor plus its re-issue list resumes with no prompt skipped
or repeated."""

from __future__ import annotations

from asyncrl.config import DataConfig
from asyncrl.job.coordinator import Coordinator

ROWS = [{"problem": f"Compute {i} + 1.", "answer": str(i + 1)} for i in range(10)]
CFG = DataConfig(shuffle=False).model_dump_json()


def test_abandoned_prompts_are_reissued_first() -> None:
    c = Coordinator(ROWS, CFG)
    a, b, d = (c.next_prompt(x)["index"] for x in ("r0", "r1", "r0"))
    c.complete(b)
    assert c.abandon_actor("r0") == 2  # a and d were held by the dead actor
    assert [c.next_prompt("r1")["index"] for _ in range(3)] == [a, d, 3]


def test_cursor_resume_skips_and_repeats_nothing() -> None:
    c = Coordinator(ROWS, CFG)
    issued = [c.next_prompt("r0")["index"] for _ in range(4)]
    for i in issued[:2]:
        c.complete(i)  # reached the buffer (and so the buffer snapshot)
    state = c.cursor_state()
    assert state["reissue"] == issued[2:]
    resumed = Coordinator(ROWS, CFG, stream_state=state["stream"], reissue=state["reissue"])
    after = [resumed.next_prompt("r0")["index"] for _ in range(4)]
    assert after == issued[2:] + [4, 5]  # in-flight ones first, then the stream continues
    assert not set(after) & set(issued[:2])


def test_stopping_pauses_admission() -> None:
    c = Coordinator(ROWS, CFG)
    c.set_stopping()
    assert c.next_prompt("r0") is None
    assert c.status()["admitting"] is False


def test_restarted_coordinator_restores_cursor_and_in_flight(tmp_path) -> None:
    path = str(tmp_path / "coordinator.json")
    c = Coordinator(ROWS, CFG, state_path=path, recover=False)
    a = c.next_prompt("r0", "q1")["index"]
    b = c.next_prompt("r1", "q1")["index"]
    d = c.next_prompt("r0", "q2")["index"]
    c.complete(b)
    c.set_version(3, trained=[b])
    # the process dies here; Ray starts a new one with the same arguments
    r = Coordinator(ROWS, CFG, state_path=path, recover=True)
    assert r.counters["restarts"] == 1 and r.version == 3
    assert r.next_prompt("r0", "q2")["index"] == d  # a retried call gets the prompt already issued
    assert r.next_prompt("r1", "q2")["index"] == 3  # the stream continues: nothing skipped or repeated
    r.complete(a)
    assert r.abandon_actor("r0") == 1  # d is still held by r0
    assert r.next_prompt("r1", "q3")["index"] == d
    assert r.cursor_state([a])["reissue"] == sorted([3, d])  # trained b is done; a is in the snapshot


def test_stale_dropped_prompt_is_reissued_once_and_trained_prompt_never() -> None:
    c = Coordinator(ROWS, CFG)
    a, b = (c.next_prompt("r0")["index"] for _ in range(2))
    c.complete(a)
    c.complete(b)
    c.trained([a])
    assert c.reissue([b, b, a], "stale") == 1  # a was trained: never again; b once
    assert c.counters["reissued_stale"] == 1
    assert c.next_prompt("r0")["index"] == b


def test_buffer_restart_without_log_reissues_exactly_the_lost_groups() -> None:
    c = Coordinator(ROWS, CFG)
    idx = [c.next_prompt("r0")["index"] for _ in range(4)]
    for i in idx[:3]:
        c.complete(i)  # acknowledged by the buffer
    c.trained([idx[0]])
    assert c.reissue_lost(present=[idx[2]]) == [idx[1]]  # idx[3] is still being generated
    assert [c.next_prompt("r0")["index"] for _ in range(2)] == [idx[1], 4]
