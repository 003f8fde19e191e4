"""The learner-paced training loop of a running job (its components: asyncrl.job.topology).

Per step: learner rank 0 takes a batch of B groups for its version from the replay buffer itself
(asyncrl.learner.feed; waiting is `perf/learner_idle_ratio`) and the driver gets only their
metadata (prompt indices, versions, rewards, token counts: no sample bytes, `perf/driver_bytes`);
the learner trains, bumps the version and the rollout fleet takes the new weights
(asyncrl.actors.fleet.RolloutFleet.sync_weights, `perf/weight_sync_s`); then the step's metrics
are logged under one step, control commands from `asyncrl.ctl` are executed (asyncrl.job.commands), the
fleet heals its dead actors, and checkpoints (asyncrl.job.checkpoint) and evaluations
(asyncrl.eval.evaluate_on_fleet) happen on their schedule. The loop stops at `trainer.max_steps`,
on a signal or on `asyncrl.ctl stop`. Deaths are handled by asyncrl.job.recovery: a dead learner rank
is rebuilt in the job, any other death ends the job with a checkpoint. The fleet is never paused
for the learner: it is paced only by the buffer's admission tickets (staleness bound).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config
from asyncrl.eval import EVAL_KEYS, evaluate_on_fleet
from asyncrl.failure_watch import DivergenceWatch, FailureWatch, JobStop, verifier_name
from asyncrl.job.checkpoint import write_job_checkpoint
from asyncrl.job.commands import run_queued
from asyncrl.job.disk_watch import (
    DiskFull,
    DiskWatch,
    buffer_log_full,
    emergency_root,
    is_disk_full,
    remove_partial,
)
from asyncrl.job.recovery import LearnerRecovery, Progress, ServiceWatch, mark_resume, stop_on_failure
from asyncrl.job.step_metrics import GroupLengths, StepClock, batch_metrics
from asyncrl.job.topology import Topology
from asyncrl.logs import console
from asyncrl.metrics import MetricLogger, ProgressDisplay
from asyncrl.startup import say

if TYPE_CHECKING:
    from asyncrl.actors.fleet import RolloutFleet
    from asyncrl.startup import StopFlag


class Trainer:
    """The loop over a built topology; every piece of its state is set here, in `__init__`."""

    def __init__(self, cfg: Config, topo: Topology, run_dir: Path, stop: StopFlag, resume: Path | None):
        assert topo.fleet is not None and topo.learner is not None, "a built topology"
        self.cfg, self.topo, self.run_dir, self.stop, self.resume = cfg, topo, run_dir, stop, resume
        self.fleet: RolloutFleet = topo.fleet
        self.logger = MetricLogger(run_dir, cfg.trainer.logger, cfg.trainer.project_name,
                                   cfg.trainer.experiment_name, cfg.model_dump(mode="json"))
        version = topo.learner.version
        step = version  # one learner step = one policy version
        if resume is not None and (resume / "run_state.json").exists():
            step = int(json.loads((resume / "run_state.json").read_text())["step"])
        self.progress = Progress(step=step, version=version)
        self.learner_recovery = LearnerRecovery(cfg, topo, self.fleet, run_dir)
        self.services = ServiceWatch(cfg, topo)
        self.failures = FailureWatch(self.fleet, outage_wait_s=cfg.verifier.outage_wait_s,
                                     verifier=verifier_name(cfg))  # failures said once, fatal ones stop the job
        self.divergence = DivergenceWatch(cfg.learner.max_nonfinite_steps, run_dir / "checkpoints")
        self.disk = DiskWatch(run_dir, cfg.trainer.min_free_disk_mb, cfg.trainer.disk_full_wait_s,
                              lambda admitting: topo.coordinator.set_admitting.remote(admitting),
                              buffer_log_full=lambda: buffer_log_full(topo.buffer))
        self.lengths = GroupLengths()
        self.clock = StepClock()
        self.summary: dict[str, Any] = {}  # the evaluations before/after (summary.json)
        self.duplicates_dropped = 0  # groups re-delivered across a buffer restart, dropped
        self.stop_requested_by_ctl = False
        self.last_batch_version: int | None = None  # version that trained the latest batch (None: no batch yet)
        if resume is not None:
            mark_resume(run_dir, step, resume)
        self.t_start = time.time()
        self.t_loop = self.t_start  # the ETA counts training time only (reset when the loop starts)
        self.first_step = step  # steps of this process (a resumed run starts later): for the ETA

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def version(self) -> int:
        return self.progress.version

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Steps until a stop condition, then a final checkpoint and evaluation; returns the summary."""
        import ray

        cfg = self.cfg
        if cfg.trainer.eval_before_after and cfg.data.test_files and self.resume is None:
            self.summary["before"] = self.evaluate("test", tag="before")
        self.fleet.start_loops()
        shown = ProgressDisplay(cfg.trainer.max_steps, self.step, console())
        self.t_loop = time.time()
        while self.step < cfg.trainer.max_steps and not self.stop.requested and not self.stop_requested_by_ctl:
            try:
                metrics = self.train_one_step()
            except JobStop:
                raise  # a named stop (asyncrl.failure_watch): nothing to recover
            except Exception as exc:  # noqa: BLE001 - a dead learner rank is recovered in the job if possible
                if not self.learner_recovery.recover(exc, self.progress, self.logger):
                    raise
                continue
            if metrics is None:
                break
            self.progress.step += 1
            self.fleet.forget_failures()  # a trained step: earlier failures were not a persistent fault
            self.logger.log(self.step, metrics)
            shown.step(self.step, metrics)
            self.after_step(metrics)
        shown.close()
        # Graceful end: no new groups; what is in flight is abandoned (not waited for: nothing would
        # train it) and re-issued on resume.
        ray.get(self.topo.coordinator.set_stopping.remote())
        self.fleet.stop_loops(abandon_in_flight=True)
        self.checkpoint()
        if cfg.trainer.eval_before_after and cfg.data.test_files and not self.stop.requested:
            self.summary["after"] = self.evaluate("test", tag="after")
        self.dump_samples(f"step_{self.step}")
        return self.run_summary()

    def after_step(self, metrics: dict[str, Any]) -> None:
        """Status, ctl commands, healing, and the scheduled checkpoint and evaluation."""
        cfg = self.cfg
        self.publish_status(metrics)
        run_queued(self)
        self.fleet.heal()
        if cfg.trainer.save_every > 0 and self.step % cfg.trainer.save_every == 0:
            self.checkpoint()
        if cfg.trainer.eval_every > 0 and self.step % cfg.trainer.eval_every == 0 and cfg.data.val_files:
            self.dump_samples(f"step_{self.step}")
            result = self.evaluate("val", tag=f"step_{self.step}")
            self.logger.log(self.step, {f"eval/{k}": v for k, v in result.items() if k in EVAL_KEYS})

    def train_one_step(self) -> dict[str, Any] | None:
        """One batch fetched, trained and synced to the fleet; the step's metrics (None: stopping)."""
        import ray

        cfg, topo, progress = self.cfg, self.topo, self.progress
        t0 = time.time()
        metas = self.get_batch(cfg.data.rollout_batch_size, cfg.learner.batch_timeout_s)
        t_batch = time.time()
        if not metas:  # stopping while waiting: nothing taken from the buffer, nothing to train
            return None
        progress.taken = metas  # taken from the buffer, not trained yet (re-issued if the learner dies now)
        # (a partial batch only happens while stopping: it is trained rather than lost)
        lags = [self.version - m["min_version"] for m in metas]
        self.last_batch_version = self.version
        last = self.step + 1 >= cfg.trainer.max_steps or self.stop.requested or self.stop_requested_by_ctl
        prefetch = (None if last or not cfg.learner.prefetch else
                    (cfg.data.rollout_batch_size, self.version + 1, min(cfg.learner.batch_timeout_s, 30.0)))
        learner_metrics = topo.learner.train_fetched([m["id"] for m in metas], prefetch)
        t1 = time.time()
        # Trained from here on: if the step fails before its row is logged, the error path logs it
        # (the learner's state includes it) and no checkpoint may list these prompts as pending.
        progress.mark_trained([m["prompt_index"] for m in metas])
        self.divergence.observe(self.step + 1, learner_metrics)
        batch = batch_metrics(metas, lags, cfg.buffer.max_staleness)
        progress.pending_row = {**learner_metrics, **batch}
        progress.version = int(learner_metrics.get("train/version", self.version + 1))
        self.fleet.heal()  # a dead engine found now is withdrawn before the broadcast waits for it
        sync = self.fleet.sync_weights(topo.weight_address)
        t2 = time.time()
        trained = [m["prompt_index"] for m in metas]
        coord = ray.get(topo.coordinator.set_version.remote(self.version, [i for i in trained if i >= 0]))
        if cfg.buffer.staleness == "drift" and "train/seq_mismatch_kl" in learner_metrics:  # drift pacing
            ray.get(topo.buffer.observe_drift.remote(learner_metrics["train/seq_mismatch_kl"], cfg.buffer.drift_budget))
        progress.taken = []
        metrics = {**learner_metrics, **ray.get(topo.buffer.stats.remote())}
        reconciled, dropped_lengths = self.services.reconcile(metrics, coord or {})
        self.lengths.add(metas, dropped_lengths)
        metrics.update({**reconciled, **self.lengths.metrics(), **self.fleet.stats(), **batch,
                        "train/duplicates_dropped": float(self.duplicates_dropped),
                        **self.clock.perf(metas, wait_s=t_batch - t0, train_s=t1 - t_batch, sync_s=t2 - t1, sync=sync,
                                          actors=len(self.fleet))})
        for aid in sync.get("dropped", []):
            say(f"weight sync watchdog dropped {aid}; it catches up from the weight store")
        progress.pending_row = None
        return metrics

    def get_batch(self, num_groups: int, timeout_s: float) -> list[dict[str, Any]]:
        """Metadata of exactly `num_groups` groups for the current version, fetched by learner rank 0
        (the buffer may answer with fewer when its wait times out; keep asking until the deadline,
        then fail with a message). Groups of prompts trained lately (re-delivered across a buffer
        restart) are left out: rank 0 drops every fetched group the step does not name."""
        metas: list[dict[str, Any]] = []
        deadline = time.time() + timeout_s
        while len(metas) < num_groups:
            left = deadline - time.time()
            if left <= 0 or self.stop.requested:
                break
            self.failures.check()  # a broken reward function stops the job now, not at the batch timeout
            self.disk.check()  # a full disk pauses admission (its own limit replaces the batch timeout)
            if self.disk.paused or self.failures.outage:  # their own limits replace the batch timeout
                deadline = max(deadline, time.time() + 5.0)
            got = self.topo.learner.fetch(self.topo.buffer_address, num_groups - len(metas), self.version,
                                          min(left, 5.0))
            fresh = [m for m in got if m["prompt_index"] not in self.progress.trained_recent]
            self.duplicates_dropped += len(got) - len(fresh)
            metas += fresh
            if len(metas) < num_groups:
                self.fleet.heal()
        if len(metas) < num_groups and not self.stop.requested:
            raise RuntimeError(f"the learner got {len(metas)}/{num_groups} groups in learner.batch_timeout_s="
                               f"{timeout_s:.0f}s: is the rollout fleet alive? (asyncrl.ctl status)")
        return metas

    # ------------------------------------------------------------------ what the loop reports
    def publish_status(self, m: dict[str, Any]) -> None:
        """What `asyncrl.ctl status` prints: held by the coordinator (`--live`) and written to
        `<run_dir>/status.json` (asyncrl.job.status), which ctl reads without joining Ray."""
        from asyncrl.job.status import job_status, write_status

        steps_here = self.step - self.first_step
        eta = (time.time() - self.t_loop) / steps_here * (self.cfg.trainer.max_steps - self.step) if steps_here > 0 else None
        status = job_status(self.cfg, self.fleet, self.run_dir, self.step, self.version, m,
                            elapsed_s=time.time() - self.t_start, eta_s=eta)
        self.topo.coordinator.set_status.remote(status)
        write_status(self.run_dir, status)

    def dump_samples(self, tag: str) -> None:
        """A few decoded trajectories of the latest trained batch, for a person to read (asked of
        learner rank 0, which holds the batch: a little JSON, not the sample arrays)."""
        if self.last_batch_version is None:
            return
        out = self.topo.learner.sample_records(self.cfg.trainer.samples_per_eval)
        for rec in out:
            rec["version_lag"] = self.last_batch_version - int(rec["min_version"])
        if out:
            (self.run_dir / "samples" / f"train_{tag}.json").write_text(json.dumps(out, indent=2, default=str))

    def run_summary(self) -> dict[str, Any]:
        """summary.json: the evaluations before/after and the run's totals."""
        return {**self.summary, "steps": self.step, "version": self.version,
                **self.clock.summary(time.time() - self.t_start)}

    def evaluate(self, split: str, tag: str) -> dict[str, Any]:
        return evaluate_on_fleet(self.cfg, self.fleet, self.version, self.run_dir, split, tag)

    def checkpoint(self, emergency: bool = False, root: Path | None = None) -> Path | None:
        """The job's checkpoint; None when the disk has no room for it (said aloud, training goes
        on; on the error path the failure propagates to `stop_on_failure`, which says it)."""
        from asyncrl.learner.checkpoint import CheckpointNoRoom

        try:
            return write_job_checkpoint(self.topo, self.run_dir, self.progress, len(self.fleet), emergency, root)
        except CheckpointNoRoom as exc:
            if emergency:
                raise
            say(f"checkpoint at step {self.step} skipped: {exc}")
            return None

    def on_failure(self, exc: BaseException) -> int:
        """The job cannot go on (asyncrl.job.recovery.stop_on_failure); the exit status. A full disk behind
        it: `DiskFull`, with the emergency checkpoint written elsewhere (asyncrl.job.disk_watch)."""
        if is_disk_full(exc):
            if not isinstance(exc, DiskFull):
                from asyncrl.startup import one_line, root_cause

                full = DiskFull(f"a write of the job failed on a full disk ({one_line(root_cause(exc), 300)})")
                full.__cause__ = exc
                exc = full
            remove_partial(self.run_dir / "checkpoints")
            root = emergency_root(self.cfg.trainer.emergency_dir, self.run_dir)
            return stop_on_failure(exc, self.topo, self.run_dir, self.progress, self.logger,
                                   lambda: self.checkpoint(emergency=True, root=root))
        return stop_on_failure(exc, self.topo, self.run_dir, self.progress, self.logger,
                               lambda: self.checkpoint(emergency=True))
