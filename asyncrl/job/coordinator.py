"""The job's control plane: one named Ray actor per run (`coordinator`).

It owns the single training prompt stream and hands prompts to rollout actors one group at a
time, so that actors can be added or removed at any moment without re-sharding, and a checkpoint
can record exactly which prompts are done:

    cursor (stream state)  +  issued-but-not-trained prompt indices  =  everything needed to resume
    with no prompt skipped or repeated.

Every prompt is in exactly one place: issued to an actor (`in_flight`), in the buffer (`buffered`:
its group was acknowledged, not yet trained), trained (reported by the trainer), or waiting to be
issued again (`reissue`: its actor died, its group was dropped stale, or it died with the buffer).

Surviving its own death: with a `state_path`, that bookkeeping is written (atomically) on every
change before the call returns, and a restarted incarnation (Ray `max_restarts`; callers' tasks are
retried by Ray) reads it back: no prompt skipped or issued twice. `next_prompt` takes a request id
per actor, so a call retried after the reply was lost returns the prompt already issued.

It also carries the learner's current version, the stop flag the actors poll (admission ends
with it), per-actor statistics, and a small command queue through which `python -m asyncrl.ctl` asks the driver to
scale, swap the verifier, checkpoint or stop (the driver is the only code that changes the
topology; it polls the queue between learner steps and posts each command's result back; queued
commands are not durable: a ctl call in flight across a coordinator restart times out).
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

COORDINATOR_NAME = "coordinator"
RECENT_TRAINED = 8192  # trained indices remembered (a late `complete` of a trained prompt is ignored)


def derive_cursor(stream: dict[str, Any], reissue: list[int], in_flight: list[int], buffered: list[int],
                  snapshot_indices: list[int] | None, completed: int = 0) -> dict[str, Any]:
    """The checkpoint cursor: every prompt not trained and not in the buffer snapshot is issued
    again on resume (without a snapshot list: the buffered ones are assumed in the snapshot)."""
    in_snapshot = set(snapshot_indices or [])
    pending = set(reissue) | set(in_flight)
    if snapshot_indices is not None:
        pending |= set(buffered)
    return {"stream": stream, "reissue": sorted(pending - in_snapshot), "buffered": sorted(in_snapshot),
            "completed": completed}


def cursor_from_state_file(path: str | os.PathLike[str], snapshot_indices: list[int] | None) -> dict[str, Any]:
    """The cursor of a coordinator that is gone, from its durable state file (the error path)."""
    st = json.loads(Path(path).read_text())
    return derive_cursor(st["stream"], st["reissue"], [int(r[0]) for r in st["in_flight"]], st["buffered"],
                         snapshot_indices or [], int(st["completed"]))


def _reconstructed() -> bool:
    try:
        import ray

        return ray.is_initialized() and bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not inside a Ray actor
        return False


class Coordinator:
    def __init__(self, rows: list[dict[str, Any]], data_cfg_json: str, stream_state: dict[str, Any] | None = None,
                 reissue: list[int] | None = None, buffered: list[int] | None = None, state_path: str = "",
                 recover: bool | None = None):
        from asyncrl.config import DataConfig
        from asyncrl.data import PromptStream
        from asyncrl.logs import redirect_output

        redirect_output("coordinator")
        data_cfg = DataConfig.model_validate_json(data_cfg_json)
        self.stream = PromptStream(rows, seed=data_cfg.seed, shuffle=data_cfg.shuffle, cfg=data_cfg)
        if stream_state:
            self.stream.load_state_dict(stream_state)
        self._reissue: list[int] = list(reissue or [])
        self._in_flight: dict[int, dict[str, Any]] = {}  # prompt index -> item
        self._buffered: set[int] = set(buffered or [])
        self._recent: deque[int] = deque(maxlen=RECENT_TRAINED)
        self._recent_set: set[int] = set()
        self._last_issue: dict[str, tuple[str, int]] = {}  # actor -> (request id, prompt index)
        self._completed = 0
        self._abandoned = 0
        self.counters = {"restarts": 0, "reissued_stale": 0, "reissued_lost": 0}
        self.version = 0
        self.admitting = True
        self.stopping = False
        self._commands: list[dict[str, Any]] = []
        self._results: dict[int, dict[str, Any]] = {}
        self._ids = itertools.count(1)
        self.started_at = time.time()
        self.status_snapshot: dict[str, Any] = {}
        self.state_path = Path(state_path) if state_path else None
        recover = _reconstructed() if recover is None else recover
        if recover and self.state_path is not None and self.state_path.exists():
            self._load(json.loads(self.state_path.read_text()))
            self.counters["restarts"] += 1
        if self.state_path is not None:
            (self.state_path.parent / "coordinator.pid").write_text(str(os.getpid()))
        self._save()

    # ------------------------------------------------------------------ durable state
    def _save(self) -> None:
        if self.state_path is None:
            return
        state = {"stream": self.stream.state_dict(), "reissue": self._reissue,
                 "in_flight": [[i, r["actor_id"], r["issued_at"]] for i, r in self._in_flight.items()],
                 "buffered": sorted(self._buffered), "recent_trained": list(self._recent),
                 "last_issue": {a: list(v) for a, v in self._last_issue.items()},
                 "completed": self._completed, "abandoned": self._abandoned, "counters": self.counters,
                 "version": self.version, "admitting": self.admitting, "stopping": self.stopping,
                 "next_command": next(self._ids)}
        self._ids = itertools.count(state["next_command"])
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.state_path)
        except OSError as exc:  # a full disk: the prompts' accounting lives on in memory; the next save retries
            if exc.errno != errno.ENOSPC:
                raise
            self.counters["state_save_failed"] = self.counters.get("state_save_failed", 0) + 1
            tmp.unlink(missing_ok=True)

    def _load(self, st: dict[str, Any]) -> None:
        self.stream.load_state_dict(st["stream"])
        self._reissue = [int(i) for i in st["reissue"]]
        self._in_flight = {int(i): {**self.stream.item(int(i)).to_dict(), "actor_id": a, "issued_at": t}
                           for i, a, t in st["in_flight"]}
        self._buffered = {int(i) for i in st["buffered"]}
        self._recent = deque((int(i) for i in st["recent_trained"]), maxlen=RECENT_TRAINED)
        self._recent_set = set(self._recent)
        self._last_issue = {a: (str(r), int(i)) for a, (r, i) in st["last_issue"].items()}
        self._completed, self._abandoned = int(st["completed"]), int(st["abandoned"])
        self.counters.update({k: int(v) for k, v in st["counters"].items()})
        self.version, self.admitting, self.stopping = int(st["version"]), bool(st["admitting"]), bool(st["stopping"])
        self._ids = itertools.count(int(st["next_command"]))

    def where(self) -> dict[str, Any]:
        import ray

        return {"host": ray.util.get_node_ip_address(), "pid": os.getpid()}

    # ------------------------------------------------------------------ prompts
    def next_prompt(self, actor_id: str, request_id: str | None = None) -> dict[str, Any] | None:
        """The next prompt for a group, or None while admission is paused. A repeated
        `request_id` of the same actor (a retried call) returns the prompt issued to the first."""
        if request_id is not None and self._last_issue.get(actor_id, ("", -1))[0] == request_id:
            index = self._last_issue[actor_id][1]
            if index in self._in_flight:
                return self._in_flight[index]
        if not self.admitting or self.stopping:
            return None
        if self._reissue:
            index = self._reissue.pop(0)
            item = self.stream.item(index)
        else:
            item = self.stream.next()
        record = {**item.to_dict(), "actor_id": actor_id, "issued_at": time.time()}
        self._in_flight[item.index] = record
        if request_id is not None:
            self._last_issue[actor_id] = (request_id, item.index)
        self._save()
        return record

    def complete(self, index: int) -> None:
        """The group of prompt `index` reached the buffer (or was deliberately dropped and counted)."""
        if self._in_flight.pop(index, None) is not None:
            self._completed += 1
            if index not in self._recent_set and index not in self._reissue:
                self._buffered.add(index)
            self._save()

    def abandon(self, index: int) -> None:
        """The group of prompt `index` will not be produced (actor stopping): issue it again."""
        if self._in_flight.pop(index, None) is not None:
            self._abandoned += 1
            self._reissue.append(index)
            self._save()

    def abandon_actor(self, actor_id: str) -> int:
        """Re-issue every prompt held by an actor that died or was removed."""
        lost = [i for i, r in self._in_flight.items() if r["actor_id"] == actor_id]
        for index in lost:
            self.abandon(index)
        self._last_issue.pop(actor_id, None)
        self._save()
        return len(lost)

    def trained(self, indices: list[int]) -> None:
        """The learner trained the groups of these prompts: they are done for good."""
        for index in indices:
            self._buffered.discard(index)
            self._in_flight.pop(index, None)  # trained before its actor reported `complete`
            if index not in self._recent_set:
                if len(self._recent) == self._recent.maxlen:
                    self._recent_set.discard(self._recent[0])
                self._recent.append(index)
                self._recent_set.add(index)
        self._save()

    def untrain(self, indices: list[int]) -> int:
        """The learner lost the steps that trained these prompts (rolled back to a checkpoint):
        issue them again."""
        for index in indices:
            if index in self._recent_set:
                self._recent_set.discard(index)
                self._recent.remove(index)
        return self.reissue(indices, reason="rolled_back")

    def reissue(self, indices: list[int], reason: str = "stale") -> int:
        """Issue these prompts again (their groups were dropped stale, or died with the buffer)."""
        added = 0
        for index in indices:
            index = int(index)
            if index in self._recent_set or index in self._reissue or (reason == "lost" and index in self._in_flight):
                continue
            self._buffered.discard(index)
            self._reissue.append(index)
            added += 1
        self.counters[f"reissued_{reason}"] = self.counters.get(f"reissued_{reason}", 0) + added
        self._save()
        return added

    def reissue_lost(self, present: list[int]) -> list[int]:
        """After the buffer restarted: re-issue the buffered prompts it no longer holds."""
        lost = sorted(self._buffered - set(present))
        self.reissue(lost, reason="lost")
        return lost

    def cursor_state(self, snapshot_indices: list[int] | None = None) -> dict[str, Any]:
        """What a checkpoint stores: the stream state plus every prompt not yet trained. With the
        prompt indices of the buffer snapshot taken just before, the pair is consistent while
        rollouts continue: a prompt completed after the snapshot is re-issued on resume, one in the
        snapshot is not (it is restored with the buffer)."""
        return derive_cursor(self.stream.state_dict(), self._reissue, list(self._in_flight),
                             sorted(self._buffered), snapshot_indices, self._completed)

    # ------------------------------------------------------------------ versions and flags
    def set_version(self, version: int, trained: list[int] | None = None) -> dict[str, int]:
        """The learner's new version (and the prompts its step trained); returns the counters."""
        self.version = version
        if trained:
            self.trained(trained)
        else:
            self._save()
        return dict(self.counters)

    def get_state(self) -> dict[str, Any]:
        return {"version": self.version, "admitting": self.admitting, "stopping": self.stopping}

    def set_admitting(self, admitting: bool) -> None:
        """Pause (False) or resume issuing prompts; the rollout loops idle while paused (a full disk)."""
        self.admitting = bool(admitting) and not self.stopping
        self._save()

    def set_stopping(self) -> None:
        self.stopping = True
        self.admitting = False
        self._save()

    # ------------------------------------------------------------------ ctl commands
    def submit(self, command: str, args: dict[str, Any] | None = None) -> int:
        cid = next(self._ids)
        self._commands.append({"id": cid, "command": command, "args": args or {}, "submitted_at": time.time()})
        return cid

    def take_commands(self) -> list[dict[str, Any]]:
        out, self._commands = self._commands, []
        return out

    def post_result(self, cid: int, result: dict[str, Any]) -> None:
        self._results[cid] = result

    def result(self, cid: int) -> dict[str, Any] | None:
        return self._results.get(cid)

    def set_status(self, status: dict[str, Any]) -> None:
        self.status_snapshot = status

    def status(self) -> dict[str, Any]:
        return {**self.status_snapshot, "version": self.version, "admitting": self.admitting,
                "prompts_completed": self._completed, "prompts_in_flight": len(self._in_flight),
                "prompts_abandoned": self._abandoned, "prompts_buffered": len(self._buffered),
                **counter_metrics(self.counters), "uptime_s": time.time() - self.started_at}


def counter_metrics(counters: dict[str, int]) -> dict[str, float]:
    """The coordinator's counters as `coordinator/<counter>` metrics (their one writer)."""
    return {f"coordinator/{k}": float(v) for k, v in counters.items()}
