"""The job's own reasons to stop, noticed fast and said once.

A job whose outside world is broken must not wait out `learner.batch_timeout_s` and then blame the
rollout fleet. The driver asks the rollout actors for their cumulative failure counters (`health()`)
every few seconds while it waits for a batch and after every step (`FailureWatch.check`):
- a reward function that failed on `reward.max_consecutive_failures` groups in a row on an actor stops
  the job with `RewardFunctionFailed` carrying that function's own error (file, line, function,
  message; asyncrl.rewards.guard); each distinct reward failure is one console line, with its count;
- groups re-issued because a verifier failure ended their conversations (never trained as the
  policy's failure) are one console line the first time; a verifier whose every call in a poll
  window failed is a console line ("outage"), and one more when it answers again. An outage that
  lasts `verifier.outage_wait_s` stops the job with `VerifierOutage` (the back-end, the time, the
  last error). Until then the job waits for it: the rollout actors keep starting groups (their
  verifier calls are what notices the verifier is back; each failed group is re-issued, never
  trained) and the driver's batch deadline is extended (`outage`), so a short outage costs time,
  not the run, and a lasting one (a wrong URL, a revoked key, a dead service) ends the job with its
  cause and a checkpoint instead of "is the rollout fleet alive?".
`DivergenceWatch` stops the job with `TrainingDiverged` after `learner.max_nonfinite_steps` learner
steps in a row had no finite gradient (every optimizer step skipped) or a non-finite loss, naming
the newest checkpoint written before the streak began.

`JobStop` is the base of these named stops: `stop_named` (called by asyncrl.job.recovery.stop_on_failure)
prints one `error:` line, writes the traceback to error.log, and exits 3.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.startup import one_line, root_cause, say

if TYPE_CHECKING:
    from asyncrl.metrics import MetricLogger

HEALTH_TIMEOUT_S = 10.0  # an actor busy in a long call still answers health() (max_concurrency)
OUTAGE_MIN_CALLS = 4  # verifier calls in one poll window before "every call failed" is an outage


class JobStop(RuntimeError):
    """A named reason for the job to stop; `checkpoint`: whether the state is worth an emergency checkpoint."""

    checkpoint = True
    advice = ""


class RewardFunctionFailed(JobStop):
    advice = "fix the reward function (reward.function), then resume with trainer.resume=auto"


class VerifierOutage(JobStop):
    advice = "bring the verifier back (verifier.backend, verifier.http.base_url), then resume with trainer.resume=auto"


class TrainingDiverged(JobStop):
    checkpoint = False  # the weights are what diverged: the last good checkpoint is named instead
    advice = "lower learner.optim.lr (or check the data), then resume from the last good checkpoint"


class FailureWatch:
    """Polls `fleet`'s actors (`health()`), says each new failure once, raises a `JobStop` when fatal."""

    def __init__(self, fleet: Any, echo: Callable[[str], None] = say, min_interval_s: float = 2.0,
                 outage_wait_s: float = 0.0, verifier: str = "the verifier",
                 clock: Callable[[], float] = time.monotonic):
        """`outage_wait_s`: how long a verifier outage may last before `VerifierOutage` (0: forever);
        `verifier`: how the back-end is named in the messages."""
        self.fleet, self.echo, self.min_interval_s = fleet, echo, min_interval_s
        self.outage_wait_s, self.verifier, self.clock = outage_wait_s, verifier, clock
        self.seen_kinds: dict[str, int] = {}
        self.verifier_seen: dict[str, tuple[int, int]] = {}  # actor -> (calls, errors) at the last poll
        self.outage = False
        self.outage_since = 0.0
        self.outage_calls = 0  # verifier calls failed since the outage began
        self.last_verifier_error = ""
        self.reissued_said = False
        self.last_check = -math.inf

    def health(self) -> dict[str, dict[str, Any]]:
        import ray

        refs = {aid: a.health.remote() for aid, a in self.fleet.actors.items()}
        out = {}
        for aid, ref in refs.items():
            try:
                out[aid] = ray.get(ref, timeout=HEALTH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - dead or restarting: the fleet heals it, its failures are not lost
                continue
        return out

    def check(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_check < self.min_interval_s:
            return
        self.last_check = now
        self.observe(self.health())

    def observe(self, per_actor: dict[str, dict[str, Any]]) -> None:
        """Say what is new in the actors' cumulative counters; raise `RewardFunctionFailed` when an
        actor's reward function is fatally broken."""
        calls = errors = 0
        last_error = ""
        for aid, h in sorted(per_actor.items()):
            reward = h.get("reward") or {}
            for kind in reward.get("kinds", []):
                count = int(kind["count"])
                if kind["error"] not in self.seen_kinds:
                    self.echo(f"reward failure on rollout actor {aid}: {kind['error']} (each group it fails is "
                              "re-issued; further failures of this kind are counted, not printed)")
                self.seen_kinds[kind["error"]] = count
            if reward.get("fatal"):
                raise RewardFunctionFailed(f"rollout actor {aid}: {reward['fatal']}")
            if h.get("groups_reissued_verifier_error") and not self.reissued_said:
                self.reissued_said = True
                self.echo("a verifier failure ended conversations of a group even after re-running them: such groups "
                          "are re-issued, not trained as the policy's failure (rollout/groups_reissued_verifier_error, "
                          "rollout/conversations_rerun_verifier_error count them)")
            v = h.get("verifier")
            if v:
                c0, e0 = self.verifier_seen.get(aid, (0, 0))
                calls += int(v["calls"]) - c0
                errors += int(v["errors"]) - e0
                self.verifier_seen[aid] = (int(v["calls"]), int(v["errors"]))
                last_error = v.get("last_error") or last_error
        self.last_verifier_error = last_error or self.last_verifier_error
        if calls >= OUTAGE_MIN_CALLS and errors == calls and not self.outage:
            self.outage, self.outage_since, self.outage_calls = True, self.clock(), 0
            limit = (f"the job stops if it lasts verifier.outage_wait_s={self.outage_wait_s:.0f}s"
                     if self.outage_wait_s > 0 else "the job waits for it (verifier.outage_wait_s=0)")
            self.echo(f"verifier outage: all {calls} call(s) to {self.verifier} since the last check failed (last "
                      f"error: {last_error}); their groups are re-issued, nothing is trained until it answers "
                      f"again; {limit}")
        elif self.outage and calls > errors:
            self.outage = False
            self.echo(f"the verifier answers again ({calls - errors}/{calls} call(s) succeeded since the last check, "
                      f"after {self.clock() - self.outage_since:.0f}s of outage): training goes on")
        if self.outage:
            self.outage_calls += errors
            lasted = self.clock() - self.outage_since
            if 0 < self.outage_wait_s <= lasted:
                raise VerifierOutage(f"{self.verifier} failed every call for {lasted:.0f}s ({self.outage_calls} "
                                     f"failed call(s); verifier.outage_wait_s={self.outage_wait_s:.0f}); last error: "
                                     f"{self.last_verifier_error or 'none reported'}")

    def counted(self) -> str:
        """The distinct reward failures with their counts, for the closing message."""
        return "; ".join(f"{n}x {err}" for err, n in self.seen_kinds.items())


def nonfinite_step(metrics: dict[str, Any]) -> bool:
    """A learner step that could not train: every optimizer step skipped for a non-finite gradient
    (no finite norm was recorded) or a non-finite policy loss."""
    skipped = float(metrics.get("train/skipped_steps", 0.0))
    norm = float(metrics.get("train/grad_norm", 0.0))
    loss = float(metrics.get("loss/pg", 0.0))
    return (skipped > 0 and not math.isfinite(norm)) or not math.isfinite(loss)


class DivergenceWatch:
    """Counts learner steps in a row that were non-finite (`nonfinite_step`); raises `TrainingDiverged`."""

    def __init__(self, limit: int, checkpoints: Path):
        self.limit, self.checkpoints = limit, checkpoints
        self.streak = 0
        self.last_good: Path | None = None

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        if not nonfinite_step(metrics):
            self.streak = 0
            return
        if self.streak == 0:  # checkpoints written from now on hold what diverged
            from asyncrl.learner.checkpoint import latest_checkpoint

            self.last_good = latest_checkpoint(self.checkpoints)
        self.streak += 1
        if 0 < self.limit <= self.streak:
            good = str(self.last_good) if self.last_good else "none (the initial model)"
            raise TrainingDiverged(
                f"training diverged: {self.streak} learner steps in a row (up to step {step}) had a non-finite "
                f"gradient norm or loss (learner.max_nonfinite_steps={self.limit}; grad_norm="
                f"{metrics.get('train/grad_norm')}, loss/pg={metrics.get('loss/pg')}); last good checkpoint: {good}")


def stop_named(exc: JobStop, run_dir: Path, progress: Any, logger: MetricLogger,
               checkpoint: Callable[[], Path | None]) -> int:
    """`progress`: the loop's asyncrl.job.recovery.Progress (its step). One `error:` line naming why the job stops, the traceback to error.log, an emergency checkpoint
    when the state is worth one, the metric sinks closed; exit status 3."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(exc))
    log = None
    for where in (run_dir, Path(tempfile.gettempdir()) / "asyncrl-emergency" / run_dir.name):
        try:  # the run directory's disk may be the reason for the stop
            where.mkdir(parents=True, exist_ok=True)
            (where / "error.log").write_text(text)
            log = where / "error.log"
            break
        except OSError:
            continue
    say(f"error: {type(exc).__name__}: {exc}")
    say(f"stopping at step {progress.step} (exit status 3): {exc.advice}. Traceback: {log or 'not written'}")
    if exc.checkpoint:
        try:
            path = checkpoint()
            if path is not None and run_dir not in Path(path).parents:
                say(f"emergency checkpoint written outside the run directory: {path} (resume with "
                    f"trainer.resume={path}, or move it into {run_dir / 'checkpoints'})")
        except Exception as exc2:  # noqa: BLE001 - already failing; say what could not be written
            say(f"the emergency checkpoint could not be written: {one_line(root_cause(exc2))}")
    try:
        logger.close()
    except Exception as exc3:  # noqa: BLE001 - already failing; the sinks' files are flushed per row
        say(f"the metric sinks could not be closed: {type(exc3).__name__}: {exc3}")
    return 3


def verifier_name(cfg: Any) -> str:
    """The verifier back-end as the console names it (the URL for `http`)."""
    v = cfg.verifier
    if v.backend == "http":
        return f"the http verifier at {v.http.base_url}"
    return f"the {v.backend} verifier" + (f" ({v.model_path})" if v.backend == "vllm" and v.model_path else "")
