"""The input embedding is packed for a GEMM only when one runs (asyncrl.small_machine.patches
.vllm_embedding_packs_lazily), against vLLM 0.32's real `UnquantizedEmbeddingMethod` on the CPU
build: an embedding gets a lazy `cpu_linear` that, called, builds vLLM's kernel and gives
F.linear's result; a `ParallelLMHead` is packed at once as before; switching the patch off puts
vLLM's own method back."""

from __future__ import annotations

import torch

from asyncrl.small_machine.patches import vllm_embedding_packs_lazily


def _layer(cls: type) -> torch.nn.Module:
    layer = cls.__new__(cls)  # no tensor-parallel group needed: only `weight` is read
    torch.nn.Module.__init__(layer)
    layer.weight = torch.nn.Parameter(torch.randn(300, 64), requires_grad=False)
    return layer


def test_embedding_packs_on_first_use_and_the_head_at_once() -> None:
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    vllm_original = getattr(UnquantizedEmbeddingMethod.process_weights_after_loading, "_asyncrl_original",
                            UnquantizedEmbeddingMethod.process_weights_after_loading)
    try:
        assert vllm_embedding_packs_lazily() is True
        assert vllm_embedding_packs_lazily() is True  # idempotent: one wrapper, not two
        method = UnquantizedEmbeddingMethod()
        embed, head = _layer(VocabParallelEmbedding), _layer(ParallelLMHead)
        method.process_weights_after_loading(embed)
        method.process_weights_after_loading(head)
        lazy = embed.cpu_linear
        assert lazy.__name__ == "pack_then_run" and head.cpu_linear.__name__ != "pack_then_run"
        x = torch.randn(5, 64)
        want = torch.nn.functional.linear(x, embed.weight)
        torch.testing.assert_close(embed.cpu_linear(x, embed.weight, None), want)
        assert embed.cpu_linear is not lazy  # packed by that first call, kept for the next
        torch.testing.assert_close(embed.cpu_linear(x, embed.weight, None), want)
        torch.testing.assert_close(head.cpu_linear(x, head.weight, None), torch.nn.functional.linear(x, head.weight))
    finally:
        assert vllm_embedding_packs_lazily(False) is False
    assert UnquantizedEmbeddingMethod.process_weights_after_loading is vllm_original
