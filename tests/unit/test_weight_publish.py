"""The WeightStore copy is published off the learner's critical path.

Ordering, not timing: with publish_mode="background", `broadcast` returns while the publish of its
version is still blocked (so the next learner step can start), versions reach the store in order
(a new publish first waits for the one in flight), `flush`/`close` wait for it, and a failing
publish is counted without breaking the broadcast; "sync" publishes before `broadcast` returns;
`publish_every` skips versions. Also the integrity fingerprint's contract: deterministic per name,
exact for equal data, sensitive to one changed sampled element.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from asyncrl.weights.sender import WeightSender
from asyncrl.weights.wire import (
    bucket_fingerprint,
    fingerprint_mismatches,
    pack_buckets,
    sample_index,
    unpack_bucket,
)


def sender(mode: str = "background", every: int = 1) -> WeightSender:
    cfg = SimpleNamespace(bucket_mb=0.01, backend="gloo", timeout_s=5.0, host="127.0.0.1",
                          publish_mode=mode, publish_every=every)
    return WeightSender(cfg, publish=True)  # no members: broadcast = export + publish


def weights(v: int) -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.full((64,), float(v))), ("b", torch.arange(10, dtype=torch.int64) + v)]


def test_background_publish_never_blocks_the_broadcast_and_keeps_versions_in_order():
    s = sender()
    log: list[tuple[str, int]] = []
    release = {1: threading.Event(), 2: threading.Event()}
    started = {1: threading.Event(), 2: threading.Event()}

    def publish(buckets, version, name):
        log.append(("start", version))
        started[version].set()
        assert release[version].wait(30)
        log.append(("done", version))

    s.publish_fn = publish
    r1 = s.broadcast(weights(1), 1)
    assert r1.published and started[1].wait(10)
    assert ("done", 1) not in log  # broadcast 1 returned while its publish is still blocked
    t = threading.Thread(target=s.broadcast, args=(weights(2), 2))
    t.start()
    t.join(0.5)
    assert t.is_alive() and not started[2].is_set()  # publish 2 waits for publish 1 (ordering)
    release[1].set()
    assert started[2].wait(10)
    t.join(10)
    assert not t.is_alive() and ("done", 2) not in log  # broadcast 2 returned, publish 2 still running
    release[2].set()
    s.close()  # flushes
    assert log == [("start", 1), ("done", 1), ("start", 2), ("done", 2)]


def test_published_copy_is_a_snapshot_taken_at_broadcast_time():
    s = sender()
    got: dict[int, torch.Tensor] = {}
    gate = threading.Event()

    def publish(buckets, version, name):
        assert gate.wait(30)
        got[version] = torch.cat([f.float() for _, f in buckets])

    s.publish_fn = publish
    live = torch.zeros(64)
    s.broadcast([("a", live)], 1)
    live += 5  # the optimizer step that follows must not leak into version 1's copy
    gate.set()
    s.flush()
    assert torch.equal(got[1], torch.zeros(64))


def test_sync_mode_publishes_before_returning_and_every_n_skips():
    s = sender("sync", every=2)
    seen: list[int] = []
    s.publish_fn = lambda buckets, version, name: seen.append(version)
    reports = [s.broadcast(weights(v), v) for v in (1, 2, 3, 4, 5)]
    assert seen == [1, 3, 5] and [r.published for r in reports] == [True, False, True, False, True]


def test_failed_publish_is_counted_and_the_next_one_still_runs():
    s = sender()
    seen: list[int] = []

    def publish(buckets, version, name):
        if version == 1:
            raise RuntimeError("object store full")
        seen.append(version)

    s.publish_fn = publish
    s.broadcast(weights(1), 1)
    s.broadcast(weights(2), 2)
    s.close()
    assert s.publish_errors == 1 and seen == [2] and s.last_publish["version"] == 2


def test_fingerprint_is_deterministic_exact_and_sensitive():
    assert torch.equal(sample_index("w", 1000), sample_index("w", 1000))
    assert not torch.equal(sample_index("w", 1000), sample_index("v", 1000))  # per name, fixed
    t = torch.randn(1000)
    (m, flat), = pack_buckets([("w", t)], 2**20)
    fp = bucket_fingerprint(m, flat)
    assert fingerprint_mismatches(fp, bucket_fingerprint(m, flat.clone())) == []
    bad = flat.clone()
    bad[int(sample_index("w", 1000)[3])] += 1e-6  # one sampled element, by one ulp-ish step
    assert fingerprint_mismatches(fp, bucket_fingerprint(m, bad)) == ["w"]
    assert fingerprint_mismatches(fp, {}) == ["w"]  # a missing tensor is a mismatch


def test_store_copies_reuse_one_host_arena():
    # The store copy of every published version lands in ONE host buffer (page-locked on a GPU
    # learner; plain memory here, same logic): the first version learns the size, every later
    # version is copied into the same storage, exact values each time, the previous version
    # having been published before its bytes are overwritten. Mixed dtypes (an odd count of bf16
    # elements before fp32) check the aligned offsets.
    s = sender()
    seen: dict[int, dict[str, torch.Tensor]] = {}
    ptrs: dict[int, list[int]] = {}

    def publish(buckets, version, name):
        seen[version] = {n: t.clone() for m, f in buckets for n, t in unpack_bucket(m, f)}
        ptrs[version] = [f.data_ptr() for _, f in buckets]

    def mixed(v: int) -> list[tuple[str, torch.Tensor]]:
        return [("h", torch.full((3,), float(v), dtype=torch.bfloat16)), ("a", torch.full((700,), float(v))),
                ("b", torch.arange(10, dtype=torch.int64) + v)]

    s.publish_fn = publish
    for v in (1, 2, 3):
        s.broadcast(mixed(v), v)
        s.flush()
        assert {n: t.tolist() for n, t in seen[v].items()} == {n: t.tolist() for n, t in mixed(v)}
        if v == 1:  # no arena yet: version 1 went to exact-size buffers and taught the arena its size
            assert s.arena.arena is None and len(s.arena.overflow) == len(ptrs[1])
    arena = s.arena.arena
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
    assert arena.numel() == s.arena.need and not s.arena.overflow  # sized by version 1, no overflow after
    assert all(lo <= p < hi for p in ptrs[2] + ptrs[3]) and ptrs[2] == ptrs[3]  # the same storage reused
    s.close()
