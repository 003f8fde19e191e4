"""Wire format of the verifier service: the OpenAI chat-completions request and reply.

The request accepts exactly what Guided-GRPO's HTTP client sends (`model`, `messages`,
`max_tokens`, `temperature`, `top_p`, `top_k`; docs/guided_grpo.md#http-verifier), plus optional
fields for retries and reproducibility (`seed`, `stop`, `request_id`) and vLLM's
`chat_template_kwargs`. Unknown keys are
ignored, as OpenAI-compatible servers do; what cannot be served (`n > 1`, `stream`) and malformed
values are rejected with a message (HTTP 400), never silently coerced.

The reply is OpenAI's `chat.completion` object. asyncrl adds `version` (the verifier's version
label, also in `system_fingerprint` so the official `openai` client exposes it), `latency_ms`
(time spent in the replica) and `request_id`. Errors use OpenAI's error shape
`{"error": {"message", "type", "code"}}`, where `code` is the HTTP status.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_TOKENS_LIMIT = 65536
"""Largest `max_tokens` accepted by any back-end; the vllm back-end also checks its context length."""

MAX_BODY_BYTES = 8 * 1024 * 1024
"""Largest accepted request body."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]
    """A string, or OpenAI content parts; text parts are joined (verifiers read text only)."""

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type", "text") == "text")


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = "verifier"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int = Field(256, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = None
    """vLLM extension; None, -1 or 0 = off."""
    seed: int | None = None
    stop: str | list[str] | None = None
    request_id: str | None = Field(None, max_length=256)
    """Idempotency key: a replica answers a repeated id with the reply it already gave."""
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    """vllm back-end: extra chat-template arguments (e.g. `{"enable_thinking": false}` for Qwen3)."""

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool) -> bool:
        if v:
            raise ValueError("streaming is not supported by the asyncrl verifier")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError("top_k must be -1, 0 (off) or a positive integer")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class RequestError(Exception):
    """A request the service refuses; `status` is the HTTP status (4xx, or 502 for upstream)."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.kind = kind


def parse_request(payload: Any) -> ChatRequest:
    """Validate a decoded JSON body; raises RequestError(400) naming every bad field."""
    if not isinstance(payload, dict):
        raise RequestError(f"request body must be a JSON object, got {type(payload).__name__}")
    try:
        return ChatRequest.model_validate(payload)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "body"
            parts.append(f"{loc}: {err['msg']}")
        raise RequestError("invalid request: " + "; ".join(parts)) from None


@dataclass
class Generation:
    """What a back-end produced for one request."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def error_body(message: str, status: int, kind: str = "invalid_request_error", version: str | None = None) -> dict:
    body: dict[str, Any] = {"error": {"message": message, "type": kind, "code": status}}
    if version is not None:
        body["version"] = version
    return body


def completion_body(gen: Generation, *, request_id: str, model: str, version: str, latency_ms: float) -> dict:
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": version,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": gen.text},
                "finish_reason": gen.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        },
        "version": version,
        "latency_ms": latency_ms,
        "request_id": request_id,
    }
