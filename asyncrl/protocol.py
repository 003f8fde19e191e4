"""Wire types shared by every process role, and their MessagePack codec.

Guarantees
- One frame = one self-describing msgpack map ``{"schema": SCHEMA_VERSION, "type": name, "body": {...}}``;
  every encoded object (a control message, a Group, a Sample) carries the schema version.
- numpy arrays travel as msgpack ext type ``EXT_NDARRAY``: payload = ``u8 len(dtype) | dtype str |
  u8 ndim | ndim x u64 shape | raw little-endian C-order bytes``. Encoding writes the array's memory
  straight into the output frame (one copy, by the final ``b"".join``); decoding copies each ext
  payload once (msgpack hands it over as ``bytes``) and wraps it with ``np.frombuffer`` (no further
  copy). Decoded arrays are therefore **read-only**; copy them before writing in place.
- A Group travels columnar: per-sample scalars in a list, each array field of all samples back to
  back in one ext array, plus int64[n, 2] lengths (5 arrays per group instead of 5 per sample), so
  decoding and validation are vectorised over the group; decoded samples are views into them.
- No pickle, no Python lists of numbers.
- ``decode`` validates strictly: schema version, message type, field names and types, dtype
  allow-list, shape consistency between a Sample's arrays, mask/version invariants, the Group's
  version range, sizes. Every failure raises ``ProtocolError`` whose message names the field and
  what was wrong; no other exception type escapes ``decode`` (a receiver only catches one).

Codec accounting: every process counts the Group and Sample frames it encodes and decodes, and
their bytes, in `CODEC_COUNTS` (a dict add per frame; `codec_counts()` reads a copy). The driver of
a job reports its own bytes as ``perf/driver_bytes``, so a test can prove that sample arrays never
pass through it.

Schema evolution: new fields are added with defaults and ``SCHEMA_VERSION`` bumped; frames of any
version in ``ACCEPTED_SCHEMAS`` decode (missing new fields take their defaults), unknown fields are
rejected. This keeps e.g. multimodal fields (images, mRoPE position ids) an additive change.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack
import numpy as np

SCHEMA_VERSION = 1
ACCEPTED_SCHEMAS = frozenset({1})
EXT_NDARRAY = 1
MAX_NDIM = 8
MAX_SAMPLES_PER_GROUP = 65536
DEFAULT_MAX_FRAME_BYTES = 256 * 2**20
# Allow-list of array dtypes accepted on decode (little-endian or byte-order-free only).
ALLOWED_DTYPES = frozenset(
    np.dtype(t).str for t in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                              "uint64", "float16", "float32", "float64")
)


class ProtocolError(ValueError):
    """A frame could not be decoded or failed validation; the message says what and where."""


# ------------------------------------------------------------------------------------- messages
def _arr(x: Any, dtype: str) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=dtype)


@dataclass(slots=True)
class Sample:
    """One trajectory (possibly many turns). Arrays are coerced to their wire dtypes (no copy when
    they already have them). ``response_mask`` 1 = policy token that is trained;
    ``behaviour_logprobs`` are 0 and ``token_versions`` are -1 where the mask is 0."""

    uid: str
    prompt_uid: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    token_versions: np.ndarray
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    num_turns: int = 1
    finish_reason: str = ""
    verifier_version: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    ARRAYS: ClassVar[dict[str, str]] = {
        "prompt_ids": "<i4", "response_ids": "<i4", "response_mask": "|i1",
        "behaviour_logprobs": "<f4", "token_versions": "<i4",
    }

    def __post_init__(self) -> None:
        for name, dt in self.ARRAYS.items():
            setattr(self, name, _arr(getattr(self, name), dt))

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in self.ARRAYS)


@dataclass(slots=True)
class Group:
    """The n samples of one prompt; produced, stored, staleness-checked, consumed and dropped whole.
    ``min_version``/``max_version`` = min/max over the masked (trained) token_versions of all samples;
    build with ``Group.from_samples`` to have them computed."""

    prompt_uid: str
    samples: list[Sample]
    min_version: int
    max_version: int
    created_at: float = 0.0
    actor_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_samples(cls, samples: list[Sample], *, created_at: float = 0.0, actor_id: str = "",
                     metadata: dict[str, Any] | None = None) -> Group:
        lo, hi = _version_range(samples)
        if lo is None:
            raise ValueError("group has no trained (mask=1) tokens; cannot derive its policy version")
        return cls(samples[0].prompt_uid, samples, lo, hi, created_at, actor_id, metadata or {})

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.samples)


def _version_range(samples: list[Sample]) -> tuple[int | None, int | None]:
    lo = hi = None
    for s in samples:
        v = s.token_versions[s.response_mask.astype(bool)]
        if v.size:
            lo = int(v.min()) if lo is None else min(lo, int(v.min()))
            hi = int(v.max()) if hi is None else max(hi, int(v.max()))
    return lo, hi


# Control messages of the replay buffer (DEALER client <-> ROUTER server). Groups ride in extra
# zmq frames after the control frame (`Push`: 1, `BatchReply`: num_groups), each its own encoded frame.
@dataclass(slots=True)
class TicketRequest:
    """Ask for admission to start one group; answered by `TicketReply` when granted or at timeout."""
    actor_id: str = ""
    timeout_s: float = 0.0


@dataclass(slots=True)
class TicketReply:
    ticket: int = -1
    """-1 = not granted before the timeout."""
    version: int = 0
    """The learner version v at the time of the reply (actors can check their weights against it)."""


@dataclass(slots=True)
class TicketRelease:
    """The group of this ticket is abandoned; its admission slot is freed."""
    ticket: int = -1


@dataclass(slots=True)
class Push:
    """One group follows in the next frame. ticket -1 = pushed without admission (untracked, no dedup)."""
    ticket: int = -1
    want_ticket: bool = False
    """Also ask for the next admission ticket (granted only if available at once): saves a round trip."""


@dataclass(slots=True)
class PushReply:
    status: str = "stored"
    """stored | duplicate (this ticket's group is already stored) | filtered (dynamic sampling,
    accepted and dropped) | stale (beyond the staleness bound already; dropped) | full (not stored;
    retry later)."""
    detail: str = ""
    next_ticket: int = -1
    """The ticket asked for with Push.want_ticket; -1 = none available right now."""
    version: int = 0
    """The learner version v at the time of the reply."""


@dataclass(slots=True)
class BatchRequest:
    """Learner asks for `num_groups` groups to train at version `version`, which also sets the
    buffer's v to `version - ahead`. The reply comes when that many are buffered, or at `timeout_s`
    with what there is (maybe none)."""
    num_groups: int = 1
    version: int = 0
    timeout_s: float = 0.0
    ahead: int = 0
    """Steps the request is made before the learner reaches `version` (1: a prefetch sent while
    step version-1 trains). Delivery obeys the staleness bound at `version`; admission counts from
    `version - ahead`, so a prefetch admits no new work before the weights it will meet are out."""


@dataclass(slots=True)
class BatchReply:
    num_groups: int = 0
    version: int = 0
    dropped_stale: int = 0
    """Groups dropped for staleness so far (the buffer's running total)."""


@dataclass(slots=True)
class SetVersion:
    """Set the buffer's version to any value. Never accepted over the socket (answered `forbidden`):
    the job sets it through the `BufferHost` actor; the learner moves forward with `VersionReached`."""
    version: int = 0


@dataclass(slots=True)
class VersionReached:
    """The learner reached `version`: admission advances now. Forward only: a lower version changes
    nothing, one more than a bounded step ahead is refused `out_of_range`."""
    version: int = 0


@dataclass(slots=True)
class StatsRequest:
    pass


@dataclass(slots=True)
class StatsReply:
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class SnapshotRequest:
    path: str = ""


@dataclass(slots=True)
class RestoreRequest:
    path: str = ""


@dataclass(slots=True)
class Ack:
    detail: str = ""


@dataclass(slots=True)
class ErrorReply:
    code: str = "error"
    """malformed | schema | oversized | unknown_ticket | bad_request | internal | forbidden (an admin
    request over the socket) | out_of_range (a number outside its bound; the message names the
    field) | busy (too many waiting requests from one connection) | unauthenticated (no valid HMAC
    of the job's secret) | disk_full (the durable log cannot be written: nothing was stored)."""
    message: str = ""


MESSAGE_TYPES: dict[str, type] = {
    c.__name__: c for c in (Sample, Group, TicketRequest, TicketReply, TicketRelease, Push, PushReply,
                            BatchRequest, BatchReply, SetVersion, VersionReached, StatsRequest, StatsReply,
                            SnapshotRequest, RestoreRequest, Ack, ErrorReply)
}
_FIELDS: dict[type, tuple[str, ...]] = {c: tuple(f.name for f in fields(c)) for c in MESSAGE_TYPES.values()}


# --------------------------------------------------------------------------------------- encode
_MAP16, _MAP32, _ARR16, _ARR32 = b"\xde", b"\xdf", b"\xdc", b"\xdd"


def _map_header(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else (_MAP16 + struct.pack(">H", n) if n < 65536 else _MAP32 + struct.pack(">I", n))


def _array_header(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else (_ARR16 + struct.pack(">H", n) if n < 65536 else _ARR32 + struct.pack(">I", n))


def _pack_ndarray(a: np.ndarray, parts: list[Any]) -> None:
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    if not a.flags.c_contiguous:
        a = a.copy(order="C")
    dt = a.dtype.str.encode()
    head = struct.pack("<B", len(dt)) + dt + struct.pack(f"<B{a.ndim}Q", a.ndim, *a.shape)
    parts.append(b"\xc9" + struct.pack(">Ib", len(head) + a.nbytes, EXT_NDARRAY) + head)
    parts.append(memoryview(a.reshape(-1).view(np.uint8)))


_local = threading.local()
_KEYS: dict[str, bytes] = {}  # packed field names (a fixed, small set)


def _packb(obj: Any) -> bytes:
    """msgpack.packb without building a Packer per call (a Packer is not thread-safe: one per thread)."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer()
    return packer.pack(obj)


def _key(name: str) -> bytes:
    b = _KEYS.get(name)
    if b is None:
        b = _KEYS[name] = msgpack.packb(name)
    return b


def _packb_or_none(obj: Any) -> bytes | None:
    try:
        return _packb(obj)
    except TypeError:  # an ndarray (or numpy scalar) somewhere inside: the caller walks it
        return None


def _pack_plain(obj: Any, parts: list[Any]) -> bool:
    packed = _packb_or_none(obj)
    if packed is not None:
        parts.append(packed)
    return packed is not None


def _pack_concat(arrays: list[np.ndarray], dtype: str, parts: list[Any]) -> None:
    """One 1-D ext array holding `arrays` back to back, without concatenating them first."""
    arrays = [np.ascontiguousarray(a, dtype=dtype) for a in arrays]
    total = sum(a.size for a in arrays)
    dt = np.dtype(dtype)
    head = struct.pack("<B", len(dt.str)) + dt.str.encode() + struct.pack("<BQ", 1, total)
    parts.append(b"\xc9" + struct.pack(">Ib", len(head) + total * dt.itemsize, EXT_NDARRAY) + head)
    parts.extend(memoryview(a.view(np.uint8)) for a in arrays if a.size)


_GROUP_SCALARS = ("prompt_uid", "min_version", "max_version", "created_at", "actor_id", "metadata")
_SAMPLE_SCALARS = tuple(n for n in _FIELDS[Sample] if n not in Sample.ARRAYS)


def _pack_group(g: Group, parts: list[Any]) -> None:
    """Columnar body: per-sample scalars in `samples`, each array field of all samples concatenated
    in `columns`, and `lengths` = int64[n, 2] (prompt, response) to split them again. 5 arrays per
    group instead of 5 per sample: decoding and validation are vectorised over the whole group."""
    head = {n: getattr(g, n) for n in _GROUP_SCALARS}
    head["samples"] = [{n: getattr(x, n) for n in _SAMPLE_SCALARS} for x in g.samples]
    packed = _packb_or_none(head)  # one C call unless some metadata holds arrays
    if packed is not None:  # a map of 7 entries: re-emit its header for 9 entries, then the rest
        parts += [_map_header(len(head) + 2), packed[1:]]
    else:
        parts.append(_map_header(len(head) + 2))
        for k, v in head.items():
            parts.append(_key(k))
            _pack(v, parts)
    parts.append(_key("lengths"))
    _pack_ndarray(np.array([(len(x.prompt_ids), len(x.response_ids)) for x in g.samples], dtype=np.int64)
                  .reshape(len(g.samples), 2), parts)
    parts += [_key("columns"), _map_header(len(Sample.ARRAYS))]
    for name, dt in Sample.ARRAYS.items():
        parts.append(_key(name))
        _pack_concat([getattr(x, name) for x in g.samples], dt, parts)


def _pack(obj: Any, parts: list[Any]) -> None:
    """Writes msgpack for `obj` into `parts` (bytes / memoryviews); arrays are not copied here."""
    if type(obj) is Group:
        _pack_group(obj, parts)
    elif isinstance(obj, np.ndarray):
        _pack_ndarray(obj, parts)
    elif type(obj) in _FIELDS:
        names = _FIELDS[type(obj)]
        parts.append(_map_header(len(names)))
        for n in names:
            parts.append(_key(n))
            _pack(getattr(obj, n), parts)
    elif isinstance(obj, (dict, list, tuple)) and _pack_plain(obj, parts):
        pass  # no arrays inside: packed in one C call
    elif isinstance(obj, dict):
        parts.append(_map_header(len(obj)))
        for k, v in obj.items():
            parts.append(_packb(k))
            _pack(v, parts)
    elif isinstance(obj, (list, tuple)):
        parts.append(_array_header(len(obj)))
        for v in obj:
            _pack(v, parts)
    elif isinstance(obj, np.generic):
        parts.append(_packb(obj.item()))
    else:
        parts.append(_packb(obj))


# Per-process counts of the sample-carrying frames through this process's codec (see the module
# docstring); control messages are not counted.
CODEC_COUNTS: dict[str, int] = {"encoded_frames": 0, "encoded_bytes": 0, "decoded_frames": 0, "decoded_bytes": 0}
_COUNTED = frozenset({"Group", "Sample"})


def codec_counts() -> dict[str, int]:
    """A copy of this process's `CODEC_COUNTS` (Group/Sample frames and bytes encoded and decoded)."""
    return dict(CODEC_COUNTS)


def encode(msg: Any) -> bytes:
    """One frame for any message in MESSAGE_TYPES (Group, Sample and the control messages)."""
    name = type(msg).__name__
    if MESSAGE_TYPES.get(name) is not type(msg):
        raise TypeError(f"cannot encode {type(msg)!r}: not a protocol message")
    parts: list[Any] = [b"\x83", _key("schema"), _packb(SCHEMA_VERSION), _key("type"), _key(name), _key("body")]
    _pack(msg, parts)
    frame = b"".join(parts)
    if name in _COUNTED:
        CODEC_COUNTS["encoded_frames"] += 1
        CODEC_COUNTS["encoded_bytes"] += len(frame)
    return frame


# --------------------------------------------------------------------------------------- decode
def _ext_hook(code: int, data: bytes) -> np.ndarray:
    if code != EXT_NDARRAY:
        raise ProtocolError(f"unknown msgpack ext type {code}")
    try:
        n = data[0]
        dt = data[1:1 + n].decode("ascii")
        ndim = data[1 + n]
        if ndim > MAX_NDIM:
            raise ProtocolError(f"array ndim {ndim} > {MAX_NDIM}")
        off = 2 + n + 8 * ndim
        shape = struct.unpack_from(f"<{ndim}Q", data, 2 + n)
    except (IndexError, struct.error, UnicodeDecodeError) as exc:
        raise ProtocolError(f"truncated array header ({exc})") from None
    if dt not in ALLOWED_DTYPES:
        raise ProtocolError(f"array dtype {dt!r} not allowed")
    dtype = np.dtype(dt)
    count = math.prod(shape)
    if count * dtype.itemsize != len(data) - off:
        raise ProtocolError(f"array of shape {tuple(shape)} {dt} needs {count * dtype.itemsize} bytes, "
                            f"frame has {len(data) - off}")
    return np.frombuffer(data, dtype=dtype, count=count, offset=off).reshape(shape)


def _fail(where: str, what: str) -> ProtocolError:
    return ProtocolError(f"{where}: {what}")


def _check(where: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    """Exact type check (msgpack yields exact builtins; bool is not accepted as a number)."""
    if type(value) is kind or (type(value) in kind if type(kind) is tuple else False):
        return value
    name = " or ".join(k.__name__ for k in kind) if type(kind) is tuple else kind.__name__
    raise _fail(where, f"expected {name}, got {type(value).__name__}")


# field name -> expected python type of scalar fields (arrays, nested types checked separately)
_SCALARS: dict[str, type | tuple[type, ...]] = {
    "uid": str, "prompt_uid": str, "reward": (int, float), "num_turns": int, "finish_reason": str,
    "verifier_version": str, "min_version": int, "max_version": int, "created_at": (int, float),
    "actor_id": str, "metadata": dict, "reward_parts": dict, "samples": list, "ticket": int,
    "timeout_s": (int, float), "status": str, "detail": str, "num_groups": int, "version": int,
    "dropped_stale": int, "stats": dict, "path": str, "code": str, "message": str, "want_ticket": bool,
    "next_ticket": int, "ahead": int,
}


def _build_group(body: Any, where: str) -> Group:
    if not isinstance(body, dict):
        raise _fail(where, f"body must be a map, got {type(body).__name__}")
    keys = {*_GROUP_SCALARS, "samples", "lengths", "columns"}
    if set(body) - keys:
        raise _fail(where, f"unknown field(s) {sorted(map(str, set(body) - keys))}")
    missing = [n for n in ("prompt_uid", "min_version", "max_version", "samples", "lengths", "columns") if n not in body]
    if missing:
        raise _fail(where, f"missing field(s) {missing}")
    kw = {n: _check(f"{where}.{n}", body[n], _SCALARS[n]) for n in _GROUP_SCALARS if n in body}
    rows = _check(f"{where}.samples", body["samples"], list)
    n = len(rows)
    if not 0 < n <= MAX_SAMPLES_PER_GROUP:
        raise _fail(f"{where}.samples", f"{n} samples (need 1..{MAX_SAMPLES_PER_GROUP})")
    lengths = body["lengths"]
    if not isinstance(lengths, np.ndarray) or lengths.dtype.str != "<i8" or lengths.shape != (n, 2):
        raise _fail(f"{where}.lengths", f"expected int64[{n}, 2]")
    if lengths.min() < 0:
        raise _fail(f"{where}.lengths", "negative length")
    cols = _check(f"{where}.columns", body["columns"], dict)
    if set(cols) != set(Sample.ARRAYS):
        raise _fail(f"{where}.columns", f"expected exactly {sorted(Sample.ARRAYS)}, got {sorted(map(str, cols))}")
    for name, dt in Sample.ARRAYS.items():
        a = cols[name]
        if not isinstance(a, np.ndarray) or a.dtype.str != dt or a.ndim != 1:
            raise _fail(f"{where}.columns.{name}", f"expected 1-D {dt} array")
    p_total, r_total = (int(x) for x in lengths.sum(axis=0))
    if cols["prompt_ids"].shape[0] != p_total or cols["response_ids"].shape[0] != r_total:
        raise _fail(f"{where}.lengths", "do not add up to the column lengths")
    lo, hi = _validate_sample(cols, f"{where}.columns")  # all invariants at once, over the whole group
    if hi >= 0 and (lo, hi) != (kw["min_version"], kw["max_version"]):
        raise _fail(where, f"min/max_version ({kw['min_version']}, {kw['max_version']}) differ from the "
                           f"samples' trained token versions ({lo}, {hi})")
    if kw["min_version"] > kw["max_version"]:
        raise _fail(where, "min_version > max_version")
    p_off = [0, *np.cumsum(lengths[:, 0]).tolist()]
    r_off = [0, *np.cumsum(lengths[:, 1]).tolist()]
    samples = []
    for i, row in enumerate(rows):
        at = f"{where}.samples[{i}]"
        if not isinstance(row, dict):
            raise _fail(at, f"expected a map, got {type(row).__name__}")
        if set(row) - set(_SAMPLE_SCALARS):
            raise _fail(at, f"unknown field(s) {sorted(map(str, set(row) - set(_SAMPLE_SCALARS)))}")
        if "uid" not in row or "prompt_uid" not in row:
            raise _fail(at, "missing field(s) uid/prompt_uid")
        skw = {k: _check(f"{at}.{k}", v, _SCALARS[k]) for k, v in row.items()}
        for k, v in skw.get("reward_parts", {}).items():
            _check(f"{at}.reward_parts[{k!r}]", v, (int, float))
        a, b, c, d = p_off[i], p_off[i + 1], r_off[i], r_off[i + 1]
        samples.append(Sample(prompt_ids=cols["prompt_ids"][a:b], response_ids=cols["response_ids"][c:d],
                              response_mask=cols["response_mask"][c:d],
                              behaviour_logprobs=cols["behaviour_logprobs"][c:d],
                              token_versions=cols["token_versions"][c:d], **skw))
    return Group(samples=samples, **kw)


def _build(cls: type, body: Any, where: str, ranges: list[tuple[int, int]] | None = None) -> Any:
    if cls is Group:
        return _build_group(body, where)
    if not isinstance(body, dict):
        raise _fail(where, f"body must be a map, got {type(body).__name__}")
    names = _FIELDS[cls]
    unknown = set(body) - set(names)
    if unknown:
        raise _fail(where, f"unknown field(s) {sorted(map(str, unknown))}")
    kw: dict[str, Any] = {}
    for name, value in body.items():
        if cls is Sample and name in Sample.ARRAYS:
            if not isinstance(value, np.ndarray):
                raise _fail(f"{where}.{name}", f"expected ndarray, got {type(value).__name__}")
            if value.dtype.str != Sample.ARRAYS[name] or value.ndim != 1:
                raise _fail(f"{where}.{name}", f"expected 1-D {Sample.ARRAYS[name]}, got {value.ndim}-D {value.dtype.str}")
        elif name == "samples":
            _check(f"{where}.samples", value, list)
            if not 0 < len(value) <= MAX_SAMPLES_PER_GROUP:
                raise _fail(f"{where}.samples", f"{len(value)} samples (need 1..{MAX_SAMPLES_PER_GROUP})")
            ranges = []
            value = [_build(Sample, s, f"{where}.samples[{i}]", ranges) for i, s in enumerate(value)]
        else:
            _check(f"{where}.{name}", value, _SCALARS[name])
            if name in ("reward_parts", "stats"):
                for k, v in value.items():
                    _check(f"{where}.{name}[{k!r}]", v, (int, float))
        kw[name] = value
    if cls is Sample:
        missing = [n for n in ("uid", "prompt_uid", *Sample.ARRAYS) if n not in kw]
        if missing:
            raise _fail(where, f"missing field(s) {missing}")
        lo, hi = _validate_sample(kw, where)
        if ranges is not None and hi >= 0:
            ranges.append((lo, hi))
    elif cls is Group:
        missing = [n for n in ("prompt_uid", "samples", "min_version", "max_version") if n not in kw]
        if missing:
            raise _fail(where, f"missing field(s) {missing}")
    obj = cls(**kw)
    if cls is Group:
        lo, hi = (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else (None, None)
        if lo is not None and (lo, hi) != (obj.min_version, obj.max_version):
            raise _fail(where, f"min/max_version ({obj.min_version}, {obj.max_version}) differ from the "
                               f"samples' trained token versions ({lo}, {hi})")
        if obj.min_version > obj.max_version:
            raise _fail(where, "min_version > max_version")
    return obj


def _validate_sample(kw: dict[str, Any], where: str) -> tuple[int, int]:
    """Checks lengths and invariants with a handful of vectorised reductions; returns the (min, max)
    policy version of the trained tokens ((-1, -1) when there are none)."""
    t = kw["response_ids"].shape[0]
    for n in ("response_mask", "behaviour_logprobs", "token_versions"):
        if kw[n].shape[0] != t:
            raise _fail(f"{where}.{n}", f"length {kw[n].shape[0]} != len(response_ids) {t}")
    if t == 0:
        return -1, -1
    mask = kw["response_mask"].view(np.uint8)  # -1 shows as 255
    if mask.max() > 1:
        raise _fail(f"{where}.response_mask", "values must be 0 or 1")
    on = mask.view(np.bool_)  # valid 0/1 bytes: a free boolean view
    tv = kw["token_versions"]
    if tv.min() < -1 or ((tv >= 0) != on).any():
        raise _fail(f"{where}.token_versions", "must be -1 where mask is 0 and >= 0 where mask is 1")
    lp = kw["behaviour_logprobs"]
    if np.isnan(lp.sum()) and np.isnan(lp).any():  # the sum is NaN if any term is (cheap first test)
        raise _fail(f"{where}.behaviour_logprobs", "contains NaN")
    # -1 (untrained) is the largest uint32, so the unsigned minimum is the minimum trained version
    return int(tv.view(np.uint32).min()) if tv.max() >= 0 else -1, int(tv.max())


def decode(frame: bytes | memoryview, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Any:
    """Frame -> message object. Raises only ProtocolError (naming what was wrong)."""
    if len(frame) > max_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        top = msgpack.unpackb(frame, raw=False, ext_hook=_ext_hook, strict_map_key=True)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many types (ExtraData, FormatError, ValueError, ...)
        raise ProtocolError(f"not a valid msgpack frame: {type(exc).__name__}: {exc}") from None
    if not isinstance(top, dict) or set(top) != {"schema", "type", "body"}:
        raise ProtocolError("frame must be a map with exactly the keys schema, type, body")
    if top["schema"] not in ACCEPTED_SCHEMAS or isinstance(top["schema"], bool):
        raise ProtocolError(f"schema version {top['schema']!r} not accepted (this build: {sorted(ACCEPTED_SCHEMAS)})")
    cls = MESSAGE_TYPES.get(top["type"]) if isinstance(top["type"], str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {top['type']!r}")
    if top["type"] in _COUNTED:
        CODEC_COUNTS["decoded_frames"] += 1
        CODEC_COUNTS["decoded_bytes"] += len(frame)
    try:
        return _build(cls, top["body"], cls.__name__)
    except ProtocolError:
        raise
    except Exception as exc:  # defensive: validation must never let another type escape
        raise ProtocolError(f"{cls.__name__}: invalid content ({type(exc).__name__}: {exc})") from None
