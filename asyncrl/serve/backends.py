"""The three verifier back-ends, each a `VerifierReplica` (replica.py) run by the `Verifier`
deployment (app.py).

- `RuleVerifier`: a built-in task's rule verifier (`asyncrl.tasks.get_rule_verifier(cfg.task)`),
  pure and deterministic; sampling fields are accepted and ignored; token counts are words.
  Messages the rule cannot read (it raises ValueError) are a 400, not a server error.
- `VLLMVerifier`: a verifier model in a vLLM `AsyncLLM` engine inside the replica, with its real
  weights loaded from `verifier.model_path` (Guided-GRPO's local verifier ran on random weights:
  docs/guided_grpo.md#bug-local-verifier) on the replica's own resources, not the policy's GPUs
  (#bug-local-verifier-gpus). The chat template of the verifier's tokenizer is applied; the reply
  is the raw generated text, `<think>` blocks included: the guided protocol's parser strips them
  (#bug-stop-detection), so nothing is lost here. Sampling comes from the request;
  `prompt + max_tokens > max_model_len` is a 400.
- `HTTPVerifier`: pass-through to an external OpenAI-compatible endpoint (`verifier.http.*`) with
  a per-request socket timeout, bounded concurrency and retries with backoff on transport errors,
  429 and 5xx. `top_k` is forwarded only when the caller set it (real OpenAI endpoints reject it).
  Upstream 4xx are passed on as they are; other upstream failures become 502.
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from collections.abc import Callable
from typing import Any

from asyncrl.serve.replica import VerifierReplica, logger, resolve_secret
from asyncrl.serve.schema import ChatRequest, Generation, RequestError


class RuleVerifier(VerifierReplica):
    backend = "rule"

    def __init__(self, cfg: dict[str, Any], rule_fn: Callable[[list[dict]], str] | None = None):
        from asyncrl.startup import starting

        super().__init__(cfg)
        if rule_fn is None:
            from asyncrl.tasks import get_rule_verifier

            with starting(f"verifier replica ({self.backend}, {self.version})"):
                rule_fn = get_rule_verifier(self.cfg.task)
        self._rule = rule_fn

    async def _generate(self, req: ChatRequest) -> Generation:
        messages = req.plain_messages()
        try:
            # In a worker thread: a slow rule must not stall the replica's other requests.
            text = str(await asyncio.to_thread(self._rule, messages))
        except ValueError as exc:  # the rule cannot read these messages: the request is at fault
            raise RequestError(f"rule verifier {self.cfg.task!r} cannot read this request: {exc}") from None
        prompt_words = sum(len(m["content"].split()) for m in messages)
        return Generation(text, "stop", prompt_words, len(text.split()))



def verifier_engine_args(c: Any, tokenizer_path: str, on_gpu: bool) -> Any:
    """vLLM engine arguments of a verifier replica: tensor parallel over all of the replica's
    `gpus_per_replica` GPUs (Serve gives the replica that many), CUDA graphs on GPU."""
    from vllm import AsyncEngineArgs

    return AsyncEngineArgs(model=c.model_path, tokenizer=tokenizer_path, dtype=c.engine_dtype,
                           max_model_len=c.max_model_len, enforce_eager=not on_gpu, seed=0,
                           tensor_parallel_size=max(1, int(c.gpus_per_replica)) if on_gpu else 1)

def forks_engine_core(on_gpu: bool, small_machine: bool | None) -> bool:
    """Whether a verifier replica forks its vLLM engine core instead of spawning it: on CPU, behind
    `cluster.small_machine` as the rollout actors' engines are (`actors.engine.EngineSpec`); None
    (a verifier deployed without a job config: `python -m asyncrl.serve`, rescore) = the switch's
    derived value there, on without a GPU."""
    return not on_gpu and small_machine is not False


class VLLMVerifier(VerifierReplica):
    backend = "vllm"

    def __init__(self, cfg: dict[str, Any], small_machine: bool | None = None):
        from asyncrl.startup import starting

        super().__init__(cfg)
        self.small_machine = small_machine
        with starting(f"verifier replica ({self.backend}, {self.version})"):
            self._build_engine()

    def _build_engine(self) -> None:
        import torch
        from transformers import AutoTokenizer
        from vllm.v1.engine.async_llm import AsyncLLM

        c = self.cfg
        if not c.model_path or not os.path.isdir(c.model_path):
            raise RuntimeError(f"verifier.model_path {c.model_path!r} is not a directory")
        on_gpu = torch.cuda.is_available() and c.gpus_per_replica > 0
        tok_path = c.tokenizer_path or c.model_path
        self.tokenizer = AutoTokenizer.from_pretrained(tok_path)
        if not getattr(self.tokenizer, "chat_template", None):
            raise RuntimeError(f"tokenizer at {tok_path} has no chat template")
        args = verifier_engine_args(c, tok_path, on_gpu)
        from asyncrl.engine_setup import apply_engine_env, engine_core_forked, engine_env

        apply_engine_env(engine_env(c.gpus_per_replica if on_gpu else 0, None))  # in-process on CPU
        vllm_config = args.create_engine_config()
        # CPU on a small machine: the engine core forked from the replica, not spawned
        with engine_core_forked(forks_engine_core(on_gpu, self.small_machine)):
            self.engine = AsyncLLM.from_vllm_config(vllm_config)

    def __del__(self) -> None:
        """Serve calls this on graceful replica shutdown (after a swap): free the engine now, so
        its memory (GPU memory on a cluster) is back before the next version needs it."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as exc:  # the process is going away anyway; say so and move on
                logger.warning("vLLM engine shutdown of verifier %s failed: %s", self.version, exc)

    def check_health(self) -> None:
        """Serve's health check: a dead engine marks the replica unhealthy (Serve replaces it)."""
        if self.engine.errored:
            raise RuntimeError(f"vLLM engine of verifier {self.version} is dead")

    async def _generate(self, req: ChatRequest) -> Generation:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        text = self.tokenizer.apply_chat_template(req.plain_messages(), tokenize=False, add_generation_prompt=True,
                                                  **(req.chat_template_kwargs or {}))
        prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(prompt_ids) + req.max_tokens > self.cfg.max_model_len:
            raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                               f"verifier's max_model_len ({self.cfg.max_model_len})")
        params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                top_k=max(req.top_k or 0, 0), seed=req.seed, stop=req.stop_list() or None)
        final = None
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                              f"{req.request_id or 'req'}-{uuid.uuid4().hex[:8]}"):
            final = out
        if final is None or not final.outputs:
            raise RuntimeError("vLLM returned no output")
        o = final.outputs[0]
        return Generation(o.text, o.finish_reason or "stop", len(prompt_ids), len(o.token_ids))


_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class HTTPVerifier(VerifierReplica):
    backend = "http"

    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg)
        h = self.cfg.http
        if not h.base_url:
            raise RuntimeError("verifier.backend=http requires verifier.http.base_url")
        self._url = h.base_url.rstrip("/") + "/chat/completions"
        self._headers = {"Content-Type": "application/json"}
        if h.api_key:
            self._headers["Authorization"] = f"Bearer {resolve_secret(h.api_key)}"
        self._client: Any = None
        self._sem: asyncio.Semaphore | None = None

    def _body(self, req: ChatRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.cfg.http.model, "messages": req.plain_messages(),
                                "max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p}
        for key in ("top_k", "seed", "stop", "chat_template_kwargs"):
            if getattr(req, key) is not None:
                body[key] = getattr(req, key)
        return body

    async def _generate(self, req: ChatRequest) -> Generation:
        import httpx

        h = self.cfg.http
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=h.timeout_s)
            self._sem = asyncio.Semaphore(h.concurrency)
        assert self._sem is not None
        last = ""
        for attempt in range(h.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(5.0, 0.25 * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0))
            try:
                async with self._sem:
                    resp = await self._client.post(self._url, json=self._body(req), headers=self._headers)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code in _RETRY_STATUS:
                last = f"upstream HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            if resp.status_code >= 400:
                raise RequestError(f"upstream HTTP {resp.status_code}: {resp.text[:500]}", resp.status_code,
                                   "upstream_error")
            try:
                return _parse_upstream(resp.json())
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                last = f"upstream reply is not a chat completion: {exc}"
                continue
        raise RequestError(f"upstream {self._url} failed after {h.max_retries + 1} attempts: {last}", 502,
                           "upstream_error")


def _parse_upstream(body: Any) -> Generation:
    """Guided-GRPO's reply parsing: `choices[0].message.content`, else `choices[0].text`."""
    choice = body["choices"][0]
    if not isinstance(choice, dict):
        return Generation(str(choice), "stop", 0, 0)
    content = (choice.get("message") or {}).get("content") or choice.get("text") or ""
    usage = body.get("usage") or {}
    return Generation(str(content), choice.get("finish_reason") or "stop", int(usage.get("prompt_tokens") or 0),
                      int(usage.get("completion_tokens") or 0))


BACKENDS: dict[str, type[VerifierReplica]] = {"rule": RuleVerifier, "vllm": VLLMVerifier, "http": HTTPVerifier}
