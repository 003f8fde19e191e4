"""Buffer rules without sockets: AReaL's admission rule with hand-computed limits, ticket leases,
duplicate/late pushes, the hard staleness bound (ingest, version change, delivery, a prefetch's later version), oldest-first
delivery, capacity answers, the DAPO filter, requeue, and stats names."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.protocol import encode
from asyncrl.replay.state import BufferState, UnknownTicket
from asyncrl.replay.synthetic import synthetic_group

RNG = np.random.default_rng(0)


def group(version: int, uid: str = "p", rewards: list[float] | None = None):
    g = synthetic_group(RNG, prompt_uid=uid, version=version, n=2, min_tokens=8, max_tokens=8, rewards=rewards)
    return g, encode(g)


def state(**kw) -> BufferState:
    args = dict(max_staleness=1, batch_size=2, capacity_groups=100, capacity_bytes=10**9)
    return BufferState(**{**args, **kw})


def test_admission_rule_hand_computed() -> None:
    st = state()
    # v=0, eta=1, B=2: limit = (0 + 1 + 1) * 2 = 4 tickets while nothing is consumed
    tickets = [st.grant() for _ in range(5)]
    assert tickets == [0, 1, 2, 3, None]
    for t in tickets[:3]:
        assert st.ingest(*group(0), ticket=t) == "stored"
    # consumed 0 + buffered 3 + in_flight 1 = 4 -> still full
    assert st.grant() is None
    assert len(st.take(2)) == 2  # consumed 2 + buffered 1 + in_flight 1 = 4
    assert st.grant() is None
    st.set_version(1)  # limit (1 + 1 + 1) * 2 = 6 -> two more
    assert [st.grant(), st.grant(), st.grant()] == [4, 5, None]
    assert st.release(5) is True and st.release(5) is False  # slot freed once
    assert st.grant() == 6


def test_lease_expiry_frees_slot_and_late_push_is_accepted() -> None:
    st = state(ticket_lease_s=10.0)
    t0 = [st.grant(now=100.0) for _ in range(4)]
    assert st.grant(now=105.0) is None
    assert st.expire(now=111.0) == 4 and st.counters["tickets_expired"] == 4
    assert st.grant(now=111.0) == 4
    assert st.ingest(*group(0), ticket=t0[0]) == "stored"  # late push of a dead actor's work: kept
    assert st.counters["late_pushes"] == 1
    assert st.ingest(*group(0), ticket=t0[0]) == "duplicate"
    with pytest.raises(UnknownTicket):
        st.ingest(*group(0), ticket=99)


def test_hard_bound_at_ingest_version_change_and_delivery() -> None:
    st = state(max_staleness=1)
    st.set_version(3)
    assert st.ingest(*group(1)) == "stale"  # 3 - 1 > 1
    assert st.ingest(*group(2)) == "stored" and st.ingest(*group(3)) == "stored"
    assert st.set_version(4) == 1  # the version-2 group: 4 - 2 > 1
    got = st.take(5)
    assert [g.min_version for g in got] == [3]
    assert st.counters["dropped_stale"] == 2
    assert st.stats()["buffer/staleness/1"] == 1.0


def test_prefetch_take_obeys_the_bound_of_its_training_version_without_raising_admission() -> None:
    st = state(max_staleness=1)
    for v in (0, 1, 1):
        st.ingest(*group(v))
    # a prefetch made at v=1 for the step trained at v=2: the v0 group (2 - 0 > 1) is dropped,
    # the two v1 groups are delivered with lag 2 - 1 = 1; the buffer's v (admission) stays 1
    st.set_version(1)
    got = st.take(3, at=2)
    assert [sg.min_version for sg in got] == [1, 1] and st.counters["dropped_stale"] == 1
    assert st.version == 1 and st.admission_limit() == (1 + 1 + 1) * 2
    assert st.staleness_hist[1] == 2


def test_strictly_on_policy_with_zero_staleness() -> None:
    st = state(max_staleness=0)
    st.ingest(*group(0))
    st.set_version(1)
    assert st.take(1) == [] and st.counters["dropped_stale"] == 1


def test_oldest_version_first_then_arrival() -> None:
    st = state(max_staleness=5)
    st.set_version(5)
    for v, uid in [(4, "a"), (2, "b"), (4, "c"), (3, "d"), (2, "e")]:
        st.ingest(*group(v, uid))
    from asyncrl.protocol import decode

    order = [decode(g.blob).prompt_uid for g in st.take(5)]
    assert order == ["b", "e", "d", "a", "c"]


def test_capacity_full_keeps_ticket_in_flight() -> None:
    g, blob = group(0)
    st = state(capacity_groups=1, batch_size=10)
    t = st.grant()
    assert st.ingest(g, blob) == "stored"
    assert st.ingest(g, blob, ticket=t) == "full" and t in st.in_flight
    st.take(1)
    assert st.ingest(g, blob, ticket=t) == "stored"
    by_bytes = state(capacity_bytes=len(blob) + 10)
    assert by_bytes.ingest(g, blob) == "stored" and by_bytes.ingest(g, blob) == "full"
    assert by_bytes.counters["rejected_full"] == 1


def test_dynamic_sampling_filter_counts_and_frees_slot() -> None:
    st = state(filter_enable=True, filter_key="overall", filter_low=0.01, filter_high=0.99)
    t = st.grant()
    assert st.ingest(*group(0, rewards=[1.0, 1.0]), ticket=t) == "filtered"  # mean 1.0 not < 0.99
    assert st.ingest(*group(0, rewards=[0.0, 0.0])) == "filtered"  # mean 0.0 not > 0.01
    assert st.ingest(*group(0, rewards=[0.0, 1.0])) == "stored"  # mean 0.5 kept
    assert st.counters["dropped_filtered"] == 2 and not st.in_flight


def test_requeue_restores_groups_and_counters() -> None:
    st = state()
    st.ingest(*group(0))
    taken = st.take(1)
    st.requeue(taken)
    assert st.buffered == 1 and st.consumed == 0 and st.staleness_hist[0] == 0
    assert len(st.take(1)) == 1


def test_stats_are_flat_buffer_metrics() -> None:
    st = state()
    st.ingest(*group(0))
    st.take(1)
    stats = st.stats()
    assert all(k.startswith("buffer/") and isinstance(v, float | int) for k, v in stats.items())
    for key in ("buffer/size_groups", "buffer/size_mb", "buffer/in_flight", "buffer/dropped_stale",
                "buffer/dropped_filtered", "buffer/rejected_malformed", "buffer/ingest_groups_per_s",
                "buffer/serve_groups_per_s", "buffer/staleness/0", "buffer/batch_wait_s_mean",
                "buffer/ticket_wait_s_p99", "buffer/group_age_s_mean"):
        assert key in stats
    assert stats["buffer/consumed"] == 1.0
