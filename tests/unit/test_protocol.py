"""Wire codec: arbitrary Samples/Groups/control messages round-trip exactly (property-based); every
malformed frame (random bytes, mutations, wrong schema/type/dtype/shape/invariant) raises only
ProtocolError with a message naming the problem; no pickle; a 1 MB group encodes+decodes in ms."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from asyncrl.protocol import (
    SCHEMA_VERSION,
    BatchRequest,
    ErrorReply,
    Group,
    ProtocolError,
    PushReply,
    Sample,
    StatsReply,
    TicketRequest,
    codec_counts,
    decode,
    encode,
)
from asyncrl.replay.synthetic import synthetic_group

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                      st.floats(allow_nan=False), st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                          max_leaves=12)
allowed_dtypes = st.sampled_from(["bool", "int8", "uint8", "int16", "int32", "int64", "uint64", "float16",
                                  "float32", "float64"])
any_array = allowed_dtypes.flatmap(lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)))


@st.composite
def samples(draw: st.DrawFn, version: int | None = None) -> Sample:
    t = draw(st.integers(0, 40))
    mask = np.array(draw(st.lists(st.integers(0, 1), min_size=t, max_size=t)), dtype=np.int8)
    v = draw(st.integers(0, 1000)) if version is None else version
    versions = np.where(mask == 1, v + draw(hnp.arrays(np.int32, t, elements=st.integers(0, 3))), -1)
    return Sample(
        uid=draw(st.text(max_size=10)), prompt_uid="p",
        prompt_ids=draw(hnp.arrays(np.int32, st.integers(0, 30))),
        response_ids=draw(hnp.arrays(np.int32, t)), response_mask=mask,
        behaviour_logprobs=np.where(mask == 1, draw(hnp.arrays(np.float32, t, elements=st.floats(-50, 0, width=32))), 0),
        token_versions=versions, reward=draw(st.floats(-10, 10)),
        reward_parts=draw(st.dictionaries(st.text(max_size=8), st.floats(allow_nan=False), max_size=3)),
        num_turns=draw(st.integers(1, 8)), finish_reason=draw(st.sampled_from(["stop", "length", ""])),
        verifier_version=draw(st.text(max_size=10)),
        metadata=draw(st.dictionaries(st.text(max_size=8), json_value | any_array, max_size=4)),
    )


def assert_same(a: object, b: object) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif hasattr(a, "__slots__") and not isinstance(a, (str, bytes)):
        assert type(a) is type(b)
        for name in a.__slots__:
            assert_same(getattr(a, name), getattr(b, name))
    else:
        assert a == b and type(a) is type(b)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(samples(version=None), min_size=1, max_size=4), json_value)
def test_group_round_trip(ss: list[Sample], meta: object) -> None:
    if all(not s.response_mask.any() for s in ss):
        group = Group("p", ss, 0, 0, 1.5, "actor", {"m": meta})
    else:
        group = Group.from_samples(ss, created_at=1.5, actor_id="actor", metadata={"m": meta})
    assert_same(group, decode(encode(group)))


@settings(max_examples=40, deadline=None)
@given(samples())
def test_sample_round_trip(s: Sample) -> None:
    assert_same(s, decode(encode(s)))


def test_control_messages_round_trip() -> None:
    for msg in (TicketRequest("a", 1.5), BatchRequest(8, 3, 2.0), BatchRequest(8, 3, 2.0, 1), PushReply("full", "x"),
                StatsReply({"buffer/a": 1.0}), ErrorReply("malformed", "m")):
        assert decode(encode(msg)) == msg


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_frames_raise_only_protocol_error(data: st.DataObject) -> None:
    frame = bytearray(encode(synthetic_group(np.random.default_rng(0), prompt_uid="p", version=2, n=2,
                                             min_tokens=8, max_tokens=8)))
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(frame)))
    try:
        msg = decode(bytes(frame[:cut]))
    except ProtocolError:
        return
    assert isinstance(msg, (Group, Sample))  # a mutation that keeps every invariant is still valid


def _frame(body: dict, type_: str = "Sample", schema: int = SCHEMA_VERSION) -> bytes:
    """Re-encodes a (possibly broken) body with the real array ext packer."""
    from asyncrl import protocol

    parts: list = [b"\x83", msgpack.packb("schema"), msgpack.packb(schema), msgpack.packb("type"),
                   msgpack.packb(type_), msgpack.packb("body")]
    protocol._pack(body, parts)
    return b"".join(parts)


def _good_body() -> dict:
    s = synthetic_group(np.random.default_rng(1), prompt_uid="p", version=3, n=1, min_tokens=16, max_tokens=16).samples[0]
    return {n: getattr(s, n) for n in s.__slots__}


@pytest.mark.parametrize("change, needle", [
    (lambda b: b.update(response_mask=b["response_mask"][:-1]), "response_mask: length 15 != len(response_ids) 16"),
    (lambda b: b.update(response_ids=b["response_ids"].astype(np.int64)), "response_ids: expected 1-D <i4"),
    (lambda b: b.update(prompt_ids=b["prompt_ids"].reshape(-1, 2)), "prompt_ids: expected 1-D"),
    (lambda b: b.update(response_mask=np.full(16, 2, np.int8)), "response_mask: values must be 0 or 1"),
    (lambda b: b.update(token_versions=np.full(16, -1, np.int32)), "token_versions: must be -1 where mask is 0"),
    (lambda b: b.update(behaviour_logprobs=np.full(16, np.nan, np.float32)), "contains NaN"),
    (lambda b: b.update(reward="high"), "Sample.reward: expected"),
    (lambda b: b.update(extra_field=1), "unknown field(s) ['extra_field']"),
    (lambda b: b.pop("uid"), "missing field(s) ['uid']"),
    (lambda b: b.update(reward_parts={"acc": "x"}), "reward_parts['acc']"),
    (lambda b: b.update(prompt_ids=np.zeros(3, dtype=np.complex64)), "dtype '<c8' not allowed"),
])
def test_invalid_sample_is_named(change, needle: str) -> None:
    body = _good_body()
    change(body)
    with pytest.raises(ProtocolError) as err:
        decode(_frame(body))
    assert needle in str(err.value)


def test_envelope_errors_are_named() -> None:
    good = encode(TicketRequest("a", 1.0))
    with pytest.raises(ProtocolError, match="schema version 99 not accepted"):
        decode(_frame({}, "TicketRequest", schema=99))
    with pytest.raises(ProtocolError, match="unknown message type 'Pickle'"):
        decode(_frame({}, "Pickle"))
    with pytest.raises(ProtocolError, match="not a valid msgpack frame"):
        decode(good[:-3])
    with pytest.raises(ProtocolError, match="exceeds the limit of 10"):
        decode(good + b"x" * 100, max_bytes=10)
    ext = msgpack.packb({"schema": 1, "type": "TicketRequest", "body": {"actor_id": msgpack.ExtType(7, b"x")}})
    with pytest.raises(ProtocolError, match="unknown msgpack ext type 7"):
        decode(ext)


def test_group_version_range_must_match_tokens() -> None:
    g = synthetic_group(np.random.default_rng(2), prompt_uid="p", version=5, n=2, min_tokens=8, max_tokens=8)
    g.min_version = 6  # would understate staleness of tokens generated at version 5
    with pytest.raises(ProtocolError, match=r"min/max_version \(6, 5\) differ"):
        decode(encode(g))


def test_decoded_arrays_share_one_buffer_and_no_pickle() -> None:
    g = synthetic_group(np.random.default_rng(3), prompt_uid="p", version=1, n=2, min_tokens=32, max_tokens=32)
    frame = encode(g)
    assert b"pickle" not in frame and b"\x80\x04" not in frame[:2]
    s = decode(frame).samples[0]
    assert not s.response_ids.flags.writeable  # a view on the received ext payload, not a copy


def test_codec_counts_sample_frames_only() -> None:
    g = synthetic_group(np.random.default_rng(5), prompt_uid="p", version=1, n=2, min_tokens=8, max_tokens=8)
    before = codec_counts()
    frame = encode(g)
    decode(frame)
    decode(encode(TicketRequest("a", 1.0)))  # control messages are not counted
    after = codec_counts()
    # one Group frame each way, its length in bytes
    assert after["encoded_frames"] - before["encoded_frames"] == 1
    assert after["decoded_frames"] - before["decoded_frames"] == 1
    assert after["encoded_bytes"] - before["encoded_bytes"] == len(frame)
    assert after["decoded_bytes"] - before["decoded_bytes"] == len(frame)


def test_one_mb_group_encode_decode_is_fast() -> None:
    # 8 samples x ~8k tokens x (4 ids + 1 mask + 4 logprob + 4 version bytes) + prompts ~= 1 MB
    g = synthetic_group(np.random.default_rng(4), prompt_uid="p", version=1, n=8, min_tokens=9500, max_tokens=9500)
    frame = encode(g)
    assert 0.9e6 < len(frame) < 1.2e6
    best = min(_timed(lambda: decode(encode(g))) for _ in range(5))
    assert best < 0.025, f"encode+decode of a 1 MB group took {best * 1e3:.1f} ms"


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
