"""What the driver's parts share: its console lines, start-up steps that fail by name, the stop flag.

`say` writes one asyncrl line (the quiet console keeps these, asyncrl.logs); `step_timer` wraps one
start-up step: announced, timed, and any error turned into a `StartupError` naming the step.
`RepeatedFailure` stops a job whose component keeps failing the same way; `check_reachable` fails
fast on a cluster address nothing listens at; `StopFlag` is what SIGINT/SIGTERM set and the
training loop reads. This module imports nothing of asyncrl's roles, so the runtime, the topology,
the fleet, the trainer and `asyncrl.ctl` can all use it without an import cycle.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from asyncrl.logs import echo


class StartupError(RuntimeError):
    """A component could not start; the message names it."""


class RepeatedFailure(StartupError):
    """A component failed the same way `cluster.max_identical_failures` times in a row; the
    message names it, its host and the address it could not reach. Stops the job (exit 1)."""


def say(message: str) -> None:
    echo(f"[asyncrl] {message}")


@contextmanager
def step_timer(what: str) -> Iterator[None]:
    t0 = time.time()
    say(f"starting {what} ...")
    try:
        yield
    except StartupError:
        raise
    except Exception as exc:
        raise StartupError(f"{what} failed to start: {type(exc).__name__}: {exc}") from exc
    say(f"{what} ready ({time.time() - t0:.1f}s)")


class StopFlag:
    """First SIGINT/SIGTERM: stop gracefully (checkpoint, shut down). Second: exit at once."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        if self.requested:
            say("second signal: exiting now")
            os._exit(130)
        self.requested = True
        say(f"{signal.Signals(signum).name}: stopping admission, checkpointing, shutting down "
            "(send again to exit at once)")


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on an unreachable `host:port` (ray.init would retry for minutes)."""
    target = address.removeprefix("ray://")
    if target == "auto" or ":" not in target:
        return
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise StartupError(f"cluster.ray_address={address!r} is unreachable: {exc}") from None
