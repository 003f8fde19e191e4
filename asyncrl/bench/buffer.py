"""`python -m asyncrl.bench buffer [--smoke]`: replay buffer throughput vs bare ZeroMQ, same payloads.

Payloads: realistic groups (8 samples x 1-4k response tokens + 256 prompt tokens, with logprobs,
masks and per-token versions; ~0.3 MB each). Measured in one run, each in its own processes:
- `bare`: the encoded group frames through a bare pyzmq PUSH/PULL pair (no encode, no decode,
  no acknowledgement): the transport ceiling.
- `codec_pipe`: the same PUSH/PULL pair, but the producer encodes each Group and the consumer
  decodes (validates) it: what any typed transport costs.
- `buffer` (the `ratio`): one producer process -> replay buffer server process -> learner (this
  process), the real path: admission ticket, encode, push, server-side validation and
  acknowledgement, batch request at a stepping version, decode; one push at a time, the next
  ticket riding on the push's acknowledgement (one round trip per group when tickets are free). Full runs add `buffer_4_pushers` (4 threads pushing concurrently in one
  producer process) and `buffer_2_producers` (two producer processes). Latency = delivery time - the group's created_at
  (set just before the push), so it includes time spent waiting in the buffer.
`buffer_window` is the `buffer` path with pipelined pushes (`replay.PushWindow`, window
`max(2, buffer.push_window)`: that many pushes unacknowledged at once; `window_ratio` = its groups/s /
the `buffer` path's). The learner side of every buffer path takes raw frames and decodes them once,
as learner rank 0 does in a job. `buffer_durable` is the `buffer` path with the durable log on (`buffer.durable`, fsync before every
acknowledgement; a full run adds `buffer_durable_fsync_never`), the log in a temporary directory on
local disk; `durable_ratio` = its groups/s / the `buffer` path's, both from the same rounds.
`ratio` = buffer groups/s / bare groups/s; MB/s counts the groups' array bytes (ids, masks,
logprobs, versions), the same for every path. Also the encode and decode time of a 1 MB group.

Every buffer path authenticates its requests (`buffer.auth`, an HMAC of the job's secret on every
request, the default) except `buffer_no_auth`: `auth_ratio` = `buffer` / `buffer_no_auth` groups/s
(what authentication costs). `buffer_durable_window` is `buffer_window` with the durable log and
fsync before every acknowledgement: the pushes in flight together reach the server together and
share one fsync (group commit); `durable_window_ratio` = its groups/s / `buffer_window`'s (the
in-memory figure of the same path, same rounds), and `durable_fleet_headroom` = its MB/s / 7.2 MB/s
(what a 256-engine 7B fleet produces: docs/benchmarks.md). The durable paths fsync on the log's
sync thread (`buffer.durable.sync_thread` set by the bench); each `*_inline` path is the same with
the fsync in the socket loop (the baseline), and `sync_thread_ratio` = sync thread / inline
groups/s. `buffer_durable` and `buffer_durable_fsync_never` keep the config's setting (in line by default).

`--durable-only` runs just the pipelined paths group commit is judged on (in memory, durable with
the sync thread, durable inline; one and two producers), 3 rounds: the issue's ">= 20x" reads
`durable_window_ratio` >= 0.62 (20 x 7.2 MB/s against the 234 MB/s in-memory figure).
"""

from __future__ import annotations

import multiprocessing as mp
import struct
import time
from typing import Any

import numpy as np

from asyncrl.bench.common import print_table

HWM = 64
PAYLOAD_SEED = 1  # every path sends the same 8 groups, cycled
PUSHERS = 4  # concurrent pushes per producer process (threads, each with its own DEALER socket)
FLEET_MB_PER_S = 7.2  # a 256-engine fleet of 7B engines (the assumption in docs/benchmarks.md)


def _pool(seed: int, count: int, min_tokens: int, max_tokens: int) -> list[Any]:
    from asyncrl.replay.synthetic import synthetic_group

    rng = np.random.default_rng(seed)
    return [synthetic_group(rng, prompt_uid=f"g{i}", version=0, n=8, min_tokens=min_tokens,
                            max_tokens=max_tokens) for i in range(count)]


# ------------------------------------------------------------------------------------ bare zmq
def _bare_producer(address: str, n: int, seed: int, tokens: tuple[int, int], codec: bool, ready: Any,
                   go: Any) -> None:
    import zmq

    from asyncrl.protocol import encode

    pool = _pool(PAYLOAD_SEED, 8, *tokens)
    blobs = [encode(g) for g in pool]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.connect(address)
    ready.set()
    go.wait(60)
    for i in range(n):
        payload = encode(pool[i % len(pool)]) if codec else blobs[i % len(blobs)]
        sock.send_multipart([struct.pack("<d", time.time()), payload], copy=False)
    sock.close(linger=-1)
    ctx.term()


def _bare(n: int, seed: int, tokens: tuple[int, int], codec: bool) -> dict[str, float]:
    import zmq

    from asyncrl.protocol import decode

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.bind("tcp://127.0.0.1:*")
    spawn = mp.get_context("spawn")
    ready, go = spawn.Event(), spawn.Event()
    proc = spawn.Process(target=_bare_producer, args=(sock.getsockopt_string(zmq.LAST_ENDPOINT), n, seed,
                                                      tokens, codec, ready, go), daemon=True)
    proc.start()
    if not ready.wait(120):
        raise TimeoutError("bare producer did not start")
    time.sleep(0.2)  # connection established; the clock starts at `go`
    sizes = [g.nbytes for g in _pool(PAYLOAD_SEED, 8, *tokens)]  # array bytes, as counted for the buffer
    latencies, nbytes = [], 0
    start = time.perf_counter()
    go.set()
    for i in range(n):
        if not sock.poll(60_000):
            raise TimeoutError("bare producer stalled")
        ts, payload = sock.recv_multipart(copy=False)
        if codec:
            decode(payload.buffer)
        nbytes += sizes[i % len(sizes)]
        latencies.append(time.time() - struct.unpack("<d", ts.bytes)[0])
    elapsed = time.perf_counter() - start
    proc.join(30)
    sock.close(linger=0)
    ctx.term()
    return _figures(n, nbytes, elapsed, latencies)


# ------------------------------------------------------------------------------------ buffer
def _serve(cfg_json: str, batch_size: int, address_q: Any, stop: Any, log_path: str | None = None) -> None:
    from asyncrl.config import BufferConfig
    from asyncrl.replay.server import ReplayBufferServer

    server = ReplayBufferServer(BufferConfig.model_validate_json(cfg_json), batch_size=batch_size, log_path=log_path)
    address_q.put(server.start())
    stop.wait(600)
    server.stop()


def _buffer_producer(address: str, seed: int, tokens: tuple[int, int], threads: int, ready: Any,
                     go: Any, stop: Any, window: int = 0, secret: str | None = None) -> None:
    """One producer process with `threads` concurrent pushers (an actor has many groups in flight),
    each pushing until `stop` (`_push_one_at_a_time`, or `_push_windowed` when `window` > 0)."""
    import threading

    from asyncrl.replay.client import BufferClient

    pools = [_pool(PAYLOAD_SEED, 8, *tokens) for _ in range(threads)]  # the same groups as the bare pair
    errors: list[BaseException] = []

    def pusher(t: int) -> None:
        try:
            if window:
                _push_windowed(client, pools[t], f"{seed}-{t}", stop, window)
            else:
                _push_one_at_a_time(client, pools[t], f"{seed}-{t}", stop)
        except BaseException as exc:
            errors.append(exc)

    with BufferClient(address, secret=secret, reply_grace_s=60.0) as client:
        client.stats()  # connected
        ready.release()
        go.wait(60)
        workers = [threading.Thread(target=pusher, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    if errors:
        raise errors[0]


def _next_group(pool: list[Any], i: int, version: int, tag: str) -> Any:
    """The pool's i-th group (cycled), stamped with `version`, its own prompt uid and its creation time."""
    from asyncrl.replay.synthetic import restamp

    group = restamp(pool[i % len(pool)], version)
    group.prompt_uid = f"{tag}-{i}"
    group.created_at = time.time()
    return group


def _checked(reply: Any) -> Any:
    if reply.status not in ("stored", "stale"):
        raise RuntimeError(f"push answered {reply.status}")
    return reply


def _push_one_at_a_time(client: Any, pool: list[Any], tag: str, stop: Any) -> None:
    """Until `stop`: ticket -> stamp the group with the version that came with it -> push; the next
    ticket rides on the push's acknowledgement."""
    i, ticket = 0, None
    while not stop.is_set():
        if ticket is None:
            ticket = client.acquire_ticket(timeout_s=0.5)
            if ticket is None:
                continue
        reply = client.push(_next_group(pool, i, client.version or 0, tag), ticket, want_ticket=True)
        i += 1
        reply = _checked(reply)
        ticket = reply.next_ticket if reply.next_ticket >= 0 else None
    if ticket is not None:
        client.release_ticket(ticket)


def _push_windowed(client: Any, pool: list[Any], tag: str, stop: Any, window: int) -> None:
    """Until `stop`, `window` pushes in flight through a `PushWindow` (as a rollout actor does), each
    acknowledgement bringing the ticket of a later group; what is in flight at `stop` is awaited."""
    from collections import deque

    from asyncrl.replay.window import PushWindow

    pushes = PushWindow(client, window)
    try:
        i, spare, pending, version = 0, [], deque(), 0
        while not stop.is_set() or pending:
            while not stop.is_set() and len(pending) < window:
                if spare:
                    ticket = spare.pop()
                else:
                    ticket = client.acquire_ticket(timeout_s=0.0 if pending else 0.5)
                    version = max(version, client.version or 0)
                if ticket is None:
                    break
                # the newest version the buffer reported (acks carry it too), as an engine would have
                pending.append(pushes.submit(_next_group(pool, i, version, tag), ticket, want_ticket=True))
                i += 1
            if not pending:
                continue
            reply = _checked(pending.popleft().result(timeout=120))
            version = max(version, reply.version)
            if reply.next_ticket >= 0:
                spare.append(reply.next_ticket)
        for ticket in spare:
            client.release_ticket(ticket)
    finally:
        pushes.close()


def _through_buffer(cfg: Any, batch_size: int, n: int, producers: int, seed: int,
                    tokens: tuple[int, int], threads: int = 1, fsync: str | None = None,
                    window: int = 0, auth: bool = True, sync_thread: bool | None = None) -> dict[str, float]:
    """`fsync`: with the durable log (that fsync policy; `sync_thread`: fsync off the socket loop,
    None: as configured), in a temporary directory; None: without.
    `window`: pipelined pushes (see `_buffer_producer`). The learner side is what learner rank 0
    does: raw frames from the buffer (`get_batch_frames`), decoded once."""
    import tempfile

    from asyncrl.protocol import decode
    from asyncrl.replay.client import BufferClient

    cfg = cfg.model_copy(update={"auth": auth})
    secret = cfg.secret if auth else None
    log_dir = tempfile.TemporaryDirectory(prefix="asyncrl-bench-wal-") if fsync else None
    if fsync:
        thread = cfg.durable.sync_thread if sync_thread is None else sync_thread
        durable = cfg.durable.model_copy(update={"enable": True, "fsync": fsync, "sync_thread": thread})
        cfg = cfg.model_copy(update={"durable": durable})
    log_path = f"{log_dir.name}/buffer.wal" if log_dir else None
    spawn = mp.get_context("spawn")
    address_q, stop, go, stop_producers = spawn.Queue(), spawn.Event(), spawn.Event(), spawn.Event()
    server = spawn.Process(target=_serve, args=(cfg.model_dump_json(), batch_size, address_q, stop, log_path),
                           daemon=True)
    server.start()
    address = address_q.get(timeout=120)
    ready = spawn.Semaphore(0)
    procs = [spawn.Process(target=_buffer_producer,
                           args=(address, seed + i, tokens, threads, ready, go, stop_producers, window, secret),
                           daemon=True) for i in range(producers)]
    for p in procs:
        p.start()
    client = BufferClient(address, secret=secret, reply_grace_s=60.0)
    client.stats()
    for _ in procs:
        if not ready.acquire(timeout=120):
            raise TimeoutError("buffer producer did not start")
    latencies, nbytes, version, got = [], 0, 0, 0
    start = time.perf_counter()
    go.set()
    while got < n:  # producers run until the learner has taken n groups
        batch = [decode(f) for f in client.get_batch_frames(batch_size, version, timeout_s=30.0)]
        now = time.time()
        if not batch:
            stats = {k: v for k, v in client.stats().items() if v}
            raise TimeoutError(f"no group arrived within 30 s ({got}/{n} received); buffer: {stats}")
        for g in batch:
            latencies.append(now - g.created_at)
            nbytes += sum(s.nbytes for s in g.samples)
        got += len(batch)
        version += 1
    elapsed = time.perf_counter() - start
    stats = client.stats()
    client.close()
    stop_producers.set()
    fsyncs = stats.get("buffer/log_fsyncs", 0.0)
    for p in procs:
        p.join(30)
    stop.set()
    server.join(30)
    if log_dir is not None:
        log_dir.cleanup()
    out = _figures(got, nbytes, elapsed, latencies)
    out["dropped_stale"] = stats["buffer/dropped_stale"]
    if fsync:
        out["fsyncs_per_group"] = fsyncs / max(1, stats["buffer/ingested"])
    out["staleness_mean"] = stats["buffer/staleness_mean"]
    return out


def _figures(n: int, nbytes: int, elapsed: float, latencies: list[float]) -> dict[str, float]:
    lat = np.asarray(latencies) * 1e3
    return {"groups": n, "mb_per_group": nbytes / 2**20 / max(n, 1), "seconds": elapsed, "groups_per_s": n / elapsed, "mb_per_s": nbytes / 2**20 / elapsed,
            "latency_p50_ms": float(np.percentile(lat, 50)), "latency_p99_ms": float(np.percentile(lat, 99))}


# ------------------------------------------------------------------------------------ codec
def _codec_1mb(reps: int) -> dict[str, float]:
    from asyncrl.protocol import decode, encode

    group = _pool(7, 1, 9500, 9500)[0]  # 8 x 9500 tokens x 13 bytes + prompts ~= 1.0 MB
    frame = encode(group)
    enc, dec = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        frame = encode(group)
        t1 = time.perf_counter()
        decode(frame)
        enc.append(t1 - t0)
        dec.append(time.perf_counter() - t1)
    return {"frame_mb": len(frame) / 2**20, "encode_ms": 1e3 * float(np.median(enc)),
            "decode_ms": 1e3 * float(np.median(dec)), "encode_decode_ms": 1e3 * float(np.median(np.add(enc, dec))),
            "encode_decode_ms_best": 1e3 * float(np.min(np.add(enc, dec)))}


def add_args(parser: Any) -> None:
    parser.add_argument("--durable-only", action="store_true",
                        help="only the pipelined paths group commit is judged on: in memory, durable with the "
                             "fsync on its own thread, durable with the fsync in the loop (baseline); 3 rounds")


def _paths(cfg: Any, n: int, tokens: tuple[int, int], smoke: bool, durable_only: bool) -> dict[str, Any]:
    """name -> a function measuring that path once (see the module doc)."""
    b, bs, window = cfg.buffer, cfg.data.rollout_batch_size, max(2, cfg.buffer.push_window)

    def through(producers: int, seed: int, **kw: Any) -> Any:
        return lambda: _through_buffer(b, bs, n, producers, seed, tokens, **kw)

    pipelined = {
        "buffer_window": through(1, 1, window=window),
        "buffer_durable_window": through(1, 1, fsync="always", window=window, sync_thread=True),
        "buffer_durable_window_inline": through(1, 1, fsync="always", window=window, sync_thread=False),
    }
    if not smoke:  # two pipelined producers: more pushes reach the server together (what group commit groups)
        pipelined.update({
            "buffer_window_2_producers": through(2, 21, window=window),
            "buffer_durable_window_2_producers": through(2, 21, fsync="always", window=window, sync_thread=True),
            "buffer_durable_window_2_producers_inline": through(2, 21, fsync="always", window=window,
                                                                sync_thread=False)})
    if durable_only:
        return pipelined
    paths: dict[str, Any] = {
        "bare": lambda: _bare(n, 1, tokens, codec=False), "codec_pipe": lambda: _bare(n, 1, tokens, codec=True),
        "buffer": through(1, 1), "buffer_no_auth": through(1, 1, auth=False),
        "buffer_durable": through(1, 1, fsync="always"), **pipelined}
    if not smoke:
        paths.update({f"buffer_{PUSHERS}_pushers": through(1, 2, threads=PUSHERS), "buffer_2_producers": through(2, 11),
                      "buffer_durable_fsync_never": through(1, 1, fsync="never")})
    return paths


RATIOS = {  # name -> (numerator path, denominator path), groups/s; each reported for the best rounds and as a median
    "ratio": ("buffer", "bare"), "ratio_vs_codec_pipe": ("buffer", "codec_pipe"),
    "durable_ratio": ("buffer_durable", "buffer"), "window_ratio": ("buffer_window", "buffer"),
    "auth_ratio": ("buffer", "buffer_no_auth"),
    "durable_window_ratio": ("buffer_durable_window", "buffer_window"),
    "durable_window_inline_ratio": ("buffer_durable_window_inline", "buffer_window"),
    "sync_thread_ratio": ("buffer_durable_window", "buffer_durable_window_inline"),
    "durable_window_2_producers_ratio": ("buffer_durable_window_2_producers", "buffer_window_2_producers"),
    "durable_window_2_producers_inline_ratio": ("buffer_durable_window_2_producers_inline",
                                                "buffer_window_2_producers"),
    "sync_thread_2_producers_ratio": ("buffer_durable_window_2_producers", "buffer_durable_window_2_producers_inline"),
}


def _ratios(best: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (num, den) in RATIOS.items():
        if num in best and den in best:
            out[name] = best[num]["groups_per_s"] / best[den]["groups_per_s"]
            out[f"{name}_median"] = float(np.median([h[num]["groups_per_s"] / h[den]["groups_per_s"] for h in history]))
    for name, path in (("durable_fleet_headroom", "buffer_durable_window"),
                       ("durable_2_producers_fleet_headroom", "buffer_durable_window_2_producers"),
                       ("durable_one_at_a_time_fleet_headroom", "buffer_durable")):
        if path in best:
            out[name] = best[path]["mb_per_s"] / FLEET_MB_PER_S
    return out


def _rows(result: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = [(f"{name} (best | median)", f"{result[name]:.3f} | {result[name + '_median']:.3f}")
                                   for name in RATIOS if name in result]
    rows += [(f"{name}: durable MB/s / {FLEET_MB_PER_S} MB/s fleet", f"{result[name]:.1f}x")
             for name in ("durable_fleet_headroom", "durable_2_producers_fleet_headroom",
                          "durable_one_at_a_time_fleet_headroom") if name in result]
    for name, r in result.items():
        if isinstance(r, dict) and "groups_per_s" in r:
            rows.append((f"{name}: groups/s | MB/s", f"{r['groups_per_s']:.1f} | {r['mb_per_s']:.1f}"))
            rows.append((f"{name}: latency p50 | p99 ms", f"{r['latency_p50_ms']:.2f} | {r['latency_p99_ms']:.2f}"))
            if "fsyncs_per_group" in r:
                rows.append((f"{name}: fsyncs per stored group", f"{r['fsyncs_per_group']:.2f}"))
    return rows


def run(cfg: Any, args: Any) -> dict[str, Any]:
    """Rounds interleave every path (bare, codec pipe, buffer, ...) so that load from other
    processes on a shared machine hits them alike; each path's figures are from its best round
    (the least disturbed), all rounds are kept under `rounds`."""
    smoke, durable_only = bool(args.smoke), bool(getattr(args, "durable_only", False))
    n, rounds = (40, 1) if smoke else (600, 3)
    tokens = (256, 512) if smoke else (1024, 4096)
    codec = None if durable_only else _codec_1mb(5 if smoke else 50)
    paths = _paths(cfg, n, tokens, smoke, durable_only)
    history = [{name: fn() for name, fn in paths.items()} for _ in range(rounds)]
    best = {name: max((h[name] for h in history), key=lambda r: r["groups_per_s"]) for name in paths}
    result: dict[str, Any] = {
        **_ratios(best, history), **best, "rounds": history,
        "params": {"groups": n, "rounds": rounds, "samples_per_group": 8, "response_tokens": list(tokens),
                   "prompt_tokens": 256, "batch_size": cfg.data.rollout_batch_size,
                   "max_staleness": cfg.buffer.max_staleness, "hwm": cfg.buffer.hwm,
                   "push_window": max(2, cfg.buffer.push_window), "smoke": smoke, "durable_only": durable_only}}
    rows = _rows(result)
    if codec is not None:
        result["codec_1mb"] = codec
        rows += [("1 MB group encode | decode ms", f"{codec['encode_ms']:.2f} | {codec['decode_ms']:.2f}"),
                 ("1 MB group encode+decode ms (median | best)",
                  f"{codec['encode_decode_ms']:.2f} | {codec['encode_decode_ms_best']:.2f}")]
    print_table("replay buffer vs bare ZeroMQ", rows)
    return result
