"""The buffer's generated vs delivered vs dropped counts by difficulty and length (asyncrl.replay.mix):
buckets by hand, every kind counted once through the real BufferState rules (ingest, stale drop at
ingest and on a version change, the filter, delivery, requeue), and the counts survive a restart
from the durable header."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.protocol import Group, Sample, encode
from asyncrl.replay.mix import GroupMix, difficulty_bucket, power_bin
from asyncrl.replay.state import BufferState


def group(version: int, *, steps: int | None = None, policy_tokens: int = 20, prompt_tokens: int = 40,
          reward: float = 1.0, uid: str = "p") -> tuple[Group, bytes]:
    """Two samples, each with `policy_tokens` trained tokens after 4 untrained (verifier) tokens."""
    samples = []
    for i in range(2):
        mask = np.array([0] * 4 + [1] * policy_tokens, dtype=np.int8)
        samples.append(Sample(uid=f"{uid}/{i}", prompt_uid=uid, prompt_ids=np.zeros(prompt_tokens, np.int32),
                              response_ids=np.zeros(mask.size, np.int32), response_mask=mask,
                              behaviour_logprobs=np.zeros(mask.size, np.float32),
                              token_versions=np.where(mask == 1, version, -1).astype(np.int32),
                              reward=reward, reward_parts={"overall": reward}))
    meta = {"prompt_index": 0} if steps is None else {"prompt_index": 0, "num_steps": steps}
    g = Group.from_samples(samples, metadata=meta)
    return g, encode(g)


def test_bins_and_buckets_by_hand() -> None:
    assert power_bin(0) == "0-15" and power_bin(15.9) == "0-15"
    assert power_bin(16) == "16-31" and power_bin(63) == "32-63" and power_bin(64) == "64-127"
    assert difficulty_bucket(group(0, steps=3)[0]) == "steps3"
    # no step count: the prompt's 40 tokens fall in 32-63
    assert difficulty_bucket(group(0, prompt_tokens=40)[0]) == "prompt32-63"


def test_every_kind_is_counted_once_through_the_buffer_rules() -> None:
    st = BufferState(max_staleness=1, batch_size=2, capacity_groups=100, capacity_bytes=10**9,
                     filter_enable=True, filter_key="overall", filter_low=0.01, filter_high=0.99)
    st.set_version(2)
    assert st.ingest(*group(0, steps=4, policy_tokens=100, reward=0.5)) == "stale"     # 2 - 0 > 1
    assert st.ingest(*group(2, steps=1, policy_tokens=10, reward=1.0)) == "filtered"   # mean 1.0 >= 0.99
    for steps, tokens in ((2, 20), (3, 40), (4, 70)):
        assert st.ingest(*group(2, steps=steps, policy_tokens=tokens, reward=0.5)) == "stored"
    delivered = st.take(1)  # oldest first, then arrival: the steps2 group
    st.requeue(delivered)   # not sent: the delivery is taken back
    assert len(st.take(1)) == 1
    st.set_version(4)       # the two still buffered (version 2) go stale
    m = st.stats()
    # generated: all five pushes; stale: steps4 at ingest + steps3, steps4 on the version change
    assert {k: v for k, v in m.items() if k.startswith("buffer/mix/generated/difficulty/")} == {
        "buffer/mix/generated/difficulty/steps1": 1.0, "buffer/mix/generated/difficulty/steps2": 1.0,
        "buffer/mix/generated/difficulty/steps3": 1.0, "buffer/mix/generated/difficulty/steps4": 2.0}
    assert m["buffer/mix/delivered/difficulty/steps2"] == 1.0
    assert "buffer/mix/delivered/difficulty/steps3" not in m
    assert m["buffer/mix/dropped_stale/difficulty/steps4"] == 2.0 and m["buffer/mix/dropped_stale/difficulty/steps3"] == 1.0
    assert m["buffer/mix/dropped_filtered/difficulty/steps1"] == 1.0
    # lengths (policy tokens per sample): generated 100, 10, 20, 40, 70 -> mean 48; bins 64-127 holds 100 and 70
    assert m["buffer/mix/generated/len_mean"] == pytest.approx(48.0)
    assert m["buffer/mix/generated/length/64-127"] == 2.0 and m["buffer/mix/generated/length/0-15"] == 1.0
    assert m["buffer/mix/delivered/len_mean"] == pytest.approx(20.0)   # the requeue took one 20 back
    assert m["buffer/mix/dropped_stale/len_mean"] == pytest.approx((100 + 40 + 70) / 3)


def test_counts_survive_a_restart_from_the_durable_header() -> None:
    kw = dict(max_staleness=1, batch_size=2, capacity_groups=100, capacity_bytes=10**9)
    st = BufferState(**kw)
    st.ingest(*group(0, steps=2))
    st.ingest(*group(0, steps=3))
    st.take(1)
    header = st.durable_header()
    stored = [(st.group_meta(sg), sg.blob) for sg in st.groups()]
    again = BufferState(**kw)
    again.recover(header, stored)
    def mix(state: BufferState) -> dict[str, float]:
        return {k: v for k, v in state.stats().items() if k.startswith("buffer/mix/")}

    assert mix(again) == mix(st) and mix(st)["buffer/mix/delivered/difficulty/steps2"] == 1.0
    # the group still buffered kept its bucket: delivering it now counts it under steps3
    again.take(1)
    assert again.stats()["buffer/mix/delivered/difficulty/steps3"] == 1.0


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown group kind 'trained'"):
        GroupMix().add("trained", "steps1", 3.0)
