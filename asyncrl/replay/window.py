"""`PushWindow`: several unacknowledged pushes in flight from one producer, acknowledged per group.

A producer that waits for each acknowledgement before sending the next group spends one round trip
per group on the wire. A window of k keeps up to k pushes outstanding on one DEALER socket owned
by one background thread (ZeroMQ sockets are not thread-safe); `submit` returns a future that
resolves to the group's own `PushReply`, so acknowledgements stay per group and may complete in
any order.

Guarantees (the same as `BufferClient.push`, per group)
- A future resolves only with the server's answer for that group (stored / duplicate / filtered /
  stale), or fails with `BufferFull` (the buffer stayed full for `block_s`), `BufferTimeout` /
  `BufferDisconnected` (no answer), or `BufferRequestError` (rejected).
- An attempt left unanswered for `attempt_s`, or cut by a dropped connection (the buffer process
  restarted), is sent again with the same ticket; the server answers ``duplicate`` when the first
  copy was stored, so no group is stored twice and none is lost. The first answer for a group
  wins; answers to its earlier attempts that arrive later are ignored. Pushes without a ticket
  are not deduplicated by the server, so they are never resent: they fail instead.
- "full" is retried with backoff (per group) until `block_s`; the other groups in the window go on.
"""

from __future__ import annotations

import itertools
import queue
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq

from asyncrl.protocol import ErrorReply, Group, Push, PushReply, decode, encode
from asyncrl.replay.client import (
    BufferClient,
    BufferDisconnected,
    BufferDiskFull,
    BufferFull,
    BufferRequestError,
    BufferTimeout,
)


@dataclass(slots=True)
class _Pending:
    blob: Group | bytes  # encoded by the window's thread before the first attempt
    ticket: int | None
    want_ticket: bool
    future: Future
    deadline: float  # "full" is retried until then
    reconnect_deadline: float  # a dropped connection is waited out until then
    not_before: float = 0.0  # the next attempt is sent from then on (backoff after "full")
    sent_at: float | None = None  # of the current attempt; None = not sent
    rid: bytes = b""  # of the current attempt
    backoff: float = 0.005
    rids: list[bytes] = field(default_factory=list)  # of every attempt (a late answer still resolves it)


class PushWindow:
    """Up to `window` pushes in flight through `client`'s address, each acknowledged on its own."""

    def __init__(self, client: BufferClient, window: int = 4, *, block_s: float = 60.0,
                 attempt_s: float = 10.0) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.client, self.window, self.block_s, self.attempt_s = client, int(window), block_s, attempt_s
        self.resent = 0  # attempts sent again (unanswered, or the connection dropped)
        self.max_in_flight = 0  # the most pushes outstanding at once so far
        self._submitted: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._rids = itertools.count(1)
        # Owned by the window's thread alone: taken from the queue and not answered yet (at most
        # `window`), and every attempt's request id -> its push (a late answer still resolves it).
        self._active: list[_Pending] = []
        self._by_rid: dict[bytes, _Pending] = {}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="push-window", daemon=True)
        self._thread.start()

    def submit(self, group: Group | bytes, ticket: int | None = None, *, want_ticket: bool = False) -> Future:
        """Queues one group (a Group, encoded by the window's thread, or its frame); the future
        resolves to its PushReply."""
        if self._closed.is_set():
            raise RuntimeError("push window closed")
        now = time.monotonic()
        fut: Future = Future()
        self._submitted.put(_Pending(group, None if ticket is None else int(ticket), want_ticket, fut,
                                     now + self.block_s, now + max(self.block_s, self.client.reconnect_s)))
        return fut

    def push(self, group: Group | bytes, ticket: int | None = None, *, want_ticket: bool = False) -> PushReply:
        """`submit` and wait for the answer (for callers that want one group at a time)."""
        return self.submit(group, ticket, want_ticket=want_ticket).result()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the thread; pushes still unanswered fail with RuntimeError (idempotent)."""
        if not self._closed.is_set():
            self._closed.set()
            self._submitted.put(None)
            self._thread.join(timeout_s)

    # ---------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        """The window's loop: fill, send what is due, read the answers, then resend what a dropped
        connection or an unanswered attempt cut. Whatever ends it (close, or an error) fails every
        push still waiting, so no caller hangs on a future."""
        try:
            sock = self.client.thread_socket()
            while not self._closed.is_set():
                if not self._fill():
                    continue
                now = time.monotonic()
                self._send_due(sock, now)
                in_flight = sum(p.sent_at is not None for p in self._active)
                self.max_in_flight = max(self.max_in_flight, in_flight)
                if self.client.wait_readable(self._poll_ms(now)):
                    self._receive(sock)
                self._on_dropped_connection()
                sock = self._on_unanswered(sock)
        except BaseException as exc:  # noqa: BLE001 - fail every waiter instead of hanging it
            for p in list(self._active):
                self._finish(p, error=exc)
            raise
        finally:
            self._fail_the_rest()

    def _fill(self) -> bool:
        """Takes queued pushes until the window is full; False when there was nothing to do and
        the thread waited for the next submit (or close) instead, so the loop starts over."""
        while len(self._active) < self.window:
            try:
                item = self._submitted.get_nowait()
            except queue.Empty:
                break
            if item is None:
                break
            self._active.append(item)
        if self._active:
            return True
        item = self._submitted.get()
        if item is not None:
            self._active.append(item)
        return False

    def _send_due(self, sock: zmq.Socket, now: float) -> None:
        """Sends every unsent push whose backoff has passed, each attempt under a fresh request id
        (so an answer names its attempt) and the group's own ticket (so a resend is deduplicated)."""
        for p in self._active:
            if p.sent_at is not None or p.not_before > now:
                continue
            if isinstance(p.blob, Group):  # off the caller's thread (e.g. an event loop)
                p.blob = encode(p.blob)
            p.rid = struct.pack("<Q", next(self._rids))
            p.rids.append(p.rid)
            self._by_rid[p.rid] = p
            msg = Push(-1 if p.ticket is None else p.ticket, p.want_ticket)
            try:
                sock.send_multipart(self.client.frames([p.rid, encode(msg), p.blob]), copy=False)
            except zmq.Again:
                p.not_before = now + 0.05  # the socket's queue is full: try again shortly
                continue
            p.sent_at = now

    def _poll_ms(self, now: float) -> int:
        """How long to wait for answers: until the first attempt times out or the first backoff
        ends, and at most 50 ms, so a close or a dropped connection is seen soon."""
        wake = min([p.sent_at + self.attempt_s for p in self._active if p.sent_at is not None]
                   + [p.not_before for p in self._active if p.sent_at is None] + [now + 0.05])
        return max(1, int((wake - now) * 1000) + 1)

    def _receive(self, sock: zmq.Socket) -> None:
        """Reads every answer waiting on the socket without blocking and settles its push."""
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            p = self._by_rid.get(frames[0].bytes)
            if p is None:
                continue  # an answer to an attempt of a group already answered
            self._on_answer(p, frames[0].bytes, decode(frames[1].buffer))

    def _on_answer(self, p: _Pending, rid: bytes, reply: Any) -> None:
        """The first answer settles the push; "full" instead schedules the next attempt with
        doubling backoff (capped at 0.5 s) until `block_s`, counting only the current attempt's
        "full" (an earlier attempt's may still arrive after it was resent)."""
        if isinstance(reply, ErrorReply):
            self._finish(p, error=(BufferDiskFull if reply.code == "disk_full" else BufferRequestError)(reply.code, reply.message))
        elif not isinstance(reply, PushReply):
            self._finish(p, error=RuntimeError(f"push answered with a {type(reply).__name__}"))
        elif reply.status != "full":
            self._finish(p, result=reply)
        elif rid == p.rid:
            t = time.monotonic()
            if t + p.backoff > p.deadline:
                self._finish(p, error=BufferFull(f"replay buffer full for {self.block_s}s"))
            else:
                p.sent_at, p.not_before = None, t + p.backoff
                p.backoff = min(p.backoff * 2, 0.5)

    def _on_dropped_connection(self) -> None:
        """The server restarted: every outstanding attempt is sent again (until its
        `reconnect_deadline`), since what was in flight on the old connection is lost."""
        if self.client.connection_dropped():
            address = self.client.address
            self._resend_all(lambda: BufferDisconnected(f"connection to {address} dropped during a push"),
                             lambda p: p.reconnect_deadline)

    def _on_unanswered(self, sock: zmq.Socket) -> zmq.Socket:
        """An attempt unanswered for `attempt_s`: a fresh socket drops what is queued to a dead
        peer, so every outstanding attempt is sent again on it (same tickets: no doubles).
        Returns the socket to use from now on."""
        now = time.monotonic()
        if not any(p.sent_at is not None and now >= p.sent_at + self.attempt_s for p in self._active):
            return sock
        sock = self.client.reopen_socket()
        address = self.client.address
        self._resend_all(lambda: BufferTimeout(f"no reply from {address} to a push within "
                                               f"{self.attempt_s:.1f}s"), lambda p: p.deadline)
        return sock

    def _resend_all(
        self, reason: Callable[[], BaseException], deadline_of: Callable[[_Pending], float]
    ) -> None:
        """Marks every sent push for another attempt shortly; one without a ticket (the server
        would not deduplicate it) or past `deadline_of` fails with `reason()` instead."""
        now = time.monotonic()
        for p in [p for p in self._active if p.sent_at is not None]:
            if p.ticket is None or now >= deadline_of(p):
                self._finish(p, error=reason())
            else:
                p.sent_at, p.not_before = None, now + 0.05
                self.resent += 1

    def _finish(self, p: _Pending, result: Any = None, error: BaseException | None = None) -> None:
        """Settles one push and forgets its attempts, so their late answers are ignored."""
        self._active.remove(p)
        for rid in p.rids:
            self._by_rid.pop(rid, None)
        if error is not None:
            p.future.set_exception(error)
        else:
            p.future.set_result(result)

    def _fail_the_rest(self) -> None:
        """On the way out: pushes in the window and still queued fail instead of waiting forever."""
        for p in list(self._active):
            self._finish(p, error=RuntimeError("push window closed"))
        while True:
            try:
                item = self._submitted.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item.future.set_exception(RuntimeError("push window closed"))
