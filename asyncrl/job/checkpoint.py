"""A checkpoint of the whole job: the learner's state (asyncrl.learner.checkpoint writes it, atomically)
plus, in the same staging directory, the replay buffer's snapshot, the data cursor and the loop's
step and version.

Consistency while rollouts continue: the buffer snapshot is taken first and the cursor is derived
from what it holds, so a prompt completed in between is re-issued on resume, never lost or doubled;
a prompt the learner already trained is never listed as pending.

This is driver-side assembly (it asks the buffer and coordinator actors), which is why it lives
beside the loop and not in the learner package.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.startup import say

if TYPE_CHECKING:
    from asyncrl.job.recovery import Progress
    from asyncrl.job.topology import Topology

EMERGENCY_TIMEOUT_S = 120  # on the error path a service may hang instead of failing


def write_job_checkpoint(topo: Topology, run_dir: Path, progress: Progress, actors: int,
                         emergency: bool = False, root: Path | None = None) -> Path:
    """Learner state + buffer snapshot + data cursor + run state; returns the checkpoint directory
    (under `root`, default the run's checkpoints/). `emergency` (the error path): a dead buffer or
    coordinator is skipped, its prompts re-issued on resume."""

    def extra(staging: Path) -> None:
        indices = _buffer_snapshot(topo, staging, emergency)
        cursor = _cursor(topo, run_dir, indices, emergency)
        # a prompt the learner trained is never pending, whatever the coordinator heard yet
        cursor["reissue"] = [i for i in cursor["reissue"] if int(i) not in progress.trained_recent]
        (staging / "data_cursor.json").write_text(json.dumps(cursor))
        (staging / "run_state.json").write_text(json.dumps({"step": progress.step, "version": progress.version,
                                                            "actors": actors}))

    from asyncrl.learner.checkpoint import check_room

    check_room(root or topo.learner.checkpoint_root(), _estimate(topo))  # before anything is written
    t0 = time.time()
    path = topo.learner.save_checkpoint(progress.step, extra, **({"root": root} if root else {}))
    say(f"checkpoint {path} ({time.time() - t0:.1f}s)")
    return Path(path)


def _estimate(topo: Topology) -> int:
    """The first checkpoint's size, estimated from the policy's config.json (0 when unreadable:
    then only later checkpoints, sized by the newest one, are checked)."""
    from asyncrl.checks.preflight import checkpoint_estimate, read_model

    cfg = topo.cfg
    try:
        return checkpoint_estimate(cfg, read_model("model.path", cfg.model.path, cfg.model.tokenizer_path))
    except (ValueError, KeyError, TypeError, OSError):
        return 0


def _buffer_snapshot(topo: Topology, staging: Path, emergency: bool) -> list[int]:
    """The buffer's groups into `staging/buffer/groups.snapshot`; the prompt indices it holds."""
    import ray

    (staging / "buffer").mkdir(exist_ok=True)
    target = staging / "buffer" / "groups.snapshot"
    try:
        return ray.get(topo.buffer.snapshot_indices.remote(str(target.resolve())),
                       timeout=EMERGENCY_TIMEOUT_S if emergency else None)
    except Exception as exc:  # noqa: BLE001 - only on the error path: the buffer is gone
        if not emergency:
            raise
        say(f"  buffer snapshot not written ({type(exc).__name__}): its prompts are re-issued on resume")
        target.unlink(missing_ok=True)
        return []


def _cursor(topo: Topology, run_dir: Path, indices: list[int], emergency: bool) -> dict[str, Any]:
    """The data cursor consistent with the buffer snapshot's `indices` (from the coordinator, or
    from its state file when it is gone on the error path)."""
    import ray

    try:
        return ray.get(topo.coordinator.cursor_state.remote(indices), timeout=EMERGENCY_TIMEOUT_S if emergency else None)
    except Exception as exc:  # noqa: BLE001 - only on the error path: the coordinator is gone
        if not emergency:
            raise
        from asyncrl.job.coordinator import cursor_from_state_file

        say(f"  coordinator gone ({type(exc).__name__}): cursor taken from its state file")
        return cursor_from_state_file(run_dir / "state" / "coordinator.json", indices)

