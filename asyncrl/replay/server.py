"""ZeroMQ replay buffer server: one ROUTER socket, one background thread, the rules of `state.py`.

Wire (DEALER client <-> ROUTER server, request/reply with acknowledgements):
  request  = [rid (8 bytes), control frame, *group frames]   (Push carries exactly one group frame)
  reply    = [rid, control frame, *group frames]             (BatchReply carries num_groups frames)
A push is acknowledged only after the group is validated and stored (or explicitly dropped as
stale/filtered, or refused as full), so producers can count exactly what was accepted; a retried
push with the same ticket is answered ``duplicate`` and stored once. Group frames are validated once
at ingest and then forwarded to the learner byte for byte (never re-encoded).

Guarantees
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
    decode,
    encode,
)
from asyncrl.replay.snapshot import SnapshotError, read_snapshot, write_snapshot
from asyncrl.replay.state import BufferState, StoredGroup, UnknownTicket
from asyncrl.replay.wal import BufferLog

T = TypeVar("T")

log = logging.getLogger(__name__)
CONTROL_MAX_BYTES = 1 << 20


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
    from that log (a restarted buffer process), otherwise the log starts empty."""

    def __init__(self, cfg: BufferConfig, batch_size: int, port_range: str | None = None,
                 log_path: str | None = None, recover: bool = False) -> None:
        self.cfg = cfg
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
        self._tickets: deque[_Waiter] = deque()
        self._batches: deque[_Waiter] = deque()
        self._auth: Any = None
        self.log: BufferLog | None = None
        self._logged = -1
        if log_path is not None and cfg.durable.enable:
            d = cfg.durable
            self.log = BufferLog(log_path, d.fsync, d.fsync_interval_s, int(d.compact_min_mb * 2**20))
            header, groups = self.log.replay() if recover else (None, [])
            if header is not None:
                self.state.recover(header, groups, lease_cap_s=d.restored_lease_s)
                self.state.counters["recovered_groups"] += len(groups)
            if recover:
                self.state.counters["restarts"] += 1
            self._compact()

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
        out["buffer/waiting_ticket_requests"] = float(len(self._tickets))
        out["buffer/waiting_batch_requests"] = float(len(self._batches))
        return out

    def _change(self, change: Callable[..., T], *args: Any) -> T:
        """Applies one state change under the lock and makes it durable before returning."""
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
    def _durable(self, stored: StoredGroup | None = None) -> None:
        """Appends the state (and the group just stored) to the log per its fsync policy; called
        before every acknowledgement of a change. No-op without a log or without a change."""
        log, st = self.log, self.state
        if log is None or (stored is None and st.mutations == self._logged):
            return
        self._logged = st.mutations
        if stored is not None:
            log.append_group(st.durable_header(), st.group_meta(stored), stored.blob)
            if log.needs_compaction(st.bytes, st.buffered):
                return self._compact()
        elif log.needs_compaction(st.bytes, st.buffered):
            return self._compact()
        else:
            log.append_state(st.durable_header())
        log.commit()

    def _compact(self) -> None:
        if self.log is None:
            return
        st = self.state
        self.log.rewrite(st.durable_header(), [(st.group_meta(sg), sg.blob) for sg in st.groups()])
        self._logged = st.mutations

    def snapshot(self, path: str, with_indices: bool = False) -> Any:
        """Writes all buffered groups + counters atomically; returns the number of groups (or, with
        `with_indices`, the prompt indices of the groups written)."""
        with self._lock:
            groups = self.state.groups()
            write_snapshot(path, self.state.snapshot_header(), [g.blob for g in groups])
            return sorted(g.prompt_index for g in groups if g.prompt_index >= 0) if with_indices else len(groups)

    def restore(self, path: str) -> int:
        """Replaces the buffer's content and counters by the snapshot's (all or nothing)."""
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
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(self._poll_ms()):
                    for _ in range(256):  # drain a burst, then look after waiters and deadlines
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        with self._lock:
                            self._handle(sock, frames)
                with self._lock:
                    self._serve_waiters(sock, time.monotonic())
                    self._durable()
        finally:
            sock.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            ctx.term()
            if self.log is not None:
                self.log.close()

    def _poll_ms(self) -> int:
        deadlines = [w.deadline for w in (*self._tickets, *self._batches)]
        nxt = min(deadlines, default=time.monotonic() + 0.1)
        return max(1, min(100, int((nxt - time.monotonic()) * 1000) + 1))

    def _send(self, sock: zmq.Socket, ident: bytes, rid: bytes, msg: Any, extra: list[Any] = ()) -> bool:
        try:
            sock.send_multipart([ident, rid, encode(msg), *extra], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH (peer gone) or EAGAIN (peer's queue full)
            self.state.counters["reply_failures"] += 1
            log.warning("replay buffer: reply to a peer failed (%s)", exc)
            return False

    def _error_reply(self, sock: zmq.Socket, ident: bytes, rid: bytes, code: str, message: str) -> None:
        counter = {"schema": "rejected_schema", "oversized": "rejected_oversized",
                   "unknown_ticket": "rejected_unknown_ticket"}.get(code, "rejected_malformed")
        if code != "unknown_ticket":  # counted by the state
            self.state.counters[counter] += 1
        self._send(sock, ident, rid, ErrorReply(code, message[:2000]))

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
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
        except UnknownTicket as exc:
            self._error_reply(sock, ident, rid, "unknown_ticket", str(exc))
        except (SnapshotError, OSError) as exc:  # a snapshot/restore the caller asked for failed
            log.warning("replay buffer: %s", exc)
            self._send(sock, ident, rid, ErrorReply("bad_request", f"{type(exc).__name__}: {exc}"))
        except Exception as exc:  # a bug must not take the buffer down for every client
            log.exception("replay buffer: handler failed")
            self.state.counters["internal_errors"] += 1
            self._send(sock, ident, rid, ErrorReply("internal", f"{type(exc).__name__}: {exc}"))

    def _dispatch(self, sock: zmq.Socket, ident: bytes, rid: bytes, msg: Any, extra: list[zmq.Frame]) -> None:
        st, now = self.state, time.monotonic()
        if isinstance(msg, Push):
            frame = extra[0]
            if len(frame) > self.max_frame_bytes:
                return self._error_reply(sock, ident, rid, "oversized",
                                         f"group frame of {len(frame)} bytes over max_frame_mb={self.cfg.max_frame_mb}")
            group = decode(frame.buffer, max_bytes=self.max_frame_bytes)
            if not isinstance(group, Group):
                raise ProtocolError(f"Push must carry a Group frame, got {type(group).__name__}")
            status = st.ingest(group, frame.buffer, msg.ticket)
            # FIFO fairness: no ticket jumps the queue of parked ticket requests
            nxt = st.grant(group.actor_id) if msg.want_ticket and status != "full" and not self._tickets else None
            self._durable(st.last_stored if status == "stored" else None)
            if not self._send(sock, ident, rid, PushReply(status, "", -1 if nxt is None else nxt, st.version)) \
                    and nxt is not None:
                st.release(nxt)
        elif isinstance(msg, TicketRequest):
            self._tickets.append(_Waiter(ident, rid, msg, now, now + max(0.0, float(msg.timeout_s))))
        elif isinstance(msg, BatchRequest):
            if msg.num_groups <= 0:
                raise ProtocolError("BatchRequest.num_groups must be > 0")
            admit = msg.version - max(0, msg.ahead)
            if admit != st.version and (msg.ahead <= 0 or admit > st.version):  # a prefetch never lowers v
                st.set_version(admit)
            self._batches.append(_Waiter(ident, rid, msg, now, now + max(0.0, float(msg.timeout_s))))
        elif isinstance(msg, TicketRelease):
            released = st.release(msg.ticket)
            self._durable()
            self._send(sock, ident, rid, Ack("released" if released else "not in flight"))
        elif isinstance(msg, SetVersion):
            dropped = st.set_version(msg.version)
            self._durable()
            self._send(sock, ident, rid, Ack(f"dropped_stale={dropped}"))
        elif isinstance(msg, StatsRequest):
            self._send(sock, ident, rid, StatsReply(self.stats()))
        elif isinstance(msg, SnapshotRequest):
            self._send(sock, ident, rid, Ack(f"groups={self.snapshot(msg.path)}"))
        elif isinstance(msg, RestoreRequest):
            self._send(sock, ident, rid, Ack(f"groups={self.restore(msg.path)}"))
        else:
            raise ProtocolError(f"{type(msg).__name__} is not a request")
        if isinstance(msg, (TicketRequest, BatchRequest, TicketRelease, SetVersion, RestoreRequest)):
            self._serve_waiters(sock, now)

    def _serve_waiters(self, sock: zmq.Socket, now: float) -> None:
        st = self.state
        st.expire()
        while self._tickets:
            w = self._tickets[0]
            ticket = st.grant(w.msg.actor_id)
            if ticket is None and now < w.deadline:
                break  # FIFO: later requests wait behind the first
            self._tickets.popleft()
            if ticket is None:
                st.counters["tickets_timed_out"] += 1
            else:
                st.record_wait("ticket", now - w.t0)
                self._durable()  # the lease is logged before the ticket is handed out
            if not self._send(sock, w.ident, w.rid, TicketReply(-1 if ticket is None else ticket, st.version)) and ticket is not None:
                st.release(ticket)
        while self._batches:
            w = self._batches[0]
            st.drop_stale(w.msg.version)
            if st.buffered < w.msg.num_groups and now < w.deadline:
                break
            self._batches.popleft()
            taken = st.take(w.msg.num_groups, at=w.msg.version)
            st.record_wait("batch", now - w.t0)
            reply = BatchReply(len(taken), st.version, st.counters["dropped_stale"])
            if not self._send(sock, w.ident, w.rid, reply, [g.blob for g in taken]):
                st.requeue(taken)
