"""The components of a running job: `build_topology` starts them, `Topology` holds them.

Read `build_topology` top to bottom to see every component of a job and the order they start in:
the verifier service (in the background, from the first moment), replay buffer (its process
started), the learner's placement (reserved before any engine), learner group (ranks building in
the background), rollout fleet (launched, engines building), weight store (in the background),
data (the rows the launcher loads in the background), coordinator (its process started),
coordinator and replay buffer (waited for), weight store (waited for), learner group (waited for),
weight sender (publishing version 0), verifier service (waited for), rollout fleet (joined) and, on
resume, a first weight broadcast: what the first step waits for (the learner, the engines) is asked
of Ray first. Each step is timed and a step that cannot start fails the launch with its name
(asyncrl.startup.StartupError), with everything already started torn down. `Topology.shutdown`
stops them in reverse start order (the fleet first, so no actor pushes to a buffer that is gone).
`describe_failure` names the component behind an error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from threading import Thread
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config
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
    hosts: dict[str, str] = field(default_factory=dict)  # component -> node address (error messages)

    def shutdown(self) -> None:
        """Stop every component, the fleet first; how long each took goes to the driver's log."""
        import ray

        took: dict[str, float] = {}
        if self.fleet is not None:
            with _timed(took, "fleet"):
                self.fleet.shutdown()
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
    """Every component of a job, in start order. Each step is timed and fails with its name.
    `rows_loading`: the launcher's thread loading the training rows (`data.preload_training_rows`),
    waited for by the data step."""
    import ray

    from asyncrl.actors.fleet import RolloutFleet
    from asyncrl.actors.rollout import make_rollout_actor_class
    from asyncrl.coordinator import COORDINATOR_NAME, Coordinator
    from asyncrl.data import has_preloaded_rows, load_training_rows
    from asyncrl.learner.group import LearnerGroup, reserve_placement
    from asyncrl.replay.host import BufferHost
    from asyncrl.weights.store import start_weight_store

    namespace = ray.get_runtime_context().namespace
    topo = Topology(cfg, run_dir, namespace)
    timeout = cfg.cluster.startup_timeout_s
    verifier_step = f"verifier service ({cfg.verifier.backend}, version {cfg.verifier.version})"
    # Components whose start is mostly waiting (a process start, a deployment) start in the
    # background; their steps below only wait for them. Ray starts worker processes a few at a time
    # (at most one per core at once), in the order they were asked for: the learner's ranks and the
    # engines, what the first step waits for, are asked for before the coordinator and the weight
    # store. The verifier starts first, so that a verifier that cannot work stops the launch
    # before any engine is built (`fail_early`).
    background = ThreadPoolExecutor(max_workers=3, thread_name_prefix="asyncrl-start")
    pending: dict[str, Future] = {}
    if cfg.rollout.guide.enable:
        pending["verifier"] = background.submit(_deploy_and_probe, cfg)
        say("starting verifier service in the background ...")

    def fail_early() -> None:
        """A background start that has already failed (an unreachable HTTP verifier, say) or training
        rows that did not load (a row without an answer) stop the launch now, between steps, before
        the learner and the engines are built, not when their own step comes."""
        if "verifier" in pending and pending["verifier"].done() and pending["verifier"].exception() is not None:
            with step_timer(verifier_step):
                pending["verifier"].result()
        if rows_loading is not None and not rows_loading.is_alive() and not has_preloaded_rows(cfg):
            with step_timer("data"):
                load_training_rows(cfg)  # raises the loading error, naming the file and row

    try:
        # Stateful services survive their own death: Ray restarts them (and retries the calls made
        # to them); each reads its state back from `state/` (on the driver's node, where they run).
        state_dir = run_dir / "state"
        state_dir.mkdir(exist_ok=True)
        restarts = dict(max_restarts=cfg.cluster.max_restarts, max_task_retries=-1,
                        scheduling_strategy=_on_this_node())
        # Created now (a handle: the rollout actors are given it), so its process starts while the
        # learner's placement is reserved and the engines build; its step below waits for it.
        topo.buffer = BufferHost.options(num_cpus=0, resources=cfg.cluster.resources.get("buffer"), **restarts).remote(
            cfg.buffer.model_dump_json(), cfg.data.rollout_batch_size, str(state_dir), cfg.cluster.port_range)
        fail_early()  # training rows that did not load (usually known by now: they load while Ray starts)
        # The learner's GPUs first: reserved after the engines, its ranks would be spread over
        # the nodes the engines left (ZeRO collectives then cross the inter-node link).
        with step_timer(f"learner placement ({cfg.learner_world_size} rank(s), reserved before the engines)"):
            topo.learner_placement = reserve_placement(cfg)
        # The learner's ranks (process start, model, DeepSpeed engine) build from now on too: they
        # need nothing of the coordinator, the buffer or the weight store (their step waits).
        pending["learner"] = background.submit(LearnerGroup, cfg, placement=topo.learner_placement)
        fail_early()
        # The engine builds (the longest step: what the first step waits for) start now and run
        # while the coordinator, the buffer, the weight store and the learner start; an actor asks
        # the buffer for its address once its engine is up. Not on resume: an actor started then
        # must see the restored version (and its weights).
        topo.fleet = RolloutFleet(cfg, make_rollout_actor_class(cfg), buffer_address="",  # coordinator: below
                                  namespace=namespace, coordinator=None, buffer=topo.buffer, learner=None)
        launched = topo.fleet.launch(cfg.rollout.num_actors) if resume is None else None
        if launched is not None:
            say(f"rollout actors x{cfg.rollout.num_actors}: engines building while the other services start")
        pending["weight store"] = background.submit(start_weight_store, namespace)
        # The rows are needed by the coordinator only: loaded (the tokenizer of the overlong filter)
        # in a thread of the launcher since Ray started, waited for once the learner and the engines are on their way.
        with step_timer("data"):
            if rows_loading is not None:
                rows_loading.join()
                rows_loading = None  # taken: `fail_early` no longer looks at them
            rows = load_training_rows(cfg)
            cursor = json.loads((resume / "data_cursor.json").read_text()) if resume else None
        topo.rows_ref = ray.put(rows)  # held by the driver for the job's life: a restarted coordinator is built from it
        topo.coordinator = topo.fleet.coordinator = ray.remote(num_cpus=0)(Coordinator).options(
            name=COORDINATOR_NAME, lifetime="detached" if cfg.cluster.ray_address else None,
            resources=cfg.cluster.resources.get("coordinator"), **restarts).remote(
            topo.rows_ref, cfg.data.model_dump_json(),
            stream_state=cursor["stream"] if cursor else None, reissue=cursor["reissue"] if cursor else None,
            buffered=cursor.get("buffered") if cursor else None, state_path=str(state_dir / "coordinator.json"))
        with step_timer("coordinator"):
            topo.hosts["coordinator"] = ray.get(topo.coordinator.where.remote(), timeout=timeout)["host"]
        with step_timer("replay buffer"):
            topo.buffer_address = topo.fleet.buffer_address = ray.get(topo.buffer.start.remote(), timeout=timeout)
            topo.hosts["buffer"] = ray.get(topo.buffer.where.remote(), timeout=timeout)["host"]
            say(f"  replay buffer listening at {topo.buffer_address}")
            if resume:  # a missing or damaged snapshot: its prompts are issued again, said with how many
                from asyncrl.resume_snapshot import restore_buffer

                buf, coord = topo.buffer, topo.coordinator
                restore_buffer(resume / "buffer" / "groups.snapshot",
                               lambda p: ray.get(buf.restore.remote(p), timeout=timeout),
                               lambda: ray.get(buf.prompt_indices.remote(), timeout=timeout),
                               lambda present: ray.get(coord.reissue_lost.remote(present), timeout=timeout))
        fail_early()
        if not cfg.rollout.guide.enable:  # nothing would call it (no Serve processes competing for the CPUs)
            say("verifier service: not started (rollout.guide.enable=false; `asyncrl.ctl swap-verifier` deploys one)")
        with step_timer("weight store"):
            topo.weight_store = pending["weight store"].result(timeout=timeout)
            del pending["weight store"]
        with step_timer(f"learner ({cfg.learner_world_size} rank(s), ZeRO-{cfg.learner.zero_stage})"):
            topo.learner = pending["learner"].result(timeout=timeout)
            del pending["learner"]
            topo.learner_placement = None  # the learner group owns it now
            topo.fleet.learner = topo.learner
            if resume:
                topo.learner.load_checkpoint(str(resume))
            version = topo.learner.version
            ray.get(topo.coordinator.set_version.remote(version))
            ray.get(topo.buffer.set_version.remote(version))
        fail_early()
        with step_timer("weight sender (learner rank 0)"):
            topo.weight_address = topo.learner.start_weight_sender(port=cfg.learner.weights.port, publish=True)
            say(f"  weight rendezvous at {topo.weight_address}")
            if version == 0:  # no members yet: publishes version 0 only, so the store is never empty
                publish_initial_weights(topo.learner)
        if cfg.rollout.guide.enable:  # waited for while the engines build: an actor looks it up at its first request
            with step_timer(verifier_step):
                topo.verifier = pending["verifier"].result(timeout=timeout)
                del pending["verifier"]  # kept until then: a failed wait still stops what it started
        with step_timer(f"rollout actors x{cfg.rollout.num_actors}"):
            if launched is not None:
                topo.fleet.join(launched, timeout)
            else:
                topo.fleet.start(cfg.rollout.num_actors, timeout)
        if version > 0:
            with step_timer(f"weight group (resumed at v{version}: first broadcast)"):
                topo.fleet.sync_weights(topo.weight_address)
    except BaseException:
        _collect_started(pending, topo)
        topo.shutdown()
        raise
    finally:
        background.shutdown(wait=False)
    return topo


def _deploy_and_probe(cfg: Config) -> DeploymentHandle:
    """The verifier application, deployed and answering one probe request."""
    from asyncrl.serve.deploy import deploy_verifier

    handle = deploy_verifier(cfg)
    probe_verifier(cfg)
    return handle


def _collect_started(pending: dict[str, Future], topo: Topology) -> None:
    """After a failed start-up step: wait for the background starts still running and hand what
    they started to `topo`, so its shutdown stops them too. A verifier whose deployment or probe
    failed may still have started Serve: stopped here."""
    for what, future in pending.items():
        try:
            started = future.result(timeout=60)
        except BaseException:  # noqa: BLE001 - its own failure is not the one being reported
            if what == "verifier":
                _stop_serve()
            continue
        if what == "weight store":
            topo.weight_store = started
        elif what == "learner":
            topo.learner, topo.learner_placement = started, None  # the group's shutdown removes its placement
        else:
            topo.verifier = started


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

    from asyncrl.actors.guided import render_verifier_messages
    from asyncrl.serve.client import VerifierClient

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
