"""Learner batching: groups flatten into response-aligned tensors; mini-batches keep whole groups;
rank shards and micro-batches cover every sample exactly once; micro-batches respect the token
budget and the sequence cap; re-splitting to a larger (synchronised) count keeps coverage and
yields dummy slots; collate puts prompt/response tokens where the learner's logits slice expects
them (response starts at column Pm of every row)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.learner.batching import (
    balance_into,
    collate,
    flatten_groups,
    plan_micro_batches,
    shard_indices,
    split_mini_batches,
)
from asyncrl.protocol import Group, Sample


def _group(uid: str, prompt: list[int], responses: list[list[int]], rewards: list[float]) -> Group:
    samples = []
    for i, (r, rew) in enumerate(zip(responses, rewards)):
        mask = np.ones(len(r), dtype=np.int8)
        mask[0] = 0  # first response token untrained (e.g. a guidance token)
        samples.append(Sample(uid=f"{uid}-{i}", prompt_uid=uid, prompt_ids=np.array(prompt, np.int32),
                              response_ids=np.array(r, np.int32), response_mask=mask,
                              behaviour_logprobs=np.where(mask == 1, -1.5, 0.0).astype(np.float32),
                              token_versions=np.where(mask == 1, 3, -1).astype(np.int32), reward=rew))
    return Group.from_samples(samples)


@pytest.fixture
def groups() -> list[Group]:
    rng = np.random.default_rng(0)
    out = []
    for g in range(5):
        prompt = list(rng.integers(3, 50, size=int(rng.integers(2, 9))))
        responses = [list(rng.integers(3, 50, size=int(rng.integers(2, 15)))) for _ in range(4)]
        out.append(_group(f"p{g}", prompt, responses, [float(i % 2) for i in range(4)]))
    return out


def test_flatten_layout(groups: list[Group]) -> None:
    flat = flatten_groups(groups)
    assert flat.num_samples == 20
    assert flat.group_index.tolist() == [g for g in range(5) for _ in range(4)]
    t = max(len(s.response_ids) for g in groups for s in g.samples)
    assert flat.response_mask.shape == (20, t)
    s = groups[1].samples[2]
    row = 6
    k = len(s.response_ids)
    assert flat.response_mask[row, :k].tolist() == [0.0] + [1.0] * (k - 1)
    assert flat.response_mask[row, k:].sum() == 0
    assert flat.behaviour_logprobs[row, 1:k].eq(-1.5).all()
    assert flat.token_versions[row, k:].eq(-1).all()
    assert flat.rewards[row] == 0.0 and flat.rewards[7] == 1.0


def test_mini_batches_keep_groups(groups: list[Group]) -> None:
    minis = split_mini_batches([4] * 5, 2)
    assert [m.tolist() for m in minis] == [list(range(12)), list(range(12, 20))]  # groups 0-2 | 3-4
    assert len(split_mini_batches([4] * 5, 9)) == 5  # never more mini-batches than groups


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_and_micro_batches_cover_once(groups: list[Group], world: int) -> None:
    flat = flatten_groups(groups)
    plen, rlen = flat.prompt_lengths, flat.response_lengths
    rows = np.arange(flat.num_samples)
    seen: list[int] = []
    loads = []
    for rank in range(world):
        mine = shard_indices(rows, plen + rlen, world, rank)
        loads.append(int((plen + rlen)[mine].sum()))
        plan = plan_micro_batches(mine, plen, rlen, token_budget=40, max_seqs=3)
        for mb in plan:
            assert len(mb) <= 3
            cost = len(mb) * (plen[mb].max() + rlen[mb].max())
            assert cost <= 40 or len(mb) == 1  # a single over-budget sample gets its own micro-batch
        seen += [i for mb in plan for i in mb]
    assert sorted(seen) == rows.tolist()
    # greedy longest-first balancing: loads differ by at most the longest sample
    assert max(loads) - min(loads) <= int((plen + rlen).max())


def test_balance_into_larger_count(groups: list[Group]) -> None:
    flat = flatten_groups(groups)
    plen, rlen = flat.prompt_lengths, flat.response_lengths
    bins = balance_into(np.arange(3), plen, rlen, 5)
    assert len(bins) == 5 and sorted(i for b in bins for i in b) == [0, 1, 2]
    assert sum(1 for b in bins if not b) == 2  # two dummy slots


def test_collate_positions_and_dummy(groups: list[Group]) -> None:
    flat = flatten_groups(groups)
    rows = [0, 5, 9]
    mb = collate(flat, rows, pad_id=0)
    pm = max(len(flat.prompt_ids[i]) for i in rows)
    tm = max(len(flat.response_ids[i]) for i in rows)
    assert mb.input_ids.shape == (3, pm + tm) and mb.response_len == tm
    for j, i in enumerate(rows):
        p, r = flat.prompt_ids[i], flat.response_ids[i]
        assert mb.input_ids[j, pm - len(p):pm].tolist() == p.tolist()  # prompt left-padded up to column Pm
        assert mb.input_ids[j, pm:pm + len(r)].tolist() == r.tolist()  # response starts at column Pm
        assert mb.attention_mask[j].sum() == len(p) + len(r)
        # positions count real tokens only: first prompt token at 0, first response token at len(p)
        assert mb.position_ids[j, pm - len(p)] == 0 and mb.position_ids[j, pm] == len(p)
    # labels the learner uses: the last Tm columns = response tokens
    assert torch.equal(mb.input_ids[0, -tm:][: len(flat.response_ids[0])], torch.from_numpy(flat.response_ids[0]))
    assert torch.equal(mb.response_mask, flat.response_mask[rows, :tm])
    assert mb.num_tokens == int(flat.response_mask[rows].sum())
    dummy = collate(flat, [], pad_id=0)
    assert dummy.is_dummy and dummy.num_tokens == 0 and dummy.response_len == 1
