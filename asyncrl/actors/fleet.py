"""The rollout fleet: every rollout actor of a job, supervised from the driver in one place.

`RolloutFleet` starts actors (engines up, enrolled in the weight group), runs and stops their
rollout loops, takes part in each weight round, heals an actor whose loop ended with an error
(its prompts re-issued, its admission tickets released, the process restarted by Ray with the
newest weights), scales the fleet up or down on `asyncrl.ctl scale`, gathers the actors' metrics,
and shuts them down. The fleet is never paused for the learner: each actor is paced only by the
buffer's admission tickets.

Contracts:
- An actor is killed one way: `shutdown()` with a timeout, then `ray.kill(no_restart=True)`.
- Heal never restarts an actor forever: the same error `cluster.max_identical_failures` times in
  a row raises `RepeatedFailure` (a restart cannot fix an unreachable address); a trained step
  (`forget_failures`) clears the count.
- The weight round is the fleet's: every actor's receive side is posted before the learner's
  broadcast blocks, and a dead actor yields an error result instead of failing the round (the
  next heal restarts it). The learner side reaches the fleet only through `LearnerWeights`, so
  this module imports nothing of `asyncrl.learner`.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.startup import RepeatedFailure, say

if TYPE_CHECKING:
    from ray.actor import ActorClass, ActorHandle
    from ray.types import ObjectRef

    from asyncrl.config import Config

# Per-actor metrics that add up over the fleet; every other number is averaged over the actors.
SUMMED_STATS = ("rollout/tokens_per_s", "rollout/groups_per_s", "rollout/groups_pushed", "rollout/groups_failed",
                "rollout/groups_dropped_verifier_error", "rollout/groups_reissued_verifier_error",
                "rollout/policy_tokens", "rollout/groups_in_flight")


def merge_actor_stats(per_actor: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The fleet's numbers from each actor's `stats()`: `SUMMED_STATS` added up, every other number
    averaged over the actors that report it; `perf/rollout_idle_ratio` is the mean idle ratio."""
    if not per_actor:
        return {}
    out: dict[str, Any] = {}
    keys = {k for s in per_actor.values() for k in s}
    for key in keys:
        values = [s[key] for s in per_actor.values() if isinstance(s.get(key), (int, float))]
        if not values:
            continue
        out[key] = sum(values) if key in SUMMED_STATS else sum(values) / len(values)
    out["perf/rollout_idle_ratio"] = out.get("rollout/idle_ratio", 0.0)
    return out


class LearnerWeights(Protocol):
    """The learner side of the weight wire, as the fleet uses it (asyncrl.learner.group.LearnerGroup)."""

    def add_receivers(self, members: list[str]) -> None: ...

    def remove_receivers(self, members: list[str]) -> None: ...

    def broadcast_weights(self) -> dict[str, Any]: ...


def launch_actors(cfg: Config, actor_cls: ActorClass, namespace: str, buffer: ActorHandle, count: int, *,
                  first_index: int = 0, buffer_address: str = "") -> dict[str, tuple[ActorHandle, ObjectRef]]:
    """Create `count` rollout actors (`rollout-<first_index>`, ...) and begin their `start()` (the
    engine builds) without waiting: {actor id: (handle, its start)}. An actor given no
    `buffer_address` asks `buffer` for it once its engine is up, so the engines can build while the
    buffer, the coordinator and the learner start; `RolloutFleet.join` finishes the start."""
    pending = {}
    for index in range(first_index, first_index + count):
        actor_id = f"rollout-{index}"
        actor = actor_cls.options(name=actor_id, resources=cfg.cluster.resources.get("rollout")).remote(
            cfg.model_dump_json(), actor_id, buffer_address, namespace, buffer)
        pending[actor_id] = (actor, actor.start.remote())
    return pending


class RolloutFleet:
    def __init__(self, cfg: Config, actor_cls: ActorClass, *, buffer_address: str, namespace: str,
                 coordinator: ActorHandle | None, buffer: ActorHandle, learner: LearnerWeights | None) -> None:
        self.cfg = cfg
        self.actor_cls = actor_cls
        self.buffer_address = buffer_address
        self.namespace = namespace
        self.coordinator = coordinator
        self.buffer = buffer
        self.learner = learner  # replaced when the learner is rebuilt (asyncrl.job.recovery)
        self.actors: dict[str, ActorHandle] = {}
        self.loops: dict[str, ObjectRef] = {}  # actor id -> its running `run()` call
        self.next_index = 0  # actor ids are never reused: rollout-0, rollout-1, ...
        self._failures: dict[str, tuple[str, int]] = {}  # actor -> (error signature, times in a row)
        self._stats: dict[str, dict[str, Any]] = {}  # each actor's latest `stats()` (for status.json)
        self._launching: dict[str, ActorHandle] = {}  # launched, not joined yet (killed by shutdown too)

    def __len__(self) -> int:
        return len(self.actors)

    # ------------------------------------------------------------------ start, enrol, withdraw
    def start(self, count: int, timeout: float) -> list[str]:
        """Start `count` new rollout actors (engines up) and enrol them in the weight group."""
        return self.join(self.launch(count), timeout)

    def launch(self, count: int) -> dict[str, tuple[ActorHandle, ObjectRef]]:
        """Create `count` new actors and begin their `start()` (the engine builds) without waiting,
        so the driver can start other components meanwhile; `join` finishes the start."""
        pending = launch_actors(self.cfg, self.actor_cls, self.namespace, self.buffer, count,
                                first_index=self.next_index, buffer_address=self.buffer_address)
        self.next_index += count
        self._launching.update({aid: actor for aid, (actor, _) in pending.items()})
        return pending

    def join(self, pending: dict[str, tuple[ActorHandle, ObjectRef]], timeout: float) -> list[str]:
        """Wait for `launch`ed actors' engines, then enrol them in the weight group (the learner
        must exist by now)."""
        import ray

        reports = ray.get([ref for _, ref in pending.values()], timeout=timeout)
        for report in reports:
            core = f", engine core {report['engine_core']}" if report.get("engine_core") else ""
            say(f"  {report['actor_id']} on {report.get('host', '?')}: engine up in {report['start_s']:.1f}s "
                f"(weights v{report['version']}{core})")
        self.actors.update({aid: actor for aid, (actor, _) in pending.items()})
        for aid in pending:
            self._launching.pop(aid, None)
            self.next_index = max(self.next_index, int(aid.rsplit("-", 1)[1]) + 1)  # launched before the fleet existed
        self.enrol(list(pending))
        return list(pending)

    def enrol(self, actor_ids: list[str], *, remove_first: bool = False) -> None:
        """(Re-)enrol actors in the weight group; the group is rebuilt at the next broadcast."""
        import ray

        members = [m for aid in actor_ids for m in ray.get(self.actors[aid].weight_members.remote())]
        if remove_first:
            self.learner.remove_receivers(members)
        self.learner.add_receivers(members)

    def withdraw(self, actor_ids: list[str]) -> None:
        """Take actors out of the weight group (one member per tensor-parallel rank)."""
        members = [f"{aid}/tp{r}" for aid in actor_ids for r in range(max(1, self.cfg.rollout.gpus_per_actor))]
        self.learner.remove_receivers(members)

    def running(self) -> list[str]:
        """The actors whose rollout loop was started and not stopped."""
        return [a for a in self.loops if a in self.actors]

    # ------------------------------------------------------------------ weights
    def sync_weights(self, address: str) -> dict[str, Any]:
        """One broadcast of the learner's current version to every engine: the actors join the round
        (or catch up from the weight store if they are not members), the learner sends bucket by
        bucket under its watchdog. Returns the sender's report plus each actor's result."""
        import ray

        refs = {aid: a.receive_weights.remote(address) for aid, a in self.actors.items()}
        report = self.learner.broadcast_weights()
        results: dict[str, Any] = {}
        wait = 4 * self.cfg.learner.weights.timeout_s + 30
        for aid, ref in refs.items():
            try:
                results[aid] = ray.get(ref, timeout=wait)
            except Exception as exc:  # noqa: BLE001 - a dead actor is healed after the step
                results[aid] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        return {"report": report, "actors": results, "dropped": report.get("dropped", []) if report else []}

    # ------------------------------------------------------------------ rollout loops
    def start_loops(self, actor_ids: list[str] | None = None) -> None:
        for aid in list(self.actors) if actor_ids is None else actor_ids:
            self.loops[aid] = self.actors[aid].run.remote()

    def stop_loops(self, actor_ids: list[str] | None = None, timeout: float = 60.0, *,
                   abandon_in_flight: bool = False) -> None:
        """Ask the loops of `actor_ids` (None: all) to stop and wait for them to end; their groups
        in flight finish first, or are abandoned (prompts re-issued) with `abandon_in_flight`."""
        import ray

        ids = list(self.loops) if actor_ids is None else actor_ids
        for aid in ids:
            actor = self.actors.get(aid)
            if actor is not None:
                actor.stop.remote(abandon_in_flight)
        refs = [self.loops.pop(aid) for aid in ids if aid in self.loops]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout)

    # ------------------------------------------------------------------ heal
    def heal(self) -> None:
        """A rollout loop that ended with an error means its actor died: Ray restarts the process
        (max_restarts); its prompts are re-issued and its admission tickets released, it is started
        again with the newest weights and the weight group is rebuilt."""
        import ray

        if not self.loops:
            return
        done, _ = ray.wait(list(self.loops.values()), num_returns=len(self.loops), timeout=0)
        changed = False
        for ref in done:
            aid = next(a for a, r in self.loops.items() if r == ref)
            try:
                ray.get(ref)
                continue  # ended normally (stop requested)
            except Exception as exc:  # noqa: BLE001 - actor death is expected here; we heal it
                self._count_failure(aid, exc)
                say(f"{aid} died ({type(exc).__name__}); re-issuing its prompts and restarting it")
            lost = ray.get(self.coordinator.abandon_actor.remote(aid))
            released = ray.get(self.buffer.release_actor.remote(aid))  # its admission tickets
            if released:
                say(f"  released {released} admission ticket(s) held by {aid}")
            self.loops.pop(aid)
            try:
                report = self._start_restarted(aid)
                say(f"{aid} restarted at weights v{report['version']} ({lost} prompt(s) re-issued)")
                self.start_loops([aid])
            except Exception as exc:  # noqa: BLE001 - a restart that fails removes the actor
                say(f"{aid} could not be restarted ({exc}); removing it")
                ray.kill(self.actors.pop(aid), no_restart=True)  # no shutdown(): its process is broken
            changed = True
        if changed:
            self.enrol(self.running(), remove_first=True)

    def forget_failures(self) -> None:
        """A trained step: earlier actor failures were not a persistent fault."""
        self._failures.clear()

    def _count_failure(self, aid: str, exc: BaseException) -> None:
        """Raise RepeatedFailure once `aid` failed `cluster.max_identical_failures` times in a row
        with the same error (a restart cannot fix an unreachable address)."""
        cause = getattr(exc, "cause", None) or exc
        text = f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"
        signature = re.sub(r"\d+(\.\d+)?s\b", "Ns", text)  # "within 30.0s" and the like do not make it new
        last, count = self._failures.get(aid, ("", 0))
        count = count + 1 if signature == last else 1
        self._failures[aid] = (signature, count)
        if count >= self.cfg.cluster.max_identical_failures:
            ip = re.search(r"\bip[=:] ?(\d{1,3}(?:\.\d{1,3}){3})", str(exc))
            host = getattr(exc, "ip", None) or (ip.group(1) if ip else "unknown host")
            found = re.search(r"(tcp://[^\s,;)]+|\b\d{1,3}(?:\.\d{1,3}){3}:\d+)", text)
            where = f"; unreachable address: {found.group(1)}" if found else ""
            raise RepeatedFailure(f"{aid} on host {host} failed {count} times in a row with the same error "
                                  f"({text}){where}; stopping instead of restarting it again "
                                  "(python -m asyncrl.doctor --config ... checks every address from every node)")

    def _start_restarted(self, aid: str) -> dict[str, Any]:
        """`start()` on an actor Ray is restarting: "temporarily unavailable" while its new process
        comes up is waited out (up to cluster.startup_timeout_s), not taken for a failed restart."""
        import ray

        actor, deadline = self.actors[aid], time.time() + self.cfg.cluster.startup_timeout_s
        while True:  # a cheap call first: `start` is sent once, to the new process
            try:
                ray.get(actor.pid.remote(), timeout=max(1.0, deadline - time.time()))
                break
            except ray.exceptions.ActorUnavailableError:
                if time.time() >= deadline:
                    raise
                time.sleep(1.0)
        return ray.get(actor.start.remote(), timeout=max(1.0, deadline - time.time()))

    # ------------------------------------------------------------------ scale, shut down
    def scale(self, n: int, timeout: float) -> dict[str, Any]:
        """`n` rollout actors: new ones started and running, or the newest removed (their prompts
        re-issued, out of the weight group, shut down)."""
        import ray

        current = list(self.actors)
        if n > len(current):
            added = self.start(n - len(current), timeout)
            self.start_loops(added)
            return {"ok": True, "added": added, "actors": sorted(self.actors)}
        removed = current[n:]
        self.withdraw(removed)
        self.stop_loops(removed)
        for aid in removed:
            ray.get(self.coordinator.abandon_actor.remote(aid))
            self._kill(self.actors.pop(aid))
        return {"ok": True, "removed": removed, "actors": sorted(self.actors)}

    def shutdown(self) -> None:
        """Every actor (and any launched but not joined) shut down at once, then killed."""
        self._kill_all([*self.actors.values(), *self._launching.values()])
        self.actors.clear()
        self._launching.clear()
        self.loops.clear()

    @staticmethod
    def _kill(actor: ActorHandle, timeout: float = 15.0) -> None:
        """The one way an actor is removed: its own shutdown (engine and child processes), bounded
        by `timeout`, then `ray.kill(no_restart=True)` so Ray does not bring it back."""
        RolloutFleet._kill_all([actor], timeout)

    @staticmethod
    def _kill_all(actors: list[ActorHandle], timeout: float = 15.0) -> None:
        """`_kill` for several actors, their shutdowns running concurrently (one `timeout` for all)."""
        import ray

        refs = []
        for actor in actors:
            try:
                refs.append(actor.shutdown.remote())
            except Exception:  # noqa: BLE001 - a dead handle; the kill below is the backstop
                pass
        deadline = time.monotonic() + timeout
        for ref in refs:
            try:
                ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - it may be dead or stuck; the kill below is the backstop
                pass
        for actor in actors:
            ray.kill(actor, no_restart=True)

    # ------------------------------------------------------------------ evaluation, metrics
    def evaluate(self, rows: list[dict[str, Any]], mode: str, keep: int) -> list[dict[str, Any]]:
        """Greedy evaluation of `rows` split over the actors' engines (current weights); each
        actor's per-mode summaries, with up to `keep` transcripts over all of them."""
        import ray

        actors = list(self.actors.values())
        shards = [rows[i:: len(actors)] for i in range(len(actors))]
        per_shard = -(-keep // max(1, len(actors)))
        return ray.get([a.evaluate.remote(s, mode, per_shard) for a, s in zip(actors, shards, strict=True) if s])

    def stats(self) -> dict[str, Any]:
        """The fleet's rollout metrics since the previous call: rates summed over the actors, the rest
        averaged; an actor that does not answer (dead, healed after the step) is skipped."""
        import ray

        refs = {aid: a.stats.remote() for aid, a in self.actors.items()}
        per_actor = {}
        for aid, ref in refs.items():
            try:
                per_actor[aid] = ray.get(ref, timeout=30)
            except Exception:  # noqa: BLE001 - a dead actor is healed after the step; skip its stats
                continue
        self._stats = per_actor
        return merge_actor_stats(per_actor)

    def status(self) -> dict[str, dict[str, Any]]:
        """Each actor's state for `asyncrl.ctl status`, from the latest `stats()`."""
        out = {}
        for aid in self.actors:
            s = self._stats.get(aid, {})
            out[aid] = {"state": "running" if aid in self.loops else "stopped", "version": s.get("rollout/version"),
                        "tokens_per_s": s.get("rollout/tokens_per_s"),
                        "groups_in_flight": s.get("rollout/groups_in_flight")}
        return out
