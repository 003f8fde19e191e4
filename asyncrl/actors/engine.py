"""`PolicyEngine`: the one module that talks to vLLM (plus its worker extension in
`worker_extension.py`). vLLM upgrades break private APIs; keeping them here keeps the breakage in
one small, tested place.

Guarantees:
- `generate` runs on vLLM's `AsyncLLM` (continuous batching: many concurrent `generate` calls
  share engine steps). A prompt is token ids; each request has its own `SamplingParams` and seed.
  It returns the sampled token ids, the logprob of every sampled token under the distribution it
  was actually sampled from (`logprobs_mode="processed_logprobs"`: after temperature and
  top-k/top-p; with top_p=1, top_k=-1 this is softmax(logits / T), what the learner recomputes), the
  finish reason and the policy version of every token.
- Weight updates (`update_weights_from_group`, `load_weights_from_store`, `load_named_tensors`)
  pause the scheduler (running requests are kept, not aborted), load, verify, bump `version`,
  reset the prefix cache, and resume. Requests also carry a cache salt `v{version}`, so no prompt ever
  reuses KV blocks computed by older weights even if a reset is refused. Running requests keep
  their KV cache across an update (as PipelineRL/SkyRL); their later tokens carry the new version.
- CPU build here (fp32 unless configured, KV cache `rollout.cpu_kvcache_gb` GiB); CUDA build on
  GPUs with tensor parallel = `rollout.gpus_per_actor`.
How a rollout actor uses it (the learner's `WeightSender.broadcast` runs concurrently):
    if await engine.announced_version(addr) > engine.version:          # cheap store read
        res = await engine.update_weights_from_group(addr)              # joins/rejoins itself
        if res["status"] != "ok":                                       # dropped/late/failed
            await engine.load_weights_from_store()                      # WeightStore copy
A restarted actor calls `load_weights_from_store()` before generating. Member ids for the
sender (`WeightSender(..., members=...)` / `add_receivers`) come from `weight_member_ids()`;
a member the sender does not know yet asks to join by itself on its first update call.

Safe loads (`_paused`): the version is bumped only after a verified load; a round that failed
after the model saw part of it, or whose read-back fingerprint mismatched, is replaced by the
newest full WeightStore version inside the same pause (no token is generated in between); with
no store copy the engine stays paused (`unsafe`) and retries the store in the background until a
version loads (the topology publishes version 0 at start-up, so the store is never empty), and a
mismatch that persists through the store reload raises `WeightIntegrityError`. An exception out
of a load never leaves the engine paused: it is a failed, touched load.

Two weight paths (`rollout.weight_transfer`), the same transport, checks and safe loads:
`extension` (default) runs a round as one `collective_rpc("asyncrl_receive_weights")`; `native`
drives vLLM's weight-transfer API (`init_weight_transfer_engine`, `start_weight_update`,
`update_weights`, `finish_weight_update`, `update_weight_version`) with asyncrl's transfer engine
registered in vLLM's factory as backend "asyncrl" (`worker_extension.AsyncrlTransferEngine`). vLLM's
own back-ends are not used: 0.32 has no gloo one, and its NCCL one receives with no deadline or
abort, i.e. without the failure bounds above.

Departure from Guided-GRPO (EasyR1): the original samples `n` copies of a request with one
seed, the source of its seed collapse; here every sample is its own request with its own seed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.actors.lora import AdapterSlots
from asyncrl.config import Config, RolloutConfig, rollout_device_defaults
from asyncrl.engine_setup import apply_engine_env, engine_core_forked, engine_env
from asyncrl.weights.local import LocalFeed
from asyncrl.weights.receiver import announced_version
from asyncrl.weights.store import STORE_NAME, fetch_weights
from asyncrl.weights.wire import WeightsInput

log = logging.getLogger(__name__)

EXTENSION = "asyncrl.actors.worker_extension.WeightReceiverExtension"
NATIVE_BACKEND = "asyncrl"  # registered by EXTENSION's module in every worker (WeightTransferEngineFactory)


@dataclass
class Generation:
    """Result of one request. Unpacks as `(token_ids, logprobs, finish_reason)`."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[int] = field(default_factory=list)

    def __iter__(self):  # the agreed 3-tuple contract
        return iter((self.token_ids, self.logprobs, self.finish_reason))


class WeightIntegrityError(RuntimeError):
    """The engine's weights keep differing from the published ones: never generate on them."""


def _merge_worker_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result for all tensor-parallel workers: the first bad one (else the first), with
    `touched` if any worker's model saw part of the round and the summed mismatch count."""
    bad = [r for r in results if r["status"] != "ok"]
    out = dict(bad[0] if bad else results[0])
    out["touched"] = bool(bad) and any(r.get("touched") for r in results)  # TP ranks may now disagree
    out["fingerprint_mismatch"] = sum(int(r.get("fingerprint_mismatch") or 0) for r in results)
    out["workers"] = results
    return out


def _lora_engine_kwargs(adapter: dict[str, Any] | None, keep: int) -> dict[str, Any]:
    """vLLM's LoRA engine arguments for adapters of `adapter["r"]`: room for `keep` versions in one
    batch (in-flight requests of older versions beside new ones) plus one being added."""
    if adapter is None:
        return {}
    return {"enable_lora": True, "max_lora_rank": int(adapter["r"]), "max_loras": keep, "max_cpu_loras": keep + 1}


@dataclass(frozen=True)
class EngineSpec:
    """Everything a `PolicyEngine` is built from, typed: the rollout section it reads and the
    engine's own settings. A job's rollout actor builds it with `from_job` (the one place that maps
    the job config onto the engine); tests and benches name only what they change."""

    model_path: str
    rollout: RolloutConfig  # reads the engine keys: dtype, lengths, KV cache, gpus_per_actor, weight path
    engine_id: str | None = None
    tokenizer_path: str | None = None
    max_model_len: int | None = None  # None: `rollout.max_model_len`
    seed: int = 0
    weight_timeout_s: float = 60.0
    weight_bucket_mb: float = 256.0
    store_name: str = STORE_NAME
    logprobs_mode: str = "processed_logprobs"
    version: int = 0
    # None: all buckets before loading on CPU (a failed round leaves the weights untouched); on GPUs
    # bucket by bucket (no second copy of the model in GPU memory; a failed round is then followed
    # by `load_weights_from_store`)
    weight_buffered: bool | None = None
    # a vision-language policy (Qwen-VL): vLLM gets the multimodal engine arguments
    # (`vision.vllm_mm_engine_kwargs(limit_images)`), `generate` accepts `multi_modal_data`, and every
    # weight load also resets vLLM's multimodal and encoder caches
    vl: bool = False
    limit_images: int = 0
    # the `adapter_config.json` of a LoRA policy synced as adapters (`actors.lora.AdapterSlots`, at
    # most `lora_keep` versions loaded); versions then arrive as adapters, not weights
    lora_adapter: dict[str, Any] | None = None
    lora_keep: int = 3
    worker_extension: str = EXTENSION  # vLLM's `worker_extension_cls`: EXTENSION or a subclass (tests)
    # `cluster.small_machine`: vLLM's imports without the cyclic GC and, on CPU, its engine-core
    # process forked from this one instead of spawned (`engine_core_forked`; `rollout.engine_fork`
    # can turn the fork off). Only for a process that does nothing but own the engine (the rollout
    # actor): the child inherits every module's state of the parent, e.g. the weight groups of a
    # test process that also ran the sender side (a native-path round then hung in the engine;
    # reproduced in tests/integration/test_engine.py).
    small_machine: bool = False

    @classmethod
    def from_job(cls, cfg: Config, engine_id: str, *, vl: bool = False) -> EngineSpec:
        """A rollout actor's engine: the policy at `model.path` (version 0), the weight sync's
        timeout and buckets, the small-machine switch, and the LoRA adapter slots when versions
        travel as adapters (`weights.adapter.sync_kind`: room for every version a group in flight
        may still sample from, `buffer.max_staleness + 2`; merged and full sync need none)."""
        from asyncrl.weights.adapter import adapter_config, sync_kind

        adapter = adapter_config(cfg.model.lora, cfg.model.path) if sync_kind(cfg, warn=True) == "adapter" else None
        return cls(cfg.model.path, cfg.rollout, engine_id=engine_id, tokenizer_path=cfg.model.tokenizer_path,
                   seed=cfg.rollout.seed, weight_timeout_s=cfg.learner.weights.timeout_s,
                   weight_bucket_mb=cfg.learner.weights.bucket_mb, vl=vl,
                   limit_images=cfg.rollout.limit_images if vl else 0,
                   lora_adapter=adapter, lora_keep=cfg.buffer.max_staleness + 2,
                   small_machine=bool(cfg.cluster.small_machine))


def _engine_args(spec: EngineSpec, on_gpu: bool, tensor_parallel: int) -> dict[str, Any]:
    """vLLM's `AsyncEngineArgs` of the spec on this device."""
    cfg = spec.rollout
    mm_kwargs: dict[str, Any] = {}
    if spec.vl:
        from asyncrl.vision import vllm_mm_engine_kwargs

        mm_kwargs = vllm_mm_engine_kwargs(spec.limit_images)
    eager, memory = rollout_device_defaults(cfg.gpus_per_actor)  # a bare RolloutConfig leaves them None
    eager = eager if cfg.enforce_eager is None else cfg.enforce_eager
    memory = memory if cfg.gpu_memory_utilization is None else cfg.gpu_memory_utilization
    return dict(
        model=spec.model_path, tokenizer=spec.tokenizer_path or spec.model_path, dtype=cfg.engine_dtype,
        seed=spec.seed, enforce_eager=eager, enable_prefix_caching=cfg.enable_prefix_caching,
        max_model_len=spec.max_model_len or cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, tensor_parallel_size=tensor_parallel,
        gpu_memory_utilization=memory, worker_extension_cls=spec.worker_extension,
        **({"weight_transfer_config": {"backend": NATIVE_BACKEND}} if cfg.weight_transfer == "native" else {}),
        logprobs_mode=spec.logprobs_mode, disable_log_stats=True, **mm_kwargs,
        **_lora_engine_kwargs(spec.lora_adapter, spec.lora_keep),
        # vLLM's CPU build cannot rewind a seeded request's generator after a partial (chunked)
        # prefill ("CPU Generator does not use offset"); without chunking a prefill waits for
        # token budget instead, and per-request seeds stay safe.
        enable_chunked_prefill=on_gpu,
        # CPU: `rollout.cpu_kvcache_gb`, fractions included; vLLM zero-fills all of it at start-up
        # (CPU time in proportion to its size, on every engine start; the quick start needs ~0.1 GiB)
        kv_cache_memory_bytes=None if on_gpu else int(cfg.cpu_kvcache_gb * 2**30),
    )


class PolicyEngine:
    """An async vLLM engine for the policy. Create inside a running process (Ray actor or a
    `__main__`-guarded script: vLLM starts its engine-core process, on CPU by fork when it can,
    `engine_core_forked`)."""

    def __init__(self, spec: EngineSpec, *, beside_build: Callable[[], None] | None = None) -> None:
        """`spec`: what to build (`EngineSpec`). `beside_build`: called once the engine-core process
        exists (`engine_core_forked`'s `after_fork`), to start work that runs while the engine core
        builds (~3 s on CPU)."""
        from asyncrl.small_machine.process import gc_paused

        cfg = spec.rollout
        # vLLM's imports (here and in its engine config below) without the cyclic GC: ~20 % less CPU
        with gc_paused(spec.small_machine):
            import torch
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

        self.spec = spec
        self.engine_id = spec.engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.on_gpu = torch.cuda.is_available() and cfg.gpus_per_actor > 0
        self.tensor_parallel = max(1, cfg.gpus_per_actor) if self.on_gpu else 1
        if not self.on_gpu:  # the KV cache is sized in bytes below; this (whole GiB) would override it
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self.version = spec.version
        self.weight_buffered = not self.on_gpu if spec.weight_buffered is None else spec.weight_buffered
        self.weight_timeout_s = spec.weight_timeout_s
        self.weight_bucket_mb = spec.weight_bucket_mb
        self.weight_transfer = cfg.weight_transfer
        self._native_senders: set[tuple[str, str]] = set()  # (address, prefix) the native engine knows
        self.store_name = spec.store_name
        self.vl = spec.vl
        args = AsyncEngineArgs(**_engine_args(spec, self.on_gpu, self.tensor_parallel))
        # read by vLLM when it builds the engine config and the engine-core process (inherited)
        env = engine_env(cfg.gpus_per_actor if self.on_gpu else 0, cfg.engine_in_process)
        apply_engine_env(env)
        in_process = env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # CPU, model worker in the engine core
        with gc_paused(spec.small_machine):  # left before the engine core is forked: the child would inherit it off
            vllm_config = args.create_engine_config()  # (vLLM's CPU platform asks for spawn here)
        fork = spec.small_machine and in_process and cfg.engine_fork is not False
        with engine_core_forked(fork, after_fork=beside_build) as forked:
            self.llm = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=True)
        self.engine_core_start = "forked" if forked else "spawned"  # reported in the actor's start line
        self._update_lock = asyncio.Lock()
        self.load_events: list[tuple[float, str]] = []  # (monotonic time, what): pause/resume/recovery
        self.fingerprint_mismatches = 0  # parameters found differing after loads, in total
        self.unsafe = False  # paused on weights that failed to load and could not be replaced
        self.adapters: AdapterSlots | None = None  # LoRA versions as adapters (model.lora, adapter sync)
        self._adapter_receivers: dict[tuple[str, str], Any] = {}
        if spec.lora_adapter is not None:
            self.adapters = AdapterSlots(self.llm, self.engine_id, spec.lora_adapter, spec.lora_keep)
        self._catch_up_task: asyncio.Future | None = None  # retries the store while unsafe

    # ---- generation -------------------------------------------------------------------------
    async def generate(self, prompt_ids: Sequence[int], max_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = -1, seed: int | None = None, *,
                       stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                       request_id: str | None = None,
                       on_tokens: Callable[[int], None] | None = None,
                       multi_modal_data: dict[str, Any] | None = None,
                       logit_bias: dict[int, float] | None = None) -> Generation:
        """Sample one response. `on_tokens(n)` (optional) is called with the number of tokens
        so far after every engine step that produced some (streaming progress). VL prompts:
        `prompt_ids` are the COLLAPSED ids (one placeholder per image, `vision.vllm_prompt`; never
        the processor-expanded ones) and `multi_modal_data` = {"image": [PIL images]};
        `logit_bias` {token: bias} is added to the logits before temperature."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            logprobs=0, output_kind=RequestOutputKind.DELTA, ignore_eos=ignore_eos,
            stop_token_ids=list(stop_token_ids or []), detokenize=False, skip_special_tokens=False,
            **({"logit_bias": dict(logit_bias)} if logit_bias else {}),
        )
        prompt = {"prompt_token_ids": [int(t) for t in prompt_ids], "cache_salt": f"v{self.version}"}
        if multi_modal_data is not None:
            prompt["multi_modal_data"] = multi_modal_data
        if self.adapters is not None:  # under the current adapter, continued under a newer one in flight
            return Generation(*await self.adapters.generate(prompt, params, request_id or uuid.uuid4().hex, on_tokens))
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish = "abort"
        async for out in self.llm.generate(prompt, params, request_id or uuid.uuid4().hex):
            chunk = out.outputs[0]
            new = list(chunk.token_ids)
            for pos, tok in enumerate(new):
                logprobs.append(float(chunk.logprobs[pos][tok].logprob))
            tokens.extend(new)
            versions.extend([self.version] * len(new))
            if on_tokens is not None and new:
                on_tokens(len(tokens))
            if chunk.finish_reason is not None:
                finish = str(chunk.finish_reason)
        return Generation(tokens, logprobs, finish, versions)

    # ---- weights ----------------------------------------------------------------------------
    def weight_member_ids(self, prefix: str | None = None) -> list[str]:
        """Members this engine contributes to a weight group (one per tensor-parallel rank; one
        in all for adapters, which vLLM's workers read from the engine's own directory)."""
        if self.adapters is not None:
            return [f"{prefix or self.engine_id}/tp0"]
        return [f"{prefix or self.engine_id}/tp{r}" for r in range(self.tensor_parallel)]

    def _event(self, what: str) -> None:
        self.load_events.append((time.monotonic(), what))
        del self.load_events[:-64]

    async def _paused(self, load) -> dict[str, Any]:
        """Pause (keep running requests), run `load()`, reset the prefix cache, resume.

        Safe loads: the version is bumped only after a load whose read-back fingerprint matched.
        A load that failed after the model saw part of the round (`touched`: streamed buckets,
        or a read-back mismatch) never resumes generation on those weights: the newest full
        version is reloaded from the WeightStore inside the same pause; if the store has none,
        the engine stays paused (status "paused_unsafe") until a later load succeeds; if the
        store's copy mismatches too, `WeightIntegrityError` is raised (still paused)."""
        async with self._update_lock:
            t0 = time.perf_counter()
            await self.llm.pause_generation(mode="keep", clear_cache=False)
            self._event("pause")
            await asyncio.sleep(0)  # let consumers drain chunks produced under the old version
            t_pause = time.perf_counter()
            result = await self._guarded(load)
            t_round = time.perf_counter()
            # the engine's phases (asyncrl.weights.phases.ENGINE_PHASES)
            phases = result["engine_phases"] = {"pause": t_pause - t0, "round": t_round - t_pause, "recover": 0.0}
            self.fingerprint_mismatches += int(result.get("fingerprint_mismatch") or 0)
            if result["status"] != "ok" and result.get("touched"):
                self._event("load_failed")
                log.warning("engine %s: weight load failed after touching the model (%s); reloading the newest "
                            "full version from the weight store before generating", self.engine_id,
                            result.get("error") or result["status"])
                recovered = await self._recover_from_store()
                result["recovered"] = recovered
                phases["recover"] = time.perf_counter() - t_round
                if recovered["status"] != "ok":
                    self.unsafe = True
                    result["seconds"] = time.perf_counter() - t0
                    result["status_before"], result["status"] = result["status"], "paused_unsafe"
                    self._event("stay_paused")
                    self._keep_catching_up()
                    return result
                result["version"] = recovered["version"]
                self._event("store_reload_ok")
            if result["status"] == "ok" or result.get("recovered", {}).get("status") == "ok":
                self.version = int(result["version"])
                self.unsafe = False
                await self.reset_prefix_cache()
                if self.vl:  # vLLM bug: a cached image of the old weights -> "Encoder cache miss"
                    await self.llm.reset_mm_cache()
                    await self.llm.reset_encoder_cache()
            t_resume = time.perf_counter()
            phases["reset_cache"] = t_resume - t_round - phases["recover"]
            if not self.unsafe:
                await self.llm.resume_generation()
                self._event("resume")
            result["seconds"] = time.perf_counter() - t0
            phases.update(resume=time.perf_counter() - t_resume, total=result["seconds"])
            return result

    @staticmethod
    async def _guarded(load) -> dict[str, Any]:
        """`load()`, with an exception out of it (an RPC timeout, a worker error) turned into a
        failed result instead of escaping `_paused` with the scheduler paused for good. The model
        may have seen part of the round, so it counts as `touched` (reloaded from the store)."""
        try:
            return await load()
        except WeightIntegrityError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported as a failed, touched load
            log.exception("weight load raised")
            return {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "touched": True}

    def _keep_catching_up(self, first_delay_s: float = 1.0, max_delay_s: float = 30.0) -> None:
        """Paused on weights that failed to load and could not be replaced (the store had no copy
        or did not answer): retry the store in the background until a version loads and the
        engine resumes. Without this a paused engine produces nothing, so the learner makes no
        new version and the rollout actor never calls for one: the job would starve."""
        if self._catch_up_task is not None and not self._catch_up_task.done():
            return

        async def retry() -> None:
            delay = first_delay_s
            while self.unsafe:
                await asyncio.sleep(delay)
                delay = min(2 * delay, max_delay_s)
                if self._update_lock.locked():  # another load is under way; it decides
                    continue
                try:
                    res = await self.load_weights_from_store()
                    self._event(f"catch_up_{res['status']}")
                except WeightIntegrityError:
                    log.exception("engine %s: the store's weights do not load cleanly; staying paused", self.engine_id)
                    return
                except Exception:  # noqa: BLE001 - the store may be restarting: try again later
                    log.warning("engine %s: catch-up from the weight store failed", self.engine_id, exc_info=True)

        self._catch_up_task = asyncio.ensure_future(retry())

    async def _recover_from_store(self) -> dict[str, Any]:
        """Inside a pause: load the newest published version whatever our own version is (the
        model may hold part of a newer one)."""
        try:
            fetched = await asyncio.to_thread(fetch_weights, self.store_name, -1, self.weight_timeout_s)
        except Exception as exc:  # noqa: BLE001 - no store (no Ray, nothing published): stay paused
            return {"status": "no_store", "error": f"{type(exc).__name__}: {exc}"}
        if fetched is None:
            return {"status": "no_store", "error": "nothing published yet"}
        version, buckets = fetched
        result = await self._guarded(lambda: self._load_named_unpaused(buckets, version))
        self.fingerprint_mismatches += int(result.get("fingerprint_mismatch") or 0)
        if result["status"] == "fingerprint_mismatch":
            self._event("store_reload_mismatch")
            self.unsafe = True  # stays paused; only a later verified load resumes it
            raise WeightIntegrityError(
                f"engine {self.engine_id}: the weights it holds still differ from the WeightStore's version "
                f"{version} after a reload ({result.get('fingerprint_mismatch')} parameters); refusing to generate")
        return result

    async def update_weights_from_group(self, address: str, *, timeout_s: float | None = None,
                                        member_prefix: str | None = None) -> dict[str, Any]:
        """Take part in the learner's next weight broadcast (sender at `address`). Status "ok"
        (version updated), "not_member" (asked to rejoin; call `load_weights_from_store`),
        "timeout" or "failed" (weights unchanged)."""
        timeout, prefix = timeout_s or self.weight_timeout_s, member_prefix or self.engine_id
        if self.adapters is not None:
            return await self._adapter_update(address, prefix, timeout)
        return await self._paused(lambda: self._round(address, prefix, timeout, self.weight_buffered))

    async def _round(self, address: str, prefix: str, timeout_s: float, buffered: bool, *,
                     once: bool = False) -> dict[str, Any]:
        """One round from the sender at `address` on the configured weight path (inside a pause),
        merged over the tensor-parallel workers. `once`: forget that sender afterwards."""
        if self.weight_transfer == "native":
            return await self._native_round(address, prefix, timeout_s, buffered, close=once)
        try:
            return _merge_worker_results(await self.llm.collective_rpc(
                "asyncrl_receive_weights", timeout=4 * timeout_s + 30, args=(address, prefix, timeout_s, buffered)))
        finally:
            if once:
                await self.llm.collective_rpc("asyncrl_close_receiver", args=(address, prefix))

    async def _native_round(self, address: str, prefix: str, timeout_s: float, buffered: bool, *,
                            close: bool = False) -> dict[str, Any]:
        """One round through vLLM's weight-transfer API (inside a pause). The worker engine
        records a failed round instead of raising, so `finish_weight_update` always runs (it puts
        the previous weights back where nothing arrived); the result comes from
        `asyncrl_native_result`. A verified round also sets vLLM's own weight version."""
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )

        info = {"address": address, "prefix": prefix, "timeout_s": timeout_s}
        if (address, prefix) not in self._native_senders:
            await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
            self._native_senders.add((address, prefix))
        if close:
            self._native_senders.discard((address, prefix))
        await self.llm.start_weight_update()
        try:  # the receiver bounds every wait itself; this outer bound is the extension path's
            await asyncio.wait_for(self.llm.update_weights(WeightTransferUpdateRequest(
                update_info={**info, "buffered": buffered, "close": close})), 4 * timeout_s + 30)
        finally:
            await self.llm.finish_weight_update()
        out = _merge_worker_results(await self.llm.collective_rpc("asyncrl_native_result"))
        if out["status"] == "ok":
            await self.llm.update_weight_version(str(out["version"]))
        return out

    async def announced_version(self, address: str) -> int:
        """Newest version the learner's sender at `address` has started to broadcast."""
        return await asyncio.to_thread(announced_version, address, self.weight_timeout_s)

    async def load_named_tensors(self, weights: WeightsInput, version: int) -> dict[str, Any]:
        """Load (name, tensor) pairs, buckets of them, or packed `(manifest, flat)` buckets into
        the engine through a private loopback gloo group (`asyncrl.weights.local.LocalFeed`: the
        same wire and checks as the broadcast)."""
        return await self._paused(lambda: self._load_named_unpaused(weights, version))

    async def _load_named_unpaused(self, weights: WeightsInput, version: int) -> dict[str, Any]:
        prefix = f"{self.engine_id}-local"
        feed = LocalFeed(self.weight_member_ids(prefix), bucket_mb=self.weight_bucket_mb,
                         timeout_s=self.weight_timeout_s)
        try:
            rpc = asyncio.ensure_future(self._round(feed.address, prefix, feed.timeout_s, True, once=True))
            report = await asyncio.to_thread(feed.send, weights, version)
            out = await rpc
            out["bytes"] = report.bytes
            return out
        finally:
            feed.close()

    async def load_weights_from_store(self, min_version: int | None = None) -> dict[str, Any]:
        """Catch up from the `WeightStore` copy (late join, restart, dropped member). Loads only
        a version newer than `min_version` (default: the engine's own)."""
        floor = self.version if min_version is None else min_version
        if self.adapters is not None:
            return await self._adapter_from_store(floor)
        if self.unsafe:  # paused on a half-loaded model: any full version beats it
            floor = -1
        fetched = await asyncio.to_thread(fetch_weights, self.store_name, floor, self.weight_timeout_s)
        if fetched is None:
            return {"status": "up_to_date", "version": self.version}
        version, buckets = fetched
        return await self.load_named_tensors(buckets, version)

    # ---- LoRA adapters (model.lora with adapter sync; asyncrl.actors.lora) ----------------------
    async def _adapter_update(self, address: str, prefix: str, timeout_s: float) -> dict[str, Any]:
        """One round of the weight group carrying an adapter, received in this process (the
        same membership, fingerprint and store fallbacks as weights), then loaded as a new LoRA.
        Generation goes on meanwhile: the base weights do not change."""
        from asyncrl.weights.receiver import WeightReceiver

        async with self._update_lock:
            t0 = time.perf_counter()
            member = self.weight_member_ids(prefix)[0]
            for stale in [k for k in self._adapter_receivers if k[0] != address]:  # a rebuilt learner's old sender
                self._adapter_receivers.pop(stale).close()
            rx = self._adapter_receivers.get((address, member))
            if rx is None:
                rx = await asyncio.to_thread(WeightReceiver, address, member, timeout_s)
                self._adapter_receivers[(address, member)] = rx
            result = await asyncio.to_thread(rx.receive, None, timeout_s=timeout_s)
            tensors = result.pop("tensors", None)
            if result["status"] == "ok":
                result.update(await self._load_adapter(int(result["version"]), tensors))
            result["seconds"] = time.perf_counter() - t0
            return result

    async def _adapter_from_store(self, floor: int) -> dict[str, Any]:
        """Catch up from the WeightStore's copy of the newest adapter."""
        from asyncrl.weights.wire import unpack_bucket

        fetched = await asyncio.to_thread(fetch_weights, self.store_name, floor, self.weight_timeout_s)
        if fetched is None:
            return {"status": "up_to_date", "version": self.version}
        version, buckets = fetched
        async with self._update_lock:
            t0 = time.perf_counter()
            result = await self._load_adapter(version, [nt for m, flat in buckets for nt in unpack_bucket(m, flat)])
            result["seconds"] = time.perf_counter() - t0
            return result

    async def _load_adapter(self, version: int, tensors: list[Any]) -> dict[str, Any]:
        result = await self.adapters.load(version, tensors)
        self.fingerprint_mismatches += int(result.get("fingerprint_mismatch") or 0)
        self.version = self.adapters.version
        self._event(f"adapter_{result['status']}_v{version}")
        return result

    async def reset_prefix_cache(self) -> bool:
        ok = await self.llm.reset_prefix_cache()
        if not ok:
            log.info("prefix cache reset refused (blocks in use); the version salt keeps old blocks unused")
        return bool(ok)

    def shutdown(self) -> None:
        self.llm.shutdown()
        if self.adapters is not None:
            self.adapters.close()
