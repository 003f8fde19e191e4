"""Learner rank 0's `BatchFeed` against the real ZeroMQ buffer: it receives the very frames the
producer pushed (byte for byte; the client neither decodes nor re-encodes), reports per-group
metadata that matches the groups, trains only the groups the driver names, and its prefetch for
the next version obeys that version's staleness bound without advancing admission until the
learner reaches it; groups a finished prefetch brought are listed as held (not lost)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from replay_procs import indexed_group

from asyncrl.config import BufferConfig
from asyncrl.learner.feed import BatchFeed
from asyncrl.protocol import encode
from asyncrl.replay import BufferClient, ReplayBufferServer

pytestmark = pytest.mark.integration
RNG = np.random.default_rng(0)


def group(index: int, version: int):
    return indexed_group(RNG, index, version, tokens=8)


def test_feed_fetch_take_and_prefetch() -> None:
    cfg = BufferConfig(max_staleness=1)
    server = ReplayBufferServer(cfg, batch_size=2)
    producer = BufferClient(server.start(), secret=cfg.secret, actor_id="rollout-0", reply_grace_s=5.0)
    feed = BatchFeed(server.address, secret=cfg.secret)
    try:
        groups = [group(i, 0) for i in range(2)]
        for g in groups:
            assert producer.push(g, producer.acquire_ticket(1.0)).status == "stored"
        metas = feed.fetch(2, 0, timeout_s=5.0)
        assert [m["prompt_index"] for m in metas] == [0, 1]
        assert metas[0]["tokens"] == [int(s.response_mask.sum()) for s in groups[0].samples]
        assert metas[0]["rewards"] == [s.reward for s in groups[0].samples]
        assert metas[0]["min_version"] == 0 and metas[0]["bytes"] == len(encode(groups[0]))
        frames, batch = feed.take([metas[1]["id"]])  # the driver keeps prompt 1 only
        assert frames == [encode(groups[1])]  # the producer's frame, byte for byte
        assert [g.prompt_uid for g in batch] == ["p/1"] and feed.held == 0
        # Prefetch for v1 while "step 0 trains": admission stays at v0's limit (0 + 1 + 1) * 2 = 4
        feed.start_prefetch(2, 1, timeout_s=10.0)
        time.sleep(0.2)
        assert server.stats()["buffer/admission_limit"] == 4
        for i in (2, 3):  # slots 3 and 4 of v0's limit: engines still at v0 -> lag 1 at v1
            assert producer.push(group(i, 0), producer.acquire_ticket(1.0)).status == "stored"
        end = time.monotonic() + 10
        while feed.held_prompts() != [2, 3] and time.monotonic() < end:
            time.sleep(0.05)
        assert feed.held_prompts() == [2, 3]  # brought by the prefetch, not yet trained
        metas = feed.fetch(2, 1, timeout_s=5.0)
        assert [m["prompt_index"] for m in metas] == [2, 3]
        assert server.stats()["buffer/admission_limit"] == 6  # the learner reached v1: (1 + 1 + 1) * 2
        assert [g.prompt_uid for g in feed.take([m["id"] for m in metas])[1]] == ["p/2", "p/3"]
    finally:
        feed.close()
        producer.close()
        server.stop()
