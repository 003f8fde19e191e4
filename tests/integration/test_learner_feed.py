"""Two DeepSpeed learner ranks (Ray actors, CPU/gloo) take a step's groups from the real ZeroMQ
buffer through rank 0's feed: the driver (this process) gets metadata only and encodes or decodes
no sample frame while rank 0 fetches, and ranks 1.. read the frames from rank 0's object-store
copy; the step equals the one trained on the same groups handed over by the caller."""

from __future__ import annotations

import time
import uuid

import pytest

from asyncrl.bench.learner import build_tiny_qwen2, synthetic_groups
from asyncrl.config import BufferConfig, load_config
from asyncrl.protocol import codec_counts
from asyncrl.replay import BufferClient, ReplayBufferServer

ray = pytest.importorskip("ray")
import learner_probe as lp  # noqa: E402 - after the skip

pytestmark = pytest.mark.integration


def test_two_ranks_train_fetched_batch_without_driver_bytes(tmp_path) -> None:
    from asyncrl.learner.group import LearnerGroup

    model = str(build_tiny_qwen2(tmp_path / "policy"))
    items = {"model.path": model, "trainer.run_dir": str(tmp_path / "runs"), "learner.optim.lr": 1e-3,
             "learner.cpu_ranks": 2, "learner.zero_stage": 1, "learner.cpus_per_rank": 0.5,
             "cluster.startup_timeout_s": 240, "learner.batch_timeout_s": 240, "learner.micro_batch_tokens": 48}
    cfg = load_config(None, [f"{k}={v}" for k, v in items.items()])
    groups = synthetic_groups(3, 4, 99, (3, 9), (4, 14), seed=5)
    for i, g in enumerate(groups):
        g.metadata["prompt_index"] = i
    server = ReplayBufferServer(BufferConfig(max_staleness=1, secret=cfg.buffer.secret), batch_size=3)
    producer = BufferClient(server.start(), secret=cfg.buffer.secret, actor_id="rollout-0", reply_grace_s=10.0)
    ray.init(num_cpus=4, include_dashboard=False, namespace=f"test-feed-{uuid.uuid4().hex[:8]}", log_to_driver=False)
    learner = None
    try:
        learner = LearnerGroup(cfg)
        for g in groups:
            assert producer.push(g).status == "stored"
        before = codec_counts()
        metas, end = [], time.monotonic() + 60
        while len(metas) < 3 and time.monotonic() < end:
            metas += learner.fetch(server.address, 3 - len(metas), 0, 10.0)
        assert sorted(m["prompt_index"] for m in metas) == [0, 1, 2]
        metas.sort(key=lambda m: m["prompt_index"])
        fetched = learner.train_fetched([m["id"] for m in metas])
        assert codec_counts() == before  # no sample frame through this process
        assert fetched["train/version"] == 1 and fetched["train/num_samples"] == 12
        lp.reconfigure(learner, cfg)  # the same initial weights again
        direct = lp.step(learner, groups)
        for key in ("loss/pg", "train/grad_norm", "train/mismatch_kl", "train/reward_mean"):
            if key in direct:
                assert fetched[key] == pytest.approx(direct[key], rel=1e-5, abs=1e-7), key
    finally:
        if learner is not None:
            learner.shutdown()
        ray.shutdown()
        producer.close()
        server.stop()
