"""The listener address rule (asyncrl.addresses) and the launcher's cluster checks (asyncrl.cluster)
on hand-written node descriptions: placement shortages name the roles and the counts, /dev/shm is
checked only where an engine or a learner rank can run, a wildcard is never advertised, and a
taken port fails with a message naming the listener."""

from __future__ import annotations

import socket

import pytest

from asyncrl.addresses import (
    bind_and_advertise,
    bind_first,
    candidate_ports,
    insecure_listeners,
    resolve_hosts,
)
from asyncrl.cluster import interface_problems, resource_problems, shm_problems
from asyncrl.config import ConfigError, load_config


def node(cpu: float, gpu: float = 0, shm_gb: float = 8, ip: str = "10.0.0.1", **custom: float) -> dict:
    return {"Alive": True, "NodeID": ip, "Resources": {"CPU": cpu, "GPU": gpu, **custom}, "ip": ip,
            "resources": {"CPU": cpu, "GPU": gpu, **custom}, "shm_bytes": int(shm_gb * 2**30),
            "interfaces": ["lo", "eth0"]}


def test_auto_hosts_are_loopback_embedded_and_node_when_joined() -> None:
    embedded = load_config("configs/quickstart.yaml")
    resolve_hosts(embedded)
    assert (embedded.buffer.host, embedded.learner.weights.host, embedded.verifier.host) == ("127.0.0.1",) * 3
    assert insecure_listeners(embedded) == []
    joined = load_config("configs/quickstart.yaml", ["cluster.ray_address=10.0.0.1:6379", "buffer.host=0.0.0.0"])
    resolve_hosts(joined)
    assert (joined.buffer.host, joined.learner.weights.host, joined.verifier.host) == ("0.0.0.0", "node", "node")
    lines = insecure_listeners(joined)
    assert len(lines) == 3 and "CurveZMQ" in lines[0] and "TCPStore" in lines[1] and "api_key" in lines[2]


def test_a_wildcard_is_bound_but_never_advertised() -> None:
    bind, advertise = bind_and_advertise("0.0.0.0")
    assert bind == "0.0.0.0" and advertise == "127.0.0.1"  # no Ray here: the node is this process's loopback
    assert bind_and_advertise("auto") == ("127.0.0.1", "127.0.0.1")
    assert bind_and_advertise("10.1.2.3") == ("10.1.2.3", "10.1.2.3")


def test_port_range_and_a_taken_port() -> None:
    assert candidate_ports(0, "20000-20002") == [20000, 20001, 20002]
    assert candidate_ports(5555, "20000-20002") == [5555]
    assert candidate_ports(0, None) == [0]
    with pytest.raises(ConfigError, match="cluster.port_range"):
        load_config(None, ["cluster.port_range=9-1"])
    with pytest.raises(ConfigError, match="cluster.resources.learnr: unknown role"):
        load_config(None, ["cluster.resources.learnr.x=1"])
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]

        def bind(p: int) -> int:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
                return p

        with pytest.raises(OSError, match=rf"replay buffer: cannot listen on 127.0.0.1:{port}"):
            bind_first([port], bind, "replay buffer", "127.0.0.1")


def test_placement_names_the_roles_and_the_shortage() -> None:
    cfg = load_config("configs/qwen3_14b_dapo.yaml", ["cluster.ray_address=h:6379"])
    # learner 8 GPUs + rollout 4 actors x TP2 = 16 GPUs; two CPU-only nodes have none.
    problems = resource_problems(cfg, [node(4), node(2, ip="10.0.0.2")], "h:6379")
    assert problems[0] == "needs 16 GPUs (learner 8 + rollout 8) on the cluster at h:6379, cluster has 0"
    assert any("no node of the cluster at h:6379 can host one rollout" in p for p in problems)
    # 2 x 8 GPUs: feasible by totals and per unit.
    assert resource_problems(cfg, [node(64, 8), node(64, 8, ip="10.0.0.2")], "h:6379") == []
    pinned = load_config("configs/quickstart.yaml", ["cluster.resources.rollout.node_b=0.01", "rollout.num_actors=2"])
    problems = resource_problems(pinned, [node(4, node_a=1)], "embedded")
    assert problems[0].startswith("needs 0.02 of resource 'node_b' (rollout 0.02)")
    assert "cluster.resources.rollout" in problems[1]
    assert resource_problems(pinned, [node(4, node_a=1), node(2, node_b=1, ip="10.0.0.2")], "x") == []


def test_shm_is_checked_where_engines_or_learner_ranks_can_run() -> None:
    cfg = load_config("configs/qwen3_14b_dapo.yaml", ["cluster.ray_address=h:6379"])
    probes = [node(8, 0, shm_gb=0.0625, ip="10.0.0.1"), node(64, 8, shm_gb=0.0625, ip="10.0.0.2")]
    problems = shm_problems(cfg, probes)  # the CPU-only head hosts neither an engine nor a rank
    assert len(problems) == 1 and problems[0].startswith("node 10.0.0.2: /dev/shm is 64 MiB")
    assert "emptyDir" in problems[0]
    assert shm_problems(cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"min_shm_gb": 0})}),
                        probes) == []


def test_shm_minimum_follows_the_weight_store_of_the_model(tmp_path) -> None:
    # Qwen2.5-0.5B's dimensions, fp32 learner (CPU): params = 151936*896 (tied) + 24 layers *
    # (attention 896*14*64*2 + 896*2*64*2 + MLP 3*896*4864) = 136.1M + 24*15.4M = 0.494e9;
    # a version = 4 B each = 1.98 GB; the store's node: 2 versions + 2 chunks of 256 MiB = 4.19 GiB
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}))
    from asyncrl.cluster import weight_store_shm_bytes

    cfg = load_config(None, [f"model.path={tmp_path}", "cluster.min_shm_gb=1"])
    need = weight_store_shm_bytes(cfg)
    assert 4.1 * 2**30 < need < 4.3 * 2**30, need / 2**30
    problems = shm_problems(cfg, [node(4, shm_gb=2)])  # 2 GiB would pass the flat 1 GiB minimum
    assert len(problems) == 1 and "weight store's 4.1" in problems[0]
    assert shm_problems(cfg, [node(4, shm_gb=4.5)]) == []
    assert weight_store_shm_bytes(load_config(None, ["model.path=/nonexistent"])) == 0  # not local: min_shm_gb


def test_interface_must_exist_on_every_node() -> None:
    cfg = load_config(None, ["cluster.network_interface=ib0"])
    problems = interface_problems(cfg, [node(2), node(2, ip="10.0.0.2")])
    assert len(problems) == 2 and "no interface 'ib0'" in problems[0]
    assert interface_problems(load_config(None, ["cluster.network_interface=eth"]), [node(2)]) == []


def test_model_paths_are_resolved_once_for_every_role(tmp_path, monkeypatch) -> None:
    from asyncrl.cluster import resolve_model_paths

    cfg = load_config("configs/quickstart.yaml", [f"cluster.model_dir={tmp_path}"])
    resolve_model_paths(cfg)
    assert cfg.model.path.startswith("/") and cfg.model.path.endswith("assets/tiny-policy")
    # A hub id already downloaded to cluster.model_dir is used from there, without the hub.
    (tmp_path / "org--model").mkdir()
    (tmp_path / "org--model" / "config.json").write_text("{}")
    hub = load_config(None, ["model.path=org/model", f"cluster.model_dir={tmp_path}"])
    resolve_model_paths(hub)
    assert hub.model.path == str(tmp_path / "org--model")
    # Offline and not there: one message naming the key, the id and the directory.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = load_config(None, ["model.path=org/absent", f"cluster.model_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"model.path='org/absent' is not a local directory and could not be "
                                         rf"downloaded to {tmp_path}/org--absent"):
        resolve_model_paths(missing)
