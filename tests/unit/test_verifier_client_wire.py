"""Verifier wire format and deployment options, pure functions (no Ray, no sockets).

Proves: Guided-GRPO's exact request body (model, messages, sampling fields) parses, with `top_k` optional and unknown keys
ignored; malformed bodies raise RequestError(400) naming the field; replies have OpenAI's shape
plus the version label; Serve options follow VerifierConfig (replicas or autoscaling, CPUs/GPUs,
surge-first rollout, drain time = client deadline, CPU env for vLLM); the upstream parser of the
http back-end reads a reply as Guided-GRPO's client does (the first choice's message content, else its
text, else the choice itself); replies the client cannot use are classified
retryable or final as documented.
"""

from __future__ import annotations

import pytest

from asyncrl.config import AutoscalingConfig, VerifierClientConfig, VerifierConfig
from asyncrl.serve.app import deployment_options
from asyncrl.serve.backends import _parse_upstream
from asyncrl.serve.client import _check_reply, _Final, _Retryable
from asyncrl.serve.replica import resolve_secret
from asyncrl.serve.schema import Generation, RequestError, completion_body, parse_request

BODY = {"model": "ve", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        "max_tokens": 256, "temperature": 0.2, "top_p": 0.95, "top_k": -1}


def test_original_body_parses():
    req = parse_request(BODY)
    assert req.plain_messages() == BODY["messages"] and req.top_k == -1 and req.seed is None
    no_top_k = parse_request({k: v for k, v in BODY.items() if k != "top_k"} | {"unknown_field": 1})
    assert no_top_k.top_k is None
    parts = parse_request({**BODY, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                             {"type": "text", "text": "b"}]}]})
    assert parts.plain_messages() == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("patch, field", [
    ({"messages": None}, "messages"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 10**7}, "max_tokens"),
    ({"temperature": 3}, "temperature"), ({"top_k": -5}, "top_k"), ({"stop": 5}, "stop"),
])
def test_malformed_bodies_name_the_field(patch, field):
    with pytest.raises(RequestError) as exc:
        parse_request({**BODY, **patch})
    assert exc.value.status == 400 and field in str(exc.value)


def test_completion_body_shape():
    body = completion_body(Generation("hi", "length", 5, 2), request_id="r1", model="ve", version="v9", latency_ms=1.0)
    assert body["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "hi"},
                                  "finish_reason": "length", "logprobs": None}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert body["version"] == body["system_fingerprint"] == "v9" and body["id"] == "chatcmpl-r1"


def test_deployment_options_follow_the_config():
    fixed = deployment_options(VerifierConfig(num_replicas=3, cpus_per_replica=0.5,
                                              client=VerifierClientConfig(deadline_s=45)))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0}
    assert fixed["max_surge_percent"] == 100 and fixed["graceful_shutdown_timeout_s"] == 45
    assert fixed["name"] == "Verifier"
    auto = deployment_options(VerifierConfig(backend="vllm", model_path="/m", gpus_per_replica=1,
                                             autoscaling=AutoscalingConfig(min_replicas=1, max_replicas=3)))
    assert "num_replicas" not in auto and auto["autoscaling_config"]["max_replicas"] == 3
    assert auto["ray_actor_options"]["num_gpus"] == 1 and "runtime_env" not in auto["ray_actor_options"]
    cpu_vllm = deployment_options(VerifierConfig(backend="vllm", model_path="/m"))
    assert set(cpu_vllm["ray_actor_options"]["runtime_env"]["env_vars"]) == {"VLLM_CPU_KVCACHE_SPACE",
                                                                             "OMP_NUM_THREADS"}


def test_resolve_secret(monkeypatch):
    monkeypatch.setenv("ASYNCRL_TEST_KEY", "s3cret")
    assert resolve_secret("env:ASYNCRL_TEST_KEY") == "s3cret" and resolve_secret("plain") == "plain"
    monkeypatch.delenv("ASYNCRL_TEST_KEY")
    with pytest.raises(RuntimeError, match="ASYNCRL_TEST_KEY"):
        resolve_secret("env:ASYNCRL_TEST_KEY")


def test_upstream_parsing_follows_guided_grpo():
    assert _parse_upstream({"choices": [{"message": {"content": "a"}, "finish_reason": "length"}]}).text == "a"
    assert _parse_upstream({"choices": [{"message": {"content": ""}, "text": "b"}]}).text == "b"
    assert _parse_upstream({"choices": ["raw"]}).text == "raw"
    with pytest.raises(IndexError):
        _parse_upstream({"choices": []})


def test_client_reply_classification():
    good = {"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}]}
    assert _check_reply(good, 200) is good
    for reply, status in (({"error": {"message": "busy", "code": 503}}, 200), (None, 502), ({"choices": []}, 200),
                          ({"choices": [{"message": {"content": 5}}]}, 200)):
        with pytest.raises(_Retryable):
            _check_reply(reply, status)
    for reply, status in (({"error": {"message": "bad", "code": 400}}, 200), (None, 401), ({"error": "x"}, 404)):
        with pytest.raises(_Final):
            _check_reply(reply, status)
