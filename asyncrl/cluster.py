"""What a job needs from its Ray cluster, checked before anything starts (launcher and doctor).

- `job_runtime_env(cfg)`: the job's code reaches every node through Ray's `runtime_env`
  (`py_modules` = this package, uploaded once to the cluster), never through a host path; the
  role environment (threads, offline hub, interface variables) goes with it.
- `resource_problems(cfg)`: what the config asks of the cluster (CPUs, GPUs and the custom
  resources of `cluster.resources`, in total and per unit on one node) against what the live
  nodes have; each shortage is one sentence naming the roles ("needs 16 GPUs (learner 4 +
  rollout 8 + verifier 4) on the cluster at ..., cluster has 0").
- `resolve_model_paths(cfg)`: model and tokenizer paths resolved once by the driver: a local
  directory becomes absolute, a hub id is downloaded once to `cluster.model_dir` (a directory
  every node reads); every role then gets the same resolved path.
- `probe_nodes()` / `shm_problems(cfg, probes)`: one zero-CPU task per alive node reports its
  IP, /dev/shm size, interfaces and interface variables; nodes that can host an engine or a
  learner rank must have /dev/shm for the weight store's versions of this model (at least
  `cluster.min_shm_gb`).
- `ray_init(cfg, namespace)`: join `cluster.ray_address`, or start the embedded single-host cluster
  (`embedded_ray_options`); the job, the doctor and verifier synthesis start Ray this one way.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from asyncrl.addresses import interface_env
from asyncrl.config import Config
from asyncrl.logs import verbose, worker_env
from asyncrl.startup import StartupError, check_reachable

GiB = 2**30


def job_runtime_env(cfg: Config) -> dict[str, Any]:
    from asyncrl.weights.nccl_env import job_nccl_env

    package = Path(__file__).resolve().parent
    env_vars = {
        "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        "VLLM_CPU_KVCACHE_SPACE": str(int(max(1, cfg.rollout.cpu_kvcache_gb))),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "PYTHONWARNINGS": "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        **interface_env(cfg),
        **job_nccl_env(),  # one value in every process before its first NCCL communicator
    }
    return {"py_modules": [str(package)], "excludes": ["__pycache__", "*.pyc"], "env_vars": env_vars,
            "worker_process_setup_hook": "asyncrl.small_machine.patches.worker_setup"}  # no pyarrow per process (small_machine.patches)


# ------------------------------------------------------------------------------------ resources
def role_demands(cfg: Config) -> list[tuple[str, int, dict[str, float]]]:
    """`(role, count, resources per unit)` the job will ask Ray for."""
    extra = cfg.cluster.resources
    lc, r, v = cfg.learner, cfg.rollout, cfg.verifier

    def unit(cpu: float, gpu: float, role: str) -> dict[str, float]:
        out = {"CPU": cpu, "GPU": gpu, **extra.get(role, {})}
        return {k: val for k, val in out.items() if val}

    replicas = v.autoscaling.min_replicas if v.autoscaling is not None else v.num_replicas
    return [
        ("learner", cfg.learner_world_size, unit(lc.cpus_per_rank, 1 if lc.num_gpus > 0 else 0, "learner")),
        ("rollout", r.num_actors, unit(r.cpus_per_actor, r.gpus_per_actor, "rollout")),
        ("verifier", replicas, unit(v.cpus_per_replica, v.gpus_per_replica, "verifier")),
        ("buffer", 1, unit(0, 0, "buffer")),
        ("coordinator", 1, unit(0, 0, "coordinator")),
    ]


def _fmt(x: float) -> str:
    return f"{x:g}"


def resource_problems(cfg: Config, nodes: list[dict[str, Any]], where: str) -> list[str]:
    """Shortages of the live `nodes` (ray.nodes()) for `cfg`; empty = placement is feasible by
    totals and every unit fits on some node (Ray's scheduler decides the rest)."""
    alive = [n for n in nodes if n.get("Alive")]
    total: dict[str, float] = {}
    for n in alive:
        for k, val in n.get("Resources", {}).items():
            total[k] = total.get(k, 0.0) + val
    need: dict[str, float] = {}
    parts: dict[str, list[str]] = {}
    problems = []
    for role, count, unit in role_demands(cfg):
        if count <= 0:
            continue
        for k, val in unit.items():
            need[k] = need.get(k, 0.0) + count * val
            parts.setdefault(k, []).append(f"{role} {_fmt(count * val)}")
        if unit and not any(all(n.get("Resources", {}).get(k, 0.0) >= val for k, val in unit.items()) for n in alive):
            shown = ", ".join(f"{k}={_fmt(val)}" for k, val in unit.items())
            problems.append(f"no node of the cluster at {where} can host one {role} ({shown}"
                            f"{'; cluster.resources.' + role if role in cfg.cluster.resources else ''})")
    for k, val in need.items():
        have = total.get(k, 0.0)
        if val > have + 1e-9:
            label = f"{k}s" if k in ("CPU", "GPU") else f"of resource {k!r}"
            problems.insert(0, f"needs {_fmt(val)} {label} ({' + '.join(parts[k])}) on the cluster at {where}, "
                               f"cluster has {_fmt(have)}")
    return problems


# ------------------------------------------------------------------------------------ model paths
def _hub_dir(cfg: Config, repo_id: str) -> Path:
    root = Path(cfg.cluster.model_dir or "~/.cache/asyncrl/models").expanduser()
    return root / repo_id.replace("/", "--")


def resolve_path(cfg: Config, key: str, value: str) -> str:
    """A local path -> absolute; a hub id -> its directory under `cluster.model_dir` (downloaded
    once here if missing). Raises ValueError naming the key when neither works, and for a hub id
    on a joined cluster (`cluster.ray_address`, possibly several nodes: this check runs before
    Ray starts) without `cluster.model_dir`: the default cache is on this node's disk only."""
    local = Path(value).expanduser()
    if local.exists():
        return str(local.resolve())
    if cfg.cluster.ray_address and not cfg.cluster.model_dir:
        raise ValueError(f"{key}={value!r} is a hub id and the job joins the cluster at {cfg.cluster.ray_address}, "
                         f"but cluster.model_dir is unset: it would be downloaded to {_hub_dir(cfg, value)} on "
                         "this node only, which the other nodes' engines and learner ranks cannot read; set "
                         "cluster.model_dir to a directory every node reads (on a one-node cluster the default, "
                         "~/.cache/asyncrl/models, is fine: set it explicitly)")
    dest = _hub_dir(cfg, value)
    if (dest / "config.json").exists() or (dest / "tokenizer_config.json").exists():
        return str(dest)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(value, local_dir=str(dest))
    except Exception as exc:  # noqa: BLE001 - offline, unknown id, no permission: one message for all
        raise ValueError(f"{key}={value!r} is not a local directory and could not be downloaded to {dest} "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); download it "
                         "there, or set cluster.model_dir to a directory every node can read") from None


def resolve_model_paths(cfg: Config) -> None:
    """Every model/tokenizer path of `cfg`, resolved once in place (see `resolve_path`)."""
    for section, key in (("model", "path"), ("model", "tokenizer_path")):
        value = getattr(getattr(cfg, section), key)
        if value:
            setattr(getattr(cfg, section), key, resolve_path(cfg, f"{section}.{key}", value))
    if cfg.verifier.backend == "vllm":
        for key in ("model_path", "tokenizer_path"):
            value = getattr(cfg.verifier, key)
            if value:
                setattr(cfg.verifier, key, resolve_path(cfg, f"verifier.{key}", value))
    fn = cfg.reward.function
    if ":" in fn and Path(fn.rsplit(":", 1)[0]).exists():  # a plug-in file: the actors' cwd differs
        path, name = fn.rsplit(":", 1)
        cfg.reward.function = f"{Path(path).resolve()}:{name}"


# ------------------------------------------------------------------------------------ node probes
def _probe() -> dict[str, Any]:
    import shutil
    import socket

    import ray

    try:
        shm = shutil.disk_usage("/dev/shm").total
    except OSError:
        shm = 0
    return {"ip": ray.util.get_node_ip_address(), "shm_bytes": shm,
            "interfaces": [name for _, name in socket.if_nameindex()],
            "env": {k: os.environ.get(k, "") for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "RAY_AUTH_MODE")}}


def probe_nodes(timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """One zero-CPU task pinned to each alive node; each result also carries the node's resources."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    task = ray.remote(num_cpus=0)(_probe)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in nodes]
    out = []
    for node, result in zip(nodes, ray.get(refs, timeout=timeout_s)):
        out.append({**result, "node_id": node["NodeID"], "resources": node.get("Resources", {})})
    return out


def probe_this_node() -> list[dict[str, Any]]:
    """`probe_nodes` for a cluster whose one node is the caller's (the embedded one): probed in
    this process, so no Ray worker process is started (and left idle) for the probe task."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    return [{**_probe(), "node_id": n["NodeID"], "resources": n.get("Resources", {})}
            for n in ray.nodes() if n.get("Alive") and n["NodeID"] == here]


def hosts_engine_or_learner(cfg: Config, resources: dict[str, float]) -> bool:
    for role, count, unit in role_demands(cfg):
        if role in ("learner", "rollout") and count > 0 and all(resources.get(k, 0.0) >= v for k, v in unit.items()):
            return True
    return False


def weight_store_shm_bytes(cfg: Config) -> int:
    """/dev/shm the weight sync needs on a node (0 when the model's config.json is not local yet):
    the WeightStore's versions of what is synced (`asyncrl.weights.store.shm_bytes_needed`: the
    newest + the next, and the chunks in transit; a fetching engine's node copies one version)."""
    import json
    from pathlib import Path

    from asyncrl.learner import memory as mem
    from asyncrl.weights.store import shm_bytes_needed

    path = Path(cfg.model.path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    config = config.get("text_config") or config
    try:
        params = float(mem.lora_params(config, cfg.model.lora.rank, cfg.model.lora.target_modules)) \
            if cfg.model.lora.enable else mem.shape_from_config(config).params
    except (KeyError, TypeError, ValueError):
        return 0
    return shm_bytes_needed(int(params * (2 if cfg.learner_precision == "bf16" else 4)))


def shm_problems(cfg: Config, probes: list[dict[str, Any]]) -> list[str]:
    """Nodes that can host an engine or a learner rank with less /dev/shm than the larger of
    `cluster.min_shm_gb` and what the weight store needs for this model (`weight_store_shm_bytes`);
    `cluster.min_shm_gb: 0` turns the check off."""
    if not cfg.cluster.min_shm_gb:
        return []
    store = weight_store_shm_bytes(cfg)
    need = max(cfg.cluster.min_shm_gb * GiB, store)
    return [f"node {p['ip']}: /dev/shm is {p['shm_bytes'] / 2**20:.0f} MiB, an engine or learner rank there needs "
            f">= {need / GiB:.2f} GiB (the larger of cluster.min_shm_gb and the weight store's "
            f"{store / GiB:.2f} GiB for this model): mount a larger tmpfs on /dev/shm (Kubernetes: "
            "an emptyDir volume with medium: Memory; docker: --shm-size)"
            for p in probes if need and p["shm_bytes"] < need and hosts_engine_or_learner(cfg, p["resources"])]


def interface_problems(cfg: Config, probes: list[dict[str, Any]]) -> list[str]:
    """Nodes that lack the interface the collectives are told to use."""
    iface = interface_env(cfg).get("GLOO_SOCKET_IFNAME") or interface_env(cfg).get("NCCL_SOCKET_IFNAME")
    if not iface:
        return []
    names = [n for n in iface.lstrip("^=").split(",") if n]
    return [f"node {p['ip']}: no interface {iface!r} (has {', '.join(p['interfaces'])}); set "
            "cluster.network_interface to a name every node has" for p in probes
            if not iface.startswith("^") and not any(any(i.startswith(n) for i in p["interfaces"]) for n in names)]


def ray_init(cfg: Config, namespace: str) -> None:
    """Join `cluster.ray_address`, or start the embedded single-host cluster. The embedded mode
    always starts its own cluster (`address="local"`), even when a stale or live
    /tmp/ray/ray_current_cluster or RAY_ADDRESS would make a plain `ray.init()` join another one.
    The job's code reaches every node through `runtime_env` (asyncrl.cluster.job_runtime_env)."""
    import ray

    from asyncrl.cluster import job_runtime_env
    from asyncrl.small_machine.patches import defer_arrow_serializers, lean_head

    defer_arrow_serializers()  # the driver's serialization context is built inside ray.init
    env = job_runtime_env(cfg)
    env["env_vars"].update(worker_env())  # role log files (asyncrl.logs); empty in verbose mode
    if cfg.cluster.ray_address:
        check_reachable(cfg.cluster.ray_address)
        try:
            ray.init(address=cfg.cluster.ray_address, namespace=namespace, runtime_env=env, logging_level="WARNING",
                     log_to_driver=verbose())
        except Exception as exc:
            hint = "" if os.environ.get("RAY_AUTH_MODE") else (
                " (a cluster with token authentication also needs RAY_AUTH_MODE=token and its token here)")
            raise StartupError(f"cluster.ray_address={cfg.cluster.ray_address!r} is unreachable: {exc}{hint}") from exc
    else:
        # no API server, autoscaler monitor or (quiet) log monitor: nothing here uses them (asyncrl.small_machine.patches)
        with lean_head(log_monitor=verbose()) if cfg.cluster.small_machine else contextlib.nullcontext():
            ray.init(**embedded_ray_options(cfg), namespace=namespace, runtime_env=env, logging_level="WARNING",
                     log_to_driver=verbose())  # quiet mode: the actors write to <run_dir>/logs/ (asyncrl.logs)


def embedded_ray_options(cfg: Config) -> dict[str, Any]:
    """`ray.init` options of the embedded single-host cluster: every Ray endpoint on loopback (token
    auth is Ray's default for new clusters), no dashboard, and no idle workers prestarted when the
    driver connects: the raylet would start one per CPU without the job's runtime_env, so no actor
    of the job can use them, and on a small machine they compete with the start-up for the cores
    (2-core quick start: 2-5 idle `ray::IDLE` processes during start-up, none used)."""
    return {"address": "local", "num_cpus": cfg.cluster.num_cpus or max(4, (os.cpu_count() or 2) * 2),
            "num_gpus": cfg.cluster.num_gpus, "include_dashboard": False, "_node_ip_address": "127.0.0.1",
            "_system_config": {"prestart_worker_first_driver": False}}
