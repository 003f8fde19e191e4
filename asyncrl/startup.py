"""What the driver's parts share: its console lines, start-up steps that fail by name, the stop flag.

`say` writes one asyncrl line (the quiet console keeps these, asyncrl.logs); `step_timer` wraps one
start-up step: announced, timed, and any error turned into a one-line `StartupError`
(`start_failure`: `<component> on <host> failed to start: <Type>: <message>`, unwrapped from Ray's
envelope, with where the traceback is). A component wraps its own start-up code in `starting(name)`
(inside its process): the traceback goes to its log file (asyncrl.logs) and a `ComponentStartError`
of plain strings travels to the driver, so even a cause Ray cannot pickle arrives as its message.
`gc_paused` runs a process's heavy imports without Python's cyclic garbage collector.
`RepeatedFailure` stops a job whose component keeps failing the same way; `check_reachable` fails
fast on a cluster address nothing listens at; `StopFlag` is what SIGINT/SIGTERM set and the
training loop reads. This module imports nothing of asyncrl's roles, so the runtime, the topology,
the fleet, the trainer and `asyncrl.ctl` can all use it without an import cycle.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from asyncrl.logs import echo, role_log_file


class StartupError(RuntimeError):
    """A component could not start; the message names it."""


class RepeatedFailure(StartupError):
    """A component failed the same way `cluster.max_identical_failures` times in a row; the
    message names it, its host and the address it could not reach. Stops the job (exit 1)."""


def say(message: str) -> None:
    echo(f"[asyncrl] {message}")


# How `step_timer` reports a finished step on the console, for the benchmarks that read it back
# (`bench startup`, `bench scale`): "[asyncrl] learner (1 rank(s), ZeRO-1) ready (5.3s)".
READY_LINE = re.compile(r"^\[asyncrl\] (?P<name>.+?) ready \((?P<secs>[0-9.]+)s\)", re.MULTILINE)


@contextmanager
def step_timer(what: str) -> Iterator[None]:
    t0 = time.time()
    say(f"starting {what} ...")
    try:
        yield
    except StartupError:
        raise
    except Exception as exc:
        raise StartupError(start_failure(what, exc)) from exc
    say(f"{what} ready ({time.time() - t0:.1f}s)")


# ------------------------------------------------------------------------------ start-up errors
class ComponentStartError(RuntimeError):
    """A component failed to start, raised in its own process by `starting`. Plain strings only,
    so Ray can always pickle it (a pydantic ValidationError, say, it cannot)."""

    def __init__(self, component: str, host: str, cause: str, log: str = "") -> None:
        super().__init__(component, host, cause, log)
        self.component, self.host, self.cause, self.log = component, host, cause, log

    def __str__(self) -> str:
        where = f" (traceback: {self.log})" if self.log else ""
        return f"{self.component} on {self.host} failed to start: {self.cause}{where}"


def one_line(exc: BaseException, limit: int = 400) -> str:
    """`Type: message` on one line (a pydantic ValidationError: its errors' messages)."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        try:
            text = "; ".join(str(e.get("msg", e)) for e in errors())
        except Exception:  # noqa: BLE001 - fall back to the plain message
            text = str(exc)
    else:
        text = str(exc)
    text = " ".join(text.split())
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def root_cause(exc: BaseException) -> BaseException:
    """What a Ray task raised in its own process (`RayTaskError.cause`), else `exc`: the remote
    error's first line is Ray's frame header ("ray::LearnerActor.save_checkpoint() (pid=...)"),
    not what went wrong."""
    try:
        from ray.exceptions import RayTaskError
    except ImportError:
        return exc
    while isinstance(exc, RayTaskError) and isinstance(getattr(exc, "cause", None), BaseException):
        exc = exc.cause
    return exc


def node_host() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray: the hostname says enough
        return socket.gethostname()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (restored as it was on exit). For a process's
    imports of torch, transformers and vLLM: they allocate millions of objects, each allocation
    burst triggers a collection, and a full collection walks every object allocated so far; import
    creates almost no garbage, so the collections are pure cost (docs/benchmarks.md, "Start-up").
    Keep it around imports and
    configuration only: a process forked inside would inherit the collector off for its whole life
    (the rollout actor leaves it before vLLM forks its engine core)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def starting(component: str) -> Iterator[None]:
    """Around a component's start-up code, in its own process: an error is written with its
    traceback to this process's log file (stderr, asyncrl.logs) and re-raised as one
    `ComponentStartError` line naming the component, its host and the cause."""
    try:
        yield
    except ComponentStartError:
        raise
    except Exception as exc:
        traceback.print_exc()
        sys.stderr.flush()
        log = role_log_file()
        raise ComponentStartError(component, node_host(), one_line(exc), str(log) if log else "") from None


_EMBEDDED = re.compile(r"ComponentStartError: (.+ failed to start: .+)")


def start_failure(what: str, exc: BaseException) -> str:
    """The one line for a start-up step `what` that raised `exc` (see the module docstring):
    a `ComponentStartError` from the component's process, found in Ray's envelope (a task error's
    cause, or the text of an actor's creation-task error or of a Serve deployment error), else
    the cause's type and message with the host Ray reports."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ComponentStartError):
        return str(cause)
    if isinstance(exc, ComponentStartError):
        return str(exc)
    embedded = _EMBEDDED.findall(str(exc))
    if embedded:
        return embedded[-1].strip()
    host = getattr(exc, "ip", None) or node_host()  # no Ray envelope: it failed in the driver
    if isinstance(cause, BaseException) and "isn't serializable" not in str(cause):
        exc = cause
    elif cause is not None:  # Ray could not pickle the cause: its traceback's last line
        lines = [ln for ln in getattr(exc, "traceback_str", "").splitlines() if ln.strip()]
        return f"{what} on {host} failed to start: {lines[-1].strip() if lines else type(cause).__name__}"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if getattr(exc, "actor_init_failed", False) and lines:  # the creation task's traceback: its last line
        return f"{what} on {host} failed to start: {lines[-1][:400]}"
    return f"{what} on {host} failed to start: {one_line(exc)}"


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
