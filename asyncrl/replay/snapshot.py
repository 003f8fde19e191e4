"""Atomic buffer snapshots: every buffered group (its encoded frame, as stored) plus the counters.

File layout: ``MAGIC | u64 header length | msgpack header | group frames... | u32 crc32``; the header
lists each group's frame length. Writing goes to ``<path>.tmp-<pid>``, is fsynced, renamed over
``path`` (atomic on POSIX) and the directory is fsynced; a crash at any point leaves either the old
snapshot or the new one at ``path``, never a mix. Reading checks the magic, lengths, checksum and
decodes (validates) every group before anything is returned, so a damaged file is refused whole.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack

from asyncrl.protocol import SCHEMA_VERSION, Group, ProtocolError, decode

MAGIC = b"ASRLBUF1"


class SnapshotError(RuntimeError):
    """The snapshot file is missing, truncated, corrupted or of an unknown format."""


def write_snapshot(path: str | os.PathLike[str], header: dict[str, Any], blobs: Iterable[Any]) -> int:
    """Writes atomically; returns the number of bytes written. `blobs` must match header["groups"]."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    blobs = list(blobs) if not isinstance(blobs, list) else blobs
    header = {**header, "schema": SCHEMA_VERSION, "lengths": [len(b) for b in blobs]}
    head = msgpack.packb(header)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    crc = 0
    size = 0
    with open(tmp, "wb") as f:
        for chunk in (MAGIC, struct.pack("<Q", len(head)), head, *blobs):
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
        f.write(struct.pack("<I", crc))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return size + 4


def read_snapshot(path: str | os.PathLike[str], max_frame_bytes: int) -> tuple[dict[str, Any], list[bytes], list[Group]]:
    """Returns (header, group frames, decoded groups); raises SnapshotError on any damage."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc}") from None
    if len(data) < len(MAGIC) + 12 or not data.startswith(MAGIC):
        raise SnapshotError(f"{path}: not a buffer snapshot (bad magic or too short)")
    (crc,) = struct.unpack_from("<I", data, len(data) - 4)
    if zlib.crc32(memoryview(data)[:-4]) != crc:
        raise SnapshotError(f"{path}: checksum mismatch (truncated or corrupted)")
    (hlen,) = struct.unpack_from("<Q", data, len(MAGIC))
    off = len(MAGIC) + 8
    try:
        header = msgpack.unpackb(data[off:off + hlen], raw=False, strict_map_key=False)
        lengths = [int(n) for n in header["lengths"]]
        if header.get("schema") != SCHEMA_VERSION or len(lengths) != len(header["groups"]):
            raise SnapshotError(f"{path}: unknown snapshot schema or inconsistent header")
    except SnapshotError:
        raise
    except Exception as exc:
        raise SnapshotError(f"{path}: bad header ({type(exc).__name__}: {exc})") from None
    off += hlen
    if off + sum(lengths) != len(data) - 4:
        raise SnapshotError(f"{path}: group lengths do not add up to the file size")
    blobs, groups = [], []
    for i, n in enumerate(lengths):
        blob = data[off:off + n]
        off += n
        try:
            groups.append(decode(blob, max_bytes=max_frame_bytes))
        except ProtocolError as exc:
            raise SnapshotError(f"{path}: group {i} invalid: {exc}") from None
        if not isinstance(groups[-1], Group):
            raise SnapshotError(f"{path}: entry {i} is a {type(groups[-1]).__name__}, not a Group")
        blobs.append(blob)
    return header, blobs, groups
