"""The coordinator's prompt accounting (plain class, no Ray): prompts held by a dead actor are
re-issued first, and a checkpointed cursor plus its re-issue list resumes with no prompt skipped
or repeated."""

from __future__ import annotations

from asyncrl.config import DataConfig
from asyncrl.coordinator import Coordinator

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
