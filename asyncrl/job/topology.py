"""The components of a running job: `build_topology` starts them, `Topology` holds them.

Read `build_topology` top to bottom to see every component of a job in the order it starts: the
verifier service (in the background, from the first moment), the replay buffer's process, the
learner's placement (reserved before any engine), the learner's ranks (building in the background),
the rollout actors (engines building), the weight store (background), the data, the coordinator,
the buffer's socket, then the waits: weight store, learner, its state, the weight sender (publishing
version 0), the verifier, and the rollout fleet joined; on resume a first weight broadcast.
`asyncrl.job.plan.StartPlan` runs the steps: each is timed, one that cannot start fails the launch
with its name (asyncrl.startup.StartupError), with everything already started torn down.
`Topology.shutdown` stops the components in reverse start order (the fleet first, so no actor
pushes to a buffer that is gone). `describe_failure` names the component behind an error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from threading import Thread
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config
from asyncrl.job.plan import StartPlan
from asyncrl.startup import StartupError, root_cause, say, step_timer

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.serve.handle import DeploymentHandle
    from ray.types import ObjectRef

    from asyncrl.actors.fleet import RolloutFleet
    from asyncrl.learner.group import LearnerGroup
    from asyncrl.weights.store import WeightStoreHandle


@dataclass
class Topology:
    """One field per role, each `None` until its start-up step ran (and again after shutdown)."""

    cfg: Config
    run_dir: Path
    namespace: str
    coordinator: ActorHandle | None = None  # the data cursor, admission of prompts, ctl's mailbox
    rows_ref: ObjectRef | None = None  # the training rows in the object store (the coordinator's constructor argument)
    buffer: ActorHandle | None = None  # BufferHost: the replay buffer's ZeroMQ server
    buffer_address: str = ""
    verifier: DeploymentHandle | None = None  # the Ray Serve verifier application
    learner: LearnerGroup | None = None
    learner_placement: Any = None  # the learner's placement group until the learner group takes it
    weight_store: WeightStoreHandle | None = None  # the published copy for late joiners, owned by the job
    weight_address: str = ""  # the learner's weight rendezvous (changes when the learner is rebuilt)
    fleet: RolloutFleet | None = None
    launching: dict[str, Any] = field(default_factory=dict)  # rollout actors launched, the fleet not built yet
    hosts: dict[str, str] = field(default_factory=dict)  # component -> node address (error messages)

    def adopt(self, key: str, started: Any) -> None:
        """After a failed start-up step: what a background start (`StartPlan.begin`) returned, or
        the exception it raised, held here so `shutdown` stops it. A verifier whose deployment or
        probe failed may still have started Serve: stopped now."""
        if isinstance(started, BaseException):
            if key == "verifier":
                _stop_serve()
        elif key == "weight store":
            self.weight_store = started
        elif key == "learner":
            self.learner, self.learner_placement = started, None  # the group's shutdown removes its placement
        elif key == "verifier":
            self.verifier = started

    def shutdown(self) -> None:
        """Stop every component, the fleet first; how long each took goes to the driver's log."""
        import ray

        took: dict[str, float] = {}
        if self.fleet is not None:
            with _timed(took, "fleet"):
                self.fleet.shutdown()
        if self.launching:
            from asyncrl.actors.fleet import RolloutFleet

            with _timed(took, "rollout actors launched"):
                RolloutFleet._kill_all([actor for actor, _ in self.launching.values()])
            self.launching = {}
        if self.learner is not None:
            with _timed(took, "learner"):
                self.learner.shutdown()
            self.learner = None
        if self.learner_placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.learner_placement)
            self.learner_placement = None
        if self.weight_store is not None:
            self.weight_store.shutdown()
            self.weight_store = None
        if self.verifier is not None:
            with _timed(took, "verifier service"):
                _stop_serve()
            self.verifier = None
        if self.buffer is not None:
            with _timed(took, "replay buffer"):
                try:
                    ray.get(self.buffer.stop.remote(), timeout=10)
                except Exception:  # noqa: BLE001 - tearing down
                    pass
                ray.kill(self.buffer)
            self.buffer = None
        if self.coordinator is not None:
            ray.kill(self.coordinator)
            self.coordinator = None
        log.info("shutdown took %s", ", ".join(f"{name} {secs:.2f}s" for name, secs in took.items()) or "nothing")


@contextlib.contextmanager
def _timed(took: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.monotonic()
    try:
        yield
    finally:
        took[name] = time.monotonic() - t0


def build_topology(cfg: Config, run_dir: Path, resume: Path | None, rows_loading: Thread | None = None) -> Topology:
    """Every component of a job, in dependency order (each step timed, a failure named; `StartPlan`).
    What only waits (a deployment, a process start, a model build) begins in the background as soon
    as what it needs exists; what the first step waits for, the learner and the engines, is asked of
    Ray before the rest. `rows_loading`: the launcher's thread loading the training rows."""
    import ray

    from asyncrl.actors.fleet import RolloutFleet, launch_actors
    from asyncrl.actors.rollout import make_rollout_actor_class
    from asyncrl.learner.group import LearnerGroup, reserve_placement
    from asyncrl.weights.store import start_weight_store

    topo = Topology(cfg, run_dir, ray.get_runtime_context().namespace)
    n = cfg.rollout.num_actors
    rows = _TrainingRows(cfg, rows_loading)
    plan = StartPlan(cfg.cluster.startup_timeout_s, topo.adopt, early_checks=[rows])
    with plan.stopping_on_failure(topo.shutdown):
        if cfg.rollout.guide.enable:  # first: a verifier that cannot work stops the launch before any engine is built
            plan.begin("verifier", f"verifier service ({cfg.verifier.backend}, version {cfg.verifier.version})",
                       _deploy_and_probe, cfg)
        topo.buffer = _create_buffer(cfg, run_dir)  # its process starts now; its step waits for it below
        with plan.step(f"learner placement ({cfg.learner_world_size} rank(s), reserved before the engines)"):
            topo.learner_placement = reserve_placement(cfg)  # after the engines, its ranks would spread over nodes
        plan.begin("learner", f"learner ({cfg.learner_world_size} rank(s), ZeRO-{cfg.learner.zero_stage})",
                   LearnerGroup, cfg, placement=topo.learner_placement)
        actor_cls = make_rollout_actor_class(cfg)
        # Not on resume: an actor started then must see the restored version (and its weights).
        topo.launching = launch_actors(cfg, actor_cls, topo.namespace, topo.buffer, n) if resume is None else {}
        if topo.launching:
            say(f"rollout actors x{n}: engines building while the other services start")
        plan.begin("weight store", "weight store", start_weight_store, topo.namespace)
        with plan.step("data"):
            training_rows, cursor = rows.take(), _read_cursor(resume)
        topo.rows_ref, topo.coordinator = _create_coordinator(cfg, run_dir, training_rows, cursor)
        with plan.step("coordinator"):
            topo.hosts["coordinator"] = ray.get(topo.coordinator.where.remote(), timeout=plan.timeout_s)["host"]
        with plan.step("replay buffer"):
            _start_buffer(topo, resume, plan.timeout_s)
        topo.weight_store = plan.wait("weight store")
        topo.learner, topo.learner_placement = plan.wait("learner"), None  # the group owns its placement now
        with plan.step("learner state" + (f" (resumed from {resume.name})" if resume else "")):
            version = _load_learner_state(topo, resume)
        with plan.step("weight sender (learner rank 0)"):
            _start_weight_sender(topo, version)
        if cfg.rollout.guide.enable:  # waited for while the engines build: an actor looks it up at its first request
            topo.verifier = plan.wait("verifier")
        else:
            say("verifier service: not started (rollout.guide.enable=false; `asyncrl.ctl swap-verifier` deploys one)")
        topo.fleet = RolloutFleet(cfg, actor_cls, buffer_address=topo.buffer_address, namespace=topo.namespace,
                                  coordinator=topo.coordinator, buffer=topo.buffer, learner=topo.learner)
        with plan.step(f"rollout actors x{n}"):
            topo.fleet.join(topo.launching, plan.timeout_s) if topo.launching else topo.fleet.start(n, plan.timeout_s)
            topo.launching = {}
        if version > 0:
            with plan.step(f"weight group (resumed at v{version}: first broadcast)"):
                topo.fleet.sync_weights(topo.weight_address)
    return topo


# ---- the steps of `build_topology` -----------------------------------------------------------
class _TrainingRows:
    """The training rows, loaded by the launcher's thread since Ray started. As an early check of the
    plan, until `take`: rows whose thread ended without them (a row without an answer, say) stop the
    launch between steps, naming the file and row."""

    def __init__(self, cfg: Config, loading: Thread | None) -> None:
        self.cfg, self.loading = cfg, loading

    def __call__(self) -> None:
        from asyncrl.data import has_preloaded_rows, load_training_rows

        if self.loading is not None and not self.loading.is_alive() and not has_preloaded_rows(self.cfg):
            with step_timer("data"):
                load_training_rows(self.cfg)  # raises the loading error

    def take(self) -> Any:
        from asyncrl.data import load_training_rows

        if self.loading is not None:
            self.loading.join()
            self.loading = None  # taken: the early check has nothing left to look at
        return load_training_rows(self.cfg)


def _read_cursor(resume: Path | None) -> dict[str, Any] | None:
    return json.loads((resume / "data_cursor.json").read_text()) if resume else None


def _restarts(cfg: Config) -> dict[str, Any]:
    """Stateful services survive their own death: Ray restarts them (and retries the calls made to
    them) on this node, where each reads its state back from `state/`."""
    return dict(max_restarts=cfg.cluster.max_restarts, max_task_retries=-1, scheduling_strategy=_on_this_node())


def _create_buffer(cfg: Config, run_dir: Path) -> ActorHandle:
    from asyncrl.replay.bounds import model_vocab_size
    from asyncrl.replay.host import BufferHost

    state_dir = run_dir / "state"
    state_dir.mkdir(exist_ok=True)
    return BufferHost.options(num_cpus=0, resources=cfg.cluster.resources.get("buffer"), **_restarts(cfg)).remote(
        cfg.buffer.model_dump_json(), cfg.data.rollout_batch_size, str(state_dir), cfg.cluster.port_range,
        model_vocab_size(cfg.model.path))


def _create_coordinator(cfg: Config, run_dir: Path, rows: Any, cursor: dict[str, Any] | None) -> tuple[Any, ActorHandle]:
    """(the rows in the object store, the coordinator). The driver holds the rows for the job's
    life: a restarted coordinator is built from them."""
    import ray

    from asyncrl.job.coordinator import COORDINATOR_NAME, Coordinator

    rows_ref = ray.put(rows)
    coordinator = ray.remote(num_cpus=0)(Coordinator).options(
        name=COORDINATOR_NAME, lifetime="detached" if cfg.cluster.ray_address else None,
        resources=cfg.cluster.resources.get("coordinator"), **_restarts(cfg)).remote(
        rows_ref, cfg.data.model_dump_json(),
        stream_state=cursor["stream"] if cursor else None, reissue=cursor["reissue"] if cursor else None,
        buffered=cursor.get("buffered") if cursor else None, state_path=str(run_dir / "state" / "coordinator.json"))
    return rows_ref, coordinator


def _start_buffer(topo: Topology, resume: Path | None, timeout: float) -> None:
    """The buffer's socket bound (its address is what the actors push to), restored on resume."""
    import ray

    topo.buffer_address = ray.get(topo.buffer.start.remote(), timeout=timeout)
    topo.hosts["buffer"] = ray.get(topo.buffer.where.remote(), timeout=timeout)["host"]
    say(f"  replay buffer listening at {topo.buffer_address}")
    if resume:  # a missing or damaged snapshot: its prompts are issued again, said with how many
        from asyncrl.job.resume_snapshot import restore_buffer

        buf, coord = topo.buffer, topo.coordinator
        restore_buffer(resume / "buffer" / "groups.snapshot",
                       lambda p: ray.get(buf.restore.remote(p), timeout=timeout),
                       lambda: ray.get(buf.prompt_indices.remote(), timeout=timeout),
                       lambda present: ray.get(coord.reissue_lost.remote(present), timeout=timeout))


def _load_learner_state(topo: Topology, resume: Path | None) -> int:
    """The learner's checkpoint on resume; its version told to the coordinator and the buffer."""
    import ray

    if resume:
        topo.learner.load_checkpoint(str(resume))
    version = topo.learner.version
    ray.get(topo.coordinator.set_version.remote(version))
    ray.get(topo.buffer.set_version.remote(version))
    return version


def _start_weight_sender(topo: Topology, version: int) -> None:
    topo.weight_address = topo.learner.start_weight_sender(port=topo.cfg.learner.weights.port, publish=True)
    say(f"  weight rendezvous at {topo.weight_address}")
    if version == 0:  # no members yet: publishes version 0 only, so the store is never empty
        publish_initial_weights(topo.learner)


def _deploy_and_probe(cfg: Config) -> DeploymentHandle:
    """The verifier application, deployed and answering one probe request."""
    from asyncrl.serve.deploy import deploy_verifier

    handle = deploy_verifier(cfg)
    probe_verifier(cfg)
    return handle


def _stop_serve() -> None:
    try:
        from ray import serve

        serve.shutdown()
    except Exception:  # noqa: BLE001 - tearing down
        pass


def publish_initial_weights(learner: LearnerGroup) -> dict[str, Any]:
    """Put version 0 into the WeightStore before any engine takes part in a round. An engine
    whose first streamed round fails (its model then holds part of version 1) reloads the
    store's newest version; with an empty store it could only stay paused. The broadcast has no
    members yet, so it only exports and publishes (in the background)."""
    report = learner.broadcast_weights()
    if not report.get("published"):
        raise StartupError("the learner did not publish version 0 to the weight store")
    return report


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

    from asyncrl.serve.client import VerifierClient
    from asyncrl.verifier_protocol import render_verifier_messages

    client = VerifierClient(cfg.verifier, app_name="verifier")
    messages = render_verifier_messages("1 + 1", "2", ["1 + 1 = 2\n<answer>\\boxed{2}</answer>"],
                                        cfg.rollout.guide.prompt_template)
    result = asyncio.run(client.chat(messages, max_tokens=16, temperature=0.0, top_p=1.0))
    if not result.ok:
        where = cfg.verifier.http.base_url if cfg.verifier.backend == "http" else cfg.verifier.backend
        raise StartupError(f"the verifier ({where}) did not answer a probe request: {result.error}")


def describe_failure(topo: Topology, exc: BaseException) -> tuple[str, str, str]:
    """(component, host, reason) of the failure behind `exc`: the Ray actor that died, named by
    its role in the job, or the driver itself."""
    import ray

    dead = getattr(exc, "actor_id", None) if isinstance(exc, ray.exceptions.RayActorError) else None
    cause = root_cause(exc)  # a remote error: what the task raised, not Ray's frame header
    reason = f"{type(cause).__name__}: {str(cause).splitlines()[0][:200] if str(cause) else ''}"
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
        for aid, a in (topo.fleet.actors if topo.fleet is not None else {}).items():
            roles[a._actor_id.hex()] = (f"rollout actor {aid}", "?")
        name, host = roles.get(str(dead), (f"Ray actor {dead}", "?"))
        return name, host, reason
    # Seen first by the driver (e.g. a buffer request timed out): which service is gone, if any?
    probes = []  # (component, the remote method that answers while it lives, host)
    if topo.buffer is not None:
        probes.append(("the replay buffer (BufferHost)", topo.buffer.where, topo.hosts.get("buffer", "?")))
    if topo.coordinator is not None:
        probes.append(("the coordinator", topo.coordinator.where, topo.hosts.get("coordinator", "?")))
    if topo.learner is not None:
        hosts = getattr(topo.learner, "hosts", [])
        probes += [(f"learner rank {r}", a.node_address, hosts[r] if r < len(hosts) else "?")
                   for r, a in enumerate(topo.learner.actors)]
    for name, method, host in probes:
        try:
            ray.get(method.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return name, host, f"{reason}; the process is gone"
        except Exception:  # noqa: BLE001 - slow to answer is not dead
            continue
    return "the trainer (driver)", os.uname().nodename, reason
