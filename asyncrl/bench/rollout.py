"""`python -m asyncrl.bench rollout --config X.yaml [overrides] [--smoke]`: one rollout actor vs bare vLLM.

What is compared, in one process and one run (rule verifier back-end only):
- `actor`: the rollout actor's own code path (asyncrl.actors.rollout.RolloutWorker minus Ray and
  the coordinator): an admission ticket from a real `ReplayBufferServer` -> the `n` guided
  conversations of a group (`run_guided_group`, the task's rule verifier in-process, as a Serve
  replica would answer) on a `PolicyEngine` (vLLM AsyncLLM, continuous batching) -> rewards ->
  training samples (`build_group`) -> `BufferClient.push` (acknowledged). Up to
  `rollout.groups_in_flight` groups run at once; a learner thread drains the buffer.
- `bare`: `vllm.LLM.generate` (vLLM's offline API) on exactly the requests the actor sent.

How lengths are matched. Every `generate` call of the actor is recorded: its prompt token ids
(the whole multi-turn context for later turns), its seed and the number L of tokens it sampled.
The bare engine then gets the same list of requests with `max_tokens = L` and `ignore_eos=True`,
so every request samples exactly L tokens (checked: the totals must be equal, else the run
fails), with the same temperature/top-p/top-k and seed, and `logprobs=0` as the actor asks.
Concurrency: both engines are built with the same engine arguments (dtype, eager mode,
prefix caching, max_model_len, max_num_batched_tokens) and the same `max_num_seqs` =
C = min(rollout.max_num_seqs, groups_in_flight * n). The bare engine gets all requests at once,
so it always runs C sequences; the actor runs at most C, fewer while a conversation waits for
its verifier, for scoring and pushing, or for the other conversations of its group (the group
straggler effect). The time-weighted mean number of the actor's requests in flight is
reported (`actor.mean_requests_in_flight`); with `rollout.groups_in_flight` above C / n the
actor oversubscribes C and the straggler effect shrinks.

Figures: policy tokens/s (sampled tokens / wall seconds) of both sides, per round (each round: the
actor produces `--groups` groups from fresh prompts, then the bare engine replays that round's
requests); `ratio` = median over rounds of actor/bare (robust to load spikes from other
processes on a shared machine); `ratio_total` = total actor tokens/s / total bare tokens/s.
Target: ratio >= 0.9 (docs/benchmarks.md, "Targets").
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncrl.bench.common import print_table
from asyncrl.config import Config


class RecordingEngine:
    """`PolicyEngine` proxy that records every request (prompt ids, sampled length, seed) and the
    time-weighted number of requests in flight."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.requests: list[tuple[list[int], int, int | None]] = []
        self.active = 0
        self._area = 0.0
        self._t = time.perf_counter()

    @property
    def version(self) -> int:
        return self.engine.version

    def _tick(self, delta: int) -> None:
        now = time.perf_counter()
        self._area += self.active * (now - self._t)
        self._t, self.active = now, self.active + delta

    def reset(self) -> None:
        self.requests, self._area, self._t = [], 0.0, time.perf_counter()

    def mean_in_flight(self, wall_s: float) -> float:
        self._tick(0)
        return self._area / max(wall_s, 1e-9)

    async def generate(self, prompt_ids: list[int], **kw: Any) -> Any:
        self._tick(+1)
        try:
            g = await self.engine.generate(prompt_ids, **kw)
        finally:
            self._tick(-1)
        self.requests.append((list(prompt_ids), len(g.token_ids), kw.get("seed")))
        return g


class RuleVerifier:
    """The task's rule verifier in-process, with the service client's `chat` signature."""

    def __init__(self, cfg: Config) -> None:
        from asyncrl.tasks import get_rule_verifier

        self.fn = get_rule_verifier(cfg.verifier.task)
        self.version = cfg.verifier.version

    async def chat(self, messages: list[dict[str, Any]], **_: Any) -> Any:
        from asyncrl.actors.guided.driver import VerifyOutcome

        return VerifyOutcome(ok=True, text=self.fn(messages), version=self.version)

    def metrics(self, reset: bool = False) -> dict[str, float]:  # noqa: ARG002 - client interface
        return {}


def _drain(address: str, secret: str, stop: threading.Event, counter: list[int]) -> None:
    """Stand-in learner: takes every pushed group out of the buffer (version 0)."""
    from asyncrl.replay import BufferClient

    client = BufferClient(address, secret=secret)
    try:
        while not stop.is_set():
            counter[0] += len(client.get_batch(1, version=0, timeout_s=0.3))
    finally:
        client.close()


async def _actor_round(cfg: Config, prompts: list[dict[str, Any]], engine: RecordingEngine, verifier: RuleVerifier,
                       parts: dict[str, Any]) -> float:
    """Produce one group per prompt exactly as RolloutWorker does; returns wall seconds."""
    from asyncrl.actors.group import build_group, run_guided_group

    loop = asyncio.get_running_loop()
    zmq_pool: ThreadPoolExecutor = parts["zmq"]
    client = parts["client"]

    async def one(prompt: dict[str, Any], ticket: int) -> None:
        convs = await run_guided_group(cfg, prompt, engine, verifier, chat=parts["chat"], training=True)
        group = await build_group(cfg, prompt, convs, parts["reward_fn"], parts["tokenizer"], actor_id="bench")
        reply = await loop.run_in_executor(zmq_pool, lambda: client.push(group, ticket))
        parts["push_status"][reply.status] = parts["push_status"].get(reply.status, 0) + 1

    engine.reset()
    t0 = time.perf_counter()
    tasks: set[asyncio.Task] = set()
    for prompt in prompts:
        while len(tasks) >= cfg.rollout.groups_in_flight:
            done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()
        ticket = await loop.run_in_executor(zmq_pool, lambda: client.acquire_ticket(timeout_s=30.0))
        if ticket is None:
            raise RuntimeError("no admission ticket within 30 s (buffer not drained?)")
        tasks.add(asyncio.create_task(one(prompt, ticket)))
    for t in asyncio.as_completed(tasks):
        await t
    return time.perf_counter() - t0


def _bare_round(llm: Any, cfg: Config, requests: list[tuple[list[int], int, int | None]]) -> tuple[float, int]:
    """vLLM's offline `generate` on the recorded requests, each sampling exactly its recorded length."""
    from vllm import SamplingParams

    r = cfg.rollout
    todo = [(ids, n, seed) for ids, n, seed in requests if n > 0]
    params = [SamplingParams(n=1, max_tokens=n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=seed,
                             ignore_eos=True, logprobs=0, detokenize=False, skip_special_tokens=False)
              for _, n, seed in todo]
    prompts = [{"prompt_token_ids": ids} for ids, _, _ in todo]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = sum(n for _, n, _ in todo)
    if produced != expected:
        raise RuntimeError(f"bare generate sampled {produced} tokens, the actor {expected}: lengths not matched")
    return wall, produced


def add_args(parser: Any) -> None:
    parser.add_argument("--rounds", type=int, help="measured rounds (8; --smoke 1); `ratio` is their median")
    parser.add_argument("--groups", type=int, help="groups the actor produces per round from fresh prompts (8; --smoke 2)")


def run(cfg: Config, args: Any) -> dict[str, Any]:
    smoke = bool(args.smoke)
    if cfg.verifier.backend != "rule" and cfg.rollout.guide.enable:
        raise ValueError("bench rollout runs the rule verifier in-process; set verifier.backend=rule")
    cfg = cfg.model_copy(deep=True)
    rounds = args.rounds if args.rounds is not None else 1 if smoke else 8
    groups = args.groups if args.groups is not None else 2 if smoke else 8
    if smoke:  # seconds, not minutes: few short conversations
        cfg.rollout.n = min(cfg.rollout.n, 2)
        cfg.data.max_response_length = min(cfg.data.max_response_length, 16)
        cfg.rollout.guide.max_turns = min(cfg.rollout.guide.max_turns, 2)
    concurrency = min(cfg.rollout.max_num_seqs, cfg.rollout.groups_in_flight * cfg.rollout.n)
    cfg.rollout.max_num_seqs = concurrency
    # The weights never change here, so staleness is not what is measured: admit without bound.
    cfg.buffer.max_staleness = 1_000_000
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.rollout.cpu_kvcache_gb))))
    return asyncio.run(_main(cfg, rounds, groups, concurrency))


def _make_llm(cfg: Config) -> Any:
    """The bare offline engine with the actor engine's arguments (see PolicyEngine)."""
    from vllm import LLM

    r = cfg.rollout
    return LLM(model=cfg.model.path, tokenizer=cfg.model.tokenizer_path or cfg.model.path,
               dtype=r.engine_dtype, seed=r.seed, enforce_eager=r.enforce_eager,
               enable_prefix_caching=r.enable_prefix_caching, max_model_len=r.max_model_len,
               max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens,
               logprobs_mode="processed_logprobs", disable_log_stats=True)


async def _main(cfg: Config, rounds: int, groups: int, concurrency: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from asyncrl.actors.engine import EngineSpec, PolicyEngine
    from asyncrl.actors.guided import PolicyChat
    from asyncrl.data import PromptStream, load_rows
    from asyncrl.replay import BufferClient, ReplayBufferServer
    from asyncrl.rewards import load_reward

    rows = load_rows(cfg.data.train_files, cfg.data)
    stream = PromptStream(rows, seed=cfg.data.seed, shuffle=cfg.data.shuffle, cfg=cfg.data)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    t0 = time.perf_counter()
    llm = _make_llm(cfg)
    bare_start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    policy = PolicyEngine(EngineSpec(cfg.model.path, cfg.rollout, engine_id="bench-actor", seed=cfg.rollout.seed,
                          tokenizer_path=cfg.model.tokenizer_path))
    actor_start_s = time.perf_counter() - t0
    engine = RecordingEngine(policy)
    server = ReplayBufferServer(cfg.buffer, batch_size=max(1, cfg.data.rollout_batch_size))
    address = server.start()
    stop, drained = threading.Event(), [0]
    drainer = threading.Thread(target=_drain, args=(address, cfg.buffer.secret, stop, drained), daemon=True)
    drainer.start()
    parts = {"zmq": ThreadPoolExecutor(max_workers=1), "client": BufferClient(address, secret=cfg.buffer.secret, actor_id="bench"),
             "chat": PolicyChat(tokenizer), "tokenizer": tokenizer, "reward_fn": load_reward(cfg.reward),
             "push_status": {}}
    per_round: list[dict[str, Any]] = []
    try:
        # warm-up: one group through both sides (first-request allocations), not measured
        await _actor_round(cfg, [stream.next().to_dict()], engine, RuleVerifier(cfg), parts)
        _bare_round(llm, cfg, engine.requests)
        verifier = RuleVerifier(cfg)
        for i in range(rounds):
            prompts = [stream.next().to_dict() for _ in range(groups)]
            a_wall = await _actor_round(cfg, prompts, engine, verifier, parts)
            in_flight = engine.mean_in_flight(a_wall)
            tokens = sum(n for _, n, _ in engine.requests)
            b_wall, b_tokens = _bare_round(llm, cfg, engine.requests)
            lens = [n for _, n, _ in engine.requests]
            per_round.append({
                "round": i, "groups": groups, "requests": len(lens), "policy_tokens": tokens,
                "mean_tokens_per_request": statistics.fmean(lens) if lens else 0.0,
                "actor_wall_s": a_wall, "bare_wall_s": b_wall, "actor_tokens_per_s": tokens / a_wall,
                "bare_tokens_per_s": b_tokens / b_wall, "ratio": (tokens / a_wall) / (b_tokens / b_wall),
                "actor_mean_requests_in_flight": in_flight})
            print(f"  round {i}: actor {tokens / a_wall:.0f} tok/s, bare {b_tokens / b_wall:.0f} tok/s, "
                  f"ratio {per_round[-1]['ratio']:.3f}, actor in flight {in_flight:.1f}/{concurrency}")
    finally:
        stop.set()
        drainer.join(timeout=5)
        parts["client"].close()
        parts["zmq"].shutdown(wait=False)
        server.stop()
        policy.shutdown()
        del llm
    return _report(cfg, per_round, concurrency, parts["push_status"], drained[0],
                   {"actor": actor_start_s, "bare": bare_start_s}, groups)


def _report(cfg: Config, per_round: list[dict[str, Any]], concurrency: int, push_status: dict[str, int],
            drained: int, start_s: dict[str, float], groups: int) -> dict[str, Any]:
    """The printed table and the JSON: both sides' tokens/s over all rounds, the median round ratio."""
    tok = sum(r["policy_tokens"] for r in per_round)
    a_tps = tok / sum(r["actor_wall_s"] for r in per_round)
    b_tps = tok / sum(r["bare_wall_s"] for r in per_round)
    ratio = statistics.median(r["ratio"] for r in per_round)
    print_table("rollout: one actor (guided groups, rule verifier, buffer push) vs bare vLLM generate", [
        ("actor policy tok/s", a_tps), ("bare generate tok/s", b_tps), ("ratio (median of rounds)", ratio),
        ("ratio_total", a_tps / b_tps), ("concurrency C (max_num_seqs)", concurrency),
        ("actor mean requests in flight", statistics.fmean(r["actor_mean_requests_in_flight"] for r in per_round)),
        ("groups pushed / drained", f"{sum(push_status.values())} / {drained}")])
    return {
        "ratio": ratio, "ratio_total": a_tps / b_tps, "goal": 0.9,
        "actor": {"tokens_per_s": a_tps, "mean_requests_in_flight":
                  statistics.fmean(r["actor_mean_requests_in_flight"] for r in per_round),
                  "push_status": push_status, "groups_drained": drained, "engine_start_s": start_s["actor"]},
        "bare": {"tokens_per_s": b_tps, "engine_start_s": start_s["bare"]},
        "concurrency": concurrency, "rounds": per_round,
        "settings": {"model": cfg.model.path, "n": cfg.rollout.n, "groups_in_flight": cfg.rollout.groups_in_flight,
                     "groups_per_round": groups, "max_turns": cfg.rollout.guide.max_turns,
                     "max_response_length": cfg.data.max_response_length, "guide": cfg.rollout.guide.enable,
                     "verifier": f"rule:{cfg.verifier.task} (in-process)", "dtype": cfg.rollout.dtype,
                     "temperature": cfg.rollout.temperature},
    }
