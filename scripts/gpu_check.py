"""What one GPU without vLLM, Ray or network can prove about asyncrl, in one prepared run.

    python scripts/gpu_check.py [--wheelhouse DIR] [--out DIR] [--stages S0,S1,...]  # CUDA machine, < 8 min on one H200
    python scripts/gpu_check.py --cpu [--out DIR]             # dry mode: every stage that can, small shapes

`--wheelhouse DIR` (built by scripts/gpu_wheelhouse.sh: DeepSpeed, pydantic and what they need,
for Python 3.12) is installed first with `pip --no-index` into a directory put on sys.path, so
the stages that need them run on a machine that has only torch and transformers.

Stages (each reports status ok / failed / skipped with the reason, and its figures; a missing
package or device SKIPS the stages that need it, never fails them):
  S0 probe: Python, torch, CUDA, NCCL and driver versions, the device; which packages import.
  S1 the learner's chunked logprob / entropy kernels (asyncrl.learner.losses) on bf16 logits at a
     152k vocabulary against an fp32 reference: values, gradients, peak memory vs the unchunked form.
  S2 the weight wire (asyncrl.weights): bf16 bucket pack/unpack bit-exact on the device; a one-rank
     NCCL group built and connected the way the weight group does it (`connect_group`), a
     broadcast bounded by `wait_work`, `abort_group`; a gloo sender -> receiver round with CUDA
     tensors; pinned vs pageable device-to-host copy throughput. (NCCL refuses two ranks on one
     GPU, "Duplicate GPU detected": a multi-rank NCCL group cannot be tested on one device.)
  S3 the learner's memory per GPU for every recipe in configs/ (asyncrl.learner.memory, by
     component: parameters, gradients with fp32 accumulation, optimizer, the KL reference model,
     checkpointed activations, logits, runtime) against the recipes' 80 GB GPUs, with one
     Qwen2.5-7B decoder layer's recomputed activations per token measured here (bf16,
     checkpointed; its parameters' gradients subtracted).
  S4 logprob parity of the tiny policy (assets/tiny-policy) through the learner's forward: bf16 on
     the device vs fp32 on the CPU.
  S5 a one-rank DeepSpeed engine (ZeRO 0/2/3, bf16 on GPU): two optimizer steps on the tiny policy.
  S6 NCCL failure semantics under torch, in subprocesses: a one-rank collective held back on the
     GPU (a sleep kernel queued before it) passes its deadline; with the weight group's scoped
     TORCH_NCCL_ASYNC_ERROR_HANDLING=2 the group is aborted and the process survives torch's
     watchdog, with torch's default (3) the watchdog kills the process. And communicator creation
     with a member that never comes (a 2-rank group, rank 1 absent): `connect_group` gives up at
     its deadline, while a plain first collective is still blocked 10 s later.
  S7 asyncrl's real `LearnerWorker.train_step` (bf16, ZeRO-3, gradient checkpointing, several
     micro-batches) on the tiny policy, then `export_named_tensors` through a `WeightSender` into
     a `WeightReceiver`: bit-exact against the learner's own parameters.
  S8 left-padded bf16 attention (the learner's batch layout) against each row run unpadded.
  S9 gradient accumulation over 32 micro-batches under DeepSpeed (ZeRO-1 and ZeRO-3, bf16) with
     `grad_accum_dtype` fp32 (the learner's config) and bf16 (DeepSpeed's default), against an
     fp32 reference.
  S10 the store copy of a 7B bf16 model (15.2 GB) through the sender's pinned host arena: seconds
     and page-locked bytes per version, first and second version.
  S11 asyncrl's weight-sync phases at Qwen2.5-7B bf16 shapes, timed with CUDA events
     (`asyncrl.weights.phases`): pack, store copy, fingerprint, a one-rank NCCL broadcast, the
     receive side's copies; the round with the store copy on the critical path, overlapped with
     the wire (side stream), and off.

Imports only the standard library, torch and asyncrl modules that import nothing else at import
time; each stage imports what it needs and is skipped if that is missing. Writes
`<out>/gpu_check-<date>-<device>.json` and a readable summary next to it after EVERY stage (a
lease that ends mid-run returns what ran) and prints each stage's figures as it finishes.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import sys
import threading
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's asyncrl, installed or not

import torch  # noqa: E402

# Qwen2.5-7B's shape (config.json of the published model)
QWEN7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
              num_hidden_layers=28, vocab_size=152064)
RECIPE_GPU_BYTES = 80 * 10**9  # the recipes' GPUs (A100/H100 80 GB), not the lent device's 141 GB


class Skip(Exception):
    """A stage cannot run here (missing package or device); not a failure."""


def _need(*modules: str) -> None:
    """Skip the stage unless every module imports."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure means: cannot run here
            raise Skip(f"{name} does not import ({type(exc).__name__}: {exc}); "
                       "install it (scripts/gpu_wheelhouse.sh, --wheelhouse)") from None


def install_wheelhouse(path: Path, target: Path) -> list[str]:
    """`pip install --no-index --no-deps` every wheel of `path` into `target` and put it first on
    sys.path (and PYTHONPATH, for the stages' subprocesses). Returns the wheels installed."""
    import subprocess

    wheels = sorted(str(w) for w in path.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"--wheelhouse {path}: no .whl files there (build it with scripts/gpu_wheelhouse.sh)")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--upgrade",
                    "--target", str(target), *wheels], check=True)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), str(ROOT), os.environ.get("PYTHONPATH")]))
    importlib.invalidate_caches()
    return [Path(w).name for w in wheels]


def _device(cpu: bool) -> torch.device:
    if cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Skip("no CUDA device (use --cpu for the dry mode)")
    return torch.device("cuda", 0)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _peak_reset(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)


def _peak_gib(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None


# ---------------------------------------------------------------------------------------- S0
def _driver_version() -> str:
    """The NVIDIA driver's version (vLLM 0.32's CUDA 13 build needs >= 580)."""
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True).stdout.split()[0]
    except Exception:  # noqa: BLE001 - no nvidia-smi: the CUDA driver API's number instead
        try:
            import ctypes

            v = ctypes.c_int()
            ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v))
            return f"CUDA driver API {v.value // 1000}.{v.value % 1000 // 10}"
        except Exception as exc:  # noqa: BLE001
            return f"unknown ({type(exc).__name__})"


def s0_probe(args) -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, device_memory_gib=props.total_memory / 2**30, device_count=torch.cuda.device_count(),
                   capability=f"{props.major}.{props.minor}", bf16=torch.cuda.is_bf16_supported())
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001
            out["nccl"] = f"unavailable: {exc}"
        out["driver"] = _driver_version()
    out["dist_nccl_available"] = torch.distributed.is_nccl_available()
    mods = {}
    for name in ("transformers", "deepspeed", "pydantic", "numpy", "safetensors", "msgpack", "yaml"):
        try:
            m = importlib.import_module(name)
            mods[name] = getattr(m, "__version__", "imported")
        except Exception as exc:  # noqa: BLE001 - report, never fail the probe
            mods[name] = f"missing ({type(exc).__name__})"
    for name, dist_name in (("vllm", "vllm"), ("ray", "ray"), ("zmq", "pyzmq")):  # not needed here: not imported
        found = importlib.util.find_spec(name) is not None
        try:
            version = importlib.metadata.version(dist_name) if found else None
        except importlib.metadata.PackageNotFoundError:
            version = None
        mods[name] = f"installed {version or ''}".strip() if found else "missing"
    out["imports"] = mods
    return out


# ---------------------------------------------------------------------------------------- S1
def s1_kernels(args) -> dict[str, Any]:
    from asyncrl.learner.losses import entropy_from_logits, logprobs_from_logits

    dev = _device(args.cpu)
    rows, vocab = (64, 4096) if args.cpu else (4096, QWEN7B["vocab_size"])
    dtype = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    base = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    grad_lp, grad_h = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    out: dict[str, Any] = {"rows": rows, "vocab": vocab, "logits_dtype": str(dtype)}
    for temperature in (1.0, 0.7):
        # fp32 reference on the same (bf16-rounded) logits
        ref_x = base.detach().float().to(dev).requires_grad_(True)
        ref_lp = torch.log_softmax(ref_x / temperature, -1).gather(-1, labels.to(dev)[:, None])[:, 0]
        logq = torch.log_softmax(ref_x / temperature, -1)
        ref_h = -(logq.exp() * logq).sum(-1)
        (ref_lp * grad_lp.to(dev)).sum().add((ref_h * grad_h.to(dev)).sum()).backward()
        x = base.detach().clone().to(dev).requires_grad_(True)
        _peak_reset(dev)
        before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        t = time.perf_counter()
        lp = logprobs_from_logits(x, labels.to(dev), temperature, chunk_rows=1024 if not args.cpu else 16)
        h = entropy_from_logits(x, temperature, chunk_rows=1024 if not args.cpu else 16)
        (lp * grad_lp.to(dev)).sum().add((h * grad_h.to(dev)).sum()).backward()
        _sync(dev)
        secs = time.perf_counter() - t
        peak = (torch.cuda.max_memory_allocated(dev) - before) / 2**30 if dev.type == "cuda" else None
        key = f"T={temperature}"
        out[key] = {
            "logprob_max_abs_err": float((lp - ref_lp.detach()).abs().max()),
            "entropy_max_abs_err": float((h - ref_h.detach()).abs().max()),
            # the gradient lands in bf16 (the logits' dtype): compare at bf16 resolution
            "grad_max_abs_err": float((x.grad.float() - ref_x.grad).abs().max()),
            "grad_ref_max_abs": float(ref_x.grad.abs().max()),
            "seconds_fwd_bwd": secs, "peak_extra_gib": peak,
        }
        out[key]["ok"] = (out[key]["logprob_max_abs_err"] < 1e-3 and out[key]["entropy_max_abs_err"] < 1e-3
                          and out[key]["grad_max_abs_err"] <= 0.02 * max(out[key]["grad_ref_max_abs"], 1e-6))
        del ref_x, x, logq
    if dev.type == "cuda":  # the unchunked form's peak, for scale
        x = base.detach().clone().to(dev).requires_grad_(True)
        _peak_reset(dev)
        before = torch.cuda.memory_allocated(dev)
        naive = torch.log_softmax(x.float(), -1).gather(-1, labels.to(dev)[:, None]).sum()
        naive.backward()
        _sync(dev)
        out["unchunked_peak_extra_gib"] = (torch.cuda.max_memory_allocated(dev) - before) / 2**30
    out["ok"] = all(out[f"T={t}"]["ok"] for t in (1.0, 0.7))
    return out


# ---------------------------------------------------------------------------------------- S2
def s2_wire(args) -> dict[str, Any]:
    import torch.distributed as dist

    from asyncrl.weights.group import abort_group, connect_group, make_group, make_store, wait_work
    from asyncrl.weights.sender import WeightSender
    from asyncrl.weights.wire import pack_buckets, unpack_bucket

    dev = torch.device("cpu") if args.cpu else _device(False)
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(1)
    n = 1 if args.cpu else 64
    tensors = {f"layer{i}.w": (torch.randn(256 * n, 256, generator=g)).to(torch.bfloat16).to(dev) for i in range(8)}
    tensors["norm"] = torch.randn(256, generator=g).to(torch.bfloat16).to(dev)
    buckets = list(pack_buckets(tensors.items(), 2**20 * n))
    back = {k: v for m, f in buckets for k, v in unpack_bucket(m, f)}
    out["pack_unpack_bit_exact"] = all(torch.equal(back[k].view(torch.int16), t.view(torch.int16))
                                       for k, t in tensors.items())
    out["buckets"] = len(buckets)

    # one-rank NCCL group, built and connected as the weight group does it, bounded wait, abort
    if dev.type == "cuda" and dist.is_nccl_available():
        store = make_store("127.0.0.1", 0, is_master=True, timeout_s=30)
        t = time.perf_counter()
        pg = connect_group(lambda: make_group(store, 1, 0, 1, "nccl", 30.0, dev), dev, time.monotonic() + 60, 150.0)
        connect_s = time.perf_counter() - t
        flat = buckets[0][1].clone()
        wait_work(pg.broadcast([flat]), time.monotonic() + 30)
        out["nccl_one_rank"] = {"broadcast_ok": bool(torch.equal(flat, buckets[0][1])), "seconds_connect": connect_s,
                                "seconds_build_and_broadcast": time.perf_counter() - t,
                                "error_handling_env_after_build": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}
        abort_group(pg)
        out["nccl_one_rank"]["aborted"] = True  # S6 measures what the scoped error handling does
        out["nccl_multi_rank"] = "not testable on one GPU (NCCL refuses two ranks on one device)"
    else:
        out["nccl_one_rank"] = "skipped: no CUDA/NCCL (dry mode)"

    # gloo sender -> receiver (thread) with device tensors: bit-exact
    from asyncrl.weights.receiver import WeightReceiver

    cfg = argparse.Namespace(bucket_mb=1.0 * n, gloo_bucket_mb=16.0, backend="gloo", timeout_s=30.0, host="127.0.0.1")
    sender = WeightSender(cfg, members=["r0"])
    box: dict[str, Any] = {}

    def recv() -> None:
        rec = WeightReceiver(sender.address, "r0", timeout_s=30.0)
        box["res"] = rec.receive(None, timeout_s=60)

    th = threading.Thread(target=recv, daemon=True)
    th.start()
    t = time.perf_counter()
    report = sender.broadcast(tensors.items(), 1)
    th.join(90)
    res = box.get("res", {})
    got = dict(res.get("tensors") or [])
    out["gloo_round"] = {"status": res.get("status"), "acked": report.acked, "seconds": time.perf_counter() - t,
                         "bytes": report.bytes, "fingerprint_mismatch": res.get("fingerprint_mismatch"),
                         "bit_exact": bool(got) and all(torch.equal(got[k].view(torch.int16), v.cpu().view(torch.int16))
                                                        for k, v in tensors.items())}
    sender.close()

    # pinned vs pageable device -> host
    if dev.type == "cuda":
        big = torch.empty(2**28, dtype=torch.bfloat16, device=dev)  # 512 MiB
        rates = {}
        for kind in ("pageable", "pinned"):
            host = torch.empty(big.shape, dtype=big.dtype, pin_memory=(kind == "pinned"))
            host.copy_(big)
            _sync(dev)
            t = time.perf_counter()
            for _ in range(3):
                host.copy_(big, non_blocking=(kind == "pinned"))
            _sync(dev)
            rates[f"{kind}_gib_per_s"] = 3 * big.numel() * 2 / 2**30 / (time.perf_counter() - t)
        out["d2h"] = rates
    else:
        out["d2h"] = "skipped: no CUDA (dry mode)"
    out["ok"] = out["pack_unpack_bit_exact"] and out["gloo_round"]["bit_exact"] and out["gloo_round"]["status"] == "ok"
    return out


# ---------------------------------------------------------------------------------------- S3
def _decoder_stack(layers: int, dev: torch.device, tiny: bool):
    """Qwen2.5-7B-shaped decoder layers (tiny in dry mode) with checkpointing, the embedding
    frozen: what a backward holds beyond the layers' own gradients is their activations."""
    from transformers import Qwen2Config, Qwen2Model

    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512) if tiny else {k: v for k, v in QWEN7B.items() if k != "num_hidden_layers"}
    cfg = Qwen2Config(**shape, num_hidden_layers=layers, max_position_embeddings=32768)
    cfg._attn_implementation = "sdpa"
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    with torch.device(dev):
        model = Qwen2Model(cfg).to(dtype)
    model.embed_tokens.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, cfg


def _measure_layers(layers: int, dev: torch.device, tiny: bool, seq: int, batch: int) -> dict[str, float]:
    model, cfg = _decoder_stack(layers, dev, tiny)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)
    layer_params = sum(p.numel() for p in model.layers.parameters())
    elem = next(model.layers.parameters()).element_size()
    for _ in range(2):  # warm-up, then measured
        model.zero_grad(set_to_none=True)
        _peak_reset(dev)
        base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        t = time.perf_counter()
        h = model(input_ids=ids, use_cache=False).last_hidden_state
        h.float().pow(2).mean().backward()
        _sync(dev)
        secs = time.perf_counter() - t
        peak = (torch.cuda.max_memory_allocated(dev) - base) if dev.type == "cuda" else float("nan")
    out = {"layers": layers, "layer_params": layer_params, "seconds": secs, "peak_extra_bytes": peak,
           "layer_grad_bytes": layer_params * elem, "hidden": cfg.hidden_size}
    del model, h
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def s3_memory_model(args) -> dict[str, Any]:
    _need("transformers")
    from asyncrl.learner.memory import GiB

    dev = _device(args.cpu)
    tiny = args.cpu
    seq, batch = (128, 2) if tiny else (4096, 2)
    tokens = seq * batch
    one, two = (_measure_layers(n, dev, tiny, seq, batch) for n in (1, 2))
    elem = 4 if dev.type == "cpu" else 2
    act_per_token = None
    if dev.type == "cuda":  # one layer's peak beyond its gradients and the layer-boundary states
        act = one["peak_extra_bytes"] - one["layer_grad_bytes"] - 2 * tokens * one["hidden"] * elem
        act_per_token = max(0.0, act / tokens)
    layer_s = two["seconds"] - one["seconds"]
    out: dict[str, Any] = {"tokens_per_micro_batch": tokens, "measured": {"1_layer": one, "2_layers": two},
                           "recompute_activation_bytes_per_token_per_layer": act_per_token,
                           "seconds_per_layer_fwd_bwd": layer_s,
                           "tokens_per_s_per_layer": tokens / layer_s if layer_s > 0 else None,
                           "shape": "tiny (dry mode)" if tiny else "Qwen2.5-7B layer, bf16, checkpointed",
                           "budget_gib": RECIPE_GPU_BYTES / GiB}
    out["recipes"] = _recipes(act_per_token, out["tokens_per_s_per_layer"])
    return out


def _recipes(act_per_token_layer: float | None, tok_s_layer: float | None) -> list[dict[str, Any]]:
    """Per-GPU learner memory of each GPU recipe in configs/ (asyncrl.learner.memory, by
    component) against the recipes' 80 GB GPUs."""
    try:
        import yaml
    except Exception:  # noqa: BLE001
        return [{"skipped": "pyyaml missing"}]
    from asyncrl.learner.memory import GiB, describe, rank_bytes, shape_for

    rows = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text()) or {}
        learner, model = doc.get("learner") or {}, str((doc.get("model") or {}).get("path", ""))
        gpus = int(learner.get("num_gpus", 0))
        if gpus <= 0:
            continue
        shape = shape_for(model)
        if shape is None:
            rows.append({"recipe": path.name, "skipped": f"unknown model size for {model!r}"})
            continue
        stage = int(learner.get("zero_stage", 1))
        tokens = int(learner.get("micro_batch_tokens", 8192))
        kl = bool((learner.get("kl") or {}).get("enable", False))
        bf16 = learner.get("precision", "auto") != "fp32"
        parts = rank_bytes(shape, ranks=gpus, zero_stage=stage, bf16=bf16, micro_batch_tokens=tokens,
                           reference=kl, act_bytes_per_token_layer=act_per_token_layer, gpu=True)
        total = sum(parts.values())
        row = {"recipe": path.name, "model": shape.name, "learner_gpus": gpus, "zero_stage": stage,
               "micro_batch_tokens": tokens, "kl_reference": kl, "estimated_gib_per_gpu": round(total / GiB, 1),
               "budget_gib": round(RECIPE_GPU_BYTES / GiB, 1), "fits": total < 0.9 * RECIPE_GPU_BYTES,
               "components_gib": {k: round(v / GiB, 2) for k, v in parts.items()},
               "summary": describe(parts, RECIPE_GPU_BYTES)}
        if act_per_token_layer is None:
            row["note"] = "recompute activations not measured (CPU dry mode): the model's default per-token factor"
        if tok_s_layer:
            row["estimated_train_tokens_per_s_per_gpu"] = round(tok_s_layer / shape.layers * (7.62e9 / shape.params), 1)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------- S4
def _tiny_policy(dtype: torch.dtype, dev: torch.device):
    _need("transformers")
    from transformers import AutoModelForCausalLM

    path = ROOT / "assets" / "tiny-policy"
    if not (path / "config.json").exists():
        raise Skip(f"{path} missing")
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).to(dev)


def _learner_logprobs(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The learner's forward (`Learner._forward_logits`) and kernel on [n, P + T] ids."""
    from asyncrl.learner.losses import logprobs_from_logits

    t = ids.shape[1] - prompt_len
    attn = torch.ones_like(ids)
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=t + 1,
                   use_cache=False).logits[:, :-1]
    return logprobs_from_logits(logits, ids[:, -t:])


def s4_parity(args) -> dict[str, Any]:
    _need("transformers")
    dev = torch.device("cpu") if args.cpu else _device(False)
    ref_model = _tiny_policy(torch.float32, torch.device("cpu")).eval()
    test_model = _tiny_policy(torch.bfloat16, dev).eval()
    g = torch.Generator().manual_seed(2)
    vocab = ref_model.config.vocab_size
    ids = torch.randint(3, vocab, (8, 48), generator=g)
    with torch.no_grad():
        ref = _learner_logprobs(ref_model, ids, 16)
        got = _learner_logprobs(test_model, ids.to(dev), 16).cpu()
    diff = (got - ref).abs()
    return {"compare": f"bf16 on {dev.type} vs fp32 on cpu", "max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()), "mean_ref_logprob": float(ref.mean()),
            "ok": float(diff.mean()) < 0.05}


# ---------------------------------------------------------------------------------------- S5
def s5_deepspeed(args) -> dict[str, Any]:
    try:
        import deepspeed
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"deepspeed does not import ({type(exc).__name__}: {exc}); carry its wheel to run S5") from None

    dev = torch.device("cpu") if args.cpu else _device(False)
    _init_one_rank(deepspeed, dev)
    g = torch.Generator().manual_seed(3)
    out: dict[str, Any] = {"deepspeed": deepspeed.__version__}
    stages = (0, 3) if args.cpu else (0, 2, 3)
    for stage in stages:
        model = _tiny_policy(torch.float32, torch.device("cpu"))
        ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                     "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
                     "bf16": {"enabled": dev.type == "cuda"}, "steps_per_print": 10**9}
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        t = time.perf_counter()
        engine, *_ = deepspeed.initialize(model=model, optimizer=optim, config=ds_config)
        ids = torch.randint(3, model.config.vocab_size, (4, 32), generator=g).to(engine.device)
        losses = []
        for _ in range(2):
            lp = _learner_logprobs(engine, ids, 8)
            loss = -lp.mean()
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        out[f"zero{stage}"] = {"losses": losses, "finite": all(math.isfinite(x) for x in losses),
                               "improved": losses[1] < losses[0], "seconds": time.perf_counter() - t}
        del engine, model, optim
    out["ok"] = all(out[f"zero{s}"]["finite"] for s in stages)
    return out


# ---------------------------------------------------------------------------------------- S6
NCCL_CHILD = r"""
import json, os, sys, time
from datetime import timedelta
sys.path.insert(0, sys.argv[1])
import torch
import torch.distributed as dist
from asyncrl.weights import group as g

mode = sys.argv[2]
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
store = g.make_store("127.0.0.1", 0, is_master=True, timeout_s=30)
if mode == "connect":  # a 2-rank group whose other member never comes: communicator creation
    import threading
    t = time.monotonic()
    try:
        g.connect_group(lambda: g.make_group(store, 1, 0, 2, "nccl", 2.0, dev), dev, time.monotonic() + 3.0, 60.0)
        status = "connected"
    except g.CollectiveTimeout:
        status = "passed_deadline"
    print(json.dumps({"event": "connect", "status": status, "s": round(time.monotonic() - t, 3)}), flush=True)
    box = {}
    pg = g.make_group(store, 2, 0, 2, "nccl", 2.0, dev)  # the unbounded way: first collective in a thread
    th = threading.Thread(target=lambda: box.update(work=pg.broadcast([torch.ones(1, device=dev)])), daemon=True)
    th.start()
    th.join(10.0)
    print(json.dumps({"event": "plain_first_collective", "returned_within_10s": not th.is_alive()}), flush=True)
    os._exit(0)
if mode == "scoped":  # the weight group's way: make_group, error handling 2 while it is constructed
    g.backstop_timeout = lambda timeout_s: timedelta(seconds=3)  # the group's own (watchdog) timeout
    pg = g.make_group(store, 1, 0, 1, "nccl", 1.0, dev)
else:  # torch's default error handling (3): a timed-out collective tears the process down
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=3)
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("default", store), 0, 1, opts)
x = torch.ones(1 << 20, device=dev)
g.wait_work(pg.broadcast([x]), time.monotonic() + 60)  # the communicator exists now
torch.cuda.synchronize()
torch.cuda._sleep(int(3e10))  # ~15 s of GPU time queued ahead of the next collective
work = pg.broadcast([x])
t = time.monotonic()
try:
    g.wait_work(work, time.monotonic() + 1.0)
    status = "completed"
except g.CollectiveTimeout:
    status = "passed_deadline"
print(json.dumps({"event": "deadline", "status": status, "s": round(time.monotonic() - t, 3)}), flush=True)
if mode == "scoped":
    g.abort_group(pg)
time.sleep(12)  # well past the group's 3 s timeout: torch's watchdog has acted by now
print(json.dumps({"event": "alive_after_watchdog"}), flush=True)
os._exit(0)
"""


def s6_nccl_failure(args) -> dict[str, Any]:
    """A collective past its deadline: the scoped error handling keeps the process, torch's
    default kills it (what `make_group`'s TORCH_NCCL_ASYNC_ERROR_HANDLING=2 is for)."""
    import subprocess

    if args.cpu or not torch.cuda.is_available():
        raise Skip("needs a CUDA device (NCCL)")
    if not torch.distributed.is_nccl_available():
        raise Skip("torch has no NCCL")
    out: dict[str, Any] = {}
    for mode in ("connect", "scoped", "default"):
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", NCCL_CHILD, str(ROOT), mode], capture_output=True, text=True,
                              timeout=120)
        events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        out[mode] = {"returncode": proc.returncode, "events": events, "seconds": round(time.perf_counter() - t, 1),
                     "stderr_tail": proc.stderr[-600:]}
    scoped, default = out["scoped"], out["default"]
    connect = {e["event"]: e for e in out["connect"]["events"]}
    out["connect_bounded"] = connect.get("connect", {}).get("status") == "passed_deadline"
    out["plain_first_collective_blocks"] = connect.get("plain_first_collective", {}).get("returned_within_10s") is False
    passed = [e.get("status") for e in scoped["events"] if e["event"] == "deadline"] == ["passed_deadline"]
    out["scoped_survives"] = scoped["returncode"] == 0 and any(e["event"] == "alive_after_watchdog"
                                                                for e in scoped["events"])
    out["default_dies"] = default["returncode"] != 0 and not any(e["event"] == "alive_after_watchdog"
                                                                  for e in default["events"])
    out["ok"] = passed and out["scoped_survives"] and out["default_dies"] and out["connect_bounded"]
    return out


# ---------------------------------------------------------------------------------------- S7
def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _learner_config(args, tmp: str, **over: Any):
    from asyncrl.config import load_config

    items = {"model.path": str(ROOT / "assets" / "tiny-policy"), "trainer.run_dir": tmp, "learner.zero_stage": 3,
             "model.gradient_checkpointing": True, "learner.micro_batch_tokens": 96, "learner.mini_batches": 1,
             "learner.optim.lr": 1e-4, **({"learner.cpu_ranks": 1} if args.cpu else {"learner.num_gpus": 1})}
    items.update(over)
    return load_config(None, [f"{k}={v}" for k, v in items.items()])


def s7_learner_step(args) -> dict[str, Any]:
    _need("deepspeed", "pydantic", "transformers", "yaml", "msgpack")
    import tempfile

    from asyncrl.bench.learner import synthetic_groups
    from asyncrl.learner.learner import LearnerWorker
    from asyncrl.weights.receiver import WeightReceiver
    from asyncrl.weights.sender import WeightSender

    if not (ROOT / "assets" / "tiny-policy" / "config.json").exists():
        raise Skip("assets/tiny-policy missing")
    _device(args.cpu)
    cfg = _learner_config(args, tempfile.mkdtemp(prefix="gpu-check-learner-"))
    t = time.perf_counter()
    worker = LearnerWorker(cfg, 0, 1, "127.0.0.1", _free_port())
    build_s = time.perf_counter() - t
    bucket = 256 * 1024

    def full() -> dict[str, torch.Tensor]:
        return {n: x.detach().to("cpu", copy=True) for b in worker.export_named_tensors(bucket) for n, x in b}

    before = full()
    t = time.perf_counter()
    metrics = worker.train_step(synthetic_groups(4, 4, worker.vocab_size, (4, 12), (8, 40), seed=7))
    step_s = time.perf_counter() - t
    after = full()
    moved = max(float((after[k].float() - before[k].float()).abs().max()) for k in after)
    sender = WeightSender(argparse.Namespace(bucket_mb=0.25, gloo_bucket_mb=0.25, backend="gloo", timeout_s=60.0,
                                             host="127.0.0.1"), members=["r0"])
    box: dict[str, Any] = {}
    th = threading.Thread(target=lambda: box.update(res=WeightReceiver(sender.address, "r0", 60.0).receive(None)),
                          daemon=True)
    th.start()
    report = sender.broadcast(worker.export_named_tensors(bucket), worker.version)
    th.join(120)
    sender.close()
    got = dict(box.get("res", {}).get("tensors") or [])
    exact = bool(got) and set(got) == set(after) and all(
        torch.equal(got[k].cpu().view(torch.uint8), after[k].contiguous().view(torch.uint8)) for k in after)
    out = {"precision": worker.precision, "zero_stage": 3, "gradient_checkpointing": True,
           "micro_batches": metrics.get("perf/micro_batches"), "loss_pg": metrics.get("loss/pg"),
           "grad_norm": metrics.get("train/grad_norm"), "optimizer_steps": metrics.get("train/optimizer_steps"),
           "max_param_change": moved, "seconds_build": build_s, "seconds_step": step_s,
           "export_round": {"status": box.get("res", {}).get("status"), "acked": report.acked,
                            "buckets": report.buckets, "bytes": report.bytes, "bit_exact": exact}}
    out["ok"] = (math.isfinite(float(metrics.get("loss/pg", float("nan")))) and moved > 0 and exact
                 and (metrics.get("perf/micro_batches") or 0) > 1)
    return out


# ---------------------------------------------------------------------------------------- S8
def s8_left_padding(args) -> dict[str, Any]:
    """The learner's layout (prompts left-padded, responses right-padded, positions counting real
    tokens only) in bf16 against each row alone: padding must not change a response logprob
    beyond bf16 noise."""
    from asyncrl.learner.losses import logprobs_from_logits

    dev = torch.device("cpu") if args.cpu else _device(False)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    model = _tiny_policy(dtype, dev).eval()
    g = torch.Generator().manual_seed(8)
    vocab = model.config.vocab_size
    rows = [(torch.randint(3, vocab, (p,), generator=g), torch.randint(3, vocab, (r,), generator=g))
            for p, r in ((5, 30), (17, 9), (2, 22), (11, 15))]
    pm, tm = max(len(p) for p, _ in rows), max(len(r) for _, r in rows)
    ids = torch.zeros(len(rows), pm + tm, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        ids[i, pm - len(p):pm], ids[i, pm:pm + len(r)] = p, r
        mask[i, pm - len(p):pm + len(r)] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                       use_cache=False).logits[:, pm - 1:-1]
        batched = logprobs_from_logits(logits, ids[:, pm:].to(dev)).float().cpu()
        worst = 0.0
        for i, (p, r) in enumerate(rows):
            alone = _learner_logprobs(model, torch.cat([p, r])[None].to(dev), len(p)).float().cpu()[0]
            worst = max(worst, float((batched[i, :len(r)] - alone).abs().max()))
    return {"dtype": str(dtype), "rows": len(rows), "max_abs_diff_padded_vs_alone": worst,
            "ok": worst < (1e-4 if args.cpu else 0.1)}


# ---------------------------------------------------------------------------------------- S9
def s9_grad_accumulation(args) -> dict[str, Any]:
    _need("deepspeed", "pydantic", "transformers")
    if args.cpu:
        raise Skip("bf16 accumulation error is a GPU (bf16) measurement; the config itself is unit-tested")
    import tempfile

    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from asyncrl.learner.build import build_ds_config

    dev = _device(False)
    _init_one_rank(deepspeed, dev)
    micro = 32
    g = torch.Generator().manual_seed(9)
    vocab = _tiny_policy(torch.float32, torch.device("cpu")).config.vocab_size
    batches = [torch.randint(3, vocab, (2, 48), generator=g) for _ in range(micro)]
    # reference: the same bf16 micro-batch gradients, summed in float64
    ref_model = _tiny_policy(torch.bfloat16, dev).train()
    ref: dict[str, torch.Tensor] = {}
    for ids in batches:
        ref_model.zero_grad(set_to_none=True)
        (-_learner_logprobs(ref_model, ids.to(dev), 8).float().mean() / micro).backward()
        for n, p in ref_model.named_parameters():
            ref[n] = ref.get(n, 0) + p.grad.double()
    out: dict[str, Any] = {"micro_batches": micro}
    for stage in (1, 3):
        for accum in ("fp32", "bf16"):
            cfg = _learner_config(args, tempfile.mkdtemp(prefix="gpu-check-accum-"), **{"learner.zero_stage": stage})
            ds = build_ds_config(cfg.learner, 1, "bf16")
            if accum == "bf16":
                ds.pop("data_types", None)  # DeepSpeed's default: accumulate in the model's dtype
            model = _tiny_policy(torch.float32, torch.device("cpu"))
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.0),
                                              config=ds)
            for ids in batches:
                engine.backward(-_learner_logprobs(engine, ids.to(engine.device), 8).float().mean() / micro)
            num = den = 0.0
            for n, p in engine.module.named_parameters():
                got = safe_get_full_grad(p)
                if got is None:
                    continue
                num += float((got.double() - ref[n]).pow(2).sum())
                den += float(ref[n].pow(2).sum())
            out[f"zero{stage}_{accum}"] = {"relative_error": math.sqrt(num / max(den, 1e-30)),
                                           "data_types": ds.get("data_types")}
            del engine, model
            torch.cuda.empty_cache()
    out["ok"] = all(out[f"zero{s}_fp32"]["relative_error"] <= out[f"zero{s}_bf16"]["relative_error"] for s in (1, 3))
    return out


def _init_one_rank(deepspeed: Any, dev: torch.device) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    if not torch.distributed.is_initialized():
        from asyncrl.learner.ops import pin_toolchain

        pin_toolchain()  # the CPU dry run builds DeepSpeed's comm op with the learner's ninja: no rebuild
        deepspeed.init_distributed(dist_backend="gloo" if dev.type == "cpu" else "nccl", auto_mpi_discovery=False)


# ---------------------------------------------------------------------------------------- S10
def s10_pinned_publish(args) -> dict[str, Any]:
    """The store copy of a 7B bf16 model through the sender's host arena (exactly one version
    page-locked, reused), against torch's caching host allocator (`pin_memory=True` per bucket,
    rounded up to powers of two and kept for the life of the process)."""
    from asyncrl.weights.sender import WeightSender

    dev = torch.device("cpu") if args.cpu else _device(False)
    total = 64 * 2**20 if args.cpu else int(7.62e9) * 2  # bytes of bf16 parameters
    bucket_mb = 8.0 if args.cpu else 700.0  # not a power of two: shows the allocator's rounding
    n = max(1, total // (int(bucket_mb * 2**20)))
    numel = total // n // 2
    params = [(f"layer{i}.w", torch.empty(numel, dtype=torch.bfloat16, device=dev).fill_(i % 7)) for i in range(n)]
    published: list[float] = []
    backend = "gloo" if args.cpu else "nccl"
    sender = WeightSender(argparse.Namespace(bucket_mb=bucket_mb, gloo_bucket_mb=bucket_mb, backend=backend,
                                             timeout_s=60.0, host="127.0.0.1"), publish=True)
    sender.publish_fn = lambda buckets, version, name: published.append(time.perf_counter())
    out: dict[str, Any] = {"model_bytes": n * numel * 2, "buckets": n, "bucket_mb": bucket_mb}
    for version in (1, 2):
        t = time.perf_counter()
        report = sender.broadcast(params, version)
        sender.flush()
        out[f"v{version}"] = {"seconds": round(time.perf_counter() - t, 3), "publish_wait_s": report.publish_wait_s,
                              "pinned_bytes": sender.arena.pinned_bytes}
    sender.close()
    if dev.type == "cuda" and hasattr(torch.cuda, "host_memory_stats"):  # the old way, one version, for scale
        before = torch.cuda.host_memory_stats().get("reserved_bytes.current", 0)
        copies = [torch.empty(numel, dtype=torch.bfloat16, pin_memory=True) for _ in range(n)]
        out["caching_allocator_pinned_bytes_one_version"] = (
            torch.cuda.host_memory_stats().get("reserved_bytes.current", 0) - before)
        del copies
    out["ok"] = out["v2"]["pinned_bytes"] <= 1.01 * out["model_bytes"] + 64 * n and len(published) == 2
    return out


# ---------------------------------------------------------------------------------------- S11
def qwen7b_tensors(dev: torch.device, scale: int = 1, layers: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """Qwen2.5-7B's parameter shapes in bf16 (every dimension divided by `scale`), checkpoint
    names, untied head: what a 7B learner exports for one weight round."""
    h, i, v = QWEN7B["hidden_size"] // scale, QWEN7B["intermediate_size"] // scale, QWEN7B["vocab_size"] // scale
    kv = 512 // scale
    shapes = {"self_attn.q_proj.weight": (h, h), "self_attn.q_proj.bias": (h,), "self_attn.k_proj.weight": (kv, h),
              "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
              "self_attn.o_proj.weight": (h, h), "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
              "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    out = [("model.embed_tokens.weight", torch.empty(v, h, dtype=torch.bfloat16, device=dev).normal_())]
    for layer in range(QWEN7B["num_hidden_layers"] if layers is None else layers):
        out += [(f"model.layers.{layer}.{k}", torch.empty(sh, dtype=torch.bfloat16, device=dev).normal_())
                for k, sh in shapes.items()]
    out += [("model.norm.weight", torch.ones(h, dtype=torch.bfloat16, device=dev)),
            ("lm_head.weight", torch.empty(v, h, dtype=torch.bfloat16, device=dev).normal_())]
    return out


def _phase_round(tensors, bucket_bytes: int, pg, arena, dev: torch.device, store_copy: str) -> dict[str, float]:
    """One send + receive of `tensors` through asyncrl's own pieces, every phase timed with
    `asyncrl.weights.phases.PhaseTimer` (CUDA events for device work on a GPU): pack
    (`pack_buckets`), store copy (`HostArena.copy`), fingerprint (`bucket_fingerprint`), the wire
    (a one-rank group's broadcast, bounded by `wait_work`), and the receive side's copies (the
    bucket's buffer, the copy into the model's parameters, the fingerprint's samples).
    `store_copy`: "critical" = before the bucket goes out, on the broadcast's stream (the sender
    before this stage existed); "overlapped" = after it is posted, on a side stream (GPU); "off" =
    no store copy (a version that is not published)."""
    import torch.distributed as dist

    from asyncrl.weights.group import wait_work
    from asyncrl.weights.phases import PhaseTimer
    from asyncrl.weights.wire import bucket_fingerprint, pack_buckets, sample_values, unpack_bucket

    timer = PhaseTimer(dev if dev.type == "cuda" else None)
    side = torch.cuda.Stream(dev) if dev.type == "cuda" and store_copy == "overlapped" else None
    arena.begin()
    dest = {}
    for manifest, flat in timer.timed_iter("pack", pack_buckets(tensors, bucket_bytes), device=True):
        if store_copy == "critical":
            with timer.span("store_copy", device=True):
                arena.copy(flat)
        with timer.span("fingerprint", device=True):
            bucket_fingerprint(manifest, flat)
        with timer.span("wire"):
            work = pg.broadcast([flat], dist.BroadcastOptions())
        if store_copy == "overlapped":
            with timer.span("store_copy_overlapped"):  # host time to queue it; the copy runs beside the wire
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream(dev))
                    with torch.cuda.stream(side):
                        arena.copy(flat)
                        flat.record_stream(side)
                else:
                    arena.copy(flat)
        with timer.span("wire"):
            wait_work(work, time.monotonic() + 120)
        with timer.span("recv_copies", device=True):  # the receiver: buffer, load into the model, samples
            buf = torch.empty_like(flat)
            buf.copy_(flat)
            for name, view in unpack_bucket(manifest, buf):
                target = dest.get(name)
                if target is None:
                    target = dest[name] = torch.empty_like(view)
                target.copy_(view)
                sample_values(name, view)
    if side is not None:
        with timer.span("store_copy_drain"):
            side.synchronize()
    _sync(dev)
    timer.end()
    return {k: round(v, 4) for k, v in timer.seconds().items()}


def s11_sync_phases(args) -> dict[str, Any]:
    """asyncrl's weight-sync phases at Qwen2.5-7B bf16 shapes on one device, with CUDA events: pack,
    store copy, fingerprint, a one-rank NCCL broadcast, the receive side's copies; the round with
    the store copy on the critical path, overlapped with the wire, and off. Dry mode: every shape
    /8, 2 layers, gloo."""
    from asyncrl.weights.group import abort_group, connect_group, make_group, make_store
    from asyncrl.weights.store import HostArena

    dev = torch.device("cpu") if args.cpu else _device(False)
    tensors = qwen7b_tensors(dev, scale=8, layers=2) if args.cpu else qwen7b_tensors(dev)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    bucket_bytes = (16 if args.cpu else 256) * 2**20  # the sender's bucket on gloo / NCCL (learner.weights)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    store = make_store("127.0.0.1", 0, is_master=True, timeout_s=60)
    pg = connect_group(lambda: make_group(store, 1, 0, 1, backend, 60.0, dev if dev.type == "cuda" else None),
                       dev if dev.type == "cuda" else None, time.monotonic() + 120, 300.0)
    arena = HostArena(pin=dev.type == "cuda")
    out: dict[str, Any] = {"model_bytes": nbytes, "tensors": len(tensors), "bucket_mb": bucket_bytes / 2**20,
                           "backend": backend, "timer": "cuda events" if dev.type == "cuda" else "host"}
    try:
        _phase_round(tensors, bucket_bytes, pg, arena, dev, "critical")  # warm-up: arena size, communicator
        for mode in ("critical", "overlapped", "off"):
            out[f"store_copy_{mode}"] = _phase_round(tensors, bucket_bytes, pg, arena, dev, mode)
    finally:
        abort_group(pg)
        arena.close()
    rounds = {m: out[f"store_copy_{m}"]["round"] for m in ("critical", "overlapped", "off")}
    out["round_s"] = rounds
    out["gb_per_s_critical"] = nbytes / rounds["critical"] / 1e9
    out["ok"] = all(r > 0 for r in rounds.values())
    return out


STAGES = {"S0": s0_probe, "S1": s1_kernels, "S2": s2_wire, "S3": s3_memory_model, "S4": s4_parity, "S5": s5_deepspeed,
          "S6": s6_nccl_failure, "S7": s7_learner_step, "S8": s8_left_padding, "S9": s9_grad_accumulation,
          "S10": s10_pinned_publish, "S11": s11_sync_phases}


def stage_text(name: str, stage: dict[str, Any]) -> list[str]:
    """A stage's status line and its figures, one per line."""
    status = stage["status"]
    detail = stage.get("reason") or stage.get("error", "")
    lines = [f"  {name:<3} {STAGES[name].__name__.split('_', 1)[1]:<16} {status:<8} {stage['seconds']:7.1f}s  {detail}"]
    fig = stage.get("result") or {}
    for key, val in fig.items():
        if key in ("recipes",):
            for row in val:
                lines.append(f"      recipe {json.dumps(row)}")
        elif key != "ok":
            lines.append(f"      {key}: {json.dumps(val) if not isinstance(val, str) else val}")
    return lines


def summary_text(result: dict[str, Any]) -> str:
    lines = [f"asyncrl gpu_check {result['date']} on {result['device']} (mode: {result['mode']})"]
    for name, stage in result["stages"].items():
        lines += stage_text(name, stage)
    return "\n".join(lines)


def write_result(stem: Path, result: dict[str, Any]) -> None:
    """The JSON and the summary as they stand (after every stage: a lease that ends mid-run keeps
    what ran); each written to a temporary file and renamed, so a kill never leaves half a file."""
    for suffix, text in ((".json", json.dumps(result, indent=2, default=str)), (".txt", summary_text(result) + "\n")):
        path = stem.with_suffix(suffix)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="dry mode on the CPU: small shapes, every stage that can")
    parser.add_argument("--out", default=str(ROOT / "docs" / "gpu_check"), help="directory for the JSON and summary")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset, e.g. S0,S1,S2")
    parser.add_argument("--wheelhouse", default=None,
                        help="directory of wheels (scripts/gpu_wheelhouse.sh) to install first, offline")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else torch.cuda.get_device_name(0)
    result: dict[str, Any] = {"date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "device": device,
                              "mode": "cpu-dry" if args.cpu else "gpu", "stages": {}}
    if args.wheelhouse:
        t = time.perf_counter()
        target = Path(os.environ.get("TMPDIR", "/tmp")) / "asyncrl-gpu-check-site"
        result["wheelhouse"] = {"installed": install_wheelhouse(Path(args.wheelhouse), target),
                                "target": str(target), "seconds": time.perf_counter() - t}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    stem = out / f"gpu_check-{result['date'][:10]}-{slug}{'-dry' if args.cpu else ''}"
    write_result(stem, result)
    for name in [s.strip() for s in args.stages.split(",") if s.strip()]:
        t = time.perf_counter()
        try:
            res = STAGES[name](args)
            entry = {"status": "ok" if res.get("ok", True) else "failed", "result": res}
        except Skip as exc:
            entry = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a broken stage must not hide the others
            entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        entry["seconds"] = time.perf_counter() - t
        result["stages"][name] = entry
        write_result(stem, result)
        print(f"{name}: {entry['status']} ({entry['seconds']:.1f}s)", flush=True)
        print("\n".join(stage_text(name, entry)[1:]), flush=True)
    text = summary_text(result)
    print(text)
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.txt')}")
    return 1 if any(s["status"] == "failed" for s in result["stages"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
