"""VerifierClient: the async client the rollout actors use to ask the verifier service.

Transport: a Ray Serve handle inside the cluster (`handle=`, `app_name=` or `in_cluster`), or
HTTP (`base_url=`, httpx) outside it; both carry the same request body (Guided-GRPO's
chat-completions body, docs/guided_grpo.md#http-verifier) and get the same OpenAI-shaped reply.

Guarantees (departures from Guided-GRPO's client, docs/guided_grpo.md#bug-http-client):
- `chat` never raises for remote failures: it returns `VerifierResult(ok=False, error=...)`
  after the deadline or the retries are used up. The caller (the guided protocol) turns that
  into its configured `on_error` policy; an error is never turned into a silent STOP here.
- A total deadline per request (`client.deadline_s`), retries and waiting for a concurrency slot
  included, not a per-socket timeout.
- Retries (`client.max_retries` after the first attempt) on transport errors, timeouts, 408, 429,
  5xx and replies that are not a chat completion; exponential backoff from `client.backoff_s`,
  capped at `client.backoff_max_s`, with jitter (uniform in [b/2, b]). Other 4xx are final.
- At most `client.max_concurrency` requests in flight per client (a semaphore).
- Every call has a request id (given, or a fresh uuid) sent on every attempt: replicas answer a
  repeated id with the reply they already gave. When the caller gives no seed, one is derived
  from the id, so a retry that reaches another replica samples the same reply.
- An empty reply is a successful reply with empty text (the protocol decides what it means).
Metrics (`metrics()`): `verifier/latency_ms_p50`, `verifier/latency_ms_p95` (successful calls,
end to end), `verifier/error_rate` (failed / ended calls), `verifier/retries`, `verifier/requests`, `verifier/version`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

from asyncrl.config import VerifierConfig

log = logging.getLogger(__name__)

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


@dataclass
class VerifierResult:
    ok: bool
    text: str
    version: str
    latency_ms: float
    tokens: int
    error: str | None = None
    finish_reason: str = ""
    attempts: int = 0
    request_id: str = ""


class _Retryable(Exception):
    """An attempt failed in a way that another attempt may fix."""


class _Final(Exception):
    """An attempt failed in a way that retrying cannot fix (e.g. 400, 401)."""


class VerifierClient:
    def __init__(self, cfg: VerifierConfig, handle: Any = None, base_url: str | None = None, *,
                 app_name: str | None = None, api_key: str | None = None, seed: int | None = None):
        """`handle`: a Serve DeploymentHandle of the verifier app (in-cluster), or `app_name` to
        look that handle up (`serve.get_app_handle`) at the first request, so a client may be built
        before the application runs (a rollout actor's engine builds while Serve deploys it);
        otherwise HTTP to `base_url` (default `http://{cfg.host}:{cfg.port}/v1`) with `api_key`
        (default: the service's `cfg.api_key`). `seed` seeds the backoff jitter only."""
        self.cfg = cfg
        self.handle = handle
        self._app_name = app_name if handle is None and base_url is None else None
        if base_url is None:
            from asyncrl.addresses import bind_and_advertise

            base_url = f"http://{bind_and_advertise(cfg.host)[1]}:{cfg.port}/v1"
        self.base_url = base_url.rstrip("/")
        key = cfg.api_key if api_key is None else api_key
        if key.startswith("env:"):
            from asyncrl.serve.replica import resolve_secret

            key = resolve_secret(key)
        self._headers = {"Content-Type": "application/json"}
        if key:
            self._headers["Authorization"] = f"Bearer {key}"
        self._rng = random.Random(seed)
        self._http: Any = None
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._latencies: deque[float] = deque(maxlen=4096)
        self.requests = self.errors = self.retries = 0
        self.ended = 0  # calls that ended in this window (ok or error): error_rate's denominator
        self.total_calls = self.total_errors = 0  # cumulative, for `health()`
        self.last_error = ""
        self.version = ""

    @classmethod
    def in_cluster(cls, cfg: VerifierConfig, app_name: str = "verifier") -> VerifierClient:
        """A client on the handle of the running `verifier` application (inside the Ray cluster)."""
        return cls(cfg, app_name=app_name)

    def prepare(self, timeout_s: float = 10.0) -> bool:
        """Warm the in-cluster path before the first request needs it; blocking, for a thread (a
        rollout actor runs it while its engine builds). Imports Serve (with the modules it pulls in),
        looks the application's handle up and makes one `info` call, which builds the handle's router
        and learns the replicas: without it the first turn of the first conversations pays all of
        that, on the first batch's critical path. An application that does
        not run yet leaves the lookup to the first request, as before. Returns whether the handle
        answered; never raises. An HTTP client has nothing to prepare."""
        if self.handle is None and self._app_name is None:
            return False
        try:
            from ray import serve

            handle = self.handle if self.handle is not None else serve.get_app_handle(self._app_name)
            handle.info.remote().result(timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001 - not deployed yet, or busy: the first request retries
            log.debug("verifier client: %s not ready to prepare (%s: %s)", self._app_name, type(exc).__name__, exc)
            return False
        self.handle = handle
        return True

    # ------------------------------------------------------------------ public API
    async def chat(self, messages: list[dict], *, max_tokens: int, temperature: float, top_p: float,
                   top_k: int | None = None, seed: int | None = None, request_id: str | None = None) -> VerifierResult:
        """One verifier reply for OpenAI chat `messages`; never raises for remote failures."""
        self._bind_loop()
        c = self.cfg.client
        rid = request_id or uuid.uuid4().hex
        body: dict[str, Any] = {"model": "verifier", "messages": messages, "max_tokens": max_tokens,
                                "temperature": temperature, "top_p": top_p, "request_id": rid,
                                "seed": seed if seed is not None else _seed_from(rid)}
        if top_k is not None:
            body["top_k"] = top_k
        t0 = time.monotonic()
        deadline = t0 + c.deadline_s
        self.requests += 1
        attempts, last_error = 0, "deadline passed before the first attempt"
        try:
            assert self._sem is not None
            await asyncio.wait_for(self._sem.acquire(), timeout=max(deadline - time.monotonic(), 0))
        except TimeoutError:
            return self._fail(rid, t0, 0, f"no concurrency slot within the {c.deadline_s:g}s deadline")
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                attempts += 1
                try:
                    reply = await asyncio.wait_for(self._send(body, remaining), timeout=remaining)
                    return self._succeed(reply, rid, t0, attempts)
                except TimeoutError:
                    last_error = f"no reply within the {c.deadline_s:g}s deadline"
                    break
                except _Final as exc:
                    return self._fail(rid, t0, attempts, str(exc))
                except _Retryable as exc:
                    last_error = str(exc)
                if attempts > c.max_retries:
                    last_error = f"{attempts} attempts failed; last: {last_error}"
                    break
                backoff = min(c.backoff_max_s, c.backoff_s * 2 ** (attempts - 1))
                backoff *= self._rng.uniform(0.5, 1.0)
                if time.monotonic() + backoff >= deadline:
                    last_error = f"deadline {c.deadline_s:g}s reached after {attempts} attempts; last: {last_error}"
                    break
                self.retries += 1
                await asyncio.sleep(backoff)
        finally:
            self._sem.release()
        return self._fail(rid, t0, attempts, last_error)

    def metrics(self, reset: bool = False) -> dict[str, Any]:
        """Namespaced metrics since the last reset (latency percentiles over successful calls)."""
        lat = sorted(self._latencies)
        out = {
            "verifier/latency_ms_p50": _percentile(lat, 0.50),
            "verifier/latency_ms_p95": _percentile(lat, 0.95),
            # of the calls that ENDED in this window (a call counts where it ends, so the rate is in [0, 1]
            # even when calls straddle a reset, as in an outage where every call runs to its deadline)
            "verifier/error_rate": self.errors / self.ended if self.ended else 0.0,
            "verifier/retries": self.retries,
            "verifier/requests": self.requests,
            "verifier/version": self.version,
        }
        if reset:
            self._latencies.clear()
            self.requests = self.errors = self.retries = self.ended = 0
        return out

    def health(self) -> dict[str, Any]:
        """Cumulative calls ended and failed, and the last failure's message (the job's console line
        on a verifier outage: asyncrl.failure_watch)."""
        return {"calls": self.total_calls, "errors": self.total_errors, "last_error": self.last_error}

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # ------------------------------------------------------------------ internals
    def _bind_loop(self) -> None:
        """Loop-bound objects (semaphore, HTTP pool) are made in the loop that uses them."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._sem = asyncio.Semaphore(self.cfg.client.max_concurrency)
            self._http = None

    @property
    def in_cluster_transport(self) -> bool:
        """True when requests go through a Serve handle (given, or looked up by app name)."""
        return self.handle is not None or self._app_name is not None

    async def _send(self, body: dict[str, Any], remaining: float) -> dict[str, Any]:
        if self.in_cluster_transport:
            return await self._send_handle(body)
        return await self._send_http(body, remaining)

    async def _app_handle(self) -> Any:
        """The handle, looked up once by app name (in a thread: the lookup blocks on Serve's
        controller). An application that does not run yet is a retryable failure."""
        if self.handle is None:
            from ray import serve

            try:
                self.handle = await asyncio.to_thread(serve.get_app_handle, self._app_name)
            except Exception as exc:  # not deployed (yet), or Serve not running
                raise _Retryable(f"no Serve application {self._app_name!r}: {type(exc).__name__}: {exc}") from None
        return self.handle

    async def _send_handle(self, body: dict[str, Any]) -> dict[str, Any]:
        handle = await self._app_handle()
        try:
            reply = await handle.chat.remote(body)
        except Exception as exc:  # replica died, back-pressure, app being replaced: retry
            raise _Retryable(f"handle call failed: {type(exc).__name__}: {exc}") from None
        return _check_reply(reply, 200)

    async def _send_http(self, body: dict[str, Any], remaining: float) -> dict[str, Any]:
        import httpx

        if self._http is None:
            limits = httpx.Limits(max_connections=self.cfg.client.max_concurrency)
            self._http = httpx.AsyncClient(limits=limits)
        try:
            resp = await self._http.post(f"{self.base_url}/chat/completions", json=body, timeout=remaining,
                                         headers={**self._headers, "X-Request-Id": body["request_id"]})
        except httpx.HTTPError as exc:
            raise _Retryable(f"HTTP transport error: {type(exc).__name__}: {exc}") from None
        try:
            reply = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            reply = None
        return _check_reply(reply, resp.status_code, resp.text[:200])

    def _succeed(self, reply: dict[str, Any], rid: str, t0: float, attempts: int) -> VerifierResult:
        latency_ms = (time.monotonic() - t0) * 1000.0
        self._latencies.append(latency_ms)
        self.ended += 1
        self.total_calls += 1
        choice = reply["choices"][0]
        version = str(reply.get("version") or reply.get("system_fingerprint") or "")
        self.version = version or self.version
        return VerifierResult(True, str(choice["message"].get("content") or ""), version, latency_ms,
                              int((reply.get("usage") or {}).get("completion_tokens") or 0), None,
                              str(choice.get("finish_reason") or ""), attempts, rid)

    def _fail(self, rid: str, t0: float, attempts: int, error: str) -> VerifierResult:
        self.errors += 1
        self.ended += 1
        self.total_calls += 1
        self.total_errors += 1
        self.last_error = error
        return VerifierResult(False, "", self.version, (time.monotonic() - t0) * 1000.0, 0, error, "error",
                              attempts, rid)


def _check_reply(reply: Any, status: int, raw: str = "") -> dict[str, Any]:
    """A well-formed chat completion, or the matching retryable / final failure."""
    if isinstance(reply, dict) and "error" in reply:
        err = reply["error"] if isinstance(reply["error"], dict) else {"message": str(reply["error"])}
        raw_code = err.get("code")
        code = int(raw_code) if isinstance(raw_code, int) or str(raw_code).isdigit() else status
        msg = f"verifier error {code}: {err.get('message', '')}"
        raise (_Retryable if code in _RETRY_STATUS or status in _RETRY_STATUS else _Final)(msg)
    if status in _RETRY_STATUS:
        raise _Retryable(f"HTTP {status}: {raw}")
    if status >= 400:
        raise _Final(f"HTTP {status}: {raw}")
    try:
        choice = reply["choices"][0]
        content = choice["message"].get("content")
        if content is not None and not isinstance(content, str):
            raise TypeError("content is not a string")
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise _Retryable(f"reply is not a chat completion ({type(exc).__name__}: {exc}): {raw}") from None
    return reply


def _seed_from(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile; 0.0 when there are no values."""
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return float(sorted_values[k])
