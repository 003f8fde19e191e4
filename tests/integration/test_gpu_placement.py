"""Job-level GPU set-up on a real two-node Ray cluster without GPUs: `ray.cluster_utils.Cluster`
runs two raylets on this machine (two Ray nodes, each its own resources: Ray accepts `num_gpus`
as a logical resource on a CPU node). Lighter than the namespace cluster of test_multinode.py
(no network isolation, which nothing here needs: placement and environments are Ray's).

Proves:
- the learner's placement group, reserved before the rollout actors (as `build_topology` does),
  gets all its ranks on one node (STRICT_PACK) and the engines take the other node. Reserved after
  them (the old order) the outcome is Ray's to choose: here Ray 2.60 packed the four one-GPU
  engines on one node and the late PACK learner still fitted on the other; when the engines have
  spread, the learner is split (checked when it happens), and nothing prevented it before;
- the job's one NCCL_CUMEM_ENABLE reaches every process before it could create a communicator:
  a plain actor (a rollout actor), an actor with its own runtime_env (a learner rank, whose env
  carries it too) and a process that actor spawns (vLLM's engine core), on both nodes;
- version 0 is in the WeightStore once the topology's start-up publish ran (`publish_initial_weights`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    from asyncrl.cluster import job_runtime_env
    from asyncrl.config import Config

    os.environ["NCCL_CUMEM_ENABLE"] = "1"  # the launcher's value: the job must carry it everywhere
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 4, "resources": {"node_a": 1}})
    cluster.add_node(num_cpus=2, num_gpus=4, resources={"node_b": 1})
    namespace = f"test-gpu-placement-{uuid.uuid4().hex[:8]}"
    ray.init(address=cluster.address, namespace=namespace, runtime_env=job_runtime_env(Config()), log_to_driver=False)
    try:
        yield namespace
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop("NCCL_CUMEM_ENABLE", None)


def _cfg():
    from asyncrl.config import load_config

    return load_config(None, ["learner.num_gpus=4", "learner.cpus_per_rank=0.25", "rollout.num_actors=4",
                              "rollout.gpus_per_actor=1", "cluster.startup_timeout_s=60"])


@ray.remote(num_cpus=0, num_gpus=1)
class Engine:
    """Stand-in for a rollout actor's resource demand (1 GPU, default scheduling, as the fleet)."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def env(self) -> dict[str, str | None]:
        child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('NCCL_CUMEM_ENABLE'))"],
                               capture_output=True, text=True, timeout=60).stdout.strip()
        return {"actor": os.environ.get("NCCL_CUMEM_ENABLE"), "spawned": child}


def _bundle_nodes(pg) -> list[str]:
    from ray.util.placement_group import placement_group_table

    return list(placement_group_table(pg)["bundles_to_node_id"].values())


def test_learner_reserved_first_stays_on_one_node_and_engines_take_the_other(two_nodes):
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    from asyncrl.learner.group import rank_bundles, reserve_placement

    cfg = _cfg()
    pg = reserve_placement(cfg)  # what build_topology does before the fleet starts
    engines = [Engine.remote() for _ in range(4)]
    try:
        learner_nodes = _bundle_nodes(pg)
        engine_nodes = ray.get([e.node.remote() for e in engines], timeout=60)
        print(f"\nreserved first: learner ranks on {learner_nodes}, engines on {engine_nodes}")
        assert placement_group_table(pg)["strategy"] == "STRICT_PACK"
        assert len(set(learner_nodes)) == 1 and len(learner_nodes) == 4
        assert set(engine_nodes).isdisjoint(learner_nodes)
    finally:
        for e in engines:
            ray.kill(e)
        remove_placement_group(pg)

    # the old order: engines first (Ray's default policy spreads them), then the learner with PACK
    engines = [Engine.remote() for _ in range(4)]
    try:
        engine_nodes = ray.get([e.node.remote() for e in engines], timeout=60)
        late = placement_group(rank_bundles(cfg), strategy="PACK")
        ray.get(late.ready(), timeout=60)
        print(f"engines first: engines on {engine_nodes}, learner ranks on {_bundle_nodes(late)}")
        if len(set(engine_nodes)) > 1:  # spread: the learner cannot be whole on either node
            assert len(set(_bundle_nodes(late))) == 2
        remove_placement_group(late)
    finally:
        for e in engines:
            ray.kill(e)


def test_one_cumem_value_reaches_every_process(two_nodes):
    from asyncrl.learner.group import rank_env

    cfg = _cfg()
    plain = [Engine.options(num_gpus=0, resources={node: 0.1}).remote() for node in ("node_a", "node_b")]
    own_env = [Engine.options(num_gpus=0, resources={node: 0.1}, runtime_env={"env_vars": rank_env(cfg)}).remote()
               for node in ("node_a", "node_b")]
    seen = ray.get([a.env.remote() for a in plain + own_env], timeout=120)
    print(f"\nNCCL_CUMEM_ENABLE seen: {seen}")
    assert seen == [{"actor": "1", "spawned": "1"}] * 4


def test_version_zero_is_published_at_start_up(two_nodes):
    from types import SimpleNamespace

    from asyncrl.job.topology import publish_initial_weights
    from asyncrl.weights.sender import WeightSender
    from asyncrl.weights.store import fetch_weights, start_weight_store

    store = start_weight_store(two_nodes)
    weights = {"model.embed_tokens.weight": torch.randn(50, 8), "model.norm.weight": torch.randn(8)}

    class Learner:  # rank 0's broadcast_weights with no members yet, as in a job's start-up
        def broadcast_weights(self) -> dict:
            sender = WeightSender(SimpleNamespace(bucket_mb=1.0, backend="gloo", timeout_s=10.0, host="127.0.0.1"),
                                  publish=True)
            try:
                return sender.broadcast(weights.items(), 0).as_dict()
            finally:
                sender.close()  # waits for the background publish

    try:
        assert fetch_weights(min_version=-1) is None  # nothing before the start-up publish
        report = publish_initial_weights(Learner())
        assert report["published"] and report["members"] == []
        version, buckets = fetch_weights(min_version=-1)
        from asyncrl.weights.wire import unpack_bucket

        got = {n: t for m, f in buckets for n, t in unpack_bucket(m, f)}
        assert version == 0 and all(torch.equal(got[k], v) for k, v in weights.items())
    finally:
        store.shutdown()
