"""The job side of `asyncrl.ctl`: the commands a running job executes, between two learner steps.

`asyncrl.ctl` queues a command on the job's coordinator; after each step the loop
(asyncrl.job.loop.Trainer) calls `run_queued`, which runs every queued command through the table of
`handlers` and posts each result back for the waiting ctl client. A handler acts on the loop it is
given: it scales the fleet, swaps the verifier (the loop's config follows when the swap succeeded),
writes a checkpoint, or asks the loop to stop after the current step.
"""

from __future__ import annotations

import json
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.config import Config, VerifierConfig
from asyncrl.startup import say

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from pathlib import Path


class _Fleet(Protocol):
    def scale(self, n: int, timeout: float) -> dict[str, Any]: ...


class _Services(Protocol):
    coordinator: Any  # the job coordinator's Ray actor handle (take_commands, post_result)


class Loop(Protocol):
    """What the commands read and write of the running loop (`asyncrl.job.loop.Trainer` is one). A
    protocol, not the class: the trainer imports this module, so this module does not import it back
    (not even for types; tests/unit/test_import_cycles.py)."""

    cfg: Config  # replaced by a verifier swap that held
    topo: _Services
    fleet: _Fleet
    stop_requested_by_ctl: bool

    @property
    def step(self) -> int: ...

    @property
    def version(self) -> int: ...

    def checkpoint(self) -> Path: ...


def execute(handlers: Mapping[str, Callable[..., dict[str, Any]]], command: str,
            args: dict[str, Any]) -> dict[str, Any]:
    """The result of one ctl command on the job: its handler's answer, or an error result naming an
    unknown command (and the known ones) or the exception the handler raised."""
    handler = handlers.get(command)
    if handler is None:
        return {"ok": False, "error": f"unknown command {command!r}; this job knows: {', '.join(sorted(handlers))}"}
    try:
        return handler(**args)
    except Exception as exc:  # noqa: BLE001 - report to the ctl caller instead of crashing the job
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def handlers(trainer: Loop) -> dict[str, Callable[..., dict[str, Any]]]:
    """The commands the job executes, by the name ctl queues them under, bound to `trainer`."""
    table = {"scale": scale, "swap-verifier": swap_verifier, "dry-run-verifier": dry_run_verifier,
             "checkpoint": checkpoint, "stop": stop}
    return {name: partial(fn, trainer) for name, fn in table.items()}


def run_queued(trainer: Loop) -> None:
    """Execute the commands queued on the coordinator since the last step; post each result."""
    import ray

    coordinator = trainer.topo.coordinator
    for cmd in ray.get(coordinator.take_commands.remote()):
        result = execute(handlers(trainer), cmd["command"], cmd["args"])
        say(f"ctl {cmd['command']}: {json.dumps(result, default=str)}")
        ray.get(coordinator.post_result.remote(cmd["id"], result))


def scale(trainer: Loop, n: int) -> dict[str, Any]:
    return trainer.fleet.scale(n, trainer.cfg.cluster.startup_timeout_s)


def swap_verifier(trainer: Loop, verifier: dict[str, Any]) -> dict[str, Any]:
    """Deploy `verifier` in place of the running one; the loop's config takes it only if the swap held."""
    from asyncrl.serve.deploy import swap_verifier as deploy_swap

    cfg = trainer.cfg.model_copy(update={"verifier": VerifierConfig.model_validate(verifier)})
    report = deploy_swap(cfg).to_dict()
    if report.get("ok"):
        trainer.cfg = cfg
    return report


def dry_run_verifier(trainer: Loop, verifier: dict[str, Any], last: int = 64) -> dict[str, Any]:
    """What swapping to `verifier` would change, on the job's last stored verifier requests."""
    from asyncrl.serve.dryrun import dry_run

    return dry_run(VerifierConfig.model_validate(verifier), last, trainer.cfg.rollout.guide.stop_token)


def checkpoint(trainer: Loop) -> dict[str, Any]:
    path = trainer.checkpoint()
    return {"ok": True, "path": str(path), "step": trainer.step, "version": trainer.version}


def stop(trainer: Loop) -> dict[str, Any]:
    trainer.stop_requested_by_ctl = True
    return {"ok": True, "message": f"stopping after step {trainer.step}"}
