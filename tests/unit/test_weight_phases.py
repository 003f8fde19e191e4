"""Every weight round is timed by phase, and the phases add up to the round.

Proves: `PhaseTimer` spans are exclusive (a nested span is subtracted from its parent, so nothing
counts twice); with a CUDA device the device-flagged spans report their CUDA events' time (the
GPU code path, driven here by a labelled stand-in for `torch.cuda.Event`, since this machine has
no GPU) while host waits stay host time; a real round over loopback gloo (sender in this thread,
receiver in another, buffered and streamed) reports every sender and receiver phase and the named
phases cover the round: tolerance, stated once here: named phases <= the round (exclusive) and
>= 90 % of it minus 20 ms (the scheduler of this shared 2-core machine may preempt between spans).
Also: the step metrics carry them as `perf/weight_sync/{side}_{phase}_s`, `ctl status` shows them
and the run report draws the stacked bar.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from asyncrl.weights.phases import RECEIVER_PHASES, SENDER_PHASES, PhaseTimer
from asyncrl.weights.receiver import WeightReceiver
from asyncrl.weights.sender import WeightSender

SLACK_S = 0.02


def assert_adds_up(phases: dict[str, float]) -> None:
    named = sum(v for k, v in phases.items() if k not in ("other", "round"))
    assert named <= phases["round"] + 1e-6, phases  # exclusive: nothing counted twice
    assert named >= 0.9 * phases["round"] - SLACK_S, phases  # and they cover the round
    assert phases["other"] == pytest.approx(max(0.0, phases["round"] - named), abs=1e-9)


def test_nested_spans_are_exclusive_and_add_up():
    t = PhaseTimer()
    with t.span("outer"):
        time.sleep(0.05)
        with t.span("inner"):
            time.sleep(0.1)
    items = list(t.timed_iter("produce", (time.sleep(0.02) or i for i in range(3))))
    t.end()
    s = t.seconds()
    assert items == [0, 1, 2]
    assert 0.1 <= s["inner"] < 0.1 + 0.05  # the inner sleep, not counted in outer
    assert 0.05 <= s["outer"] < 0.1  # 0.15 s wall minus the inner 0.1 s
    assert s["produce"] >= 0.06
    assert_adds_up(s)


class StandInEvent:
    """Stands in for torch.cuda.Event (no GPU on this machine): `record()` notes the host clock
    plus a fixed 'device lag' so device time visibly differs from the host's launch time."""

    LAG_S = 0.25
    synchronized = 0

    def __init__(self) -> None:
        self.t = None

    def record(self) -> None:
        self.t = time.perf_counter() + (self.LAG_S if StandInEvent.recording_end else 0.0)
        StandInEvent.recording_end = not StandInEvent.recording_end

    def synchronize(self) -> None:
        StandInEvent.synchronized += 1

    def elapsed_time(self, end: StandInEvent) -> float:
        return (end.t - self.t) * 1e3  # milliseconds, as CUDA's

    recording_end = False


def test_gpu_path_device_spans_report_event_time_and_host_waits_stay_host_time():
    # GPU code path with a stand-in event (labelled: no CUDA here)
    t = PhaseTimer(torch.device("cuda", 0), event_factory=StandInEvent)
    assert t.uses_events
    with t.span("pack", device=True):
        pass  # the host returns at once; the device works on (the stand-in's 0.25 s lag)
    with t.span("wire"):
        time.sleep(0.03)
    t.end()
    s = t.seconds()
    assert s["pack"] == pytest.approx(StandInEvent.LAG_S, abs=0.01)  # the event pair, not the host
    assert 0.03 <= s["wire"] < 0.2  # a host wait stays host time
    assert StandInEvent.synchronized == 1  # resolved once, at seconds()
    assert s["other"] == 0.0  # device time overlapping host time: other is clipped, never negative
    cpu = PhaseTimer(torch.device("cpu"))
    assert not cpu.uses_events


def _round(buffered: bool) -> tuple[dict[str, float], dict[str, float]]:
    cfg = SimpleNamespace(bucket_mb=0.05, backend="gloo", timeout_s=20.0, host="127.0.0.1")
    sender = WeightSender(cfg, members=["a"], publish=True)
    sender.publish_fn = lambda buckets, version, name: None  # the store copy is taken; no Ray here
    out: dict[str, dict] = {}

    def receive() -> None:
        rec = WeightReceiver(sender.address, "a", timeout_s=20.0)

        def load(it):  # an engine that takes 5 ms per tensor to load
            for _ in it:
                time.sleep(0.005)

        out["r"] = rec.receive(load, buffered=buffered)

    th = threading.Thread(target=receive)
    th.start()

    def export():  # a learner that takes 10 ms to gather each bucket of tensors
        for i in range(8):
            time.sleep(0.01)
            yield [(f"layer{i}.w", torch.randn(64, 64)), (f"layer{i}.b", torch.randn(64))]

    try:
        report = sender.broadcast(export(), 1)
        th.join(60)
    finally:
        sender.close()
    assert report.acked == ["a"] and out["r"]["status"] == "ok", (report, out)
    return report.phases, out["r"]["phases"]


@pytest.mark.parametrize("buffered", [True, False])
def test_a_real_round_reports_every_phase_and_they_add_up(buffered):
    send, recv = _round(buffered)
    assert set(SENDER_PHASES) <= set(send)
    assert {"enter", "header_wait", "wire", "sample", "load", "check", "ack"} <= set(recv)
    assert set(recv) - {"other", "round"} <= set(RECEIVER_PHASES)
    assert send["export"] >= 8 * 0.01  # the exporter's own time, apart from packing
    assert recv["load"] >= 16 * 0.005  # the loader's own time; streamed, the wire inside it is not in it
    assert_adds_up(send)
    assert_adds_up(recv)


def test_step_metrics_status_and_report_carry_the_phases(tmp_path):
    from asyncrl.job.status import format_status
    from asyncrl.job.step_metrics import weight_sync_phases
    from asyncrl.report import plot_images, sync_phase_means

    sync = {"report": {"phases": {"pack": 0.5, "wire": 1.0, "other": 0.1, "round": 1.6}},
            "actors": {"a": {"seconds": 2.0, "phases": {"wire": 1.0, "load": 0.7, "round": 1.8},
                             "engine_phases": {"pause": 0.1, "round": 1.8, "resume": 0.05, "total": 1.95}},
                       "b": {"seconds": 1.0, "phases": {"wire": 0.2, "round": 0.3}}}}
    m = weight_sync_phases(sync)
    assert m["perf/weight_sync/send_pack_s"] == 0.5 and m["perf/weight_sync/recv_load_s"] == 0.7  # slowest actor
    assert m["perf/weight_sync/engine_total_s"] == 1.95 and "perf/weight_sync/recv_round_s" in m
    text = format_status({"latest": m, "step": 1, "max_steps": 2})
    assert "sender" in text and "wire 1.00" in text and "receiver" in text and "load 0.70" in text
    means = sync_phase_means([{"step": 1, **m}, {"step": 2, **m}])
    assert means["send"] == {"pack": 0.5, "wire": 1.0, "other": 0.1}
    assert "round" not in means["engine"] and means["engine"]["pause"] == 0.1
    assert "Weight sync by phase" in [title for title, _ in plot_images([{"step": 1, **m}])]
