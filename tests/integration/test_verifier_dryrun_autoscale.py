"""Verifier operations on real Ray Serve (rule back-end): `swap-verifier --dry-run` replays the
running version's stored requests through a candidate deployed beside it and reports agreement
(identical candidate: full agreement; a candidate that always stops: the differences, named),
while the running version keeps serving and the candidate is removed afterwards; the request ring
is bounded; Serve autoscaling from the request backlog adds a replica live."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from asyncrl.config import AutoscalingConfig, VerifierClientConfig, VerifierConfig
from asyncrl.verifier_protocol import render_verifier_messages

pytestmark = pytest.mark.integration


def cfg(version: str, **kw) -> VerifierConfig:
    return VerifierConfig(backend="rule", task="arith", version=version, port=0,
                          client=VerifierClientConfig(deadline_s=30.0, backoff_s=0.05), **kw)


def requests(n: int) -> list[dict]:
    out = []
    for i in range(n):
        turns = [f"{i} + 1 = {i + 1}\n<answer>\\boxed{{{i + 1}}}</answer>"] if i % 2 else [f"{i} + 1 = {i + 7}"]
        out.append({"model": "ve", "messages": render_verifier_messages(f"Compute {i} + 1.", str(i + 1), turns),
                    "max_tokens": 64, "request_id": f"r{i}"})
    return out


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, namespace=f"test-ops-{uuid.uuid4().hex[:8]}", log_to_driver=False)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def test_dry_run_reports_agreement_and_leaves_the_running_version(cluster) -> None:
    from ray import serve

    from asyncrl.serve.app import APP_NAME
    from asyncrl.serve.deploy import deploy_verifier
    from asyncrl.serve.dryrun import CANDIDATE_APP, dry_run

    handle = deploy_verifier(cfg("v1", request_ring=8))
    for req in requests(12):
        assert "error" not in handle.chat.remote(req).result()
    same = dry_run(cfg("v2"), last=20)
    assert same["ok"] and same["requests"] == 8  # the ring kept the newest 8 of 12
    assert same["stop_agreement"] == 1.0 and same["score_agreement"] == 1.0 and not same["differences"]
    always_stop = dry_run(cfg("v3-stop"), last=8, rule_fn=lambda messages: "###STOP###")
    # the odd requests carry a final answer (the rule stops), the even ones a wrong step (guidance)
    assert always_stop["stop_agreement"] == 0.5
    assert always_stop["guidance_chars_candidate"] == 0 < always_stop["guidance_chars_running"]
    assert always_stop["differences"] and always_stop["differences"][0]["candidate"] == "###STOP###"
    assert CANDIDATE_APP not in serve.status().applications
    assert handle.chat.remote(requests(1)[0]).result()["version"] == "v1"
    serve.delete(APP_NAME)


def test_autoscaling_from_the_backlog_adds_a_replica_live(cluster) -> None:
    from ray import serve

    from asyncrl.serve.app import APP_NAME, DEPLOYMENT_NAME
    from asyncrl.serve.deploy import deploy_verifier

    def slow_rule(messages):
        time.sleep(0.5)
        return "###STOP###"

    auto = AutoscalingConfig(min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=1,
                             downscale_delay_s=600)
    handle = deploy_verifier(cfg("auto", autoscaling=auto), rule_fn=slow_rule)

    def running() -> int:
        states = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME].replica_states
        return int(states.get("RUNNING", 0))

    assert running() == 1
    stop = threading.Event()

    def load() -> None:  # a rollout backlog: 8 verifier requests in flight at all times
        while not stop.is_set():
            refs = [handle.chat.remote(r) for r in requests(8)]
            for ref in refs:
                ref.result()

    workers = [threading.Thread(target=load) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        deadline = time.time() + 180
        while running() < 2 and time.time() < deadline:
            time.sleep(1)
        assert running() == 2, serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    serve.delete(APP_NAME)
