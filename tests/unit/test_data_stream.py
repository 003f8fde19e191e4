"""Proves the PromptStream guarantees: the order is a deterministic function of the seed (per
epoch, every epoch a permutation of all rows, epochs roll over); a stream restored from a
JSON-round-tripped `state_dict()` continues with exactly the draws the original would have
served; shards are disjoint and together cover every draw; after shards are merged and
re-sharded with a different count (with put-backs in flight), no draw is skipped or repeated
(hypothesis property test); incompatible states are refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.config import DataConfig
from asyncrl.data import PromptStream, merge_shard_states

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


def test_resume_with_put_back_serves_it_first() -> None:
    a = PromptStream(ROWS, seed=4)
    first = a.take(3)
    a.put_back(first[1])
    b = PromptStream(ROWS, seed=4)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [x.index for x in b.take(3)] == [1, 3, 4]


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
    with pytest.raises(ValueError, match="shard 0/1"):
        PromptStream(ROWS, seed=1).shard(1, 2).load_state_dict(state)


def test_shards_are_disjoint_and_cover_the_global_order() -> None:
    g = PromptStream(ROWS, seed=6)
    g.take(2)
    shards = [g.shard(i, 3) for i in range(3)]
    drawn = [[x.index for x in s.take(6)] for s in shards]
    assert drawn[0] == [3, 6, 9, 12, 15, 18] and drawn[1] == [4, 7, 10, 13, 16, 19]
    flat = sorted(k for d in drawn for k in d)
    assert flat == list(range(2, 20))  # disjoint, no gaps, continuing the global cursor
    ref = PromptStream(ROWS, seed=6)
    assert {x.index: x.row_index for x in ref.take(20)}[10] == shards[1].item(10).row_index
    with pytest.raises(ValueError, match="global"):
        shards[0].shard(0, 2)


def test_merge_then_reshard_with_another_count() -> None:
    g = PromptStream(ROWS, seed=2)
    shards = [g.shard(i, 2) for i in range(2)]
    served = [x.index for x in shards[0].take(5)] + [x.index for x in shards[1].take(2)]  # imbalance
    back = shards[0].take(1)[0]
    shards[0].put_back(back)  # its group was abandoned
    merged = merge_shard_states([json.loads(json.dumps(s.state_dict())) for s in shards])
    g2 = PromptStream(ROWS, seed=2)
    g2.load_state_dict(merged)
    new = [g2.shard(i, 3) for i in range(3)]
    later = [x.index for s in new for x in s.take(4)]
    # 0..9 served by shard 0 (0,2,4,6,8; 10 put back) and shard 1 (1,3): next are 10 (put back), 5, 7, 9, 11..
    assert sorted(served + later)[: len(served) + 3] == list(range(len(served) + 3))
    assert len(set(served + later)) == len(served + later)
    with pytest.raises(ValueError, match="all 2 shards"):
        merge_shard_states([shards[0].state_dict()])


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    script=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.booleans()), min_size=1, max_size=12),
)
def test_no_draw_skipped_or_repeated_across_reshards(counts: list[int], script: list[tuple[int, int, bool]]) -> None:
    """Random phases: shard into `count`, let shards draw unevenly (sometimes putting the last draw
    back), merge, repeat; finally drain. Served multiset == {0..K-1} exactly once each."""
    rows = ROWS[:5]
    served: list[int] = []
    state = PromptStream(rows, seed=11).state_dict()
    for phase, count in enumerate(counts):
        g = PromptStream(rows, seed=11)
        g.load_state_dict(state)
        shards = [g.shard(i, count) for i in range(count)]
        for shard_i, n, put_back in script[phase::len(counts)] or script:
            s = shards[shard_i % count]
            items = s.take(n)
            if put_back and items:
                s.put_back(items[-1])
                items = items[:-1]
            served.extend(x.index for x in items)
        state = merge_shard_states([json.loads(json.dumps(s.state_dict())) for s in shards])
    g = PromptStream(rows, seed=11)
    g.load_state_dict(state)
    for _ in range(100):  # drain until the served set has no holes (put-backs come first)
        if sorted(served) == list(range(len(served))):
            break
        served.append(g.next().index)
    assert len(served) == len(set(served))  # nothing repeated
    assert sorted(served) == list(range(len(served)))  # nothing skipped


def test_stream_uses_data_config_for_messages() -> None:
    s = PromptStream(ROWS, seed=1, cfg=DataConfig(system_prompt="sys", format_prompt="r1v"))
    m = s.next().messages
    assert m[0] == {"role": "system", "content": "sys"} and "A conversation between User and Assistant" in m[1]["content"]
