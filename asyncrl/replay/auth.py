"""Request authentication of the replay buffer: an HMAC-SHA256 of every frame of a request, keyed
with the job's secret (`buffer.secret`), sent as one extra last frame.

    request = [rid (8 bytes), control, *group frames, mac (32 bytes)]

The MAC covers each frame with its length (`u64 len | bytes`), so frames cannot be split or joined
differently under the same MAC. The server checks it before decoding anything (an unauthenticated
request costs one hash, never a parse) and answers `ErrorReply("unauthenticated")`. Replies are not
signed: only the process holding the bound port can answer, and beyond loopback CurveZMQ
(`buffer.curve`) adds encryption and server authentication.

Why HMAC and not only CurveZMQ: it is on by default, including on loopback, at the cost of one
SHA-256 pass over the request bytes on each side (hashlib releases the GIL for large buffers);
CurveZMQ also encrypts, which a loopback link does not need (`bench buffer` measures both sides).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import Any

MAC_BYTES = 32
_LEN = struct.Struct("<Q")


def new_secret() -> str:
    """A fresh job secret (256 bits, hex)."""
    return secrets.token_hex(32)


def _key(secret: str) -> bytes:
    return secret.encode()


def mac(frames: list[Any], secret: str) -> bytes:
    """HMAC-SHA256 over `frames` (bytes-like or zmq.Frame), each prefixed with its length."""
    h = hmac.new(_key(secret), digestmod=hashlib.sha256)
    for f in frames:
        buf = f.buffer if hasattr(f, "buffer") else f
        h.update(_LEN.pack(len(buf)))
        h.update(buf)
    return h.digest()


def sign(frames: list[Any], secret: str) -> list[Any]:
    """`frames` + their MAC frame."""
    return [*frames, mac(frames, secret)]


def verify(frames: list[Any], secret: str) -> bool:
    """True if the last frame is the MAC of the others (constant-time comparison)."""
    if len(frames) < 2 or len(frames[-1]) != MAC_BYTES:
        return False
    last = frames[-1]
    got = last.bytes if hasattr(last, "bytes") else bytes(last)
    return hmac.compare_digest(got, mac(frames[:-1], secret))
