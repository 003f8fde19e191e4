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
from typing import TYPE_CHECKING, Any

import zmq

from asyncrl.protocol import ErrorReply, Group, Push, PushReply, decode, encode

if TYPE_CHECKING:
    from asyncrl.replay.client import BufferClient


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
        from asyncrl.replay.client import BufferDisconnected, BufferFull, BufferRequestError, BufferTimeout

        client = self.client
        active: list[_Pending] = []  # taken from the queue, not answered yet (at most `window`)
        by_rid: dict[bytes, _Pending] = {}

        def finish(p: _Pending, result: Any = None, error: BaseException | None = None) -> None:
            active.remove(p)
            for rid in p.rids:
                by_rid.pop(rid, None)
            if error is not None:
                p.future.set_exception(error)
            else:
                p.future.set_result(result)

        def resend_all(reason: Callable[[], BaseException], deadline_of: Callable[[_Pending], float]) -> None:
            now = time.monotonic()
            for p in [p for p in active if p.sent_at is not None]:
                if p.ticket is None or now >= deadline_of(p):
                    finish(p, error=reason())
                else:
                    p.sent_at, p.not_before = None, now + 0.05
                    self.resent += 1

        try:
            sock = client._sock()
            while not self._closed.is_set():
                while len(active) < self.window:  # fill the window
                    try:
                        item = self._submitted.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        break
                    active.append(item)
                if not active:  # nothing to do: wait for the next submit
                    item = self._submitted.get()
                    if item is not None:
                        active.append(item)
                    continue
                now = time.monotonic()
                for p in active:  # send what is due
                    if p.sent_at is None and p.not_before <= now:
                        if isinstance(p.blob, Group):  # off the caller's thread (e.g. an event loop)
                            p.blob = encode(p.blob)
                        p.rid = struct.pack("<Q", next(self._rids))
                        p.rids.append(p.rid)
                        by_rid[p.rid] = p
                        msg = Push(-1 if p.ticket is None else p.ticket, p.want_ticket)
                        try:
                            sock.send_multipart([p.rid, encode(msg), p.blob], copy=False)
                        except zmq.Again:
                            p.not_before = now + 0.05  # the socket's queue is full: try again shortly
                            continue
                        p.sent_at = now
                self.max_in_flight = max(self.max_in_flight, sum(p.sent_at is not None for p in active))
                wake = min([p.sent_at + self.attempt_s for p in active if p.sent_at is not None]
                           + [p.not_before for p in active if p.sent_at is None] + [now + 0.05])
                ready = dict(client._local.poller.poll(max(1, int((wake - now) * 1000) + 1)))
                if sock in ready:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        p = by_rid.get(frames[0].bytes)
                        if p is None:
                            continue  # an answer to an attempt of a group already answered
                        reply = decode(frames[1].buffer)
                        if isinstance(reply, ErrorReply):
                            finish(p, error=BufferRequestError(reply.code, reply.message))
                        elif not isinstance(reply, PushReply):
                            finish(p, error=RuntimeError(f"push answered with a {type(reply).__name__}"))
                        elif reply.status == "full":
                            if frames[0].bytes != p.rid:
                                continue  # an earlier attempt's "full": the current one answers
                            t = time.monotonic()
                            if t + p.backoff > p.deadline:
                                finish(p, error=BufferFull(f"replay buffer full for {self.block_s}s"))
                            else:
                                p.sent_at, p.not_before = None, t + p.backoff
                                p.backoff = min(p.backoff * 2, 0.5)
                        else:
                            finish(p, result=reply)
                if client._disconnected():  # the server restarted: every outstanding attempt again
                    client.disconnects += 1
                    resend_all(lambda: BufferDisconnected(f"connection to {client.address} dropped during a push"),
                               lambda p: p.reconnect_deadline)
                now = time.monotonic()
                if any(p.sent_at is not None and now >= p.sent_at + self.attempt_s for p in active):
                    # An unanswered attempt: a fresh socket drops what is queued to a dead peer, so
                    # every outstanding attempt is sent again on it (same tickets: no doubles).
                    client._reset_socket()
                    sock = client._sock()
                    resend_all(lambda: BufferTimeout(f"no reply from {client.address} to a push within "
                                                     f"{self.attempt_s:.1f}s"), lambda p: p.deadline)
        except BaseException as exc:  # noqa: BLE001 - fail every waiter instead of hanging it
            for p in list(active):
                finish(p, error=exc)
            raise
        finally:
            for p in list(active):
                finish(p, error=RuntimeError("push window closed"))
            while True:
                try:
                    item = self._submitted.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item.future.set_exception(RuntimeError("push window closed"))
