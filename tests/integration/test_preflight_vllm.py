"""asyncrl.checks.preflight derives a model's context as vLLM 0.32 does: the same config directories as
tests/unit/test_preflight.py (plus a legacy `rope_scaling` and a GPT-2 `n_positions`) given to
vLLM's own `ModelConfig`, whose `max_model_len` must equal `model_context(...).tokens`, and a
configured length above it refused by both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.checks.preflight import max_model_len_error, model_context, read_model
from tests.unit.test_preflight import CONTEXT_CASES, model_dir

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CASES = {
    **CONTEXT_CASES,
    "legacy rope_scaling x4": ({"rope_parameters": None, "rope_theta": 1e4,
                                "rope_scaling": {"type": "linear", "factor": 4.0}}, {"model_max_length": None}, 4096),
    "gpt2 n_positions": ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_positions": 512,
                          "n_embd": 128, "n_layer": 2, "n_head": 4, "max_position_embeddings": None},
                         {"model_max_length": None}, 512),
}


def test_same_context_as_vllm(tmp_path: Path) -> None:
    from vllm.config import ModelConfig

    for i, (name, (config, tokenizer, tokens)) in enumerate(CASES.items()):
        path = model_dir(tmp_path, f"m{i}", config=config, tokenizer=tokenizer)
        ours = model_context(read_model("model.path", str(path), None))
        theirs = ModelConfig(model=str(path)).max_model_len
        assert (name, ours.tokens) == (name, theirs) == (name, tokens)
        with pytest.raises(Exception, match="max_model_len"):
            ModelConfig(model=str(path), max_model_len=tokens + 1)
        assert max_model_len_error(read_model("model.path", str(path), None), ours, "rollout.max_model_len",
                                   tokens + 1) is not None
    vl = ROOT / "assets" / "tiny-vl-policy"
    assert model_context(read_model("model.path", str(vl), None)).tokens == ModelConfig(model=str(vl)).max_model_len
    assert json.loads((vl / "config.json").read_text())["model_type"] == "qwen2_vl"
