"""Process-group plumbing of the weight wire: the rendezvous TCPStore, one process group per
generation (`PrefixStore(asyncrl_w/g{g}/pg)`), bounded waits on collectives and non-blocking
retirement of a broken group.

Contracts: every collective is bounded by a deadline the caller enforces itself (`wait_work`
polls `work.is_completed()`, so the bound holds on NCCL, whose `wait()` does not block, and on
gloo alike); the group's own timeout (`backstop_timeout`) is later than every such deadline, so
gloo's and NCCL's watchdogs are the backstop, never the mechanism; NCCL groups are built with
TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (a timeout aborts the communicator, never the process);
`abort_group` never blocks. NCCL_CUMEM_ENABLE is one value for the whole job (`nccl_env.job_nccl_env`,
put into every process's environment by the job's runtime_env before it starts, since NCCL reads
it once, at the process's first communicator, which on a learner rank is DeepSpeed's
`init_distributed`); the weight group refuses to build when two members disagree
(`NcclEnvMismatch`), because a mismatch breaks the learner -> engine P2P connect.

Who may talk to the rendezvous: the master store listens only on the configured interface
(`learner.weights.host`; torch's own master listens on every interface, so asyncrl binds the
socket itself and hands it over); a member outside the current plan asks to (re)join with a
request signed with the job's secret (`join_request` / `join_member`: HMAC-SHA256 of the request's
number and member id), and the sender ignores any other request without waiting for it. The
store itself has no authentication: a local process that reaches its port can still write keys
(docs/security.md says what that allows).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.weights.wire import PREFIX

log = logging.getLogger(__name__)


def make_store(host: str, port: int, *, is_master: bool, timeout_s: float) -> dist.TCPStore:
    # wait_for_workers=False: the master must not block until a fixed world of clients joins.
    # (A master made here listens on every interface: the sender uses `master_store`.)
    return dist.TCPStore(host, port, None, is_master, timedelta(seconds=timeout_s), wait_for_workers=False)


def master_store(host: str, port: int, timeout_s: float) -> tuple[dist.TCPStore, socket.socket]:
    """The store server listening on `host` only: the socket is bound here and handed over
    (torch's own master binds every interface). The store uses that socket without owning it:
    the caller keeps it open for as long as the store lives."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)
        store = dist.TCPStore(host, sock.getsockname()[1], None, True, timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    return store, sock


def _join_mac(secret: str, n: int, member: str) -> str:
    return hmac.new(secret.encode(), f"{n}:{member}".encode(), hashlib.sha256).hexdigest()


def join_request(secret: str | None, n: int, member: str) -> str:
    """The value of join request number `n` for `member`, signed with the job's secret."""
    return member if secret is None else json.dumps({"member": member, "mac": _join_mac(secret, n, member)})


def join_member(secret: str | None, n: int, value: bytes) -> str | None:
    """The member asking in join request `n`, or None when the request is not signed with `secret`
    (without a secret, any request is taken, as plain-torch tools send them)."""
    text = value.decode(errors="replace")
    if secret is None:
        return text
    try:
        req = json.loads(text)
        member, mac = str(req["member"]), str(req["mac"])
    except (ValueError, TypeError, KeyError):
        return None
    return member if hmac.compare_digest(mac, _join_mac(secret, n, member)) else None


class CollectiveTimeout(RuntimeError):
    """A weight-group collective did not complete by its deadline."""


def backstop_timeout(timeout_s: float) -> timedelta:
    """The process group's own timeout: later than every deadline asyncrl enforces itself, so
    gloo's and NCCL's watchdogs never fire first (they are the backstop, not the mechanism)."""
    return timedelta(seconds=4 * timeout_s + 30)


# NCCL environment of the weight group. TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): a
# timed-out collective aborts its communicator but never tears the process down (torch's default,
# 3, kills the process, i.e. the learner).
NCCL_ERROR_HANDLING = "2"


class NcclEnvMismatch(RuntimeError):
    """Two members of the weight group run with different NCCL_CUMEM_ENABLE: a configuration
    error (every round would fail to connect), never a member failure to drop and retry."""


@contextmanager
def _scoped_env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def group_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A store client of a group's own, for `make_group`. A TCPStore client runs one request at a
    time and holds the connection for the whole of a blocking `get`/`wait`: gloo's constructor
    (and NCCL's first collective) wait there for every peer's key, up to the backstop, so on the
    member's shared client they would stall its heartbeats and the sender's own bookkeeping until
    then (a member that died before connecting would hold a round until the backstop instead of one
    deadline)."""
    return make_store(host, port, is_master=False, timeout_s=timeout_s)


def make_group(store: dist.Store, generation: int, rank: int, world: int, backend: str,
               timeout_s: float, device: torch.device | None = None) -> dist.ProcessGroup:
    """A process group made only for weights, over `PrefixStore(asyncrl_w/g{generation})`.
    Its own timeout is `backstop_timeout`; callers bound every collective with `wait_work`.
    `store` should be the group's own client (`group_store`), not one other threads use."""
    prefixed = dist.PrefixStore(f"{PREFIX}/g{generation}/pg", store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = backstop_timeout(timeout_s)
        if device is not None:
            torch.cuda.set_device(device)
        with _scoped_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": NCCL_ERROR_HANDLING}):  # read by the constructor
            return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    return dist.ProcessGroupGloo(prefixed, rank, world, backstop_timeout(timeout_s))


def wait_work(work: Any, deadline: float, tick: Any = None, tick_every_s: float = 0.2) -> None:
    """Wait for a collective until `deadline` (time.monotonic), polling `work.is_completed()`,
    so the bound holds on NCCL too (whose `wait()` does not block without
    TORCH_NCCL_BLOCKING_WAIT) and on gloo alike. `tick()` runs about every `tick_every_s` while
    waiting (receivers heartbeat there and may raise to give up early). Raises CollectiveTimeout
    at the deadline; the collective's own error otherwise comes out of the final `wait()`."""
    delay, next_tick = 2e-5, time.monotonic() + tick_every_s
    while not work.is_completed():
        now = time.monotonic()
        if now >= deadline:
            raise CollectiveTimeout("weight collective passed its deadline")
        if tick is not None and now >= next_tick:
            tick()
            next_tick = now + tick_every_s
        time.sleep(delay)
        delay = min(2 * delay, 1e-3)
    work.wait()  # re-raises a failed collective; on NCCL the current stream now waits for it


def connect_group(build: Callable[[], Any], device: torch.device | None, deadline: float, backstop_s: float,
                  tick: Callable[[], None] | None = None) -> Any:
    """Build a weight group and run its first collective (a one-element broadcast from rank 0)
    by `deadline`. NCCL creates its communicator at the first collective and gloo connects its
    mesh in the constructor; both block the calling thread until every member has joined, with
    no bound of their own short of the backstop. So both run in a helper thread; at the deadline
    the caller gets CollectiveTimeout and the half-built group is retired (`abort_group`) as soon
    as it exists. `tick()` runs while waiting (receivers heartbeat there and may raise)."""
    box: dict[str, Any] = {}
    lock = threading.Lock()

    def run() -> None:
        try:
            pg = build()
            with lock:
                box["pg"] = pg
                if box.get("abandoned"):
                    abort_group(pg, backstop_s)
                    return
            box["work"] = pg.broadcast([torch.zeros(1, device=device or "cpu")])
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="asyncrl-weight-connect", daemon=True)
    thread.start()
    next_tick = time.monotonic() + 0.2
    try:
        while thread.is_alive():
            now = time.monotonic()
            if now >= deadline:
                raise CollectiveTimeout("weight group: creating the communicator passed its deadline")
            if tick is not None and now >= next_tick:
                tick()
                next_tick = now + 0.2
            thread.join(0.01)
    except BaseException:
        with lock:
            box["abandoned"] = True
            pg = box.get("pg")
        abort_group(pg, backstop_s)
        raise
    if "error" in box:
        abort_group(box.get("pg"), backstop_s)
        raise box["error"]
    try:
        wait_work(box["work"], deadline, tick)
    except Exception:
        abort_group(box["pg"], backstop_s)
        raise
    return box["pg"]


_GRAVEYARD: list[tuple[float, Any]] = []  # (release time, gloo group) kept alive until then
_GRAVEYARD_LOCK = threading.Lock()


def abort_group(pg: Any, backstop_s: float = 0.0) -> None:
    """Retire a weight group without blocking the caller. NCCL: `abort()` in a reaper thread
    (frees kernels stuck on a dead peer). Gloo: its abort and its destructor both block the
    whole process (the GIL is held) until a hung collective reaches the group's own timeout, so
    the group is parked and released only after `backstop_s`, when nothing can hang any more."""
    now = time.monotonic()
    with _GRAVEYARD_LOCK:
        _GRAVEYARD[:] = [(t, g) for t, g in _GRAVEYARD if t > now]
        if pg is not None and not isinstance(pg, dist.ProcessGroupNCCL if dist.is_nccl_available() else ()):
            _GRAVEYARD.append((now + backstop_s, pg))
            return
    if pg is None:
        return

    def reap(group: Any) -> None:
        try:
            group.abort()
        except Exception:  # noqa: BLE001 - best effort on a group we are discarding
            log.debug("weight sync: abort of a weight group failed", exc_info=True)

    threading.Thread(target=reap, args=(pg,), name="asyncrl-weight-group-reaper", daemon=True).start()


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend

