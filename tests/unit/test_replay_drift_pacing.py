"""`buffer.staleness=drift` on the replay state: the admitted lag follows the measured drift within
[0, max_staleness] (with a hysteresis gap), the admission limit follows it, and the version bound
still decides delivery (pacing never drops what was generated)."""

from __future__ import annotations

import numpy as np

from asyncrl.replay.state import BufferState
from asyncrl.replay.synthetic import synthetic_group


def _state(max_staleness: int = 4, batch: int = 2) -> BufferState:
    return BufferState(max_staleness=max_staleness, batch_size=batch, capacity_groups=100, capacity_bytes=2**30)


def test_admitted_lag_follows_drift_with_hysteresis():
    st = _state()
    # budget 0.02: over it -> down one per step, 4 -> 3 -> 2; in [0.01, 0.02] -> unchanged; under 0.01 -> up
    assert [st.observe_drift(d, 0.02) for d in (0.05, 0.03, 0.015, 0.02, 0.005)] == [3, 2, 2, 2, 3]
    # bounded: never below 0, never above max_staleness
    assert [st.observe_drift(0.9, 0.02) for _ in range(5)][-1] == 0
    assert [st.observe_drift(0.0, 0.02) for _ in range(9)][-1] == 4


def test_admission_limit_uses_the_paced_lag():
    st = _state(max_staleness=4, batch=2)
    assert st.admission_limit() == (0 + 4 + 1) * 2
    st.observe_drift(0.05, 0.02)
    st.observe_drift(0.05, 0.02)
    assert st.admission_limit() == (0 + 2 + 1) * 2 and st.stats()["buffer/admission_staleness"] == 2.0
    tickets = [st.grant("a") for _ in range(7)]
    assert tickets[:6] == list(range(6)) and tickets[6] is None  # 6 = (2 + 1) x 2 slots


def test_delivery_keeps_the_version_bound_not_the_paced_lag():
    st = _state(max_staleness=4, batch=2)
    old = synthetic_group(np.random.default_rng(0), prompt_uid="p0", version=0, n=2, min_tokens=8, max_tokens=8)
    assert st.ingest(old, b"x" * 10) == "stored"
    st.set_version(3)
    for _ in range(4):
        st.observe_drift(0.05, 0.02)  # admitted lag now 0
    assert st.admission_staleness == 0
    assert len(st.take(1)) == 1  # lag 3 <= max_staleness 4: delivered, not dropped by the pacing
