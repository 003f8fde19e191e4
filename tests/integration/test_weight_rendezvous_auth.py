"""The weight rendezvous (learner rank 0's TCPStore) takes no strangers and listens where the config
says: a join request appended by a process without the job's secret (unsigned, or signed with
another key) is ignored and counted, and the next broadcast does not wait for it; a request from a
real receiver holding the secret is taken; the store listens on loopback only (not every
interface) by default."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from asyncrl.config import WeightSyncConfig
from asyncrl.weights.receiver import WeightReceiver
from asyncrl.weights.sender import WeightSender
from asyncrl.weights.wire import PREFIX

pytestmark = pytest.mark.integration


def sender(timeout_s: float = 10.0) -> WeightSender:
    return WeightSender(WeightSyncConfig(backend="gloo", timeout_s=timeout_s, host="127.0.0.1"))


def test_a_join_request_without_the_secret_costs_the_sender_nothing() -> None:
    s = sender(timeout_s=10.0)
    try:
        intruder = dist.TCPStore("127.0.0.1", s.port, None, False, timedelta(seconds=5))
        n = intruder.add(f"{PREFIX}/joinreq_n", 1)
        intruder.set(f"{PREFIX}/joinreq/{n}", "intruder-0")  # the plain request an old receiver sends
        n = intruder.add(f"{PREFIX}/joinreq_n", 1)
        intruder.set(f"{PREFIX}/joinreq/{n}", json.dumps({"member": "intruder-1", "mac": "00" * 32}))
        report = s.broadcast([("w", torch.ones(4))], version=1)
        assert report.members == [] and "intruder-0" not in s.members and "intruder-1" not in s.members
        # nobody was waited for: no member planned, none dropped at a deadline
        assert report.dropped == [] and report.acked == [] and s.dropped_total == 0
        assert s.rejected_joins == 2
    finally:
        s.close()


def test_a_receiver_with_the_secret_is_taken_back() -> None:
    s = sender()
    try:
        rec = WeightReceiver(s.address, "engine-0/tp0", timeout_s=5.0, secret=s.secret)
        rec._ask_to_join()
        s._absorb_join_requests()
        assert s.members == ["engine-0/tp0"] and s.rejected_joins == 0
        stranger = WeightReceiver(s.address, "engine-9/tp0", timeout_s=5.0, secret="not the job's")
        stranger._ask_to_join()
        s._absorb_join_requests()
        assert s.members == ["engine-0/tp0"] and s.rejected_joins == 1
    finally:
        s.close()


def test_the_rendezvous_listens_on_loopback_only() -> None:
    s = sender()
    try:
        listening = [c.laddr.ip for c in psutil.Process(os.getpid()).net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == s.port]
        assert listening == ["127.0.0.1"], listening
    finally:
        s.close()
