"""A periodic checkpoint taken while rollouts keep running: the buffer snapshot and the data cursor
are taken at two different moments, yet resuming from the pair trains every prompt exactly once.
Real ZeroMQ buffer server and producer threads pushing through real clients; the coordinator is the
plain class the job runs as a Ray actor; the "learner" drains batches."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from asyncrl.config import BufferConfig, DataConfig
from asyncrl.job.coordinator import Coordinator
from asyncrl.replay import BufferClient, ReplayBufferServer
from asyncrl.replay.synthetic import synthetic_group

pytestmark = pytest.mark.integration
ROWS = [{"problem": f"Compute {i} + 1.", "answer": str(i + 1)} for i in range(1000)]
CFG = DataConfig(shuffle=False).model_dump_json()


def producer(c: Coordinator, lock: threading.Lock, address: str, name: str, stop: threading.Event,
             secret: str) -> None:
    rng = np.random.default_rng(hash(name) % 2**32)
    with BufferClient(address, secret=secret, actor_id=name, reply_grace_s=10.0) as client:
        while not stop.is_set():
            ticket = client.acquire_ticket(0.2)
            if ticket is None:
                continue
            with lock:
                item = c.next_prompt(name)
            g = synthetic_group(rng, prompt_uid=item["uid"], version=0, n=2, min_tokens=8, max_tokens=8)
            g.metadata["prompt_index"] = item["index"]
            time.sleep(rng.uniform(0, 0.003))  # generation
            client.push(g, ticket)
            time.sleep(rng.uniform(0, 0.003))  # the gap between the acknowledgement and `complete`
            with lock:
                c.complete(item["index"])


def test_checkpoint_pair_is_consistent_while_rollouts_run(tmp_path: Path) -> None:
    buffer_cfg = BufferConfig(max_staleness=10**6)
    server = ReplayBufferServer(buffer_cfg, batch_size=4)
    address = server.start()
    c, lock, stop = Coordinator(ROWS, CFG), threading.Lock(), threading.Event()
    threads = [threading.Thread(target=producer, args=(c, lock, address, f"r{i}", stop, buffer_cfg.secret)) for i in range(3)]
    for t in threads:
        t.start()
    learner = BufferClient(address, secret=buffer_cfg.secret, actor_id="learner")
    trained: list[int] = []
    try:
        for _ in range(5):  # learner steps before the checkpoint
            batch = learner.get_batch(4, 0, timeout_s=10)
            trained += [g.metadata["prompt_index"] for g in batch]
            with lock:
                c.trained([g.metadata["prompt_index"] for g in batch])
        while server.stats()["buffer/size_groups"] < 4:  # let groups accumulate
            time.sleep(0.05)
        snap = tmp_path / "groups.snapshot"
        indices = server.snapshot(str(snap), with_indices=True)
        time.sleep(0.05)  # rollouts go on between the two halves of the checkpoint
        with lock:
            cursor = c.cursor_state(indices)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        learner.close()
        server.stop()
    assert indices, "the snapshot should hold groups (rollouts were running)"
    # resume: a fresh buffer from the snapshot, a fresh coordinator from the cursor
    resumed = ReplayBufferServer(BufferConfig(max_staleness=10**6), batch_size=4)
    resumed.restore(str(snap))
    r = Coordinator(ROWS, CFG, stream_state=cursor["stream"], reissue=cursor["reissue"], buffered=cursor["buffered"])
    in_snapshot = resumed.prompt_indices()
    reissued = [r.next_prompt("r0")["index"] for _ in range(len(cursor["reissue"]))]
    everything = trained + in_snapshot + reissued
    stream = cursor["stream"]
    drawn = set(range(stream["cursor"]))  # every prompt issued before the checkpoint (draws 0..cursor-1)
    assert len(everything) == len(set(everything)), "a prompt would be trained twice"
    assert set(everything) == drawn, f"skipped: {sorted(drawn - set(everything))}"
    assert r.next_prompt("r0")["index"] == stream["cursor"]  # then the stream continues
