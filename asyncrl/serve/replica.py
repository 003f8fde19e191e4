"""One verifier replica, whatever its back-end: the handle method, idempotent retries, the HTTP ingress.

Every replica answers two ways, with the same reply:
- the handle method `chat(request: dict) -> dict` for callers inside the cluster (rollout actors);
- HTTP through a FastAPI ingress: `POST /v1/chat/completions` (Guided-GRPO's request body,
  docs/guided_grpo.md#http-verifier, and OpenAI's reply shape, so the official `openai` client
  works unchanged), `GET /v1/models`, and `GET /health` (no key needed). With `verifier.api_key`
  set, `/v1/*` needs `Authorization: Bearer <key>` (else 401).

Guarantees:
- Every reply, error or not, carries the replica's version label (`version` field and the
  `X-Verifier-Version` header); the label is stamped on every sample the reply guided.
- Malformed bodies get 400 with a message naming the bad fields; the replica keeps serving.
- A repeated `request_id` gets the reply already given (or joins the one in flight) on that
  replica, so client retries are idempotent.

Back-ends (backends.py) subclass `VerifierReplica` and implement `_generate`; the deployment that
runs them is app.py's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections import OrderedDict, deque
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from asyncrl.config import VerifierConfig
from asyncrl.serve.schema import (
    MAX_BODY_BYTES,
    ChatRequest,
    Generation,
    RequestError,
    completion_body,
    error_body,
    parse_request,
)

__all__ = ["SERVED_MODEL", "VerifierReplica", "build_http_app", "logger", "resolve_secret"]

logger = logging.getLogger("asyncrl.serve")

SERVED_MODEL = "verifier"
"""Model id listed by /v1/models; requests may name any model (Guided-GRPO sends `ve` or `verifier`)."""
_IDEMPOTENCY_CACHE = 4096


def resolve_secret(value: str) -> str:
    """`env:NAME` -> the environment variable NAME (which must exist); anything else verbatim."""
    if value.startswith("env:"):
        name = value[4:]
        if name not in os.environ:
            raise RuntimeError(f"secret refers to environment variable {name}, which is not set")
        return os.environ[name]
    return value


class VerifierReplica:
    """Back-end independent part of a replica; subclasses implement `_generate`."""

    backend = "base"

    def __init__(self, cfg: dict[str, Any]):
        from asyncrl.logs import redirect_output

        redirect_output("verifier")  # a job's replicas write to <run_dir>/logs/ (no-op elsewhere)
        self.cfg = VerifierConfig.model_validate(cfg)
        self.version = self.cfg.version
        self._api_key = resolve_secret(self.cfg.api_key) if self.cfg.api_key else ""
        self._done: OrderedDict[str, dict] = OrderedDict()
        self._inflight: dict[str, asyncio.Future] = {}
        # The last answered requests with their replies (`asyncrl.ctl swap-verifier --dry-run`
        # replays them through a candidate version); bounded, so memory stays flat.
        self._ring: deque[tuple[dict[str, Any], str]] = deque(maxlen=self.cfg.request_ring)
        self.num_requests = 0
        self.num_errors = 0

    async def _generate(self, req: ChatRequest) -> Generation:  # pragma: no cover - abstract
        raise NotImplementedError

    # ------------------------------------------------------------------ handle methods
    async def chat(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answer one chat request (a decoded chat-completions body). Never raises: errors come back as
        `{"error": {"message", "type", "code"}, "version"}` with `code` the HTTP status."""
        self.num_requests += 1
        try:
            req = parse_request(request)
        except RequestError as exc:
            self.num_errors += 1
            return error_body(str(exc), exc.status, exc.kind, self.version)
        rid = req.request_id or uuid.uuid4().hex
        if rid in self._done:
            return self._done[rid]
        if rid in self._inflight:
            return await asyncio.shield(self._inflight[rid])
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._inflight[rid] = fut
        try:
            body = await self._answer(req, rid)
        except BaseException:  # only cancellation gets here (_answer catches Exception)
            fut.set_result(error_body(f"request {rid} was cancelled", 503, "unavailable", self.version))
            self._inflight.pop(rid, None)
            raise
        fut.set_result(body)
        self._inflight.pop(rid, None)
        if "error" not in body:
            if self._ring.maxlen:
                self._ring.append((request, body["choices"][0]["message"]["content"]))
            self._done[rid] = body
            while len(self._done) > _IDEMPOTENCY_CACHE:
                self._done.popitem(last=False)
        return body

    async def _answer(self, req: ChatRequest, rid: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            gen = await self._generate(req)
        except RequestError as exc:
            self.num_errors += 1
            return error_body(str(exc), exc.status, exc.kind, self.version)
        except Exception as exc:  # a back-end failure is the caller's to retry; log and count it
            self.num_errors += 1
            logger.exception("verifier %s (%s) failed on request %s", self.version, self.backend, rid)
            return error_body(f"{type(exc).__name__}: {exc}", 500, "server_error", self.version)
        latency_ms = (time.perf_counter() - t0) * 1000.0
        return completion_body(gen, request_id=rid, model=req.model, version=self.version, latency_ms=latency_ms)

    def recent_requests(self, n: int = 0) -> list[tuple[dict[str, Any], str]]:
        """The last `n` (0: all kept) answered requests of this replica with the text it replied."""
        items = list(self._ring)
        return items[-n:] if n > 0 else items

    def info(self) -> dict[str, Any]:
        """Version, back-end and the config this replica runs (used by swap reports and rollback)."""
        return {"version": self.version, "backend": self.backend, "config": self.cfg.model_dump(),
                "requests": self.num_requests, "errors": self.num_errors, "pid": os.getpid()}

    # ------------------------------------------------------------------ HTTP ingress
    def __serve_build_asgi_app__(self) -> Any:
        return build_http_app(self)


def build_http_app(replica: VerifierReplica) -> FastAPI:
    """The FastAPI app of one replica (routes close over the replica). FastAPI resolves the route
    annotations in this module's globals, hence the module-level fastapi imports."""
    api = FastAPI(title="asyncrl verifier", docs_url=None, redoc_url=None, openapi_url=None)
    headers = {"X-Verifier-Version": replica.version}

    def reply(body: dict[str, Any], status: int = 200) -> JSONResponse:
        return JSONResponse(body, status_code=status, headers=headers)

    def denied(request: Request) -> JSONResponse | None:
        if not replica._api_key:
            return None
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip() == replica._api_key:
            return None
        return reply(error_body("missing or wrong API key (Authorization: Bearer <key>)", 401,
                                "authentication_error", replica.version), 401)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        if (resp := denied(request)) is not None:
            return resp
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            return reply(error_body(f"body larger than {MAX_BODY_BYTES} bytes", 413, version=replica.version), 413)
        try:
            payload = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return reply(error_body(f"body is not valid JSON: {exc}", 400, version=replica.version), 400)
        if isinstance(payload, dict) and not payload.get("request_id") and request.headers.get("x-request-id"):
            payload["request_id"] = request.headers["x-request-id"]
        body = await replica.chat(payload)
        return reply(body, int(body["error"]["code"]) if "error" in body else 200)

    @api.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        if (resp := denied(request)) is not None:
            return resp
        return reply({"object": "list", "data": [{
            "id": SERVED_MODEL, "object": "model", "created": 0, "owned_by": "asyncrl",
            "backend": replica.backend, "version": replica.version}]})

    @api.get("/health")
    async def health() -> JSONResponse:
        return reply({"status": "ok", "backend": replica.backend, "version": replica.version})

    return api
