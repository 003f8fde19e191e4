"""Verifier service on real Ray Serve, with the quick-start rule back-end, over real HTTP on 127.0.0.1.

Proves: the official `openai` client and a raw httpx POST of Guided-GRPO's exact request body
(the JSON its verifier client POSTs: model, messages, sampling fields) get well-formed OpenAI replies whose content is exactly the rule verifier's
answer to those messages, stamped with the version label; `/v1/models` and `/health` answer; with
an API key, requests without it get 401; malformed bodies get 400 with a message naming the field
and the service keeps serving; a repeated request id gets the same reply; the `http` back-end
passes requests through to an OpenAI-compatible endpoint; the VerifierClient works over both the
Serve handle and HTTP; a live swap under continuous load (handle and HTTP clients) loses no
request and needs no retry, requests issued after the swap see the new version; a swap to a
version that cannot start reports why and the old version keeps serving throughout; a request in
flight during a swap finishes on the old version; a swap may change the back-end.
Prints the swap time and the rule back-end's latency p50/p95 (end to end, through the client).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid

import httpx
import pytest

from asyncrl.config import VerifierClientConfig, VerifierConfig, VerifierHTTPConfig
from asyncrl.serve.client import VerifierClient, _percentile
from asyncrl.tasks import get_rule_verifier
from asyncrl.verifier_protocol import render_verifier_messages

pytestmark = pytest.mark.integration

KEY = "test-key-123"
MESSAGES = render_verifier_messages("Compute 2 + 3 * 4. Show steps.", "14", ["3 * 4 = 12"])
ORIGINAL_BODY = {"model": "ve", "messages": MESSAGES, "max_tokens": 256, "temperature": 0.2, "top_p": 0.95,
                 "top_k": -1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rule_cfg(port: int, version: str, **kw) -> VerifierConfig:
    return VerifierConfig(backend="rule", task="arith", version=version, port=port, api_key=KEY,
                          client=VerifierClientConfig(deadline_s=20.0, backoff_s=0.05), **kw)


@pytest.fixture(scope="module")
def service():
    import ray
    from ray import serve

    from asyncrl.serve.deploy import deploy_verifier

    ray.init(num_cpus=4, include_dashboard=False, namespace=f"test-serve-{uuid.uuid4().hex[:8]}",
             log_to_driver=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deploy_verifier(rule_cfg(port, "v1"))
        # The http back-end as a second app, passing through to the first one over HTTP.
        proxy = VerifierConfig(backend="http", version="proxy-v1", port=port, api_key=KEY,
                               http=VerifierHTTPConfig(base_url=url, api_key=KEY, timeout_s=10, max_retries=1))
        deploy_verifier(proxy, name="verifier-proxy", route_prefix="/proxy")
        yield {"port": port, "url": url, "headers": {"Authorization": f"Bearer {KEY}"}}
    finally:
        serve.shutdown()
        ray.shutdown()


def test_openai_client_gets_a_well_formed_reply(service):
    from openai import OpenAI

    client = OpenAI(base_url=service["url"], api_key=KEY, max_retries=0, timeout=30)
    resp = client.chat.completions.create(model="ve", messages=MESSAGES, max_tokens=256, temperature=0.2,
                                          top_p=0.95, extra_body={"top_k": -1})
    assert resp.choices[0].message.content == get_rule_verifier("arith")(MESSAGES)
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens > 0 and resp.usage.total_tokens > resp.usage.completion_tokens
    assert resp.system_fingerprint == "v1" and resp.model_extra["version"] == "v1"
    assert [m.id for m in client.models.list().data] == ["verifier"]


def test_raw_httpx_post_with_the_original_body(service):
    r = httpx.post(service["url"] + "/chat/completions", json=ORIGINAL_BODY, headers=service["headers"], timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers["x-verifier-version"] == "v1" and body["version"] == "v1"
    assert body["object"] == "chat.completion" and body["model"] == "ve"
    assert body["choices"][0]["message"]["content"] == "Correct. Next: 2 + 12. What is it?\n[SCORE] hallucination_detect=1"
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    health = httpx.get(f"http://127.0.0.1:{service['port']}/health", timeout=10)  # no key needed
    assert health.status_code == 200 and health.json() == {"status": "ok", "backend": "rule", "version": "v1"}


def test_api_key_required(service):
    url = service["url"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(url + "/chat/completions", json=ORIGINAL_BODY, headers=headers, timeout=10)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert r.headers["x-verifier-version"] == "v1"
    assert httpx.get(url + "/models", timeout=10).status_code == 401


@pytest.mark.parametrize("body, field", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    ({"model": "ve", "max_tokens": 10}, "messages"),
    ({**ORIGINAL_BODY, "messages": "hello"}, "messages"),
    ({**ORIGINAL_BODY, "messages": []}, "messages"),
    ({**ORIGINAL_BODY, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({**ORIGINAL_BODY, "max_tokens": 10**9}, "max_tokens"),
    ({**ORIGINAL_BODY, "max_tokens": "lots"}, "max_tokens"),
    ({**ORIGINAL_BODY, "temperature": -1}, "temperature"),
    ({**ORIGINAL_BODY, "top_p": 0}, "top_p"),
    ({**ORIGINAL_BODY, "stream": True}, "stream"),
    ({**ORIGINAL_BODY, "n": 4}, "n"),
    ({**ORIGINAL_BODY, "messages": [{"role": "user", "content": "hi"}]}, "cannot read"),  # not the verifier-request layout
])
def test_malformed_bodies_get_400_and_the_service_stays_up(service, body, field):
    url, headers = service["url"] + "/chat/completions", {**service["headers"], "Content-Type": "application/json"}
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(url, headers=headers, timeout=10, **kw)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    assert httpx.post(url, json=ORIGINAL_BODY, headers=headers, timeout=10).status_code == 200


def test_repeated_request_id_gets_the_same_reply(service):
    body = {**ORIGINAL_BODY, "request_id": "same-id"}
    a = httpx.post(service["url"] + "/chat/completions", json=body, headers=service["headers"], timeout=10).json()
    time.sleep(1.1)
    b = httpx.post(service["url"] + "/chat/completions", json=body, headers=service["headers"], timeout=10).json()
    assert a == b and a["id"] == "chatcmpl-same-id"


def test_http_backend_passes_through(service):
    r = httpx.post(f"http://127.0.0.1:{service['port']}/proxy/v1/chat/completions", json=ORIGINAL_BODY,
                   headers=service["headers"], timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == "proxy-v1"
    assert r.json()["choices"][0]["message"]["content"] == get_rule_verifier("arith")(MESSAGES)


def test_client_over_handle_and_http(service):

    cfg = rule_cfg(service["port"], "v1")

    async def run():
        out = []
        for client in (VerifierClient(cfg, app_name="verifier"), VerifierClient(cfg)):
            res = await client.chat(MESSAGES, max_tokens=64, temperature=0.2, top_p=0.95, top_k=-1)
            bad = await client.chat([{"role": "user"}], max_tokens=64, temperature=0.2, top_p=0.95)
            out.append((res, bad, client.metrics()))
            await client.aclose()
        return out

    for res, bad, metrics in asyncio.run(run()):
        assert res.ok and res.version == "v1" and res.text.startswith("Correct.") and res.tokens > 0
        assert not bad.ok and "content" in bad.error and bad.attempts == 1  # a 400 is not retried
        assert metrics["verifier/error_rate"] == 0.5 and metrics["verifier/version"] == "v1"


async def _load(clients: list[VerifierClient], stop: asyncio.Event, log: list) -> None:
    async def loop(client: VerifierClient, transport: str) -> None:
        while not stop.is_set():
            t = time.monotonic()
            res = await client.chat(MESSAGES, max_tokens=64, temperature=0.2, top_p=0.95)
            log.append((t, time.monotonic(), transport, res))

    await asyncio.gather(*[loop(c, t) for c in clients for t in [("handle" if c.handle else "http")] * 3])


def _run_swap_under_load(service, new_cfg, settle_s: float = 1.0):
    from ray import serve

    from asyncrl.serve.deploy import swap_verifier

    cfg = rule_cfg(service["port"], "v1")
    clients = [VerifierClient(cfg, handle=serve.get_app_handle("verifier")), VerifierClient(cfg)]
    log: list = []

    async def run():
        stop = asyncio.Event()
        load = asyncio.create_task(_load(clients, stop, log))
        await asyncio.sleep(settle_s)
        t0 = time.monotonic()
        report = await asyncio.to_thread(swap_verifier, new_cfg)
        t1 = time.monotonic()
        await asyncio.sleep(settle_s)
        stop.set()
        await asyncio.wait_for(load, 30)
        for c in clients:
            await c.aclose()
        return report, t0, t1

    report, t0, t1 = asyncio.run(run())
    return report, t0, t1, log, clients


def test_live_swap_under_load(service):
    report, t0, t1, log, clients = _run_swap_under_load(service, rule_cfg(service["port"], "v2"))
    assert report.ok and report.old_version == "v1" and report.serving_version == "v2", report
    assert report.get("ok") and report["new_version"] == "v2" and json.loads(json.dumps(report.to_dict()))["ok"]
    failures = [r.error for *_, r in log if not r.ok]
    assert not failures, failures[:3]
    assert sum(c.metrics()["verifier/retries"] for c in clients) == 0
    before = {r.version for s, _, _, r in log if s < t0}
    after = {r.version for s, _, _, r in log if s > t1 + 0.5}
    assert before == {"v1"} and after == {"v2"}, (before, after)
    for transport in ("handle", "http"):
        assert {r.version for *_, tr, r in log if tr == transport} == {"v1", "v2"}
    parts = []
    for transport in ("handle", "http"):
        lat = sorted(r.latency_ms for *_, tr, r in log if tr == transport)
        parts.append(f"{transport} p50 {_percentile(lat, 0.5):.1f} ms p95 {_percentile(lat, 0.95):.1f} ms")
    print(f"\n[serve-bench] rule swap {report.seconds:.2f}s under load; {len(log)} requests from 6 concurrent "
          f"loops, end-to-end latency: " + ", ".join(parts))


def test_failed_swap_keeps_the_old_version_serving(service):
    bad = rule_cfg(service["port"], "v3-bad").model_copy(update={"task": "no-such-task"})
    report, t0, t1, log, _ = _run_swap_under_load(service, bad, settle_s=0.5)
    assert not report.ok and report.rolled_back and report.serving_version == "v2", report
    assert "no rule verifier for task 'no-such-task'" in report.error
    assert all(r.ok for *_, r in log) and {r.version for *_, r in log} == {"v2"}
    print(f"\n[serve-bench] failed swap reported + rolled back in {report.seconds:.2f}s; "
          f"{len(log)} requests served by v2 meanwhile")


def test_request_in_flight_finishes_on_the_old_version(service):
    """A 1.5 s request started just before a swap is answered by the old version, not failed."""
    from ray import serve

    from asyncrl.serve.deploy import swap_verifier

    def slow_rule(messages: list[dict]) -> str:  # a nested function: cloudpickled by value to the replica
        import time as _time

        if "SLOW" in messages[-1]["content"]:
            _time.sleep(1.5)
        return "ok " + messages[-1]["content"]

    port = service["port"]
    assert swap_verifier(rule_cfg(port, "v4-slow"), rule_fn=slow_rule).ok
    client = VerifierClient(rule_cfg(port, "v4-slow"), handle=serve.get_app_handle("verifier"))

    async def run():
        slow = asyncio.create_task(client.chat([{"role": "user", "content": "SLOW"}], max_tokens=8,
                                               temperature=0.0, top_p=1.0))
        await asyncio.sleep(0.3)  # the request is now running on a v4-slow replica
        report = await asyncio.to_thread(swap_verifier, rule_cfg(port, "v5"), rule_fn=slow_rule)
        after = await client.chat([{"role": "user", "content": "fast"}], max_tokens=8, temperature=0.0, top_p=1.0)
        return await slow, report, after

    slow, report, after = asyncio.run(run())
    assert report.ok and report.serving_version == "v5"
    assert slow.ok and slow.version == "v4-slow" and slow.text == "ok SLOW" and slow.attempts == 1
    assert after.ok and after.version == "v5"


def test_swap_to_another_backend(service):
    """The proxy app swaps from the http back-end to the rule back-end: one deployment, new class."""
    from asyncrl.serve.deploy import swap_verifier

    report = swap_verifier(rule_cfg(service["port"], "proxy-rule"), name="verifier-proxy", route_prefix="/proxy")
    assert report.ok and report.old_version == "proxy-v1" and report.serving_version == "proxy-rule", report
    r = httpx.post(f"http://127.0.0.1:{service['port']}/proxy/v1/chat/completions", json=ORIGINAL_BODY,
                   headers=service["headers"], timeout=30)
    assert r.status_code == 200 and r.json()["version"] == "proxy-rule"
    assert httpx.get(f"http://127.0.0.1:{service['port']}/proxy/health", timeout=10).json()["backend"] == "rule"
