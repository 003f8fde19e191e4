"""The verifier service without an HTTP ingress (`verifier.ingress=false`), on real Ray Serve.

Proves: Serve then starts no proxy actor, the application still answers through its handle and
`verifier_url` reports no URL; a client built by application name before the application runs
(as a rollout actor builds it while Serve deploys) finds nothing to warm up (`prepare`), looks the
handle up at its first request and gets the rule verifier's answer; one prepared once the
application runs holds the handle before its first request; a client of an application that never runs gets a failed result
naming it within its deadline instead of an exception.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from asyncrl.config import VerifierClientConfig, VerifierConfig
from asyncrl.serve.client import VerifierClient
from asyncrl.tasks import get_rule_verifier
from asyncrl.verifier_protocol import render_verifier_messages

pytestmark = pytest.mark.integration

MESSAGES = render_verifier_messages("Compute 2 + 3 * 4. Show steps.", "14", ["3 * 4 = 12"])


def _chat(client: VerifierClient):
    return asyncio.run(client.chat(MESSAGES, max_tokens=64, temperature=0.0, top_p=1.0))


def test_handles_only_service_and_a_client_built_before_the_app() -> None:
    import ray
    from ray import serve

    from asyncrl.serve.deploy import deploy_verifier, verifier_url

    cfg = VerifierConfig(backend="rule", task="arith", version="h1", port=0, ingress=False,
                         client=VerifierClientConfig(deadline_s=3.0, backoff_s=0.05))
    ray.init(num_cpus=4, include_dashboard=False, namespace=f"test-serve-h-{uuid.uuid4().hex[:8]}",
             log_to_driver=False)
    try:
        early = VerifierClient(cfg, app_name="verifier")  # no Serve yet: nothing is looked up here
        assert early.prepare(timeout_s=5.0) is False and early.handle is None  # the warm-up: nothing to find yet
        missing = _chat(VerifierClient(cfg, app_name="no-such-app"))
        assert not missing.ok and "no-such-app" in missing.error and missing.attempts > 1  # retried to the deadline
        deploy_verifier(cfg)
        result = _chat(early)
        assert result.ok and result.version == "h1" and result.text == get_rule_verifier("arith")(MESSAGES)
        warm = VerifierClient(cfg, app_name="verifier")  # a rollout actor's warm-up while its engine builds
        assert warm.prepare(timeout_s=30.0) is True and warm.handle is not None
        assert _chat(warm).text == result.text
        assert VerifierClient(cfg, base_url="http://127.0.0.1:9/v1").prepare() is False  # HTTP: nothing to warm
        assert verifier_url() is None
        assert serve.status().proxies == {}
        actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if "PROXY" in a["name"].upper()]
        assert actors == []
    finally:
        serve.shutdown()
        ray.shutdown()
