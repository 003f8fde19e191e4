"""ZeroMQ replay buffer server: one ROUTER socket, one background thread, the rules of `state.py`.

Wire (DEALER client <-> ROUTER server, request/reply with acknowledgements):
  request  = [rid (8 bytes), control frame, *group frames]   (Push carries exactly one group frame)
  reply    = [rid, control frame, *group frames]             (BatchReply carries num_groups frames)
A push is acknowledged only after the group is validated and stored (or explicitly dropped as
stale/filtered, or refused as full), so producers can count exactly what was accepted; a retried
push with the same ticket is answered ``duplicate`` and stored once. Group frames are validated once
at ingest and then forwarded to the learner byte for byte (never re-encoded).

Guarantees
- Only the job drives it: with `cfg.auth` (the default) every request must end with the HMAC of the
  job's secret (asyncrl.replay.auth), checked before anything is decoded; admin requests (snapshot,
  restore, set-version) are refused over the socket (`forbidden`): the job calls the `BufferHost`
  actor for those, and snapshots are written only inside the run directory.
- Every number from the wire is bounded (asyncrl.replay.bounds: waits, batch sizes, versions,
  tickets, token ids, log-probs); a refused request is answered `out_of_range` naming the field and
  counted per reason (`buffer/refused/<reason>`).
- Fair waiting: each connection has at most one waiting batch request and one waiting ticket
  request per actor id (at most `max_parked_per_peer`); waiting batch requests are served in
  arrival order, but one that cannot be served yet never holds back a smaller one behind it, and
  tickets are handed out round-robin over connections.
- The socket thread survives its own bugs: an exception in the loop is logged and counted
  (`buffer/loop_errors`) and the loop goes on; after 100 in a row it stops and `healthy()` turns
  False with the cause (the `BufferHost` actor's `stats`/`set_version` then raise it).
- Group commit: the replies of one pass (a burst of up to 256 requests drained at once) wait for
  the sync that covers the log records appended up to the end of the pass, so each acknowledged
  push is on disk (fsync) before its acknowledgement and one fsync covers the pushes that arrived
  together. With `durable.sync_thread` (for `fsync: always`; off by default) the fsync runs on a thread
  of its own (`wal.SyncThread`) while the loop keeps receiving, checking and appending; replies
  wait in arrival order, tagged with the log position they need, and leave when the sync thread
  reports that position durable (it wakes the poller). Without it the loop fsyncs in line.
- A full disk is its own condition: a push whose record cannot be written is taken back and
  answered `disk_full` (nothing diverges from the log), no ticket is granted while the log is full
  (admission pauses; `buffer/disk_full` = 1, `buffer/refused/disk_full` counts), and the first
  write that succeeds again ends it.
- A malformed request (random bytes, truncated frame, wrong schema, wrong types, oversized frame,
  wrong frame count, unknown ticket) is answered with an `ErrorReply` naming the problem, counted
  (`buffer/rejected_*`), and never disturbs other clients. An exception inside a handler is logged,
  counted and answered `internal`; the loop keeps serving.
- Ticket and batch requests wait in the server (FIFO) until they can be answered or until their
  timeout, so clients never poll.
- A batch whose reply cannot be sent (peer gone, its queue full) is put back, not lost.

ZeroMQ settings (chosen deliberately):
- ``SNDHWM = RCVHWM = cfg.hwm`` messages per peer. Clients keep one request in flight per socket,
  so the limits bound memory against misbehaving peers, not normal traffic.
- ``ROUTER_MANDATORY = 1`` and non-blocking sends: an unroutable or full reply raises instead of
  being dropped silently; it is counted (`buffer/reply_failures`) and batches are requeued.
- ``MAXMSGSIZE = max_frame + 64 KiB``: libzmq disconnects a peer sending a frame above it before the
  memory is spent (not countable here); frames between the two limits get an `oversized` reply.
- ``LINGER = 0`` on close; binds and advertises per `asyncrl.addresses` (loopback unless `cfg.host`
  says otherwise; never advertises a wildcard); CurveZMQ when
  `cfg.curve.enable` (server keys from files, clients authorized by the public keys in a directory).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from asyncrl.addresses import bind_and_advertise, bind_first, candidate_ports
from asyncrl.config import BufferConfig
from asyncrl.protocol import (
    Ack,
    BatchReply,
    BatchRequest,
    ErrorReply,
    Group,
    ProtocolError,
    Push,
    PushReply,
    RestoreRequest,
    SetVersion,
    SnapshotRequest,
    StatsReply,
    StatsRequest,
    TicketRelease,
    TicketReply,
    TicketRequest,
    VersionReached,
    decode,
    encode,
)
from asyncrl.replay.auth import verify
from asyncrl.replay.bounds import VERSION_LEAD, OutOfRange, check_group, check_int, check_wait
from asyncrl.replay.snapshot import read_snapshot, write_snapshot
from asyncrl.replay.state import BufferState, StoredGroup, UnknownTicket
from asyncrl.replay.wal import BufferLog, LogFull, SyncThread

T = TypeVar("T")
Reply = tuple[bytes, bytes, Any, list[Any], "Callable[[], None] | None"]  # ident, rid, msg, frames, on_fail

log = logging.getLogger(__name__)
CONTROL_MAX_BYTES = 1 << 20
MAX_LOOP_ERRORS = 100  # consecutive failures of the socket loop before it gives up (healthy() False)
MAX_PARKED_TICKETS = 4096  # waiting ticket requests over all connections
ADMIN = (SnapshotRequest, RestoreRequest, SetVersion)


class BufferUnhealthy(RuntimeError):
    """The buffer's socket thread stopped (the cause is in the message)."""


@dataclass(slots=True)
class _Waiter:
    ident: bytes
    rid: bytes
    msg: Any
    t0: float
    deadline: float


class ReplayBufferServer:
    """`start()` binds and serves in a daemon thread; `stats()`, `snapshot()`, `restore()`,
    `set_version()` may also be called in-process (they take the state lock).

    `log_path` (with `cfg.durable.enable`): every acknowledged change is appended to a durable log
    there (asyncrl.replay.wal) before its acknowledgement is sent; `recover=True` rebuilds the state
    from that log (a restarted buffer process), otherwise the log starts empty.
    `vocab_size`: token ids of pushed groups must lie in [0, vocab_size) (None: not checked).
    `run_dir`: snapshots are written only inside it (None: anywhere the in-process caller says)."""

    def __init__(self, cfg: BufferConfig, batch_size: int, port_range: str | None = None,
                 log_path: str | None = None, recover: bool = False, vocab_size: int | None = None,
                 run_dir: str | None = None) -> None:
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.run_dir = run_dir
        self.secret = cfg.secret if cfg.auth else None
        self.port_range = port_range
        self.max_frame_bytes = int(cfg.max_frame_mb * 2**20)
        ds = cfg.dynamic_sampling
        self.state = BufferState(
            max_staleness=cfg.max_staleness, batch_size=batch_size, capacity_groups=cfg.capacity_groups,
            capacity_bytes=int(cfg.capacity_mb * 2**20), ticket_lease_s=cfg.ticket_lease_s,
            filter_enable=ds.enable, filter_key=ds.key, filter_low=ds.low, filter_high=ds.high)
        self.address: str | None = None
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._tickets: dict[bytes, dict[str, _Waiter]] = {}  # per connection, per actor id; round-robin
        self._parked_tickets = 0
        self._batches: dict[bytes, _Waiter] = {}  # one per connection, in arrival order
        self._outbox: list[Reply] = []
        self._syncer: SyncThread | None = None  # durable.sync_thread: fsyncs off the socket loop
        self._unsynced: deque[tuple[int, list[Reply]]] = deque()  # replies by the log position they need
        self._auth: Any = None
        self._loop_error: BaseException | None = None
        self.disk_full = False  # the durable log could not be written; cleared by the next write that can
        self.log: BufferLog | None = None
        self._logged = -1
        if log_path is not None and cfg.durable.enable:
            d = cfg.durable
            self.log = BufferLog(log_path, d.fsync, d.fsync_interval_s, int(d.compact_min_mb * 2**20))
            header, groups = self.log.replay() if recover else (None, [])
            if header is not None:
                self.state.recover(header, groups, lease_cap_s=d.restored_lease_s)
                self.state.counters["recovered_groups"] += len(groups)
            self.state.counters["log_damaged_records"] += len(self.log.damaged)
            self.state.counters["log_lost_groups"] += len(self.log.lost)
            if recover:
                self.state.counters["restarts"] += 1
            try:
                self._compact()
            except LogFull as exc:  # serve what was recovered; pushes wait for space (disk_full)
                self.disk_full = True
                log.warning("replay buffer: recovered %d group(s) on a full disk; serving them read-only until "
                            "%d bytes are free for the log (%s)", len(groups), exc.needed_bytes, exc)

    # ---------------------------------------------------------------------------- lifecycle
    def start(self, timeout_s: float = 10.0) -> str:
        """Binds and starts serving; returns the address clients connect to (tcp://host:port)."""
        self._thread = threading.Thread(target=self._run, name="replay-buffer", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"replay buffer did not start: {self._error!r}")
        assert self.address is not None
        return self.address

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __enter__(self) -> ReplayBufferServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------------------- in-process API
    def stats(self) -> dict[str, float]:
        with self._lock:
            out = self.state.stats()
            if self.log is not None:
                out["buffer/log_mb"] = self.log.size / 2**20
                out["buffer/log_torn_bytes"] = float(self.log.torn_bytes)
                out["buffer/log_fsyncs"] = float(self.log.fsyncs)
            out["buffer/disk_full"] = float(self.disk_full)
            out["buffer/waiting_ticket_requests"] = float(self._parked_tickets)
            out["buffer/waiting_batch_requests"] = float(len(self._batches))
        return out

    def healthy(self) -> bool:
        """False once the socket thread has stopped on its own (`failure()` says why)."""
        return self._loop_error is None and (self._thread is None or self._thread.is_alive() or self._stop.is_set())

    def failure(self) -> str:
        return "" if self.healthy() else f"replay buffer socket thread stopped: {self._loop_error!r}"

    def _change(self, change: Callable[..., T], *args: Any) -> T:
        """Applies one state change under the lock and makes it durable before returning (on a full
        disk the change stands in memory, `LogFull` is raised, and the next write logs it)."""
        with self._lock:
            out = change(*args)
            self._durable()
            return out

    def set_version(self, version: int) -> int:
        return self._change(self.state.set_version, version)

    def observe_drift(self, drift: float, budget: float) -> int:
        """`BufferState.observe_drift` under the lock (drift pacing); the new admission staleness."""
        return self._change(self.state.observe_drift, drift, budget)

    def take_dropped(self) -> list[tuple[int, float]]:
        """(prompt index, length) of the groups dropped stale since the previous call."""
        return self._change(self.state.take_dropped)

    def release_actor(self, actor_id: str) -> int:
        """Frees the admission tickets of a producer that died (its prompts are being re-issued)."""
        return self._change(self.state.release_actor, actor_id)

    def prompt_indices(self) -> list[int]:
        with self._lock:
            return self.state.prompt_indices()

    # ---------------------------------------------------------------------------- durable log
    def _log_change(self, stored: StoredGroup | None = None) -> None:
        """Appends the state (and the group just stored) to the log, without fsync (`_commit` does
        that once per burst). Raises LogFull when the disk is full (the record is not in the log;
        the state keeps the removals it held for the next record). No-op without a log or change."""
        log, st = self.log, self.state
        if log is None or (stored is None and st.mutations == self._logged):
            return
        header = st.durable_header()
        try:
            if stored is not None:
                log.append_group(header, st.group_meta(stored), stored.blob)
            else:
                log.append_state(header)
        except LogFull:
            if not self.disk_full:
                log_warning = "replay buffer: the durable log's disk is full; pushes are refused and admission pauses"
                globals()["log"].warning(log_warning)
            self.disk_full = True
            raise
        if self.disk_full:
            globals()["log"].warning("replay buffer: the durable log can be written again; admission resumes")
        self.disk_full = False
        st.logged(header)
        self._logged = st.mutations
        if log.needs_compaction(st.bytes, st.buffered):
            try:
                self._compact()
            except LogFull as exc:  # the old log is whole and holds everything: go on with it
                globals()["log"].warning("replay buffer: compacting the durable log needs %d bytes: %s",
                                         exc.needed_bytes, exc)

    def _commit(self) -> None:
        if self.log is not None:
            self.log.commit()

    def _durable(self, stored: StoredGroup | None = None) -> None:
        """`_log_change` + `_commit`: the change is durable when this returns."""
        self._log_change(stored)
        self._commit()

    def _compact(self) -> None:
        if self.log is None:
            return
        st = self.state
        header = st.durable_header()
        self.log.rewrite(header, [(st.group_meta(sg), sg.blob) for sg in st.groups()])
        st.logged(header)
        self._logged = st.mutations

    def _inside_run_dir(self, path: str) -> None:
        if self.run_dir is None:
            return
        root, target = Path(self.run_dir).resolve(), Path(path).resolve()
        if not target.is_relative_to(root):
            raise ValueError(f"buffer snapshot path {path} is outside the run directory {root}")

    def snapshot(self, path: str, with_indices: bool = False) -> Any:
        """Writes all buffered groups + counters atomically (only inside `run_dir` when set);
        returns the number of groups (or, with `with_indices`, the prompt indices written)."""
        self._inside_run_dir(path)
        with self._lock:
            groups = self.state.groups()
            write_snapshot(path, self.state.snapshot_header(), [g.blob for g in groups])
            return sorted(g.prompt_index for g in groups if g.prompt_index >= 0) if with_indices else len(groups)

    def restore(self, path: str) -> int:
        """Replaces the buffer's content and counters by the snapshot's (all or nothing). Any path
        the job gives (a resume may name a checkpoint elsewhere); the file is checked whole."""
        header, blobs, _ = read_snapshot(path, self.max_frame_bytes)
        with self._lock:
            self.state.load(header, blobs)
            self._compact()
            return self.state.buffered

    # ---------------------------------------------------------------------------- socket loop
    def _socket(self, ctx: zmq.Context) -> zmq.Socket:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.cfg.hwm)
        sock.setsockopt(zmq.RCVHWM, self.cfg.hwm)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes + 65536)
        curve = self.cfg.curve
        if curve.enable:
            if not (curve.server_secret_key_file and curve.authorized_clients_dir):
                raise ValueError("buffer.curve.enable needs server_secret_key_file and authorized_clients_dir")
            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=curve.authorized_clients_dir)
            public, secret = zmq.auth.load_certificate(curve.server_secret_key_file)
            sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        # Bind the configured interface, advertise this process's node address (never a wildcard).
        bind, advertise = bind_and_advertise(self.cfg.host)

        def bind_port(port: int) -> int:
            sock.bind(f"tcp://{bind}:{port or '*'}")
            return int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])

        try:
            port = bind_first(candidate_ports(self.cfg.port, self.port_range), bind_port, "replay buffer", bind)
        except BaseException:
            sock.close(linger=0)
            raise
        self.address = f"tcp://{advertise}:{port}"
        return sock

    def _run(self) -> None:
        ctx = zmq.Context()
        try:
            sock = self._socket(ctx)
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            ctx.destroy(linger=0)
            return
        if self.log is not None and self.log.fsync == "always" and self.cfg.durable.sync_thread:
            self._syncer = SyncThread(self.log)
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if self._syncer is not None:
            poller.register(self._syncer.wake_fd, zmq.POLLIN)
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    self._serve_once(sock, poller)
                    failures = 0
                except Exception as exc:  # a bug must not silently end the buffer for every client
                    failures += 1
                    self.state.counters["loop_errors"] += 1
                    log.exception("replay buffer: the socket loop failed (%d in a row)", failures)
                    if failures >= MAX_LOOP_ERRORS:
                        self._loop_error = exc
                        log.error("replay buffer: %d consecutive loop failures; the socket thread stops", failures)
                        return
                    time.sleep(min(0.01 * failures, 0.5))
        except BaseException as exc:
            self._loop_error = exc
            raise
        finally:
            self._last_sync(sock)
            sock.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            ctx.term()
            if self._syncer is not None:
                self._syncer.stop()
            if self.log is not None:
                self.log.close()

    def _serve_once(self, sock: zmq.Socket, poller: zmq.Poller) -> None:
        """One pass: drain a burst of requests, serve the waiters, then commit the log once and send
        every reply of the pass (group commit: nothing is acknowledged before it is durable)."""
        try:
            if poller.poll(self._poll_ms()):
                if self._syncer is not None:
                    self._syncer.drain()
                for _ in range(256):  # drain a burst, then look after waiters and deadlines
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    with self._lock:
                        self._handle(sock, frames)
            with self._lock:
                self._serve_waiters(sock, time.monotonic())
                try:
                    self._log_change()
                except LogFull:
                    pass  # counted and said; the next change tries again
        finally:
            with self._lock:
                self._flush(sock)

    def _poll_ms(self) -> int:
        with self._lock:
            deadlines = [w.deadline for per in self._tickets.values() for w in per.values()]
            deadlines += [w.deadline for w in self._batches.values()]
        nxt = min(deadlines, default=time.monotonic() + 0.1)
        return max(1, min(100, int((nxt - time.monotonic()) * 1000) + 1))

    def _send(self, sock: zmq.Socket, ident: bytes, rid: bytes, msg: Any, extra: list[Any] = (),
              on_fail: Callable[[], Any] | None = None) -> None:
        """Queues a reply; `_flush` sends it after the log's commit. `on_fail` undoes what the reply
        handed over (a ticket, taken groups) when it cannot be delivered."""
        self._outbox.append((ident, rid, msg, list(extra), on_fail))

    def _flush(self, sock: zmq.Socket) -> None:
        if self._syncer is not None:
            return self._release_synced(sock)
        if not self._outbox:
            return
        out, self._outbox = self._outbox, []
        try:
            self._commit()
        except OSError as exc:
            self._fail_unsynced(sock, out, exc)
        self._deliver_all(sock, out)

    def _release_synced(self, sock: zmq.Socket) -> None:
        """Group commit with the sync thread: this pass's replies wait for the log position appended
        so far; every batch whose position is durable leaves, in arrival order."""
        assert self._syncer is not None and self.log is not None
        if self._outbox:
            need = self.log.lsn
            self._unsynced.append((need, self._outbox))
            self._outbox = []
            if need > self.log.committed:
                self._syncer.request(need)
        error = self._syncer.take_error()
        while self._unsynced and self._unsynced[0][0] <= self.log.committed:
            self._deliver_all(sock, self._unsynced.popleft()[1])
        if error is not None:  # counted, said, and nothing that waited for the sync is acknowledged
            waiting = [reply for _, replies in self._unsynced for reply in replies]
            self._unsynced.clear()
            self._fail_unsynced(sock, waiting, error)

    def _last_sync(self, sock: zmq.Socket) -> None:
        """On the way out, one sync in line so that what waited for the sync thread is acknowledged
        before the socket closes (as the in-line mode sends every reply of its last pass)."""
        if self._syncer is None or not (self._unsynced or self._outbox):
            return
        try:
            with self._lock:
                assert self.log is not None
                self.log.commit()
                self._release_synced(sock)
        except Exception:  # noqa: BLE001 - stopping anyway; the producers' retries cover what was not acknowledged
            log.exception("replay buffer: the last sync before stopping failed")

    def _fail_unsynced(self, sock: zmq.Socket, replies: list[Reply], exc: OSError) -> None:
        """The fsync failed: what was written may not be on disk, so none of `replies` is acknowledged."""
        self.state.counters["log_failures"] += 1
        log.error("replay buffer: the durable log's commit failed (%s)", exc)
        for ident, rid, _, _, on_fail in replies:
            if on_fail is not None:
                on_fail()
            self._deliver(sock, ident, rid, ErrorReply("internal", f"durable log commit failed: {exc}"), [])
        raise exc

    def _deliver_all(self, sock: zmq.Socket, replies: list[Reply]) -> None:
        for ident, rid, msg, extra, on_fail in replies:
            if not self._deliver(sock, ident, rid, msg, extra) and on_fail is not None:
                on_fail()

    def _deliver(self, sock: zmq.Socket, ident: bytes, rid: bytes, msg: Any, extra: list[Any]) -> bool:
        try:
            sock.send_multipart([ident, rid, encode(msg), *extra], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH (peer gone) or EAGAIN (peer's queue full)
            self.state.counters["reply_failures"] += 1
            log.warning("replay buffer: reply to a peer failed (%s)", exc)
            return False

    def _error_reply(self, sock: zmq.Socket, ident: bytes, rid: bytes, code: str, message: str,
                     reason: str | None = None) -> None:
        """An ErrorReply, counted: `reason` -> `refused/<reason>`, else by code (`rejected_*`)."""
        if reason is not None:
            self.state.counters[f"refused/{reason}"] += 1
        elif code != "unknown_ticket":  # counted by the state
            counter = {"schema": "rejected_schema", "oversized": "rejected_oversized"}.get(code, "rejected_malformed")
            self.state.counters[counter] += 1
        self._send(sock, ident, rid, ErrorReply(code, message[:2000]))

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        if self.secret is not None:
            if not verify(frames[1:], self.secret):
                rid = frames[1].bytes[:8].ljust(8, b"\0") if len(frames) > 1 else b"\0" * 8
                return self._error_reply(sock, ident, rid, "unauthenticated",
                                         "request without a valid HMAC of the job's secret (buffer.secret)",
                                         reason="unauthenticated")
            frames = frames[:-1]
        if len(frames) < 3 or len(frames[1]) != 8:
            rid = frames[1].bytes[:8].ljust(8, b"\0") if len(frames) > 1 else b"\0" * 8
            return self._error_reply(sock, ident, rid, "malformed", "request must be [rid(8 bytes), control, *groups]")
        rid = frames[1].bytes
        try:
            if len(frames[2]) > CONTROL_MAX_BYTES:
                return self._error_reply(sock, ident, rid, "oversized", f"control frame over {CONTROL_MAX_BYTES} bytes")
            msg = decode(frames[2].buffer, max_bytes=CONTROL_MAX_BYTES)
            expected_extra = 1 if isinstance(msg, Push) else 0
            if len(frames) - 3 != expected_extra:
                return self._error_reply(sock, ident, rid, "malformed",
                                         f"{type(msg).__name__} needs {expected_extra} group frame(s), got {len(frames) - 3}")
            self._dispatch(sock, ident, rid, msg, frames[3:])
        except ProtocolError as exc:
            code = "schema" if "schema version" in str(exc) else "malformed"
            self._error_reply(sock, ident, rid, code, str(exc))
        except OutOfRange as exc:
            self._error_reply(sock, ident, rid, "out_of_range", str(exc), reason=exc.reason)
        except UnknownTicket as exc:
            self._error_reply(sock, ident, rid, "unknown_ticket", str(exc))
        except LogFull as exc:
            self._error_reply(sock, ident, rid, "disk_full", str(exc), reason="disk_full")
        except Exception as exc:  # a bug must not take the buffer down for every client
            log.exception("replay buffer: handler failed")
            self.state.counters["internal_errors"] += 1
            self._send(sock, ident, rid, ErrorReply("internal", f"{type(exc).__name__}: {exc}"))

    def _dispatch(self, sock: zmq.Socket, ident: bytes, rid: bytes, msg: Any, extra: list[zmq.Frame]) -> None:
        st, now, cfg = self.state, time.monotonic(), self.cfg
        if isinstance(msg, ADMIN):
            return self._error_reply(sock, ident, rid, "forbidden",
                                     f"{type(msg).__name__} is not accepted over the socket: the job drives snapshots, "
                                     "restores and versions through the BufferHost actor", reason="admin")
        if isinstance(msg, Push):
            frame = extra[0]
            if len(frame) > self.max_frame_bytes:
                return self._error_reply(sock, ident, rid, "oversized",
                                         f"group frame of {len(frame)} bytes over max_frame_mb={cfg.max_frame_mb}")
            check_int("ticket", "Push.ticket", msg.ticket, -1, 2**62)
            group = decode(frame.buffer, max_bytes=self.max_frame_bytes)
            if not isinstance(group, Group):
                raise ProtocolError(f"Push must carry a Group frame, got {type(group).__name__}")
            check_group(group, st.version, self.vocab_size)
            if self.disk_full and self.log is not None:
                self._try_log_again()
            status = st.ingest(group, frame.buffer, msg.ticket)
            if status == "stored":
                try:
                    self._log_change(st.last_stored)
                except LogFull:
                    st.unstore(st.last_stored)  # nothing diverges from the log: as if it never came
                    raise
            # FIFO fairness: no ticket jumps the queue of parked ticket requests
            nxt = None
            if msg.want_ticket and status != "full" and not self._parked_tickets and not self.disk_full:
                nxt = st.grant(group.actor_id)
            self._send(sock, ident, rid, PushReply(status, "", -1 if nxt is None else nxt, st.version),
                       on_fail=None if nxt is None else (lambda t=nxt: st.release(t)))
        elif isinstance(msg, TicketRequest):
            wait = check_wait("TicketRequest", msg.timeout_s, cfg.max_wait_s)
            per = self._tickets.setdefault(ident, {})
            old = per.pop(msg.actor_id, None)
            if old is not None:  # the same actor on the same connection asks again: the newer request stands
                self._parked_tickets -= 1
                self._send(sock, old.ident, old.rid, TicketReply(-1, st.version))
            if len(per) >= cfg.max_parked_per_peer or self._parked_tickets >= MAX_PARKED_TICKETS:
                if not per:
                    del self._tickets[ident]
                return self._error_reply(sock, ident, rid, "busy", f"{len(per)} ticket requests of this connection "
                                         "are waiting already (buffer.max_parked_per_peer)", reason="busy")
            per[msg.actor_id] = _Waiter(ident, rid, msg, now, now + wait)
            self._parked_tickets += 1
        elif isinstance(msg, BatchRequest):
            wait = check_wait("BatchRequest", msg.timeout_s, cfg.max_wait_s)
            check_int("num_groups", "BatchRequest.num_groups", msg.num_groups, 1, cfg.capacity_groups)
            check_int("version", "BatchRequest.version", msg.version, 0, st.version + VERSION_LEAD)
            check_int("ahead", "BatchRequest.ahead", msg.ahead, 0, VERSION_LEAD)
            admit = msg.version - msg.ahead
            if admit >= 0 and admit != st.version and (msg.ahead <= 0 or admit > st.version):  # a prefetch never lowers v
                st.set_version(admit)
            old = self._batches.pop(ident, None)
            if old is not None:  # one waiting batch request per connection: the newer one stands
                self._send(sock, old.ident, old.rid, BatchReply(0, st.version, st.counters["dropped_stale"]))
            self._batches[ident] = _Waiter(ident, rid, msg, now, now + wait)
        elif isinstance(msg, VersionReached):
            check_int("version", "VersionReached.version", msg.version, 0, st.version + VERSION_LEAD)
            dropped = st.set_version(msg.version) if msg.version > st.version else 0  # never backwards
            self._send(sock, ident, rid, Ack(f"dropped_stale={dropped}"))
        elif isinstance(msg, TicketRelease):
            released = st.release(msg.ticket)
            self._send(sock, ident, rid, Ack("released" if released else "not in flight"))
        elif isinstance(msg, StatsRequest):
            self._send(sock, ident, rid, StatsReply(self.stats()))
        else:
            raise ProtocolError(f"{type(msg).__name__} is not a request")
        if isinstance(msg, (TicketRequest, BatchRequest, TicketRelease, VersionReached)):
            self._serve_waiters(sock, now)

    def _try_log_again(self) -> None:
        """On a full disk, write the pending state once: success ends the condition."""
        try:
            self.state.mutations += 1  # force a state record
            self._log_change()
        except LogFull:
            pass

    def _serve_waiters(self, sock: zmq.Socket, now: float) -> None:
        st = self.state
        st.expire()
        self._serve_tickets(sock, now)
        for ident, w in list(self._batches.items()):  # arrival order; none holds back the ones behind it
            st.drop_stale(w.msg.version)
            if st.buffered < w.msg.num_groups and now < w.deadline:
                continue
            del self._batches[ident]
            taken = st.take(w.msg.num_groups, at=w.msg.version)
            st.record_wait("batch", now - w.t0)
            reply = BatchReply(len(taken), st.version, st.counters["dropped_stale"])
            self._send(sock, w.ident, w.rid, reply, [g.blob for g in taken],
                       on_fail=(lambda t=taken: st.requeue(t)) if taken else None)

    def _serve_tickets(self, sock: zmq.Socket, now: float) -> None:
        """Grants round-robin over connections (each connection's oldest request first); requests
        past their deadline are answered -1. Nothing is granted while the log's disk is full."""
        st = self.state
        for ident in list(self._tickets):  # expired requests first, wherever they are
            per = self._tickets[ident]
            for actor, w in list(per.items()):
                if now >= w.deadline:
                    del per[actor]
                    self._parked_tickets -= 1
                    st.counters["tickets_timed_out"] += 1
                    self._send(sock, w.ident, w.rid, TicketReply(-1, st.version))
            if not per:
                del self._tickets[ident]
        while self._tickets and not self.disk_full:
            ident = next(iter(self._tickets))
            per = self._tickets[ident]
            actor = next(iter(per))
            w = per[actor]
            ticket = st.grant(w.msg.actor_id)
            if ticket is None:
                return  # admission is full for everyone
            del per[actor]
            self._parked_tickets -= 1
            del self._tickets[ident]
            if per:
                self._tickets[ident] = per  # to the back of the round
            try:
                self._log_change()  # the lease is logged before the ticket is handed out
            except LogFull:
                st.release(ticket)
                self._send(sock, w.ident, w.rid, TicketReply(-1, st.version))
                return
            st.record_wait("ticket", now - w.t0)
            self._send(sock, w.ident, w.rid, TicketReply(ticket, st.version), on_fail=lambda t=ticket: st.release(t))
