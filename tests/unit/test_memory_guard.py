"""The launch-time memory guard (a registered preflight check): on a 24 GiB machine a quick start
whose policy has Qwen2.5-0.5B's published dimensions is refused before anything starts, naming
the components and their estimated bytes (the reported run was killed by Ray's memory monitor at
step 2: learner rank 0 15.2 GB resident, the engine 5.5 GB); the tiny quick start passes; a GPU or
joined-cluster job is not judged against this machine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.preflight import CHECKS, memory_fit, memory_rows, read_model

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
              "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 32768, "torch_dtype": "float32"}


def _policy_dir(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "policy"
    shutil.copytree(ROOT / "assets" / "tiny-policy", path, ignore=shutil.ignore_patterns("*.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def _rows(cfg, machine: int):
    return memory_rows(cfg, read_model("model.path", cfg.model.path, None), machine)


def test_half_billion_quick_start_is_refused_on_24_gib_naming_the_components(tmp_path):
    path = _policy_dir(tmp_path, QWEN25_05B)
    cfg = load_config("configs/quickstart.yaml", [f"model.path={path}", "data.rollout_batch_size=2", "rollout.n=2",
                                                  "data.max_response_length=16"])
    (row,) = _rows(cfg, 24 * GiB)
    print(f"\n{row.result}")
    assert not row.ok and "0.49B parameters do not fit" in row.result
    for part in ("learner rank x1", "rollout engine x1", "weight store copy", "optimizer (fp32 master + Adam moments)",
                 "reference model", "gradients"):
        assert part in row.result
    assert "learner.zero_stage=0" in row.fix
    # the learner's share: 4P parameters + 8P gradients + 12P optimizer + 4P reference, P = 0.494e9
    # (13.8 GB of fp32 states), plus runtime and the small batch's activations and logits
    (big,) = _rows(cfg, 64 * GiB)
    assert big.ok


def test_tiny_quick_start_fits_and_the_check_is_registered():
    cfg = load_config("configs/quickstart.yaml", [])
    (row,) = _rows(cfg, 24 * GiB)
    assert row.ok and memory_fit in CHECKS
    gpu = load_config("configs/quickstart.yaml", ["learner.num_gpus=1"])
    assert memory_fit(gpu, {}) == []  # a GPU job: gpu_check's S3, not this machine's RAM
