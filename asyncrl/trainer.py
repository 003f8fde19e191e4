"""The learner-paced training loop of a running job (its components: asyncrl.topology).

Per step: learner rank 0 takes a batch of B groups for its version from the replay buffer itself
(asyncrl.learner.feed; waiting is `perf/learner_idle_ratio`) and the driver gets only their
metadata (prompt indices, versions, rewards, token counts: no sample bytes, `perf/driver_bytes`);
the learner trains, bumps the version and the rollout fleet takes the new weights
(asyncrl.actors.fleet.RolloutFleet.sync_weights, `perf/weight_sync_s`); then metrics from every
part are logged under one step, control commands from `asyncrl.ctl` are executed (`ctl_handlers`),
the fleet heals its dead actors, and checkpoints/evaluations happen on their schedule. A dead
learner rank is rebuilt in the job from the newest checkpoint (`recover_learner`); any other
death ends the job with a checkpoint (`on_failure`). The fleet is never paused for the learner:
it is paced only by the buffer's admission tickets (staleness bound).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config, VerifierConfig
from asyncrl.eval import EVAL_KEYS, merge_shards, print_summary
from asyncrl.logs import console
from asyncrl.metrics import MetricLogger, format_console, progress_every, save_plots
from asyncrl.startup import say
from asyncrl.topology import Topology, describe_failure

if TYPE_CHECKING:
    from collections.abc import Callable

    from asyncrl.actors.fleet import RolloutFleet
    from asyncrl.startup import StopFlag


class Trainer:
    def __init__(self, cfg: Config, topo: Topology, run_dir: Path, stop: StopFlag, resume: Path | None):
        self.cfg = cfg
        self.topo = topo
        assert topo.fleet is not None and topo.learner is not None, "a built topology"
        self.fleet: RolloutFleet = topo.fleet
        self.run_dir = run_dir
        self.stop = stop
        self.resume = resume
        self.logger = MetricLogger(run_dir, cfg.trainer.logger, cfg.trainer.project_name,
                                   cfg.trainer.experiment_name, cfg.model_dump(mode="json"))
        self.version = topo.learner.version
        self.step = topo.learner.version  # one learner step = one policy version
        if resume is not None and (resume / "run_state.json").exists():
            self.step = int(json.loads((resume / "run_state.json").read_text())["step"])
        self.summary: dict[str, Any] = {}
        from asyncrl.replay import BufferClient

        curve = cfg.buffer.curve if cfg.buffer.curve.enable else None  # the learner is a client like the actors
        self.buffer_client = BufferClient(topo.buffer_address, curve, actor_id="learner")
        self._trained_recent: dict[int, None] = {}  # prompt indices trained lately (ordered set)
        self._seen = {"buffer/restarts": 0, "coordinator/restarts": 0}
        self._lengths: dict[str, list[float]] = {"dropped": [], "trained": []}
        self._reissued_stale = 0
        self._stale_already_pending = 0
        self.duplicates_dropped = 0
        if resume is not None:
            self._mark_resume(resume)
        self.t_start = time.time()
        self._first_step = self.step  # steps of this process (a resumed run starts later): for the ETA
        self.totals = {"trained_tokens": 0, "learner_wait_s": 0.0, "train_s": 0.0, "sync_s": 0.0}

    # ------------------------------------------------------------------ main
    def train(self) -> int:
        import ray

        cfg = self.cfg
        if cfg.trainer.eval_before_after and cfg.data.test_files and self.resume is None:
            self.summary["before"] = self.evaluate("test", tag="before")
        self.fleet.start_loops()
        tty = console().isatty()
        bar = None
        if tty:
            from tqdm import tqdm

            bar = tqdm(total=cfg.trainer.max_steps, initial=self.step, desc="train", dynamic_ncols=True,
                       file=console())
        every = progress_every(cfg.trainer.max_steps)
        self._t_loop = time.time()  # the ETA counts training time only (not start-up or the first evaluation)
        rc = 0
        while self.step < cfg.trainer.max_steps and not self.stop.requested:
            try:
                metrics = self.train_one_step()
            except Exception as exc:  # noqa: BLE001 - a dead learner rank is recovered in the job if possible
                if not self.recover_learner(exc):
                    raise
                continue
            if metrics is None:
                break
            self.step += 1
            self.fleet.forget_failures()  # a trained step: earlier failures were not a persistent fault
            self.logger.log(self.step, metrics)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(format_console(self.step, cfg.trainer.max_steps, metrics).split(" | ", 1)[-1])
            elif self.step % every == 0 or self.step <= 5 or self.step == cfg.trainer.max_steps:
                say(format_console(self.step, cfg.trainer.max_steps, metrics))
            self._publish_status(metrics)
            self.handle_commands()
            self.fleet.heal()
            if cfg.trainer.save_every > 0 and self.step % cfg.trainer.save_every == 0:
                self.checkpoint()
            if cfg.trainer.eval_every > 0 and self.step % cfg.trainer.eval_every == 0 and cfg.data.val_files:
                self.dump_samples(f"step_{self.step}")
                result = self.evaluate("val", tag=f"step_{self.step}")
                self.logger.log(self.step, {f"eval/{k}": v for k, v in result.items() if k in EVAL_KEYS})
            if self._stop_requested_by_ctl:
                break
        if bar is not None:
            bar.close()
        # Graceful end: no new groups; what is in flight is abandoned and re-issued on resume.
        ray.get(self.topo.coordinator.set_stopping.remote())
        self.fleet.stop_loops()
        self.checkpoint()
        if cfg.trainer.eval_before_after and cfg.data.test_files and not self.stop.requested:
            self.summary["after"] = self.evaluate("test", tag="after")
        self.finish()
        return rc

    def close(self) -> None:
        """Release the driver-side resources (the buffer client's ZeroMQ context); idempotent."""
        self.buffer_client.close()

    _stop_requested_by_ctl = False
    _last_metas: list[dict[str, Any]] = []  # of the latest trained batch (learner.feed.group_meta)
    _driver_bytes_seen = 0  # Group/Sample bytes through this process's codec, at the previous step

    def dump_samples(self, tag: str) -> None:
        """A few decoded trajectories of the latest trained batch, for a person to read (asked of
        learner rank 0, which holds the batch: a little JSON, not the sample arrays)."""
        if not self._last_metas:
            return
        out = self.topo.learner.sample_records(self.cfg.trainer.samples_per_eval)
        version = getattr(self, "_last_batch_version", None)
        for rec in out:
            rec["version_lag"] = None if version is None else version - int(rec["min_version"])
        if out:
            (self.run_dir / "samples" / f"train_{tag}.json").write_text(json.dumps(out, indent=2, default=str))

    def train_one_step(self) -> dict[str, Any] | None:
        import ray

        from asyncrl.protocol import codec_counts

        cfg, topo = self.cfg, self.topo
        t0 = time.time()
        metas = self._get_batch(cfg.data.rollout_batch_size, cfg.learner.batch_timeout_s)
        t_batch = time.time()
        if not metas:  # stopping while waiting: nothing taken from the buffer, nothing to train
            return None
        self._last_metas = metas
        self._taken = metas  # taken from the buffer, not trained yet (re-issued if the learner dies now)
        # (a partial batch only happens while stopping: it is trained rather than lost)
        lags = [self.version - m["min_version"] for m in metas]
        self._last_batch_version = self.version
        last = self.step + 1 >= cfg.trainer.max_steps or self.stop.requested or self._stop_requested_by_ctl
        prefetch = (None if last or not cfg.learner.prefetch else
                    (cfg.data.rollout_batch_size, self.version + 1, min(cfg.learner.batch_timeout_s, 30.0)))
        learner_metrics = topo.learner.train_fetched([m["id"] for m in metas], prefetch)
        t1 = time.time()
        # Trained from here on: if the step fails before its row is logged, the error path logs it
        # (the learner's state includes it) and no checkpoint may list these prompts as pending.
        for m in metas:
            self._trained_recent[m["prompt_index"]] = None
        self._pending_row = {**learner_metrics, **_batch_metrics(metas, lags, cfg.buffer.max_staleness)}
        self.version = int(learner_metrics.get("train/version", self.version + 1))
        self.fleet.heal()  # a dead engine found now is withdrawn before the broadcast waits for it
        sync = self.fleet.sync_weights(topo.weight_address)
        t2 = time.time()
        trained = [m["prompt_index"] for m in metas]
        while len(self._trained_recent) > 8192:
            self._trained_recent.pop(next(iter(self._trained_recent)))
        coord = ray.get(topo.coordinator.set_version.remote(self.version, [i for i in trained if i >= 0]))
        self._taken = []
        wait_s = t_batch - t0
        step_s = t2 - t0
        tokens = int(sum(sum(m["tokens"]) for m in metas))
        self.totals["learner_wait_s"] += wait_s
        self.totals["train_s"] += t1 - t_batch
        self.totals["sync_s"] += t2 - t1
        self.totals["trained_tokens"] += tokens
        metrics = dict(learner_metrics)
        metrics.update(ray.get(topo.buffer.stats.remote()))
        metrics.update(self._recovery_checks(metrics, coord or {}))
        metrics.update(self._length_metrics(metas))
        metrics.update(self.fleet.stats())
        metrics.update(_batch_metrics(metas, lags, cfg.buffer.max_staleness))
        report = sync.get("report") or {}
        codec = codec_counts()  # sample bytes encoded or decoded by this (driver) process: 0 by design
        driver_bytes = codec["encoded_bytes"] + codec["decoded_bytes"]
        metrics.update({
            "perf/step_s": step_s,
            "perf/batch_wait_s": wait_s,
            "perf/train_s": t1 - t_batch,
            "perf/weight_sync_s": t2 - t1,
            "perf/weight_broadcast_s": float(report.get("seconds", 0.0)),
            "perf/learner_idle_ratio": min(1.0, wait_s / max(step_s, 1e-9)),
            "perf/train_tokens": tokens,
            "perf/tokens_per_s": tokens / max(step_s, 1e-9),
            "perf/batch_bytes": float(sum(m["bytes"] for m in metas)),
            "perf/driver_bytes": float(driver_bytes - self._driver_bytes_seen),
            "perf/rollout_actors": len(self.fleet),
            "perf/weight_sync_dropped": len(sync.get("dropped", [])),
            # parameters whose sampled fingerprint differed after a load (each was re-fed from the store)
            "weights/fingerprint_mismatch": sum(int(r.get("fingerprint_mismatch") or 0)
                                                for r in (sync.get("actors") or {}).values() if isinstance(r, dict)),
        })
        self._driver_bytes_seen = driver_bytes
        for aid in sync.get("dropped", []):
            say(f"weight sync watchdog dropped {aid}; it catches up from the weight store")
        self._pending_row = None
        return metrics

    def _get_batch(self, num_groups: int, timeout_s: float) -> list[dict[str, Any]]:
        """Metadata of exactly `num_groups` groups for the current version, fetched by learner rank 0
        (the buffer may answer with fewer when its wait times out; keep asking until the deadline,
        then fail with a message). Groups of prompts trained lately (re-delivered across a buffer
        restart) are left out: rank 0 drops every fetched group the step does not name."""
        metas: list[dict[str, Any]] = []
        deadline = time.time() + timeout_s
        address = self.topo.buffer_address
        while len(metas) < num_groups:
            left = deadline - time.time()
            if left <= 0 or self.stop.requested:
                break
            got = self.topo.learner.fetch(address, num_groups - len(metas), self.version, min(left, 30.0))
            fresh = [m for m in got if m["prompt_index"] not in self._trained_recent]
            self.duplicates_dropped += len(got) - len(fresh)  # re-delivered across a buffer restart
            metas += fresh
            if len(metas) < num_groups:
                self.fleet.heal()
        if len(metas) < num_groups and not self.stop.requested:
            raise RuntimeError(f"the learner got {len(metas)}/{num_groups} groups in learner.batch_timeout_s="
                               f"{timeout_s:.0f}s: is the rollout fleet alive? (asyncrl.ctl status)")
        return metas

    def _publish_status(self, m: dict[str, Any]) -> None:
        """What `asyncrl.ctl status` prints: held by the coordinator (`--live`) and written to
        `<run_dir>/status.json` (asyncrl.status), which ctl reads without joining Ray."""
        from asyncrl.status import STATUS_KEYS, write_status

        status = {
            "step": self.step, "max_steps": self.cfg.trainer.max_steps, "rollout_actors": sorted(self.fleet.actors),
            "verifier_version": self.cfg.verifier.version, "run_dir": str(self.run_dir),
            "latest": {k: m[k] for k in STATUS_KEYS if k in m}}
        elapsed = time.time() - self.t_start
        steps_here = self.step - self._first_step
        per_step = (time.time() - getattr(self, "_t_loop", self.t_start)) / max(steps_here, 1)
        eta = per_step * (self.cfg.trainer.max_steps - self.step) if steps_here > 0 else None
        status.update({"version": self.version, "elapsed_s": elapsed, "eta_s": eta, "actors": self.fleet.status(),
                       "pid": os.getpid(), "updated": time.time()})
        self.topo.coordinator.set_status.remote(status)
        write_status(self.run_dir, status)

    # ------------------------------------------------------------------ faults
    def _mark_resume(self, resume: Path) -> None:
        """A `resumed_from` row in metrics.jsonl: the steps after the checkpoint's are trained again
        (readers keep, for each step, the row after the newest marker: asyncrl.metrics.effective_rows)."""
        path = self.run_dir / "metrics.jsonl"
        last = 0
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    last = max(last, int(json.loads(line).get("step", 0)))
                except (ValueError, AttributeError):
                    continue
        row = {"step": self.step, "time": time.time(), "resumed_from": str(resume),
               "rolled_back_steps": max(0, last - self.step)}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if last > self.step:
            say(f"resumed from {resume} (step {self.step}): steps {self.step + 1}..{last} are trained again")

    def _recovery_checks(self, m: dict[str, Any], coord: dict[str, Any]) -> dict[str, Any]:
        """Announces a restarted buffer host / coordinator once, re-issues the prompts whose groups
        died with the buffer (none when its durable log is on) and those of stale-dropped groups."""
        import ray

        topo = self.topo
        restarts = int(m.get("buffer/restarts", 0))
        if restarts > self._seen["buffer/restarts"]:
            self._seen["buffer/restarts"] = restarts
            # groups learner rank 0 prefetched are held, not lost (asked before and after the
            # buffer, so that a prefetch answered in between is seen in one of the two)
            held = topo.learner.held_prompts()
            present = held + ray.get(topo.buffer.prompt_indices.remote()) + topo.learner.held_prompts()
            lost = ray.get(topo.coordinator.reissue_lost.remote(present))
            say(f"the replay buffer (BufferHost) on {topo.hosts.get('buffer', '?')} died and was restarted by Ray "
                f"at {topo.buffer_address} (restart {restarts}): recovering; "
                f"{int(m.get('buffer/recovered_groups', 0))} group(s) recovered from its durable log, "
                f"{len(lost)} prompt(s) re-issued; rollout actors and the learner reconnected by themselves")
        c_restarts = int(coord.get("restarts", 0))
        if c_restarts > self._seen["coordinator/restarts"]:
            self._seen["coordinator/restarts"] = c_restarts
            say(f"the coordinator on {topo.hosts.get('coordinator', '?')} died and was restarted by Ray "
                f"(restart {c_restarts}): recovering; cursor and in-flight prompts restored from its state file")
        out: dict[str, Any] = {f"coordinator/{k}": float(v) for k, v in coord.items()}
        dropped = ray.get(topo.buffer.take_dropped.remote())
        if dropped and self.cfg.buffer.reissue_stale:
            added = ray.get(topo.coordinator.reissue.remote([i for i, _ in dropped], "stale"))
            self._reissued_stale += added
            # the rest were pending already (e.g. re-issued as lost after a learner or buffer death)
            # or trained meanwhile: explained, not issued twice
            self._stale_already_pending += len(dropped) - added
        self._lengths["dropped"] += [float(n) for _, n in dropped]
        out["buffer/reissued_stale"] = float(self._reissued_stale)
        out["buffer/stale_already_pending"] = float(self._stale_already_pending)
        out["train/duplicates_dropped"] = float(self.duplicates_dropped)
        return out

    def _length_metrics(self, metas: list[dict[str, Any]]) -> dict[str, Any]:
        """Length (mean policy tokens per sample) of trained vs stale-dropped groups, over the run:
        a drop policy that favours short prompts shows up as dropped lengths above trained ones."""
        import numpy as np

        for m in metas:
            self._lengths["trained"].append(sum(m["tokens"]) / (len(m["tokens"]) or 1))
        out: dict[str, Any] = {}
        for kind, prefix in (("trained", "train/group_len"), ("dropped", "buffer/dropped_len")):
            values = self._lengths[kind][-20000:]
            self._lengths[kind] = values
            if values:
                out[f"{prefix}_mean"] = float(np.mean(values))
                out[f"{prefix}_p50"], out[f"{prefix}_p90"] = (float(q) for q in np.percentile(values, [50, 90]))
            out[f"{prefix}_count"] = float(len(values))
        return out

    _taken: list[dict[str, Any]] = []  # metadata of the groups of the step in progress
    _learner_recoveries = 0
    _pending_row: dict[str, Any] | None = None

    def recover_learner(self, exc: BaseException) -> bool:
        """A learner rank died: rebuild the learner group in this job from the newest checkpoint
        (the fleet, the verifier and the buffer keep running), train the rolled-back steps' prompts
        again, and go on. False when this is not a learner death or it cannot be recovered here
        (the error path then stops the job for a resume)."""
        import ray

        from asyncrl.learner.checkpoint import latest_checkpoint

        component, host, reason = describe_failure(self.topo, exc)
        limit = self.cfg.cluster.max_restarts
        if (not component.startswith("learner") or not self.cfg.trainer.recover_learner
                or (limit >= 0 and self._learner_recoveries >= limit)):
            return False
        self._learner_recoveries += 1
        topo, t0 = self.topo, time.time()
        newest = latest_checkpoint(self.run_dir / "checkpoints")
        k = int(json.loads((newest / "run_state.json").read_text())["step"]) if newest else 0
        say(f"{component} on {host} died ({reason}); recovering: rebuilding the learner group in this job from "
            f"{newest or 'the initial model'} (steps {k + 1}..{self.step} are trained again); rollout actors, "
            "verifier and buffer keep running")
        try:
            topo.learner.rebuild(newest)
            label = max(self.version, topo.learner.version) + 1  # a version number never names two policies
            topo.learner.set_version(label)
            topo.weight_address = topo.learner.start_weight_sender(port=self.cfg.learner.weights.port, publish=True)
            self.fleet.enrol(self.fleet.running())
            self.fleet.sync_weights(topo.weight_address)
        except Exception as exc2:  # noqa: BLE001 - cannot rebuild here (e.g. the node is gone): stop for a resume
            say(f"the learner group could not be rebuilt in this job ({type(exc2).__name__}: {exc2})")
            raise exc2 from exc
        redo = [int(i) for r in self.logger.rows if int(r.get("step", 0)) > k for i in r.get("train/prompt_indices", [])]
        redo += [m["prompt_index"] for m in self._taken]
        redo = [i for i in redo if i >= 0]
        for i in redo:
            self._trained_recent.pop(i, None)
        ray.get(topo.coordinator.untrain.remote(redo))
        # groups the dead rank 0 had fetched (or prefetched) and not trained: neither in the
        # buffer nor trained, so the coordinator issues their prompts again
        redo += ray.get(topo.coordinator.reissue_lost.remote(ray.get(topo.buffer.prompt_indices.remote())))
        ray.get(topo.coordinator.set_version.remote(label))
        ray.get(topo.buffer.set_version.remote(label))
        self.logger.rows = [r for r in self.logger.rows if int(r.get("step", 0)) <= k]
        self._taken, self._pending_row = [], None
        self.step, self.version = k, label
        self._mark_resume(newest if newest else Path("initial model"))
        say(f"learner recovered in {time.time() - t0:.1f}s: step {k}, weights v{label}, {len(redo)} prompt(s) "
            "re-issued")
        return True

    def on_failure(self, exc: BaseException) -> int:
        """A component died and the job cannot go on: one line naming it, its host and what happens,
        the traceback to `error.log`, then a checkpoint of everything still alive. Returns the exit
        status (3: restart with trainer.resume=auto)."""
        import traceback

        component, host, reason = describe_failure(self.topo, exc)
        log = self.run_dir / "error.log"
        log.write_text("".join(traceback.format_exception(exc)))
        learner_alive = not component.startswith("learner")
        plan = ("writing a checkpoint of the learner, buffer and cursor" if learner_alive else
                "the learner's state is gone: the newest checkpoint is what a resume starts from")
        verb = "failed" if component.startswith("the trainer") else "died"
        say(f"{component} on {host} {verb} ({reason}); stopping at step {self.step}: {plan}, then exiting "
            f"with status 3 (restart with trainer.resume=auto). Traceback: {log}")
        if learner_alive and self._pending_row is not None:  # the learner trained this step: it counts
            self.step += 1
            self.logger.log(self.step, {**self._pending_row, "error": f"{component} died during this step"})
            self._pending_row = None
        if learner_alive:
            try:
                self.checkpoint(emergency=True)
            except Exception as exc2:  # noqa: BLE001 - already failing; say what could not be written
                say(f"the emergency checkpoint could not be written: {type(exc2).__name__}: {exc2}")
        from asyncrl.learner.checkpoint import latest_checkpoint

        newest = latest_checkpoint(self.run_dir / "checkpoints")
        say(f"newest checkpoint: {newest if newest else 'none (a resume starts from scratch)'}")
        try:
            self.logger.close()
        except Exception:  # noqa: BLE001
            pass
        return 3

    # ------------------------------------------------------------------ ctl commands
    def ctl_handlers(self) -> dict[str, Callable[..., dict[str, Any]]]:
        """The `asyncrl.ctl` commands the job executes, by the name ctl queues them under."""
        return {"scale": self.cmd_scale, "swap-verifier": self.cmd_swap_verifier,
                "dry-run-verifier": self.cmd_dry_run_verifier, "checkpoint": self.cmd_checkpoint,
                "stop": self.cmd_stop}

    def handle_commands(self) -> None:
        """Execute the commands queued on the coordinator since the last step; post each result."""
        import ray

        from asyncrl.ctl import execute

        for cmd in ray.get(self.topo.coordinator.take_commands.remote()):
            result = execute(self.ctl_handlers(), cmd["command"], cmd["args"])
            say(f"ctl {cmd['command']}: {json.dumps(result, default=str)}")
            ray.get(self.topo.coordinator.post_result.remote(cmd["id"], result))

    def cmd_scale(self, n: int) -> dict[str, Any]:
        return self.fleet.scale(n, self.cfg.cluster.startup_timeout_s)

    def cmd_swap_verifier(self, verifier: dict[str, Any]) -> dict[str, Any]:
        from asyncrl.serve.deploy import swap_verifier

        new = VerifierConfig.model_validate(verifier)
        cfg = self.cfg.model_copy(update={"verifier": new})
        report = swap_verifier(cfg).to_dict()
        if report.get("ok"):
            self.cfg = cfg
        return report

    def cmd_dry_run_verifier(self, verifier: dict[str, Any], last: int = 64) -> dict[str, Any]:
        """What swapping to `verifier` would change, on the job's last stored verifier requests."""
        from asyncrl.serve.dryrun import dry_run

        return dry_run(VerifierConfig.model_validate(verifier), last, self.cfg.rollout.guide.stop_token)

    def cmd_checkpoint(self) -> dict[str, Any]:
        path = self.checkpoint()
        return {"ok": True, "path": str(path), "step": self.step, "version": self.version}

    def cmd_stop(self) -> dict[str, Any]:
        self._stop_requested_by_ctl = True
        return {"ok": True, "message": f"stopping after step {self.step}"}

    # ------------------------------------------------------------------ checkpoints and evaluation
    def checkpoint(self, emergency: bool = False) -> Path:
        """Learner state + buffer snapshot + data cursor, written atomically by the learner's
        checkpoint writer (the buffer and cursor go into its staging directory first). `emergency`
        (the error path): a dead buffer or coordinator is skipped (its prompts re-issued on resume)."""
        import ray

        topo = self.topo

        def extra(staging: Path) -> None:
            (staging / "buffer").mkdir(exist_ok=True)
            # The snapshot first, then the cursor derived from what it holds: consistent while
            # rollouts continue (a prompt completed in between is re-issued, not lost or doubled).
            try:
                indices = ray.get(topo.buffer.snapshot_indices.remote(
                    str((staging / "buffer" / "groups.snapshot").resolve())), timeout=None if not emergency else 120)
            except Exception as exc:  # noqa: BLE001 - only on the error path: the buffer is gone
                if not emergency:
                    raise
                say(f"  buffer snapshot not written ({type(exc).__name__}): its prompts are re-issued on resume")
                (staging / "buffer" / "groups.snapshot").unlink(missing_ok=True)
                indices = []
            try:
                cursor = ray.get(topo.coordinator.cursor_state.remote(indices), timeout=None if not emergency else 120)
            except Exception as exc:  # noqa: BLE001 - only on the error path: the coordinator is gone
                if not emergency:
                    raise
                from asyncrl.coordinator import cursor_from_state_file

                say(f"  coordinator gone ({type(exc).__name__}): cursor taken from its state file")
                cursor = cursor_from_state_file(self.run_dir / "state" / "coordinator.json", indices)
            # a prompt the learner trained is never pending, whatever the coordinator heard yet
            cursor["reissue"] = [i for i in cursor["reissue"] if int(i) not in self._trained_recent]
            (staging / "data_cursor.json").write_text(json.dumps(cursor))
            (staging / "run_state.json").write_text(json.dumps({"step": self.step, "version": self.version,
                                                                "actors": len(self.fleet)}))

        t0 = time.time()
        path = topo.learner.save_checkpoint(self.step, extra)
        say(f"checkpoint {path} ({time.time() - t0:.1f}s)")
        return Path(path)

    def evaluate(self, split: str, tag: str) -> dict[str, Any]:
        """Greedy evaluation on the actors' engines (current weights), rows split over the actors;
        the result has the layout of `python -m asyncrl.eval --output` (asyncrl.eval.merge_shards)."""
        from asyncrl.data import load_rows

        files = self.cfg.data.test_files if split == "test" else self.cfg.data.val_files
        rows = load_rows(files, self.cfg.data)
        if self.cfg.trainer.eval_limit:
            rows = rows[: self.cfg.trainer.eval_limit]
        if self.cfg.data.prompt_key != "problem":
            rows = [{**r, "problem": r[self.cfg.data.prompt_key], "answer": r[self.cfg.data.answer_key]} for r in rows]
        t0 = time.time()
        result, conversations = merge_shards(self.fleet.evaluate(rows, "both", self.cfg.trainer.samples_per_eval))
        result["seconds"] = time.time() - t0
        result["version"] = self.version
        result["rows"] = len(rows)
        if any(conversations.values()):
            result["conversations"] = conversations
        (self.run_dir / "samples").mkdir(exist_ok=True)
        (self.run_dir / "samples" / f"eval_{tag}.json").write_text(json.dumps(result, indent=2, default=str))
        result.pop("conversations", None)  # in the eval file (and the report), not in summary.json
        say(f"eval {tag} (v{self.version}, {len(rows)} rows, {result['seconds']:.0f}s): "
            + ", ".join(f"{k} {result[k]:.3f}" for k in EVAL_KEYS if isinstance(result.get(k), float)))
        return result

    def finish(self) -> None:
        self.dump_samples(f"step_{self.step}")
        wall = time.time() - self.t_start
        rows = self.logger.rows
        self.summary.update({
            "steps": self.step, "version": self.version, "wall_s": wall,
            "trained_tokens": self.totals["trained_tokens"],
            "trained_tokens_per_s": self.totals["trained_tokens"] / max(wall, 1e-9),
            "learner_wait_s": self.totals["learner_wait_s"], "train_s": self.totals["train_s"],
            "weight_sync_s": self.totals["sync_s"],
        })
        hist: list[int] = []
        for r in rows:
            h = r.get("buffer/staleness_hist")
            if isinstance(h, list):
                hist = [int(a) + int(b) for a, b in zip(hist + [0] * (len(h) - len(hist)), h + [0] * (len(hist) - len(h)))]
        self.summary["staleness_hist"] = hist
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2, default=float))
        self.logger.close()
        try:
            save_plots(rows, self.run_dir / "plots")
        except Exception as exc:  # noqa: BLE001 - plots are a convenience; never fail the run for them
            say(f"plots not written: {exc}")
        print_summary(self.summary)
        try:
            from asyncrl.report import write_report

            say(f"report: {write_report(self.run_dir)} (open it in a browser; logs in {self.run_dir / 'logs'})")
        except Exception as exc:  # noqa: BLE001 - the report is a convenience; never fail the run for it
            say(f"report not written: {type(exc).__name__}: {exc}")


def _batch_metrics(metas: list[dict[str, Any]], lags: list[int], max_staleness: int) -> dict[str, Any]:
    """What the learner trained on this step (from the groups' metadata, `learner.feed.group_meta`):
    rewards by part, staleness of its groups."""
    n = sum(len(m["rewards"]) for m in metas)
    out: dict[str, Any] = {"train/groups": len(metas), "train/samples": n}
    if not n:
        return out
    parts: dict[str, list[float]] = {}
    for m in metas:
        for rp in m["reward_parts"]:
            for k, v in rp.items():
                parts.setdefault(k, []).append(float(v))
    for k, vs in parts.items():
        out[f"reward/{k}"] = sum(vs) / len(vs)
    out["train/reward_mean"] = sum(r for m in metas for r in m["rewards"]) / n
    out["train/turns_mean"] = sum(t for m in metas for t in m["num_turns"]) / n
    hist = [0] * (max(max(lags, default=0), max_staleness) + 1)
    for lag in lags:
        hist[lag] += 1
    out["buffer/staleness_hist"] = hist
    out["buffer/staleness_mean"] = sum(lags) / max(len(lags), 1)
    out["buffer/staleness_max"] = max(lags, default=0)
    versions = sorted({v for m in metas for v in m["verifier_versions"]})
    out["verifier/versions_in_batch"] = ",".join(versions)
    out["train/prompt_indices"] = sorted(m["prompt_index"] for m in metas)
    return out
