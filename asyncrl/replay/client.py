"""Thin client of the replay buffer, usable from any process (actors, learner, tests, benchmarks).

Each thread gets its own DEALER socket (ZeroMQ sockets are not thread-safe), so e.g. an async
actor can wait for a ticket in one executor thread while another thread pushes. Every call has a
deadline; nothing blocks forever.

Exactly-once accounting: `push` is acknowledged by the server only after the group is stored (or
explicitly dropped/refused). When an acknowledgement does not arrive in time the same frames are sent
again with the same ticket, and the server answers ``duplicate`` instead of storing twice (pushes
without a ticket are not deduplicated). A batch reply arriving after its request timed out is kept
and returned by the next `get_batch`, so no delivered group is lost on the client side either.

Authentication: with the job's `secret` (`cfg.buffer.secret`; the buffer's default is to require
it) every request carries the HMAC of its frames as a last frame (asyncrl.replay.auth).

Reconnection: a buffer process that dies is restarted on the same address (asyncrl.replay.host);
ZeroMQ reconnects by itself, and a request whose connection dropped while it waited for its reply
is sent again at once (`BufferDisconnected`, seen on the socket's monitor) instead of waiting for
its deadline, for up to `reconnect_s`. Every request is safe to resend: pushes carry their ticket
(answered ``duplicate`` if the first copy was stored and logged), a ticket granted to a reply that
never arrived is given back when the reply does arrive, or expires with its lease.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
import time
import weakref
from typing import Any

import zmq
import zmq.auth

from asyncrl.config import CurveConfig
from asyncrl.protocol import (
    Ack,
    BatchReply,
    BatchRequest,
    ErrorReply,
    Group,
    ProtocolError,
    Push,
    PushReply,
    StatsReply,
    StatsRequest,
    TicketRelease,
    TicketReply,
    TicketRequest,
    VersionReached,
    decode,
    encode,
)
from asyncrl.replay.auth import sign


class BufferFull(RuntimeError):
    """The buffer stayed full (capacity in groups or bytes) for the whole push deadline."""


class BufferRequestError(RuntimeError):
    """The server answered with an ErrorReply (code and message attached)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class BufferDiskFull(BufferRequestError):
    """The buffer's durable log is on a full disk: the push was not stored (retry after space is
    freed; admission pauses meanwhile). The server's `buffer/disk_full` gauge says the same."""


class BufferTimeout(TimeoutError):
    """No reply from the server before the deadline (server down or unreachable)."""


class BufferDisconnected(BufferTimeout):
    """The connection to the server dropped while a request waited for its reply (server died)."""


def _close_sockets(sockets: list[zmq.Socket], lock: threading.Lock, ctx: zmq.Context) -> None:
    with lock:
        for sock in sockets:
            sock.close(linger=0)
        sockets.clear()
    if not ctx.closed:
        ctx.destroy(linger=0)


class BufferClient:
    def __init__(self, address: str, curve: CurveConfig | None = None, *, secret: str | None = None,
                 actor_id: str = "", hwm: int = 64, reply_grace_s: float = 30.0,
                 max_frame_bytes: int = 256 * 2**20, reconnect_s: float = 120.0) -> None:
        """`secret`: the job's buffer secret (requests are signed with it; None = unsigned);
        `reply_grace_s`: extra time a call waits beyond its own timeout for the server to answer;
        `reconnect_s`: how long requests are resent while the server is restarting."""
        self.address, self.curve, self.secret = address, curve, secret
        self.actor_id = actor_id or f"pid{os.getpid()}"
        self.hwm, self.reply_grace_s, self.max_frame_bytes = hwm, reply_grace_s, max_frame_bytes
        self.reconnect_s = reconnect_s
        self.disconnects = 0  # requests resent because the server's connection dropped
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self._stash: list[bytes] = []  # group frames of batch replies that arrived after their timeout
        # Closes the sockets and the context when the client is closed or collected. A client in a
        # reference cycle would otherwise hang the process in the collector: CPython clears the
        # context's weak references to its sockets before any finalizer runs, so the context's own
        # `__del__` closes nothing and `zmq_ctx_term` waits forever for the still-open sockets. The
        # finalizer holds the sockets and the context strongly, so they are never part of that cycle.
        self._finalizer = weakref.finalize(self, _close_sockets, self._sockets, self._lock, self._ctx)

    @property
    def version(self) -> int | None:
        """The learner version the server reported in this thread's last ticket, push or batch reply."""
        return getattr(self._local, "version", None)

    # ---------------------------------------------------------------------------- transport
    def _sock(self) -> zmq.Socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.hwm)
            sock.setsockopt(zmq.RCVHWM, self.hwm)
            sock.setsockopt(zmq.SNDTIMEO, int(self.reply_grace_s * 1000))
            if self.curve is not None and self.curve.enable:
                if not (self.curve.client_secret_key_file and self.curve.server_public_key_file):
                    raise ValueError("curve client needs client_secret_key_file and server_public_key_file")
                public, secret = zmq.auth.load_certificate(self.curve.client_secret_key_file)
                server_public, _ = zmq.auth.load_certificate(self.curve.server_public_key_file)
                sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, server_public
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(self.address)
            self._local.sock, self._local.mon = sock, mon
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
            self._local.poller = poller
            with self._lock:
                self._sockets.extend([mon, sock])
        return sock

    def _disconnected(self) -> bool:
        """Consumes pending monitor events; True if the connection dropped since the last call."""
        mon, dropped = self._local.mon, False
        while True:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return dropped
            event, _ = struct.unpack("=hi", frames[0][:6])
            dropped |= event == zmq.EVENT_DISCONNECTED

    def _resending(self, call):
        """Runs `call()`, sending it again while the server's connection drops (restart)."""
        deadline = time.monotonic() + self.reconnect_s
        while True:
            try:
                return call()
            except BufferDisconnected:
                self.disconnects += 1
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def _request(self, msg: Any, extra: list[Any] = (), wait_s: float = 0.0) -> tuple[Any, list[zmq.Frame]]:
        """Sends one request and returns (reply, extra frames); raises BufferTimeout after wait_s + grace."""
        sock = self._sock()
        self._disconnected()  # a drop before this request does not concern it
        rid = struct.pack("<Q", next(self._rids))
        try:
            sock.send_multipart(self.frames([rid, encode(msg), *extra]), copy=len(extra) == 0)
        except zmq.Again:
            raise BufferTimeout(f"could not send to {self.address} (queue full)") from None
        deadline = time.monotonic() + wait_s + self.reply_grace_s
        while True:
            left = deadline - time.monotonic()
            ready = dict(self._local.poller.poll(int(left * 1000) + 1)) if left > 0 else {}
            if not ready:
                raise BufferTimeout(f"no reply from {self.address} to {type(msg).__name__} within "
                                    f"{wait_s + self.reply_grace_s:.1f}s")
            if sock not in ready:
                if self._disconnected():
                    raise BufferDisconnected(f"connection to {self.address} dropped during {type(msg).__name__}")
                continue
            frames = sock.recv_multipart(copy=False)
            reply = decode(frames[1].buffer)
            if frames[0].bytes == rid:
                if isinstance(reply, ErrorReply):
                    raise (BufferDiskFull if reply.code == "disk_full" else BufferRequestError)(reply.code, reply.message)
                return reply, frames[2:]
            self._late(sock, reply, frames[2:])

    def _late(self, sock: zmq.Socket, reply: Any, extra: list[zmq.Frame]) -> None:
        """A reply to an earlier request that timed out: keep its groups, give back its ticket."""
        if isinstance(reply, BatchReply):
            self._stash.extend(f.bytes for f in extra)
        elif isinstance(reply, TicketReply) and reply.ticket >= 0:
            sock.send_multipart(self.frames([struct.pack("<Q", next(self._rids)), encode(TicketRelease(reply.ticket))]))

    def frames(self, frames: list[Any]) -> list[Any]:
        """A request's frames as sent: signed with the job's secret when the client has it."""
        return sign(frames, self.secret) if self.secret is not None else frames

    # ---------------------------------------------------------------------------- producer API
    def acquire_ticket(self, timeout_s: float = 0.0) -> int | None:
        """Admission ticket id, or None if none was granted within timeout_s."""
        reply, _ = self._resending(lambda: self._request(TicketRequest(self.actor_id, float(timeout_s)),
                                                         wait_s=timeout_s))
        assert isinstance(reply, TicketReply)
        self._local.version = reply.version
        return reply.ticket if reply.ticket >= 0 else None

    def release_ticket(self, ticket: int) -> bool:
        """Gives back the ticket of an abandoned group; False if it was no longer in flight."""
        reply, _ = self._resending(lambda: self._request(TicketRelease(int(ticket))))
        return isinstance(reply, Ack) and reply.detail == "released"

    def push(self, group: Group | bytes, ticket: int | None = None, *, block_s: float = 60.0,
             attempt_s: float = 10.0, want_ticket: bool = False) -> PushReply:
        """Pushes one group (a Group or its encoded frame). Returns the server's acknowledgement
        (status stored/duplicate/filtered/stale). While the buffer answers "full", retries with
        backoff for up to block_s, then raises BufferFull. Retries after an unanswered attempt
        (attempt_s) reuse the ticket, so the group is stored once. Raises BufferRequestError if
        rejected. `want_ticket`: the reply's `next_ticket` is the next admission ticket if one is
        free at once (-1 otherwise; then call acquire_ticket), saving a round trip per group."""
        blob = group if isinstance(group, (bytes, memoryview)) else encode(group)
        msg = Push(-1 if ticket is None else int(ticket), want_ticket)
        deadline, backoff = time.monotonic() + block_s, 0.005
        reconnect_deadline = time.monotonic() + self.reconnect_s
        while True:
            try:
                reply, _ = self._request(msg, [blob], wait_s=attempt_s - self.reply_grace_s)
            except BufferDisconnected:
                if time.monotonic() >= max(deadline, reconnect_deadline) or ticket is None:
                    raise
                self.disconnects += 1
                time.sleep(0.05)
                continue
            except BufferTimeout:
                if time.monotonic() >= deadline or ticket is None:
                    raise
                self._reset_socket()
                continue
            assert isinstance(reply, PushReply)
            self._local.version = reply.version
            if reply.status != "full":
                return reply
            if time.monotonic() + backoff > deadline:
                raise BufferFull(f"replay buffer full for {block_s}s")
            time.sleep(backoff)
            backoff = min(backoff * 2, 0.5)

    def _reset_socket(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            mon = self._local.mon
            with self._lock:
                self._sockets.remove(sock)
                self._sockets.remove(mon)
            sock.disable_monitor()
            mon.close(linger=0)
            sock.close(linger=0)
            self._local.sock = self._local.mon = self._local.poller = None

    # ---------------------------------------------------------------------------- pipelined pushes
    # For a caller that keeps several requests in flight on this thread's socket (`PushWindow`):
    # it sends and reads the frames itself; the client owns the socket, its monitor and reconnection.
    def thread_socket(self) -> zmq.Socket:
        """This thread's DEALER socket, connected on first use."""
        return self._sock()

    def wait_readable(self, timeout_ms: int) -> bool:
        """Waits up to `timeout_ms` for this thread's socket or its connection monitor; True if
        the socket has frames to read (a monitor event alone returns False: see `connection_dropped`)."""
        return self._local.sock in dict(self._local.poller.poll(timeout_ms))

    def connection_dropped(self) -> bool:
        """True, counted in `disconnects`, if this thread's connection dropped since the last check
        (the server restarted: what was in flight on it is lost)."""
        if not self._disconnected():
            return False
        self.disconnects += 1
        return True

    def reopen_socket(self) -> zmq.Socket:
        """Replaces this thread's socket with a fresh one, dropping what was queued on the old one
        (to a peer that stopped answering); returns the new socket."""
        self._reset_socket()
        return self._sock()

    # ---------------------------------------------------------------------------- learner API
    def get_batch_frames(self, num_groups: int, version: int, timeout_s: float = 60.0, *,
                         ahead: int = 0) -> list[bytes]:
        """Up to num_groups encoded Group frames for learner version `version`, oldest first, all
        within the staleness bound (also sets the buffer's v to `version - ahead`; see
        `BatchRequest.ahead`); fewer (maybe none) when timeout_s passes first. The frames are the
        ones the producers pushed, byte for byte: this client neither decodes nor re-encodes them
        (the caller decodes where the groups are used)."""
        out = self._stash[:num_groups]
        del self._stash[:num_groups]
        if len(out) == num_groups:
            return out
        reply, frames = self._resending(lambda: self._request(
            BatchRequest(num_groups - len(out), int(version), float(timeout_s), int(ahead)), wait_s=timeout_s))
        assert isinstance(reply, BatchReply)
        self._local.version = reply.version
        for f in frames:
            if len(f) > self.max_frame_bytes:
                raise ProtocolError(f"batch reply carried a frame of {len(f)} bytes (limit {self.max_frame_bytes})")
            out.append(f.bytes)
        extra = self._stash[: num_groups - len(out)]  # late replies that arrived during this request
        del self._stash[: len(extra)]
        return out + extra

    def get_batch(self, num_groups: int, version: int, timeout_s: float = 60.0) -> list[Group]:
        """`get_batch_frames`, decoded (tests, benchmarks, tools that read the groups here)."""
        out = []
        for frame in self.get_batch_frames(num_groups, version, timeout_s):
            g = decode(frame, max_bytes=self.max_frame_bytes)
            if not isinstance(g, Group):
                raise ProtocolError(f"batch reply carried a {type(g).__name__}")
            out.append(g)
        return out

    def set_version(self, version: int) -> None:
        """The learner reached `version` (forward only; the job sets any other version through the
        `BufferHost` actor)."""
        self._resending(lambda: self._request(VersionReached(int(version))))

    # ---------------------------------------------------------------------------- admin
    def stats(self) -> dict[str, float]:
        reply, _ = self._resending(lambda: self._request(StatsRequest()))
        assert isinstance(reply, StatsReply)
        return reply.stats

    def close(self) -> None:
        """Close every socket and the context (idempotent; also done when the client is collected)."""
        self._finalizer()

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
