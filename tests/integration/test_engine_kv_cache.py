"""The CPU engine's KV cache is `rollout.cpu_kvcache_gb` exactly, fractions of a GiB included, on the
REAL vLLM CPU build, even with the job's whole-GiB VLLM_CPU_KVCACHE_SPACE in the environment
(asyncrl.cluster exports it to every worker; vLLM would let it override the engine argument).
vLLM zero-fills the whole cache when the engine starts, so a tiny model's start-up pays for what
the config asks, not for a rounded-up GiB."""

from __future__ import annotations

import pytest
import torch
from test_engine import PROMPT, LoopThread, build_tiny_qwen

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_fractional_cpu_kv_cache(tmp_path, monkeypatch):
    from asyncrl.actors.engine import EngineSpec, PolicyEngine
    from asyncrl.config import RolloutConfig

    torch.set_num_threads(1)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # what the job's runtime_env carries
    path = build_tiny_qwen(tmp_path / "policy")
    lt = LoopThread()

    async def make():
        return PolicyEngine(EngineSpec(str(path), RolloutConfig(cpu_kvcache_gb=1 / 64, max_num_seqs=8), engine_id="kv",
                            max_model_len=128, weight_timeout_s=30))

    engine = lt.run(make())
    try:
        cache = engine.llm.vllm_config.cache_config
        assert cache.kv_cache_memory_bytes == 2**24  # 1/64 GiB = 16 MiB
        # build_tiny_qwen: 2 layers, 1 KV head of dim 64 / 2 heads = 32, fp32: one block of one layer
        # holds K and V = 2 x block_size x 1 x 32 x 4 bytes; 16 MiB / (that x 2 layers) blocks
        # (1 GiB would give 64x as many).
        per_block = 2 * 2 * cache.block_size * 1 * 32 * 4
        assert cache.num_gpu_blocks == 2**24 // per_block
        out = lt.run(engine.generate(PROMPT, 8, 1.0, seed=0))
        assert len(out.token_ids) > 0 and len(out.logprobs) == len(out.token_ids)
    finally:
        engine.shutdown()
        lt.loop.call_soon_threadsafe(lt.loop.stop)
