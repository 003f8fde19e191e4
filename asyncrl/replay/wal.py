"""The replay buffer's durable log: acknowledged groups survive the buffer process's death.

One append-only file on the buffer host's local disk. Every record is
``magic (4) | kind (1) | length (u32) | crc32 (u32) | payload`` and the CRC covers kind + payload, so
a torn or corrupted tail is detected and cut off at the last whole record on replay.

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
- Replay = the newest state header + every group record whose sequence number was not removed.
- The log does not grow without bound: it is rewritten (atomically: temporary file, fsync, rename)
  holding only the live groups once it is larger than ``max(compact_min_bytes, 2 x live bytes)``,
  and emptied down to one state record whenever the buffer is drained.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack

MAGIC = b"AWL1"
HEAD = struct.Struct("<4sBII")
META = struct.Struct("<I")
STATE, GROUP = 1, 2
FSYNC_POLICIES = ("always", "interval", "never")


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
        self._dirty = False
        self.torn_bytes = 0  # cut off the tail by the last replay

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
        """One `writev` per record (O_APPEND: records never interleave); finishes a short write."""
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(len(v) for v in views)
        left = size - os.writev(self._fd, views)
        while left > 0:
            rest = b"".join(bytes(v) for v in views)[size - left:]
            left -= os.write(self._fd, rest)
        self.size += size
        self._dirty = True

    def commit(self) -> None:
        """Makes what was appended durable per the fsync policy; call before acknowledging it."""
        if not self._dirty:
            return
        now = time.monotonic()
        if self.fsync == "always" or (self.fsync == "interval" and now - self._last_sync >= self.fsync_interval_s):
            os.fsync(self._fd)
            self._last_sync = now
            self._dirty = False
        elif self.fsync == "never":
            self._dirty = False

    def needs_compaction(self, live_bytes: int, buffered: int) -> bool:
        if buffered == 0:
            return self.size > 1 << 20
        return self.size > max(self.compact_min_bytes, 2 * live_bytes)

    def rewrite(self, header: dict[str, Any], groups: Iterable[tuple[dict[str, Any], Any]]) -> None:
        """Replaces the log by one state record + the live groups (atomic rename)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(self._record(STATE, msgpack.packb(header)))
            for meta, blob in groups:
                for part in self._group_parts({}, meta, blob):
                    f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        self.size = os.fstat(self._fd).st_size
        self._dirty = False

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1

    # ------------------------------------------------------------------------------ replay
    def replay(self) -> tuple[dict[str, Any] | None, list[tuple[dict[str, Any], bytes]]]:
        """(newest state header or None, live groups as (meta, frame) in log order). A torn or
        corrupted tail is cut off (its size is in `torn_bytes`)."""
        data = Path(self.path).read_bytes()
        header: dict[str, Any] | None = None
        groups: dict[int, tuple[dict[str, Any], bytes]] = {}
        off = 0
        while off + HEAD.size <= len(data):
            magic, kind, length, crc = HEAD.unpack_from(data, off)
            end = off + HEAD.size + length
            if magic != MAGIC or kind not in (STATE, GROUP) or end > len(data):
                break
            payload = memoryview(data)[off + HEAD.size:end]
            if zlib.crc32(payload, zlib.crc32(bytes([kind]))) != crc:
                break
            if kind == STATE:
                state = msgpack.unpackb(payload)
            else:
                (n,) = META.unpack_from(payload, 0)
                rec = msgpack.unpackb(payload[META.size:META.size + n])
                state, meta = rec["state"], rec["group"]
                groups[int(meta["seq"])] = (meta, bytes(payload[META.size + n:]))
            if state:  # a compacted log's group records carry no state
                for seq in state.get("removed", ()):
                    groups.pop(int(seq), None)
                header = state
            off = end
        if off < len(data):
            self.torn_bytes = len(data) - off
            os.ftruncate(self._fd, off)
            self.size = off
        return header, list(groups.values())
