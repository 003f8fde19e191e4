"""The launch-time memory guard (a registered preflight check): on a 24 GiB machine a quick start
whose policy has Qwen2.5-0.5B's published dimensions is refused before anything starts, naming
the components and their estimated bytes (the reported run was killed by Ray's memory monitor at
step 2: learner rank 0 15.2 GB resident, the engine 5.5 GB); the tiny quick start passes; a GPU or
joined-cluster job is not judged against this machine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from asyncrl.checks.preflight import CHECKS, memory_fit, memory_rows, read_model
from asyncrl.config import load_config

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


def test_the_two_real_size_jobs_that_were_killed_are_refused_and_the_12_layer_one_fits(tmp_path):
    # Measured (docs/benchmarks.md, "Scale") on this 23.5 GiB machine, ZeRO-0: with
    # the KL reference the job was killed by Ray's memory monitor in step 2 with learner rank 0 at
    # 15.2 GiB and the engine core at 4.5 GiB; without it, at 14.5 and 4.5 GiB. The estimate used to
    # say 11.1 GiB for the first learner and let both start. Now: the weight-sync host copy (4P =
    # 1.84 GiB), the optimizer's per-tensor temporaries (2 x the fp32 embedding, 1.0 GiB), glibc's
    # heap slack (22 % of 4P + 4P + 8P = 1.6 GiB): 13.7 + 1.8 = 15.5 GiB for the first learner. The
    # engine at its peak, a weight round: 4P weights 1.84 + the head's packed copy 4VH 0.51 + the
    # received version 4P 1.84 + the reloaded embedding 4VH 0.51 + KV 0.25 + runtime 1.5 = 6.4 GiB
    # (scripts/engine_memory.py measured the round's two terms at 2 layers: asyncrl/learner/memory.py).
    path = _policy_dir(tmp_path, QWEN25_05B)
    base = [f"model.path={path}", "learner.zero_stage=0", "rollout.guide.enable=false", "data.rollout_batch_size=2",
            "rollout.n=2", "data.max_response_length=16", "learner.mini_batches=1"]
    machine = 25_275_990_016  # this machine's MemTotal
    (row,) = _rows(load_config("configs/quickstart.yaml", base), machine)
    assert not row.ok
    for part in ("learner's weight-sync host copy (rank 0) 1.8", "allocator slack (glibc heap) 1.6",
                 "optimizer temporaries (2 x largest tensor) 1.0", "rollout engine x1 6.4"):
        assert part in row.result, row.result
    learner = float(row.result.split("learner rank x1 ")[1].split(",")[0]) + 1.8
    assert abs(learner - 15.2) / 15.2 < 0.05, row.result
    (row,) = _rows(load_config("configs/quickstart.yaml", [*base, "learner.kl.enable=false"]), machine)
    assert not row.ok, row.result
    # Qwen2.5-0.5B's shape with 12 of its 24 layers (0.315e9 parameters), KL off: the size that ran
    twelve = _policy_dir(tmp_path / "12", {**QWEN25_05B, "num_hidden_layers": 12})
    (row,) = _rows(load_config("configs/quickstart.yaml", [*base, f"model.path={twelve}", "learner.kl.enable=false"]),
                   machine)
    # (17.7 GiB before the store's two 256 MiB chunks in transit were counted, 18.2 before the engine's
    # weight round and head kernel replaced the vocabulary buffers once assumed: 19.2)
    assert row.ok and "0.32B parameters: 19.2 GiB of 21.2 GiB" in row.result, row.result
    # 20 layers (0.434e9), KL off, was accepted while the guard counted one store copy (20.0 GiB) and
    # Ray's monitor killed the rollout actor in step 3 (node at 24.01 of 25.28 GB, learner 12.1 GiB,
    # engine 5.0 GiB, the object store holding the current version while the next was put): with
    # two copies it is refused (21.7 GiB, now 23.6 with the engine's weight round); 16 layers ran
    # (19.7 GiB then, 21.4 now: just over the 10 % margin the guard keeps)
    twenty = _policy_dir(tmp_path / "20", {**QWEN25_05B, "num_hidden_layers": 20})
    (row,) = _rows(load_config("configs/quickstart.yaml", [*base, f"model.path={twenty}", "learner.kl.enable=false"]),
                   machine)
    assert not row.ok and "weight store copy x2 (current + next)" in row.result, row.result


def test_the_engine_estimate_counts_the_head_kernel_and_a_weight_round():
    from asyncrl.learner.memory import CPU_RUNTIME_BYTES, SHAPES, engine_host_bytes

    shape = SHAPES["qwen2.5-0.5b"]  # P = 0.494e9, V x H = 151,936 x 896 = 136,134,656
    parts = engine_host_bytes(shape, kv_cache_bytes=GiB // 4)
    assert parts["weights (fp32)"] == 1_976_000_000  # 4 B x 0.494e9
    assert parts["head GEMM kernel"] == 544_538_624  # 4 B x V x H: the head's packed copy
    # a round: the received fp32 version (4P) + the layer being reloaded, at most the embedding (4VH)
    assert parts["weight round (received version + one layer)"] == 1_976_000_000 + 544_538_624
    assert sum(parts.values()) == 2 * (1_976_000_000 + 544_538_624) + GiB // 4 + CPU_RUNTIME_BYTES  # 6.45 GiB
    # an adapter-only sync receives the adapter, not the model
    lora = engine_host_bytes(shape, GiB // 4, round_bytes=8_798_208)
    assert lora["weight round (received version + one layer)"] == 8_798_208 + 544_538_624
