"""The `vllm` verifier back-end on real Ray Serve with vLLM's CPU build and a tiny local model.

Proves: a replica loads the real weights of a locally built 2-layer Qwen2 (ChatML tokenizer) and
answers the official `openai` client and a raw POST of Guided-GRPO's request body (model, messages and
sampling fields, with the real default verifier prompt) in the OpenAI shape; sampling comes from the request (temperature 0
is deterministic; one seed reproduces, across request ids); `max_tokens` is honoured and gives
finish_reason `length`; a prompt that cannot fit `max_model_len` gets 400 and the engine keeps
serving; a live swap to a second vLLM version under continuous load loses no request and later
requests see the new version. Prints the swap time and latency p50/p95 of the tiny-vLLM back-end.
Slow (two engine starts, ~1-3 minutes on 2 cores).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid
from pathlib import Path

import httpx
import pytest
from conftest import wordlevel_chatml_tokenizer

from asyncrl.config import VerifierClientConfig, VerifierConfig
from asyncrl.serve.client import VerifierClient, _percentile
from asyncrl.verifier_protocol import render_verifier_messages

pytestmark = [pytest.mark.integration, pytest.mark.slow]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MESSAGES = render_verifier_messages("Compute 2 + 3 * 4. Show steps.", "14", ["3 * 4 = 12"])
ORIGINAL_BODY = {"model": "ve", "messages": MESSAGES, "max_tokens": 16, "temperature": 0.2, "top_p": 0.95,
                 "top_k": -1}
MAX_MODEL_LEN = 1024


def build_tiny_verifier(path: Path) -> Path:
    """A 2-layer Qwen2 (hidden 128, head_dim 64 - the CPU attention kernels reject 16 -, untied head,
    fp32) with a WordLevel ChatML tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    words = ["user", "assistant", "system", "Correct.", "Error:", "###STOP###", "[SCORE]", "Next:", "What", "is",
             "it?", "+", "-", "*", "=", "<think>", "</think>"] + [str(i) for i in range(60)]
    fast = wordlevel_chatml_tokenizer(words)
    vocab = fast.get_vocab()
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=MAX_MODEL_LEN,
                      tie_word_embeddings=False, eos_token_id=vocab["<|im_end|>"], pad_token_id=0,
                      bos_token_id=None, torch_dtype="float32")
    Qwen2ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    json.dump({"eos_token_id": vocab["<|im_end|>"]}, open(path / "generation_config.json", "w"))
    return path


def vllm_cfg(port: int, model: Path, version: str) -> VerifierConfig:
    return VerifierConfig(backend="vllm", version=version, model_path=str(model), dtype="float32",
                          max_model_len=MAX_MODEL_LEN, port=port, cpus_per_replica=0.25,
                          client=VerifierClientConfig(deadline_s=120.0, backoff_s=0.1))


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    import ray
    from ray import serve

    from asyncrl.serve.deploy import deploy_verifier

    model = build_tiny_verifier(tmp_path_factory.mktemp("tiny-verifier"))
    ray.init(num_cpus=4, include_dashboard=False, namespace=f"test-serve-vllm-{uuid.uuid4().hex[:8]}",
             log_to_driver=False)
    port = free_port()
    try:
        t0 = time.monotonic()
        deploy_verifier(vllm_cfg(port, model, "tiny-v1"))
        print(f"\n[serve-bench] vllm deploy {time.monotonic() - t0:.1f}s")
        yield {"port": port, "url": f"http://127.0.0.1:{port}/v1", "model": model}
    finally:
        serve.shutdown()
        ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(service, body: dict) -> httpx.Response:
    return httpx.post(service["url"] + "/chat/completions", json=body, timeout=120)


def test_openai_client_and_original_body(service):
    from openai import OpenAI

    client = OpenAI(base_url=service["url"], api_key="unused", max_retries=0, timeout=120)
    resp = client.chat.completions.create(model="ve", messages=MESSAGES, max_tokens=12, temperature=0.2,
                                          top_p=0.95, extra_body={"top_k": -1})
    choice = resp.choices[0]
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    assert 1 <= resp.usage.completion_tokens <= 12
    # the chat template of the verifier's own tokenizer was applied to the messages
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(service["model"])
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert resp.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])
    assert resp.system_fingerprint == "tiny-v1"
    r = post(service, ORIGINAL_BODY)
    assert r.status_code == 200 and r.json()["version"] == "tiny-v1", r.text
    assert r.json()["usage"]["prompt_tokens"] == resp.usage.prompt_tokens


def test_sampling_comes_from_the_request(service):
    greedy = [post(service, {**ORIGINAL_BODY, "temperature": 0.0, "max_tokens": 8}).json() for _ in range(2)]
    assert greedy[0]["choices"][0]["message"]["content"] == greedy[1]["choices"][0]["message"]["content"]
    seeded = [post(service, {**ORIGINAL_BODY, "temperature": 1.0, "seed": 7, "max_tokens": 12, "request_id": f"s{i}"})
              .json()["choices"][0]["message"]["content"] for i in range(2)]
    assert seeded[0] == seeded[1]
    longer = post(service, {**ORIGINAL_BODY, "temperature": 1.0, "max_tokens": 3, "seed": 1}).json()
    assert longer["usage"]["completion_tokens"] <= 3
    if longer["usage"]["completion_tokens"] == 3:
        assert longer["choices"][0]["finish_reason"] == "length"


def test_prompt_too_long_is_400_and_engine_survives(service):
    r = post(service, {**ORIGINAL_BODY, "max_tokens": MAX_MODEL_LEN})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    assert post(service, ORIGINAL_BODY).status_code == 200


def test_live_swap_under_load(service):
    from ray import serve

    from asyncrl.serve.deploy import swap_verifier

    cfg = vllm_cfg(service["port"], service["model"], "tiny-v1")
    clients = [VerifierClient(cfg, handle=serve.get_app_handle("verifier")), VerifierClient(cfg)]
    log: list = []

    async def loop(client: VerifierClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t = time.monotonic()
            res = await client.chat(MESSAGES, max_tokens=8, temperature=0.2, top_p=0.95)
            log.append((t, res))

    async def run():
        stop = asyncio.Event()
        load = asyncio.gather(*[loop(c, stop) for c in clients for _ in range(2)])
        await asyncio.sleep(2.0)
        t0 = time.monotonic()
        report = await asyncio.to_thread(swap_verifier, vllm_cfg(service["port"], service["model"], "tiny-v2"))
        t1 = time.monotonic()
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.wait_for(load, 120)
        return report, t0, t1

    report, t0, t1 = asyncio.run(run())
    assert report.ok and report.serving_version == "tiny-v2", report
    assert all(r.ok for _, r in log), [r.error for _, r in log if not r.ok][:3]
    assert {r.version for s, r in log if s < t0} == {"tiny-v1"}
    assert {r.version for s, r in log if s > t1 + 0.5} == {"tiny-v2"}
    lat = sorted(r.latency_ms for _, r in log)
    steady = sorted(r.latency_ms for s, r in log if s < t0 or s > t1 + 0.5)
    print(f"\n[serve-bench] vllm swap {report.seconds:.1f}s; {len(log)} requests (max_tokens 8, 4 concurrent), "
          f"latency all p50 {_percentile(lat, 0.5):.0f} ms p95 {_percentile(lat, 0.95):.0f} ms; "
          f"outside the swap p50 {_percentile(steady, 0.5):.0f} ms p95 {_percentile(steady, 0.95):.0f} ms; "
          f"retries {sum(c.metrics()['verifier/retries'] for c in clients)}")
