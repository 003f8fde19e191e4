"""What the job does when one of its parts dies during training (the loop: asyncrl.job.loop).

- A dead learner rank: `LearnerRecovery` rebuilds the learner group in the job from the newest
  checkpoint (the fleet, the verifier and the buffer keep running), rolls the loop back to that
  checkpoint's step and has the rolled-back steps' prompts trained again. It gives up (and the job
  stops for a resume) when recovery is off, its `cluster.max_restarts` are spent, or the rebuild fails.
- A restarted buffer host or coordinator (Ray restarts both): `ServiceWatch` notices the restart
  once, re-issues the prompts whose groups died with the buffer, and re-issues the prompts of
  stale-dropped groups (`buffer.reissue_stale`).
- Anything else: `stop_on_failure` names the component and its host in one line, writes the
  traceback to `error.log` and an emergency checkpoint of what is still alive, and returns exit 3.

Invariant kept by all three: a prompt the learner trained is never issued again, and a prompt taken
from the buffer but not trained is issued again (never lost) — `Progress` holds both sets.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.job.topology import describe_failure
from asyncrl.startup import one_line, root_cause, say

if TYPE_CHECKING:
    from collections.abc import Callable

    from asyncrl.actors.fleet import RolloutFleet
    from asyncrl.config import Config
    from asyncrl.job.topology import Topology
    from asyncrl.metrics import MetricLogger

RECENT_PROMPTS = 8192  # prompt indices remembered as trained (a buffer restart may re-deliver their groups)


@dataclass
class Progress:
    """Where the loop stands: what checkpoints record and recovery rolls back."""

    step: int
    version: int
    trained_recent: dict[int, None] = field(default_factory=dict)  # prompt indices trained lately (ordered set)
    taken: list[dict[str, Any]] = field(default_factory=list)  # groups of the step in progress, not trained yet
    pending_row: dict[str, Any] | None = None  # metrics of a trained step whose row is not logged yet

    def mark_trained(self, prompt_indices: list[int]) -> None:
        for i in prompt_indices:
            self.trained_recent[i] = None
        while len(self.trained_recent) > RECENT_PROMPTS:
            self.trained_recent.pop(next(iter(self.trained_recent)))


def mark_resume(run_dir: Path, step: int, source: Path | str) -> None:
    """A `resumed_from` row in metrics.jsonl: the steps after `step` are trained again (readers keep,
    for each step, the row after the newest marker: asyncrl.metrics.effective_rows)."""
    path = run_dir / "metrics.jsonl"
    last = 0
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                last = max(last, int(json.loads(line).get("step", 0)))
            except (ValueError, AttributeError):
                continue
    row = {"step": step, "time": time.time(), "resumed_from": str(source), "rolled_back_steps": max(0, last - step)}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    if last > step:
        say(f"resumed from {source} (step {step}): steps {step + 1}..{last} are trained again")


def prompts_to_retrain(rows: list[dict[str, Any]], back_to: int, taken: list[dict[str, Any]]) -> list[int]:
    """Prompts trained after step `back_to` (from the logged rows) and those of the step in progress."""
    redo = [int(i) for r in rows if int(r.get("step", 0)) > back_to for i in r.get("train/prompt_indices", [])]
    redo += [m["prompt_index"] for m in taken]
    return [i for i in redo if i >= 0]


class LearnerRecovery:
    """Rebuilds a dead learner group in the job (see the module docstring)."""

    def __init__(self, cfg: Config, topo: Topology, fleet: RolloutFleet, run_dir: Path):
        self.cfg, self.topo, self.fleet, self.run_dir = cfg, topo, fleet, run_dir
        self.recoveries = 0

    def applies(self, component: str) -> bool:
        limit = self.cfg.cluster.max_restarts
        return (component.startswith("learner") and self.cfg.trainer.recover_learner
                and (limit < 0 or self.recoveries < limit))

    def recover(self, exc: BaseException, progress: Progress, logger: MetricLogger) -> bool:
        """False when `exc` is not a learner death or cannot be recovered here; raises when the
        rebuild itself fails (the error path then stops the job for a resume)."""
        import ray

        from asyncrl.learner.checkpoint import latest_checkpoint

        component, host, reason = describe_failure(self.topo, exc)
        if not self.applies(component):
            return False
        self.recoveries += 1
        topo, t0 = self.topo, time.time()
        newest = latest_checkpoint(self.run_dir / "checkpoints")
        k = int(json.loads((newest / "run_state.json").read_text())["step"]) if newest else 0
        say(f"{component} on {host} died ({reason}); recovering: rebuilding the learner group in this job from "
            f"{newest or 'the initial model'} (steps {k + 1}..{progress.step} are trained again); rollout actors, "
            "verifier and buffer keep running")
        label = self._rebuild(newest, progress.version, exc)
        redo = prompts_to_retrain(logger.rows, k, progress.taken)
        for i in redo:
            progress.trained_recent.pop(i, None)
        ray.get(topo.coordinator.untrain.remote(redo))
        # groups the dead rank 0 had fetched (or prefetched) and not trained: neither in the
        # buffer nor trained, so the coordinator issues their prompts again
        redo += ray.get(topo.coordinator.reissue_lost.remote(ray.get(topo.buffer.prompt_indices.remote())))
        ray.get(topo.coordinator.set_version.remote(label))
        ray.get(topo.buffer.set_version.remote(label))
        logger.rows = [r for r in logger.rows if int(r.get("step", 0)) <= k]
        progress.taken, progress.pending_row = [], None
        progress.step, progress.version = k, label
        mark_resume(self.run_dir, k, newest if newest else Path("initial model"))
        say(f"learner recovered in {time.time() - t0:.1f}s: step {k}, weights v{label}, {len(redo)} prompt(s) "
            "re-issued")
        return True

    def _rebuild(self, newest: Path | None, version: int, cause: BaseException) -> int:
        """The learner group rebuilt from `newest`, under a version number never used before, with a
        new weight rendezvous the fleet is enrolled in; returns that version."""
        topo = self.topo
        try:
            topo.learner.rebuild(newest)
            label = max(version, topo.learner.version) + 1  # a version number never names two policies
            topo.learner.set_version(label)
            topo.weight_address = topo.learner.start_weight_sender(port=self.cfg.learner.weights.port, publish=True)
            self.fleet.enrol(self.fleet.running())
            self.fleet.sync_weights(topo.weight_address)
        except Exception as exc2:  # noqa: BLE001 - cannot rebuild here (e.g. the node is gone): stop for a resume
            say(f"the learner group could not be rebuilt in this job ({type(exc2).__name__}: {exc2})")
            raise exc2 from cause
        return label


class ServiceWatch:
    """Reconciles the job with a restarted buffer host or coordinator and re-issues stale-dropped
    prompts; its counters are the `buffer/reissued_stale` and `buffer/stale_already_pending` keys."""

    def __init__(self, cfg: Config, topo: Topology):
        self.cfg, self.topo = cfg, topo
        self.seen_restarts = {"buffer": 0, "coordinator": 0}
        self.reissued_stale = 0
        self.stale_already_pending = 0

    def reconcile(self, buffer_stats: dict[str, Any], coord: dict[str, Any]) -> tuple[dict[str, Any], list[float]]:
        """Metrics of the reconciliation and the lengths of the groups the buffer dropped as stale."""
        import ray

        topo = self.topo
        restarts = int(buffer_stats.get("buffer/restarts", 0))
        if restarts > self.seen_restarts["buffer"]:
            self.seen_restarts["buffer"] = restarts
            # groups learner rank 0 prefetched are held, not lost (asked before and after the
            # buffer, so that a prefetch answered in between is seen in one of the two)
            held = topo.learner.held_prompts()
            present = held + ray.get(topo.buffer.prompt_indices.remote()) + topo.learner.held_prompts()
            lost = ray.get(topo.coordinator.reissue_lost.remote(present))
            say(f"the replay buffer (BufferHost) on {topo.hosts.get('buffer', '?')} died and was restarted by Ray "
                f"at {topo.buffer_address} (restart {restarts}): recovering; "
                f"{int(buffer_stats.get('buffer/recovered_groups', 0))} group(s) recovered from its durable log, "
                f"{len(lost)} prompt(s) re-issued; rollout actors and the learner reconnected by themselves")
        c_restarts = int(coord.get("restarts", 0))
        if c_restarts > self.seen_restarts["coordinator"]:
            self.seen_restarts["coordinator"] = c_restarts
            say(f"the coordinator on {topo.hosts.get('coordinator', '?')} died and was restarted by Ray "
                f"(restart {c_restarts}): recovering; cursor and in-flight prompts restored from its state file")
        from asyncrl.job.coordinator import counter_metrics

        out: dict[str, Any] = dict(counter_metrics(coord))
        dropped = ray.get(topo.buffer.take_dropped.remote())
        if dropped and self.cfg.buffer.reissue_stale:
            added = ray.get(topo.coordinator.reissue.remote([i for i, _ in dropped], "stale"))
            self.reissued_stale += added
            # the rest were pending already (e.g. re-issued as lost after a learner or buffer death)
            # or trained meanwhile: explained, not issued twice
            self.stale_already_pending += len(dropped) - added
        out["buffer/reissued_stale"] = float(self.reissued_stale)
        out["buffer/stale_already_pending"] = float(self.stale_already_pending)
        return out, [float(n) for _, n in dropped]


def stop_on_failure(exc: BaseException, topo: Topology, run_dir: Path, progress: Progress, logger: MetricLogger,
                    checkpoint: Callable[[], Path]) -> int:
    """A component died and the job cannot go on: one line naming it, its host and what happens,
    the traceback to `error.log`, then `checkpoint()` of everything still alive. Returns the exit
    status (3: restart with trainer.resume=auto)."""
    import traceback

    from asyncrl.failure_watch import JobStop, stop_named
    from asyncrl.learner.checkpoint import latest_checkpoint

    if isinstance(exc, JobStop):  # the job's own named reason (reward function, divergence, disk)
        return stop_named(exc, run_dir, progress, logger, checkpoint)
    component, host, reason = describe_failure(topo, exc)
    log = run_dir / "error.log"
    log.write_text("".join(traceback.format_exception(exc)))
    learner_alive = not component.startswith("learner")
    plan = ("writing a checkpoint of the learner, buffer and cursor" if learner_alive else
            "the learner's state is gone: the newest checkpoint is what a resume starts from")
    verb = "failed" if component.startswith("the trainer") else "died"
    say(f"{component} on {host} {verb} ({reason}); stopping at step {progress.step}: {plan}, then exiting "
        f"with status 3 (restart with trainer.resume=auto). Traceback: {log}")
    if learner_alive and progress.pending_row is not None:  # the learner trained this step: it counts
        progress.step += 1
        logger.log(progress.step, {**progress.pending_row, "error": f"{component} died during this step"})
        progress.pending_row = None
    if learner_alive:
        try:
            checkpoint()
        except Exception as exc2:  # noqa: BLE001 - already failing; say what could not be written
            say(f"the emergency checkpoint could not be written: {one_line(root_cause(exc2))}")
    newest = latest_checkpoint(run_dir / "checkpoints")
    say(f"newest checkpoint: {newest if newest else 'none (a resume starts from scratch)'}")
    try:
        logger.close()
    except Exception as exc3:  # noqa: BLE001 - already failing; the sinks' files are flushed per row
        say(f"the metric sinks could not be closed: {type(exc3).__name__}: {exc3}")
    return 3
