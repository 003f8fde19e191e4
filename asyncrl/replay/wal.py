"""The replay buffer's durable log: acknowledged groups survive the buffer process's death.

One append-only file on the buffer host's local disk. Every record is
``magic (4) | kind (1) | length (u32) | crc32 (u32) | payload`` and the CRC covers kind + payload.
Records are self-delimiting: a damaged record (a flipped bit, a torn write in the middle) is
reported by name at replay (`DamagedRecord`: offset, length, kind, the group's seq and prompt uid
when its header still reads) and replay resynchronises at the next record whose magic and CRC
check, so every intact record after it is kept; only a damaged *tail* is cut off.

Records
- ``STATE``: the buffer's bookkeeping (`BufferState.durable_header()`: version, consumed, ticket
  leases, counters, next sequence number, and the sequence numbers of groups removed since the
  previous record), msgpack.
- ``GROUP``: a stored group: ``u32 meta length | msgpack {"state": header, "group": meta} | frame``.
  The state rides in the same record, so "group stored" and "its ticket is done" are one atomic
  append: a producer whose push was not acknowledged retries it with the same ticket, and the
  group is stored once either way.

Guarantees
- A record is written with one `write(2)` before the server acknowledges what it records, so an
  acknowledged push survives the death of the buffer *process* with every fsync policy (the page
  cache outlives the process). `fsync="always"` also survives the host's crash (fsync before the
  acknowledgement); `"interval"` bounds the loss on a host crash to `fsync_interval_s`; `"never"`
  leaves it to the OS.
- Replay = the newest state header + the group records whose sequence numbers it lists as live
  (`live`; logs without it: every group record not removed since). A live group whose record
  was damaged is reported lost by seq and uid; a damaged state record loses nothing (the next
  header lists the live groups again).
- A full disk (ENOSPC, EDQUOT, EFBIG) is `LogFull`, a named condition: the partial record is cut
  off again (truncating needs no space), nothing of it reaches a replay, and the caller refuses
  what it could not log. A compaction that cannot write its new file keeps the old log (still
  whole) and says how much space it needs; so does a recovery on a full disk, which then serves
  what it recovered without compacting (`LogFull.needed_bytes`).
- Group commit: `append_*` only write; every record gets the next log sequence number (`lsn`, one
  per record, never reset by a compaction) and `committed` is the highest one the fsync policy
  counts as durable. `commit()` makes everything appended so far durable with one fsync, in the
  caller's thread; `SyncThread` does the same off the caller's thread (PostgreSQL's WAL flush
  model: a waiter needs `committed >= its lsn`, and one fsync covers every record appended
  before it started), so the socket loop keeps receiving, checking and appending while a sync
  runs and the records appended meanwhile share the next one.
- The log does not grow without bound: it is rewritten (atomically: temporary file, fsync, rename)
  holding only the live groups once it is larger than ``max(compact_min_bytes, 2 x live bytes)``,
  and emptied down to one state record whenever the buffer is drained.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

log = logging.getLogger(__name__)

MAGIC = b"AWL1"
HEAD = struct.Struct("<4sBII")
META = struct.Struct("<I")
STATE, GROUP = 1, 2
FSYNC_POLICIES = ("always", "interval", "never")
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# The system calls that write the log, named so a test can stand a full disk in front of them.
_writev = os.writev
_write = os.write
_fsync = os.fsync  # likewise, so a test can hold a sync and watch what waits for it


class LogFull(OSError):
    """The durable log cannot be written: the disk (or quota, or file size limit) is full.
    `needed_bytes`: what the failed write or compaction needed."""

    def __init__(self, path: Path, needed_bytes: int, cause: OSError) -> None:
        super().__init__(cause.errno, f"durable log {path}: disk full ({os.strerror(cause.errno or 0)}); "
                                      f"{needed_bytes} bytes needed")
        self.needed_bytes = needed_bytes


@dataclass
class DamagedRecord:
    """A record that failed its checks at replay (skipped; the records after it were kept)."""

    offset: int
    length: int
    kind: int
    seq: int | None = None
    uid: str = ""

    def __str__(self) -> str:
        what = f"group seq {self.seq} ({self.uid or 'uid unknown'})" if self.seq is not None else (
            "state record" if self.kind == STATE else "record of unknown kind")
        return f"damaged record at offset {self.offset} ({self.length} bytes): {what}"


class BufferLog:
    def __init__(self, path: str | os.PathLike[str], fsync: str = "always", fsync_interval_s: float = 1.0,
                 compact_min_bytes: int = 64 * 2**20) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"buffer.durable.fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync, self.fsync_interval_s, self.compact_min_bytes = fsync, fsync_interval_s, compact_min_bytes
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self.size = os.fstat(self._fd).st_size
        self._last_sync = time.monotonic()
        self.lsn = 0  # records appended (log sequence number of the newest)
        self.committed = 0  # the newest lsn that is durable per the fsync policy
        self._fd_lock = threading.Lock()  # a sync never meets a file descriptor being swapped or closed
        self._count_lock = threading.Lock()
        self.torn_bytes = 0  # cut off the tail by the last replay
        self.damaged: list[DamagedRecord] = []  # skipped by the last replay
        self.lost: list[tuple[int, str]] = []  # (seq, uid) of live groups whose record was damaged
        self.fsyncs = 0  # commits that reached the disk (group commit: fewer than acknowledged pushes)

    # ------------------------------------------------------------------------------ writing
    @staticmethod
    def _record(kind: int, payload: bytes | bytearray) -> bytes:
        crc = zlib.crc32(payload, zlib.crc32(bytes([kind])))
        return HEAD.pack(MAGIC, kind, len(payload), crc) + payload

    @staticmethod
    def _group_parts(header: dict[str, Any], meta: dict[str, Any], blob: Any) -> list[Any]:
        """The GROUP record as buffers (the frame is not copied): head, meta, frame."""
        packed = msgpack.packb({"state": header, "group": meta})
        first = META.pack(len(packed)) + packed
        frame = memoryview(blob).cast("B")
        crc = zlib.crc32(frame, zlib.crc32(first, zlib.crc32(bytes([GROUP]))))
        return [HEAD.pack(MAGIC, GROUP, len(first) + len(frame), crc), first, frame]

    def append_state(self, header: dict[str, Any]) -> None:
        self._write([self._record(STATE, msgpack.packb(header))])

    def append_group(self, header: dict[str, Any], meta: dict[str, Any], blob: Any) -> None:
        self._write(self._group_parts(header, meta, blob))

    def _write(self, parts: list[Any]) -> None:
        """One `writev` per record (O_APPEND: records never interleave); finishes a short write.
        A full disk raises `LogFull` after cutting the partial record off again."""
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(len(v) for v in views)
        try:
            left = size - _writev(self._fd, views)
            while left > 0:
                rest = b"".join(bytes(v) for v in views)[size - left:]
                left -= _write(self._fd, rest)
        except OSError as exc:
            os.ftruncate(self._fd, self.size)  # the log ends at its last whole record again
            if exc.errno in FULL_ERRNOS:
                raise LogFull(self.path, size, exc) from exc
            raise
        self.size += size
        self.lsn += 1

    def commit(self) -> None:
        """Makes what was appended durable per the fsync policy; call before acknowledging it."""
        if self.committed >= self.lsn:
            return
        if self.fsync == "always" or (self.fsync == "interval"
                                      and time.monotonic() - self._last_sync >= self.fsync_interval_s):
            self.sync()
        elif self.fsync == "never":
            self.committed = self.lsn

    def sync(self) -> int:
        """One fsync covering every record appended before it started; returns the lsn it covers.
        Safe from another thread while the owner appends (`SyncThread`)."""
        target = self.lsn  # read first: a record counted here was written whole before the count moved
        with self._fd_lock:
            _fsync(self._fd)
        with self._count_lock:
            self.fsyncs += 1
            self.committed = max(self.committed, target)
            self._last_sync = time.monotonic()
        return target

    def needs_compaction(self, live_bytes: int, buffered: int) -> bool:
        if buffered == 0:
            return self.size > 1 << 20
        return self.size > max(self.compact_min_bytes, 2 * live_bytes)

    def rewrite(self, header: dict[str, Any], groups: Iterable[tuple[dict[str, Any], Any]]) -> None:
        """Replaces the log by one state record + the live groups (atomic rename)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        parts = [self._record(STATE, msgpack.packb(header))]
        for meta, blob in groups:
            parts += self._group_parts({}, meta, blob)
        needed = sum(len(memoryview(p).cast("B")) for p in parts)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while len(view):
                    view = view[_write(fd, view):]
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            os.unlink(tmp)
            if exc.errno in FULL_ERRNOS:
                raise LogFull(self.path, needed, exc) from exc
            raise
        os.close(fd)
        with self._fd_lock:
            os.replace(tmp, self.path)
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
            self.size = os.fstat(self._fd).st_size
        with self._count_lock:  # the new file was synced whole: everything appended so far is durable
            self.committed = self.lsn

    def close(self) -> None:
        with self._fd_lock:
            if self._fd >= 0:
                try:
                    _fsync(self._fd)
                finally:
                    os.close(self._fd)
                    self._fd = -1

    # ------------------------------------------------------------------------------ replay
    def replay(self) -> tuple[dict[str, Any] | None, list[tuple[dict[str, Any], bytes]]]:
        """(newest state header or None, live groups as (meta, frame) in log order). Damaged
        records are skipped and listed in `damaged`, live groups lost with them in `lost`, both
        logged as warnings; a damaged or torn tail is cut off (its size is in `torn_bytes`)."""
        data = Path(self.path).read_bytes()
        header: dict[str, Any] | None = None
        groups: dict[int, tuple[dict[str, Any], bytes]] = {}
        damaged_seqs: dict[int, str] = {}
        self.damaged, self.lost = [], []
        off, good_end = 0, 0
        while off + HEAD.size <= len(data):
            rec = self._read_record(data, off)
            if rec is None:  # damaged: report it, then resynchronise at the next record that checks
                nxt = self._resync(data, off + 1)
                bad = self._describe_damage(data, off, (nxt if nxt is not None else len(data)) - off)
                if nxt is None:
                    break  # a damaged tail: cut off below
                self.damaged.append(bad)
                if bad.seq is not None:
                    damaged_seqs[bad.seq] = bad.uid
                off = nxt
                continue
            kind, payload, end = rec
            if kind == STATE:
                state = msgpack.unpackb(payload)
            else:
                (n,) = META.unpack_from(payload, 0)
                unpacked = msgpack.unpackb(payload[META.size:META.size + n])
                state, meta = unpacked["state"], unpacked["group"]
                groups[int(meta["seq"])] = (meta, bytes(payload[META.size + n:]))
            if state:  # a compacted log's group records carry no state
                for seq in state.get("removed", ()):
                    groups.pop(int(seq), None)
                header = state
            off = good_end = end
        if header is not None and "live" in header:
            live = [int(seq) for seq in header["live"]]
            self.lost = [(seq, damaged_seqs.get(seq, "")) for seq in live if seq not in groups]
            keep = set(live)
            groups = {seq: g for seq, g in groups.items() if seq in keep}
        for bad in self.damaged:
            log.warning("buffer log %s: %s; the records after it were kept", self.path, bad)
        for seq, uid in self.lost:
            log.warning("buffer log %s: group seq %d (%s) was lost with its damaged record", self.path, seq,
                        uid or "uid unknown")
        if good_end < len(data):
            self.torn_bytes = len(data) - good_end
            os.ftruncate(self._fd, good_end)
            self.size = good_end
        return header, list(groups.values())

    @staticmethod
    def _read_record(data: bytes, off: int) -> tuple[int, memoryview, int] | None:
        """(kind, payload, end) of the record at `off` if its magic, kind, length and CRC check."""
        magic, kind, length, crc = HEAD.unpack_from(data, off)
        end = off + HEAD.size + length
        if magic != MAGIC or kind not in (STATE, GROUP) or end > len(data):
            return None
        payload = memoryview(data)[off + HEAD.size:end]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) != crc:
            return None
        return kind, payload, end

    def _resync(self, data: bytes, start: int) -> int | None:
        """Offset of the next record (from `start`) whose checks pass, None if there is none."""
        at = data.find(MAGIC, start)
        while at >= 0 and at + HEAD.size <= len(data):
            if self._read_record(data, at) is not None:
                return at
            at = data.find(MAGIC, at + 1)
        return None

    @staticmethod
    def _describe_damage(data: bytes, off: int, span: int) -> DamagedRecord:
        """What a damaged record was, as far as its head and group metadata still read."""
        _, kind, length, _ = HEAD.unpack_from(data, off)
        bad = DamagedRecord(off, span, kind)
        if kind == GROUP:
            try:
                (n,) = META.unpack_from(data, off + HEAD.size)
                meta = msgpack.unpackb(data[off + HEAD.size + META.size:off + HEAD.size + META.size + n])["group"]
                bad.seq, bad.uid = int(meta["seq"]), str(meta.get("uid", ""))
            except Exception:  # noqa: BLE001 - the metadata itself is damaged: offset and length only
                pass
        return bad


class SyncThread:
    """Group commit off the socket loop: the loop appends, asks for a sync up to an lsn
    (`request`) and goes on serving; this thread runs one fsync covering everything appended when
    it starts, publishes `log.committed`, and writes a byte to `wake_fd` so the loop's poller wakes
    to release the acknowledgements that sync covers. Requests that arrive during a sync are
    covered together by the next one (PostgreSQL's XLogFlush waiters; etcd likewise saves a batch
    of entries with one fsync before it sends what depends on them).

    A failed fsync is kept in `error` (`take_error`) for the loop, which then acknowledges nothing
    it was waiting for; the next request tries again."""

    def __init__(self, log: BufferLog) -> None:
        self.log = log
        self._cond = threading.Condition()
        self._want = 0
        self._stop = False
        self._error: OSError | None = None
        self.wake_fd, self._notify_fd = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._notify_fd, False)
        self._thread = threading.Thread(target=self._run, name="replay-buffer-fsync", daemon=True)
        self._thread.start()

    def request(self, lsn: int) -> None:
        with self._cond:
            if lsn > self._want:
                self._want = lsn
                self._cond.notify()

    def drain(self) -> None:
        """Empties the wake pipe (the loop calls it when the pipe polled readable)."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def take_error(self) -> OSError | None:
        with self._cond:
            error, self._error = self._error, None
            return error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and self._want <= self.log.committed:
                    self._cond.wait()
                if self._stop:
                    return
            try:
                self.log.sync()
            except OSError as exc:
                with self._cond:
                    self._error = exc
                    self._want = self.log.committed  # the loop fails what waited; a new request retries
            try:
                os.write(self._notify_fd, b"\0")
            except BlockingIOError:  # the pipe is full: the loop has wake-ups pending already
                pass

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout_s)
        os.close(self.wake_fd)
        os.close(self._notify_fd)
