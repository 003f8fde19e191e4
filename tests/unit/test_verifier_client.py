"""VerifierClient against real misbehaving HTTP servers on 127.0.0.1 (no Ray).

Proves: the total deadline holds against a server that never answers and one that drips its
body slowly (a socket timeout alone would not); 503s and garbage JSON are retried with backoff and
counted, and end in an explicit error result (never an exception, never a fake reply); a server
that recovers after two 503s gives an ok result after exactly 2 retries; a 400 is not retried;
the request id and a derived seed are sent and stay the same on every attempt; the number of
concurrent requests never exceeds `client.max_concurrency`; metrics have the documented keys.
"""

from __future__ import annotations

import asyncio
import json
import time

from asyncrl.config import VerifierClientConfig, VerifierConfig
from asyncrl.serve.client import VerifierClient, _percentile

MESSAGES = [{"role": "system", "content": "judge"}, {"role": "user", "content": "2+2=4"}]


def completion(content: str = "fine", version: str = "vT") -> bytes:
    return json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                       "version": version}).encode()


class Server:
    """A raw HTTP/1.1 server whose behaviour per request is `mode` (see `respond`)."""

    def __init__(self, mode: str, fail_first: int = 0):
        self.mode, self.fail_first = mode, fail_first
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.active = self.max_active = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def stop(self) -> None:
        self.server.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            self.headers.append(headers)
            self.bodies.append(json.loads(body))
            await self.respond(writer, len(self.bodies))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.active -= 1
            writer.close()

    async def respond(self, writer: asyncio.StreamWriter, n: int) -> None:
        def send(status: str, payload: bytes) -> None:
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}"
                         f"\r\nConnection: close\r\n\r\n".encode() + payload)

        mode = "ok" if n > self.fail_first and self.fail_first else self.mode
        if mode == "hang":
            await asyncio.sleep(3600)
        elif mode == "503":
            send("503 Service Unavailable", b'{"error": {"message": "busy", "code": 503}}')
        elif mode == "garbage":
            send("200 OK", b"<html>not json{")
        elif mode == "400":
            send("400 Bad Request", b'{"error": {"message": "messages: field required", "code": 400}}')
        elif mode == "slow":  # headers at once, then one byte of body every 0.3 s
            payload = completion()
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(payload)}\r\n\r\n".encode())
            for i in range(len(payload)):
                writer.write(payload[i:i + 1])
                await writer.drain()
                await asyncio.sleep(0.3)
        elif mode == "hold":  # a good reply after 0.2 s (concurrency test)
            await asyncio.sleep(0.2)
            send("200 OK", completion())
        else:
            send("200 OK", completion())
        await writer.drain()


def make_client(url: str, deadline_s: float = 1.5, max_retries: int = 3, concurrency: int = 8) -> VerifierClient:
    cfg = VerifierConfig(client=VerifierClientConfig(deadline_s=deadline_s, max_retries=max_retries, backoff_s=0.05,
                                                     backoff_max_s=0.2, max_concurrency=concurrency))
    return VerifierClient(cfg, base_url=url, seed=0)


async def one_call(mode: str, fail_first: int = 0, **kw) -> tuple:
    server = Server(mode, fail_first)
    client = make_client(await server.start(), **kw)
    t0 = time.monotonic()
    res = await client.chat(MESSAGES, max_tokens=16, temperature=0.2, top_p=0.95, request_id="rid-1")
    elapsed = time.monotonic() - t0
    await client.aclose()
    await server.stop()
    return res, elapsed, client, server


def test_good_reply_carries_request_id_and_seed():
    res, _, client, server = asyncio.run(one_call("ok"))
    assert res.ok and res.text == "fine" and res.version == "vT" and res.tokens == 1 and res.attempts == 1
    assert server.bodies[0]["request_id"] == "rid-1" and server.headers[0]["x-request-id"] == "rid-1"
    assert isinstance(server.bodies[0]["seed"], int) and "top_k" not in server.bodies[0]
    assert server.bodies[0]["messages"] == MESSAGES and server.bodies[0]["max_tokens"] == 16
    m = client.metrics()
    assert m["verifier/error_rate"] == 0.0 and m["verifier/version"] == "vT" and m["verifier/latency_ms_p50"] > 0


def test_never_answers_deadline_honoured():
    res, elapsed, client, _ = asyncio.run(one_call("hang", deadline_s=1.0))
    assert not res.ok and "deadline" in res.error and res.finish_reason == "error"
    assert 0.9 <= elapsed < 1.6, elapsed
    assert client.metrics()["verifier/error_rate"] == 1.0


def test_slow_drip_cannot_stretch_the_deadline():
    res, elapsed, _, _ = asyncio.run(one_call("slow", deadline_s=1.0))
    assert not res.ok and "deadline" in res.error
    assert elapsed < 1.6, elapsed  # the body alone would take ~60 s


def test_503_retried_counted_then_error():
    res, _, client, server = asyncio.run(one_call("503", deadline_s=5.0, max_retries=3))
    assert not res.ok and "4 attempts failed" in res.error and "503" in res.error
    assert len(server.bodies) == 4 and client.metrics()["verifier/retries"] == 3
    # every attempt is the same request: same id, same derived seed
    assert len({(b["request_id"], b["seed"]) for b in server.bodies}) == 1


def test_recovers_after_two_503():
    res, _, client, server = asyncio.run(one_call("503", fail_first=2, deadline_s=5.0))
    assert res.ok and res.text == "fine" and res.attempts == 3
    assert client.metrics()["verifier/retries"] == 2 and len(server.bodies) == 3


def test_garbage_json_retried_then_error():
    res, _, client, server = asyncio.run(one_call("garbage", deadline_s=5.0, max_retries=2))
    assert not res.ok and "not a chat completion" in res.error and res.text == ""
    assert len(server.bodies) == 3 and client.metrics()["verifier/retries"] == 2


def test_400_is_final():
    res, _, client, server = asyncio.run(one_call("400"))
    assert not res.ok and "400" in res.error and "field required" in res.error
    assert len(server.bodies) == 1 and client.metrics()["verifier/retries"] == 0


def test_connection_refused_is_an_error_result():
    async def run():
        server = Server("ok")
        url = await server.start()
        await server.stop()
        await asyncio.sleep(0.05)
        client = make_client(url, deadline_s=1.0, max_retries=2)
        return await client.chat(MESSAGES, max_tokens=8, temperature=0.0, top_p=1.0)

    res = asyncio.run(run())
    assert not res.ok and "transport error" in res.error


def test_concurrency_bounded():
    async def run():
        server = Server("hold")
        client = make_client(await server.start(), deadline_s=10.0, concurrency=3)
        results = await asyncio.gather(*[client.chat(MESSAGES, max_tokens=8, temperature=0.0, top_p=1.0)
                                         for _ in range(10)])
        await client.aclose()
        await server.stop()
        return results, server, client

    results, server, client = asyncio.run(run())
    assert all(r.ok for r in results) and len({r.request_id for r in results}) == 10
    assert server.max_active == 3
    # 10 requests, 3 at a time, 0.2 s each -> at least 4 rounds -> the slowest waited >= 0.8 s
    assert client.metrics()["verifier/latency_ms_p95"] >= 700


def test_percentile_nearest_rank():
    # nearest rank: ceil(q * n)-th smallest; n = 20 -> p50 = 10th = 10, p95 = 19th = 19
    values = [float(i) for i in range(1, 21)]
    assert _percentile(values, 0.5) == 10.0 and _percentile(values, 0.95) == 19.0
    assert _percentile([], 0.5) == 0.0


def test_error_rate_counts_what_ended_in_its_window_and_stays_within_0_1():
    """Calls that straddle a `metrics(reset=True)` (a total outage: every call runs to its deadline)
    are counted where they end: the window they end in reads 1.0, never 0.0 or above 1; `health()`
    keeps cumulative counts and the last error for the job's console line."""
    async def run():
        server = Server("hang")
        client = make_client(await server.start(), deadline_s=0.6)
        calls = [asyncio.create_task(client.chat(MESSAGES, max_tokens=4, temperature=0, top_p=1)) for _ in range(4)]
        await asyncio.sleep(0.2)
        first = client.metrics(reset=True)  # 4 started, none ended yet
        await asyncio.gather(*calls)
        late = [asyncio.create_task(client.chat(MESSAGES, max_tokens=4, temperature=0, top_p=1))]
        await asyncio.sleep(0.1)
        second = client.metrics(reset=True)  # 4 ended (all failed), 1 started
        await asyncio.gather(*late)
        await client.aclose()
        await server.stop()
        return first, second, client.health()

    first, second, health = asyncio.run(run())
    assert first["verifier/error_rate"] == 0.0  # nothing ended in this window
    assert second["verifier/error_rate"] == 1.0, second
    assert health["calls"] == 5 and health["errors"] == 5 and "deadline" in health["last_error"]
