"""Proves the PromptStream guarantees: the order is a deterministic function of the seed (per
epoch, every epoch a permutation of all rows, epochs roll over); a stream restored from a
JSON-round-tripped `state_dict()` continues with exactly the draws the original would have
served, at any cursor (hypothesis property test); `item(k)` rebuilds draw k; incompatible states
are refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.config import DataConfig
from asyncrl.data import PromptStream

ROWS = [{"problem": f"q{i}", "answer": str(i)} for i in range(7)]


def order(stream: PromptStream, n: int) -> list[int]:
    return [x.row_index for x in stream.take(n)]


def test_deterministic_by_seed_and_epochs_are_permutations() -> None:
    a, b, c = PromptStream(ROWS, seed=1), PromptStream(ROWS, seed=1), PromptStream(ROWS, seed=2)
    oa = order(a, 21)
    assert oa == order(b, 21)
    assert oa != order(c, 21)
    epochs = [oa[0:7], oa[7:14], oa[14:21]]
    assert all(sorted(e) == list(range(7)) for e in epochs)  # each epoch visits every row once
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled per epoch
    assert a.epoch == 3
    assert order(PromptStream(ROWS, shuffle=False), 9) == [0, 1, 2, 3, 4, 5, 6, 0, 1]


def test_items_have_unique_uids_and_answers() -> None:
    s = PromptStream(ROWS, seed=3, name="train")
    items = s.take(14)
    assert [x.uid for x in items] == [f"train/{k}" for k in range(14)]
    assert all(x.ground_truth == str(x.row_index) and x.messages[-1]["content"] == f"q{x.row_index}" for x in items)
    assert [x.epoch for x in items] == [0] * 7 + [1] * 7


@pytest.mark.parametrize("consumed", [0, 3, 7, 12])
def test_resume_continues_exactly(consumed: int) -> None:
    a = PromptStream(ROWS, seed=9)
    a.take(consumed)
    state = json.loads(json.dumps(a.state_dict()))
    b = PromptStream(ROWS, seed=9)
    b.load_state_dict(state)
    assert [(x.index, x.row_index) for x in a.take(15)] == [(x.index, x.row_index) for x in b.take(15)]


def test_incompatible_state_is_refused() -> None:
    state = PromptStream(ROWS, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        PromptStream(ROWS, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_rows=7"):
        PromptStream(ROWS[:6], seed=1).load_state_dict(state)
    changed = [dict(r, problem=r["problem"] + "!") for r in ROWS]
    with pytest.raises(ValueError, match="fingerprint"):
        PromptStream(changed, seed=1).load_state_dict(state)
    PromptStream(changed, seed=1).load_state_dict(state, strict=False)
    with pytest.raises(ValueError, match="format"):
        PromptStream(ROWS, seed=1).load_state_dict({**state, "format": 99})


def test_item_rebuilds_any_draw_without_moving_the_cursor() -> None:
    s = PromptStream(ROWS, seed=6)
    drawn = s.take(10)
    assert [s.item(k).row_index for k in range(10)] == [x.row_index for x in drawn]
    assert s.next().index == 10


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 50), consumed=st.integers(0, 40), more=st.integers(1, 20))
def test_resume_at_any_cursor_serves_the_same_draws(seed: int, consumed: int, more: int) -> None:
    a = PromptStream(ROWS[:5], seed=seed)
    a.take(consumed)
    b = PromptStream(ROWS[:5], seed=seed)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [(x.index, x.row_index) for x in b.take(more)] == [(x.index, x.row_index) for x in a.take(more)]


def test_stream_uses_data_config_for_messages() -> None:
    s = PromptStream(ROWS, seed=1, cfg=DataConfig(system_prompt="sys", format_prompt="r1v"))
    m = s.next().messages
    assert m[0] == {"role": "system", "content": "sys"} and "A conversation between User and Assistant" in m[1]["content"]
