"""The job's control plane: one named Ray actor per run (`coordinator`).

It owns the single training prompt stream and hands prompts to rollout actors one group at a
time, so that actors can be added or removed at any moment without re-sharding, and a checkpoint
can record exactly which prompts are done:

    cursor (stream state)  +  issued-but-unfinished prompt indices  =  everything needed to resume
    with no prompt skipped or repeated.

It also carries the learner's current version, the stop/pause flags the actors poll, per-actor
statistics, and a small command queue through which `python -m asyncrl.ctl` asks the driver to
scale, swap the verifier, checkpoint or stop (the driver is the only code that changes the
topology; it polls the queue between learner steps and posts each command's result back).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

COORDINATOR_NAME = "coordinator"


class Coordinator:
    def __init__(self, rows: list[dict[str, Any]], data_cfg_json: str, stream_state: dict[str, Any] | None = None,
                 reissue: list[int] | None = None):
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
        self._completed = 0
        self._abandoned = 0
        self.version = 0
        self.admitting = True
        self.stopping = False
        self._commands: list[dict[str, Any]] = []
        self._results: dict[int, dict[str, Any]] = {}
        self._ids = itertools.count(1)
        self.started_at = time.time()
        self.status_snapshot: dict[str, Any] = {}

    # ------------------------------------------------------------------ prompts
    def next_prompt(self, actor_id: str) -> dict[str, Any] | None:
        """The next prompt for a group, or None while admission is paused."""
        if not self.admitting or self.stopping:
            return None
        if self._reissue:
            index = self._reissue.pop(0)
            item = self.stream.item_at(index)
        else:
            item = self.stream.next()
        record = {**item.to_dict(), "actor_id": actor_id, "issued_at": time.time()}
        self._in_flight[item.index] = record
        return record

    def complete(self, index: int) -> None:
        """The group of prompt `index` reached the buffer (or was deliberately dropped and counted)."""
        if self._in_flight.pop(index, None) is not None:
            self._completed += 1

    def abandon(self, index: int) -> None:
        """The group of prompt `index` will not be produced (actor stopping): issue it again."""
        if self._in_flight.pop(index, None) is not None:
            self._abandoned += 1
            self._reissue.append(index)

    def abandon_actor(self, actor_id: str) -> int:
        """Re-issue every prompt held by an actor that died or was removed."""
        lost = [i for i, r in self._in_flight.items() if r["actor_id"] == actor_id]
        for index in lost:
            self.abandon(index)
        return len(lost)

    def cursor_state(self) -> dict[str, Any]:
        """What a checkpoint stores: the stream state plus every prompt not yet in the buffer."""
        return {"stream": self.stream.state_dict(), "reissue": sorted(self._reissue + list(self._in_flight)),
                "completed": self._completed}

    def in_flight_count(self) -> int:
        return len(self._in_flight)

    # ------------------------------------------------------------------ versions and flags
    def set_version(self, version: int) -> None:
        self.version = version

    def get_state(self) -> dict[str, Any]:
        return {"version": self.version, "admitting": self.admitting, "stopping": self.stopping}

    def set_admitting(self, flag: bool) -> None:
        self.admitting = flag

    def set_stopping(self) -> None:
        self.stopping = True
        self.admitting = False

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
                "prompts_abandoned": self._abandoned,
                "uptime_s": time.time() - self.started_at}
