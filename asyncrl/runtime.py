"""The running job: build the asynchronous topology, train, evaluate, checkpoint, shut down.

`run(cfg)` is what `python -m asyncrl.launch` calls after the config validated. Read
`build_topology` top to bottom to see every component of a job and the order they start in;
`Trainer.train` is the learner-paced loop (the rollout fleet runs on its own, paced only by the
buffer's admission tickets).

Failure behaviour: every start-up wait has a timeout (`cluster.startup_timeout_s`) and a component
that cannot start fails the launch with its name, before any training step, with everything that
was started torn down. Ctrl-C / SIGTERM: admission stops, a checkpoint is written (learner, buffer
snapshot, data cursor, versions), then the job shuts down; a second signal exits at once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.logs import echo, quiet_console, verbose, worker_env


class StartupError(RuntimeError):
    """A component could not start; the message names it."""


class RepeatedFailure(StartupError):
    """A component failed the same way `cluster.max_identical_failures` times in a row; the
    message names it, its host and the address it could not reach. Stops the job (exit 1)."""


def say(message: str) -> None:
    echo(f"[asyncrl] {message}")


@contextmanager
def step_timer(what: str):
    t0 = time.time()
    say(f"starting {what} ...")
    try:
        yield
    except StartupError:
        raise
    except Exception as exc:
        raise StartupError(f"{what} failed to start: {type(exc).__name__}: {exc}") from exc
    say(f"{what} ready ({time.time() - t0:.1f}s)")


# ------------------------------------------------------------------------------------- run dir
def prepare_run_dir(cfg: Config) -> Path:
    cfg.trainer.run_dir = str(Path(cfg.trainer.run_dir).resolve())  # actors may run in another cwd
    run_dir = cfg.run_path
    for sub in ("checkpoints", "samples", "plots"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    (run_dir / "config.resolved.json").write_text(cfg.to_json())
    return run_dir


def find_resume(cfg: Config, run_dir: Path) -> Path | None:
    from asyncrl.learner.checkpoint import latest_checkpoint

    mode = cfg.trainer.resume
    if mode == "never":
        return None
    if mode == "auto":
        return latest_checkpoint(run_dir / "checkpoints")
    path = Path(mode)
    if not path.exists():
        raise StartupError(f"trainer.resume: checkpoint {path} does not exist")
    return path


# ------------------------------------------------------------------------------------- topology
@dataclass
class Topology:
    cfg: Config
    run_dir: Path
    namespace: str
    buffer: Any = None
    buffer_address: str = ""
    coordinator: Any = None
    verifier: Any = None
    learner: Any = None
    weight_store: Any = None  # asyncrl.weights.store.WeightStoreHandle: late joiners' copy, owned by the job
    weights: Any = None
    actors: dict[str, Any] = field(default_factory=dict)
    actor_cls: Any = None
    next_actor_index: int = 0
    weight_address: str = ""
    hosts: dict[str, str] = field(default_factory=dict)  # component -> node address (error messages)
    rows_ref: Any = None  # the training rows in the object store (the coordinator's constructor argument)

    def shutdown(self) -> None:
        import ray

        for actor in list(self.actors.values()):
            try:
                ray.get(actor.shutdown.remote(), timeout=15)
            except Exception:  # noqa: BLE001 - tearing down; the kill below is the backstop
                pass
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        if self.learner is not None:
            self.learner.shutdown()
            self.learner = None
        if self.weight_store is not None:
            self.weight_store.shutdown()
            self.weight_store = None
        if self.verifier is not None:
            try:
                from ray import serve

                serve.shutdown()
            except Exception:  # noqa: BLE001 - tearing down
                pass
            self.verifier = None
        if self.buffer is not None:
            try:
                ray.get(self.buffer.stop.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - tearing down
                pass
            ray.kill(self.buffer)
            self.buffer = None
        if self.coordinator is not None:
            ray.kill(self.coordinator)
            self.coordinator = None


def describe_failure(topo: Topology, exc: BaseException) -> tuple[str, str, str]:
    """(component, host, reason) of the failure behind `exc`: the Ray actor that died, named by
    its role in the job, or the driver itself."""
    import ray

    dead = getattr(exc, "actor_id", None) if isinstance(exc, ray.exceptions.RayActorError) else None
    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    if dead:
        roles: dict[str, tuple[str, str]] = {}
        for name, handle, host_key in (("the replay buffer (BufferHost)", topo.buffer, "buffer"),
                                       ("the coordinator", topo.coordinator, "coordinator")):
            if handle is not None:
                roles[handle._actor_id.hex()] = (name, topo.hosts.get(host_key, "?"))
        if topo.learner is not None:
            for r, a in enumerate(topo.learner.actors):
                hosts = getattr(topo.learner, "hosts", [])
                roles[a._actor_id.hex()] = (f"learner rank {r}", hosts[r] if r < len(hosts) else "?")
        for aid, a in topo.actors.items():
            roles[a._actor_id.hex()] = (f"rollout actor {aid}", "?")
        name, host = roles.get(str(dead), (f"Ray actor {dead}", "?"))
        return name, host, reason
    # Seen first by the driver (e.g. a buffer request timed out): which service is gone, if any?
    probes = [("the replay buffer (BufferHost)", topo.buffer, "where", topo.hosts.get("buffer", "?")),
              ("the coordinator", topo.coordinator, "where", topo.hosts.get("coordinator", "?"))]
    if topo.learner is not None:
        hosts = getattr(topo.learner, "hosts", [])
        probes += [(f"learner rank {r}", a, "node_address", hosts[r] if r < len(hosts) else "?")
                   for r, a in enumerate(topo.learner.actors)]
    for name, handle, method, host in probes:
        if handle is None:
            continue
        try:
            ray.get(getattr(handle, method).remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return name, host, f"{reason}; the process is gone"
        except Exception:  # noqa: BLE001 - slow to answer is not dead
            continue
    return "the trainer (driver)", os.uname().nodename, reason


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on an unreachable `host:port` (ray.init would retry for minutes)."""
    import socket

    target = address.removeprefix("ray://")
    if target == "auto" or ":" not in target:
        return
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise StartupError(f"cluster.ray_address={address!r} is unreachable: {exc}") from None


def ray_init(cfg: Config, namespace: str) -> None:
    """Join `cluster.ray_address`, or start the embedded single-host cluster. The embedded mode
    always starts its own cluster (`address="local"`), even when a stale or live
    /tmp/ray/ray_current_cluster or RAY_ADDRESS would make a plain `ray.init()` join another one.
    The job's code reaches every node through `runtime_env` (asyncrl.cluster.job_runtime_env)."""
    import ray

    from asyncrl.cluster import job_runtime_env

    env = job_runtime_env(cfg)
    env["env_vars"].update(worker_env())  # role log files (asyncrl.logs); empty in verbose mode
    if cfg.cluster.ray_address:
        _check_reachable(cfg.cluster.ray_address)
        try:
            ray.init(address=cfg.cluster.ray_address, namespace=namespace, runtime_env=env, logging_level="WARNING",
                     log_to_driver=verbose())
        except Exception as exc:
            hint = "" if os.environ.get("RAY_AUTH_MODE") else (
                " (a cluster with token authentication also needs RAY_AUTH_MODE=token and its token here)")
            raise StartupError(f"cluster.ray_address={cfg.cluster.ray_address!r} is unreachable: {exc}{hint}") from exc
    else:
        num_cpus = cfg.cluster.num_cpus or max(4, (os.cpu_count() or 2) * 2)
        # Embedded cluster: every Ray endpoint on loopback (token auth is Ray's default for new clusters).
        ray.init(address="local", num_cpus=num_cpus, num_gpus=cfg.cluster.num_gpus, namespace=namespace,
                 runtime_env=env, include_dashboard=False, logging_level="WARNING", _node_ip_address="127.0.0.1",
                 log_to_driver=verbose())  # quiet mode: the actors write to <run_dir>/logs/ (asyncrl.logs)


def preflight(cfg: Config) -> None:
    """Checks on the live cluster before any component starts: resources (placement feasible),
    /dev/shm and interfaces of the nodes, listener addresses resolved and loudly reported when
    they are open beyond loopback without authentication, model paths resolved once."""
    import ray

    from asyncrl.addresses import insecure_listeners, is_loopback, resolve_hosts
    from asyncrl.cluster import (
        interface_problems,
        probe_nodes,
        resolve_model_paths,
        resource_problems,
        shm_problems,
    )

    where = cfg.cluster.ray_address or "embedded"
    problems = resource_problems(cfg, ray.nodes(), where)
    if problems:
        raise StartupError("the cluster cannot place this job: " + "; ".join(problems))
    probes = probe_nodes(cfg.cluster.startup_timeout_s)
    problems = shm_problems(cfg, probes) + interface_problems(cfg, probes)
    if problems:
        raise StartupError("; ".join(problems))
    resolve_hosts(cfg)
    if len(probes) > 1:
        for key, host in (("buffer.host", cfg.buffer.host), ("learner.weights.host", cfg.learner.weights.host)):
            if is_loopback(host):
                say(f"WARNING: {key}={host} on a {len(probes)}-node cluster: components on other nodes cannot "
                    "reach it (use auto; python -m asyncrl.doctor checks this)")
    for line in insecure_listeners(cfg):
        say(f"WARNING: listening beyond loopback without authentication: {line}")
    try:
        resolve_model_paths(cfg)
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def build_topology(cfg: Config, run_dir: Path, resume: Path | None) -> Topology:
    """Every component of a job, in start order. Each step is timed and fails with its name."""
    import ray

    from asyncrl.actors.rollout import make_rollout_actor_class
    from asyncrl.coordinator import COORDINATOR_NAME, Coordinator
    from asyncrl.data import load_training_rows
    from asyncrl.learner.group import LearnerGroup
    from asyncrl.replay.host import BufferHost
    from asyncrl.serve.deploy import deploy_verifier
    from asyncrl.weights.store import start_weight_store

    namespace = ray.get_runtime_context().namespace
    topo = Topology(cfg, run_dir, namespace)
    timeout = cfg.cluster.startup_timeout_s
    try:
        with step_timer("data"):
            rows = load_training_rows(cfg)
            cursor = json.loads((resume / "data_cursor.json").read_text()) if resume else None
        # Stateful services survive their own death: Ray restarts them (and retries the calls made
        # to them); each reads its state back from `state/` (on the driver's node, where they run).
        state_dir = run_dir / "state"
        state_dir.mkdir(exist_ok=True)
        restarts = dict(max_restarts=cfg.cluster.max_restarts, max_task_retries=-1,
                        scheduling_strategy=_on_this_node())
        with step_timer("coordinator"):
            # held by the driver for the job's life: a restarted coordinator is built from it again
            topo.rows_ref = ray.put(rows)
            topo.coordinator = ray.remote(num_cpus=0)(Coordinator).options(
                name=COORDINATOR_NAME, lifetime="detached" if cfg.cluster.ray_address else None,
                resources=cfg.cluster.resources.get("coordinator"), **restarts).remote(
                topo.rows_ref, cfg.data.model_dump_json(),
                stream_state=cursor["stream"] if cursor else None, reissue=cursor["reissue"] if cursor else None,
                buffered=cursor.get("buffered") if cursor else None, state_path=str(state_dir / "coordinator.json"))
            topo.hosts["coordinator"] = ray.get(topo.coordinator.where.remote(), timeout=timeout)["host"]
        with step_timer("replay buffer"):
            topo.buffer = BufferHost.options(num_cpus=0, resources=cfg.cluster.resources.get("buffer"), **restarts).remote(
                cfg.buffer.model_dump_json(), cfg.data.rollout_batch_size, str(state_dir), cfg.cluster.port_range)
            topo.buffer_address = ray.get(topo.buffer.start.remote(), timeout=timeout)
            topo.hosts["buffer"] = ray.get(topo.buffer.where.remote(), timeout=timeout)["host"]
            say(f"  replay buffer listening at {topo.buffer_address}")
            snap = resume / "buffer" / "groups.snapshot" if resume else None
            if snap is not None and snap.exists():
                restored = ray.get(topo.buffer.restore.remote(str(snap.resolve())), timeout=timeout)
                say(f"  buffer restored from {snap}: {restored} group(s)")
        with step_timer(f"verifier service ({cfg.verifier.backend}, version {cfg.verifier.version})"):
            topo.verifier = deploy_verifier(cfg)
            if cfg.rollout.guide.enable:
                probe_verifier(cfg)
        with step_timer("weight store"):
            topo.weight_store = start_weight_store(namespace)
        with step_timer(f"learner ({cfg.learner_world_size} rank(s), ZeRO-{cfg.learner.zero_stage})"):
            topo.learner = LearnerGroup(cfg)
            if resume:
                topo.learner.load_checkpoint(str(resume))
            version = topo.learner.version
            ray.get(topo.coordinator.set_version.remote(version))
            ray.get(topo.buffer.set_version.remote(version))
        with step_timer("weight sender (learner rank 0)"):
            topo.weight_address = topo.learner.start_weight_sender(port=cfg.learner.weights.port, publish=True)
            say(f"  weight rendezvous at {topo.weight_address}")
        with step_timer(f"rollout actors x{cfg.rollout.num_actors}"):
            topo.actor_cls = make_rollout_actor_class(cfg)
            start_actors(topo, cfg.rollout.num_actors, timeout)
        if version > 0:
            with step_timer(f"weight group (resumed at v{version}: first broadcast)"):
                sync_weights(topo)
    except BaseException:
        topo.shutdown()
        raise
    return topo


def _on_this_node() -> Any:
    """Scheduling on the driver's node, not elsewhere: the stateful services keep their durable
    state on its local disk, so a restart must come back there (and on the same address)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def probe_verifier(cfg: Config) -> None:
    """One real request through the service before anything trains, so an unreachable HTTP
    verifier (or a broken model) fails the launch with its error instead of every conversation."""
    import asyncio

    from asyncrl.actors.guided import render_verifier_messages
    from asyncrl.serve.client import VerifierClient

    client = VerifierClient(cfg.verifier, app_name="verifier")
    messages = render_verifier_messages("1 + 1", "2", ["1 + 1 = 2\n<answer>\\boxed{2}</answer>"],
                                        cfg.rollout.guide.prompt_template)
    result = asyncio.run(client.chat(messages, max_tokens=16, temperature=0.0, top_p=1.0))
    if not result.ok:
        where = cfg.verifier.http.base_url if cfg.verifier.backend == "http" else cfg.verifier.backend
        raise StartupError(f"the verifier ({where}) did not answer a probe request: {result.error}")


def start_actors(topo: Topology, count: int, timeout: float) -> list[str]:
    """Start `count` new rollout actors (engines up) and enrol them in the weight group."""
    import ray

    new = {}
    for _ in range(count):
        actor_id = f"rollout-{topo.next_actor_index}"
        topo.next_actor_index += 1
        new[actor_id] = topo.actor_cls.options(name=actor_id, resources=topo.cfg.cluster.resources.get("rollout")).remote(
            topo.cfg.model_dump_json(), actor_id, topo.buffer_address, topo.namespace)
    reports = ray.get([a.start.remote() for a in new.values()], timeout=timeout)
    for report in reports:
        say(f"  {report['actor_id']} on {report.get('host', '?')}: engine up in {report['start_s']:.1f}s "
            f"(weights v{report['version']})")
    topo.actors.update(new)
    enrol(topo, list(new))
    return list(new)


def enrol(topo: Topology, actor_ids: list[str], *, remove_first: bool = False) -> None:
    """(Re-)enrol actors in the weight group; the group is rebuilt at the next broadcast."""
    import ray

    members = [m for aid in actor_ids for m in ray.get(topo.actors[aid].weight_members.remote())]
    if remove_first:
        topo.learner.remove_receivers(members)
    topo.learner.add_receivers(members)


def withdraw(topo: Topology, actor_ids: list[str]) -> None:
    members = [f"{aid}/tp{r}" for aid in actor_ids for r in range(max(1, topo.cfg.rollout.gpus_per_actor))]
    topo.learner.remove_receivers(members)


def sync_weights(topo: Topology) -> dict[str, Any]:
    """One broadcast of the learner's current version to every engine: the actors join the round
    (or catch up from the weight store if they are not members), rank 0 sends bucket by bucket
    under the watchdog. Returns the sender's report plus each actor's result."""
    import ray

    refs = {aid: a.receive_weights.remote(topo.weight_address) for aid, a in topo.actors.items()}
    report = topo.learner.broadcast_weights()
    results: dict[str, Any] = {}
    wait = 4 * topo.cfg.learner.weights.timeout_s + 30
    for aid, ref in refs.items():
        try:
            results[aid] = ray.get(ref, timeout=wait)
        except Exception as exc:  # noqa: BLE001 - a dead actor is healed by the trainer
            results[aid] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    return {"report": report, "actors": results, "dropped": report.get("dropped", []) if report else []}


# ------------------------------------------------------------------------------------- signals
class StopFlag:
    """First SIGINT/SIGTERM: stop gracefully (checkpoint, shut down). Second: exit at once."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        if self.requested:
            say("second signal: exiting now")
            os._exit(130)
        self.requested = True
        say(f"{signal.Signals(signum).name}: stopping admission, checkpointing, shutting down "
            "(send again to exit at once)")


def run(cfg: Config) -> int:
    """The job, with the console kept for asyncrl's lines (asyncrl.logs: the rest goes to files)."""
    run_dir = prepare_run_dir(cfg)
    with quiet_console(run_dir) as logs_dir:
        if logs_dir is not None:
            say(f"logs: {logs_dir}/ (driver, buffer, verifier, rollout-N, learner-N; serve/: one line per "
                "verifier request); --verbose or ASYNCRL_VERBOSE=1 shows them here")
        return _run_job(cfg, run_dir)


def _run_job(cfg: Config, run_dir: Path) -> int:
    import ray

    stop = StopFlag()
    namespace = f"asyncrl-{cfg.trainer.experiment_name}-{os.getpid()}"
    topo = None
    try:
        resume = find_resume(cfg, run_dir)
        with step_timer("ray" + (f" (joining {cfg.cluster.ray_address})" if cfg.cluster.ray_address else " (embedded)")):
            ray_init(cfg, namespace)
        with step_timer("preflight (resources, nodes, addresses, model paths)"):
            preflight(cfg)
        (run_dir / "config.resolved.json").write_text(cfg.to_json())  # with the resolved hosts and paths
        stop.install()  # after ray.init, which installs its own SIGTERM handler in the driver
        topo = build_topology(cfg, run_dir, resume)
        (run_dir / "job.json").write_text(json.dumps({
            "ray_address": ray.get_runtime_context().gcs_address, "namespace": namespace,
            "coordinator": "coordinator", "pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "ray_auth_mode": os.environ.get("RAY_AUTH_MODE", "")}))
        from asyncrl.trainer import Trainer

        trainer = Trainer(cfg, topo, run_dir, stop, resume)
        try:
            return trainer.train()
        except Exception as exc:  # noqa: BLE001 - a component died: one message, a checkpoint, exit 3
            return trainer.on_failure(exc)
        finally:
            trainer.close()  # before the topology goes: nothing of the run is left to the GC
    except StartupError as exc:
        echo(f"error: {exc}", err=True)
        return 1
    finally:
        if topo is not None:
            say("shutting down")
            topo.shutdown()
        (run_dir / "job.json").unlink(missing_ok=True)
        if ray.is_initialized():
            ray.shutdown()
