"""Proves that the role split's model size is right: the parameter-count formula of
`asyncrl.config.model_size` equals transformers' own classes (built on the meta device, no memory)
for every entry of the known-model table (dense, MoE, Qwen2.5-VL and Qwen3-VL towers) to 0.01 %, and
exactly for the hybrid Qwen3.5 family (Gated DeltaNet layers; dense and MoE, text and VL classes, at
transformers' default shapes),
a local checkpoint's config.json is read (its dtype and KV shape), a linear-attention layer holds
no KV, and an unknown hub id has no size; the config package still imports without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config.model_size import KNOWN_MODELS, model_size, param_count, size_from_config
from asyncrl.config.role_split import engine_kv_seqs

ROOT = Path(__file__).resolve().parents[1].parent


def _hf_config(entry: dict):
    from transformers import AutoConfig

    d = {k: v for k, v in entry.items() if k not in ("model_type", "torch_dtype")}
    if entry["model_type"] == "qwen2_5_vl":  # transformers 5 nests the text dims
        vision, tied = d.pop("vision_config"), d.pop("tie_word_embeddings")
        return AutoConfig.for_model("qwen2_5_vl", text_config=d, vision_config=vision, tie_word_embeddings=tied)
    return AutoConfig.for_model(entry["model_type"], **d)


@pytest.mark.parametrize("model_id", sorted(KNOWN_MODELS))
def test_formula_equals_transformers_parameter_count(model_id: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    entry = KNOWN_MODELS[model_id]
    cls = AutoModelForImageTextToText if "vision_config" in entry else AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(_hf_config(entry))
    n = sum(p.numel() for p in model.parameters())
    assert abs(param_count(entry) - n) <= 1e-4 * n, (param_count(entry), n)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"])
def test_formula_equals_transformers_for_qwen3_5(model_type: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.for_model(model_type)  # transformers' defaults: 3 linear-attention layers per attention one
    cls = AutoModelForCausalLM if model_type.endswith("_text") else AutoModelForImageTextToText
    with torch.device("meta"):
        model = cls.from_config(cfg)
    assert param_count(cfg.to_dict()) == sum(p.numel() for p in model.parameters())


def test_published_sizes() -> None:
    # the model cards' counts: Qwen2.5-VL-32B 33.5B, Qwen3-VL-30B-A3B 31.1B, Qwen2.5-7B 7.61B
    sizes = {m: param_count(KNOWN_MODELS[m]) / 1e9 for m in KNOWN_MODELS}
    assert round(sizes["Qwen/Qwen2.5-VL-32B-Instruct"], 1) == 33.4
    assert round(sizes["Qwen/Qwen3-VL-30B-A3B-Instruct"], 1) == 31.1
    assert round(sizes["Qwen/Qwen2.5-7B-Instruct"], 2) == 7.62


def test_local_checkpoint_config_is_read(tmp_path: Path) -> None:
    cfg = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": False,
           "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    size = model_size(str(tmp_path))
    assert size is not None and str(tmp_path) in size.source
    # embed 100*64 + head 100*64 = 12800; layer: q 64*64 + k,v 2*64*32 + o 64*64 = 12288, biases
    # (4 + 2*2)*16 = 128, MLP 3*64*128 = 24576, norms 128 -> 37120; 2 layers + final norm 64 = 87104
    assert size.params == 12800 + 2 * 37120 + 64 and size.dtype_bytes == 4
    assert size.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K,V x layers x kv heads x head dim x fp32
    assert model_size(str(tmp_path), "bf16").dtype_bytes == 2  # the engine's dtype wins


def test_linear_attention_layers_hold_no_kv() -> None:
    cfg = {"model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128,
           "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}
    assert size_from_config(cfg, "t").kv_bytes_per_token == 2 * 1 * 2 * 16 * 2  # one full-attention layer


def test_unknown_hub_id_has_no_size() -> None:
    assert model_size("acme/mystery-7b") is None and model_size("Qwen/Qwen3-4B") is not None


def test_kv_heads_replicate_beyond_their_count() -> None:
    size = model_size("Qwen/Qwen3-VL-30B-A3B-Instruct")  # 4 KV heads
    _, at4 = engine_kv_seqs(size, 4, 4096)
    _, at8 = engine_kv_seqs(size, 8, 4096)
    assert "24 KiB/token" in at4 and "24 KiB/token" in at8  # 96 KiB / 4 heads, one head per GPU at TP 4 and 8


def test_config_package_imports_without_torch() -> None:
    code = "import sys, asyncrl.config.role_split, asyncrl.config.model_size; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
