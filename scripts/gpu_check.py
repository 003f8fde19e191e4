"""What one GPU without vLLM, Ray or network can prove about asyncrl, in one prepared run.

    python scripts/gpu_check.py [--out DIR] [--stages S0,S1,...]   # on a CUDA machine (< 10 min on one H200)
    python scripts/gpu_check.py --cpu [--out DIR]                 # dry mode: every stage that can, small shapes

Stages (each reports status ok / failed / skipped with the reason, and its figures; a missing
package or device skips only the stages that need it):
  S0 probe: Python, torch, CUDA, NCCL versions, the device; which of transformers, deepspeed,
     pydantic, numpy, safetensors, msgpack, yaml, vllm, ray import.
  S1 the learner's chunked logprob / entropy kernels (asyncrl.learner.losses) on bf16 logits at a
     152k vocabulary against an fp32 reference: values, gradients, peak memory vs the unchunked form.
  S2 the weight wire (asyncrl.weights): bf16 bucket pack/unpack bit-exact on the device;
     a one-rank NCCL group built the way the weight group builds it, a broadcast bounded by
     `wait_work`, then `abort_group`; a gloo sender -> receiver round with CUDA tensors (receiver
     in a thread); pinned vs pageable device-to-host copy throughput. NCCL refuses two ranks on one
     GPU ("Duplicate GPU detected"), so a multi-rank NCCL group cannot be tested on one device.
  S3 a memory / throughput model of the learner: decoder layers shaped like Qwen2.5-7B in bf16 with
     activation checkpointing, per-layer activation memory and tokens/s measured on 1 and 2 layers,
     extrapolated to every recipe in configs/ (does it fit the GPUs it states?).
  S4 logprob parity of the tiny policy (assets/tiny-policy) through the learner's forward (same
     model call and kernel as `Learner._forward_logits`): bf16 on the device vs fp32 on the CPU.
  S5 a one-rank DeepSpeed engine (ZeRO 0/2/3, bf16 on GPU) doing two optimizer steps on the tiny
     policy with the learner's log-prob kernel, if deepspeed imports (its wheel is pure Python and
     can be carried to a machine without network).

Imports only the standard library, torch, transformers, numpy, safetensors and asyncrl modules that
import nothing else at import time (asyncrl.weights / learner.losses / learner.batching), so it runs where
pydantic, pyzmq, ray and vllm are absent. Writes `<out>/gpu_check-<date>-<device>.json` and a
readable summary next to it (also printed).
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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's asyncrl, installed or not

import torch  # noqa: E402

# Qwen2.5-7B's shape (config.json of the published model)
QWEN7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
              num_hidden_layers=28, vocab_size=152064)
# parameter counts of the recipes' models (published model cards), for S3's extrapolation
MODEL_PARAMS = {"qwen2.5-7b": 7.62e9, "qwen2.5-vl-7b": 8.29e9, "qwen3-14b": 14.8e9, "qwen3-vl-8b": 8.77e9,
                "qwen3-8b": 8.19e9, "qwen2.5-1.5b": 1.54e9, "qwen2.5-0.5b": 0.49e9}


class Skip(Exception):
    """A stage cannot run here (missing package or device); not a failure."""


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

    from asyncrl.weights.group import abort_group, make_group, make_store, wait_work
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

    # one-rank NCCL group, built as the weight group builds it, bounded wait, abort
    if dev.type == "cuda" and dist.is_nccl_available():
        store = make_store("127.0.0.1", 0, is_master=True, timeout_s=30)
        t = time.perf_counter()
        pg = make_group(store, 1, 0, 1, "nccl", 30.0, dev)
        flat = buckets[0][1].clone()
        wait_work(pg.broadcast([flat]), time.monotonic() + 30)
        out["nccl_one_rank"] = {"broadcast_ok": bool(torch.equal(flat, buckets[0][1])),
                                "seconds_build_and_broadcast": time.perf_counter() - t,
                                "async_error_handling_during_build": "2 (set by make_group)"}
        abort_group(pg)
        out["nccl_one_rank"]["aborted"] = True
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
    from transformers import Qwen2Config, Qwen2Model

    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512) if tiny else {k: v for k, v in QWEN7B.items() if k != "num_hidden_layers"}
    cfg = Qwen2Config(**shape, num_hidden_layers=layers, max_position_embeddings=32768)
    cfg._attn_implementation = "sdpa"
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    with torch.device(dev):
        model = Qwen2Model(cfg).to(dtype)
    model.gradient_checkpointing_enable()
    model.train()
    return model, cfg


def s3_memory_model(args) -> dict[str, Any]:
    dev = _device(args.cpu)
    tiny = args.cpu
    seq, batch = (128, 2) if tiny else (4096, 2)
    per: dict[int, dict[str, float]] = {}
    for layers in (1, 2):
        model, cfg = _decoder_stack(layers, dev, tiny)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)
        params = sum(p.numel() for p in model.parameters())
        for _ in range(2):  # warm-up, then measured
            _peak_reset(dev)
            base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            t = time.perf_counter()
            h = model(input_ids=ids, use_cache=False).last_hidden_state
            h.float().pow(2).mean().backward()
            _sync(dev)
            secs = time.perf_counter() - t
            peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**30 if dev.type == "cuda" else float("nan")
            model.zero_grad(set_to_none=True)
        per[layers] = {"params": params, "seconds": secs, "peak_gib": peak}
        del model, h
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    tokens = seq * batch
    layer_s = per[2]["seconds"] - per[1]["seconds"]
    layer_act_gib = per[2]["peak_gib"] - per[1]["peak_gib"]
    act_per_token_per_layer = layer_act_gib / tokens if not math.isnan(layer_act_gib) else None
    out: dict[str, Any] = {"tokens_per_micro_batch": tokens, "measured": per,
                           "seconds_per_layer_fwd_bwd": layer_s,
                           "tokens_per_s_per_layer": tokens / layer_s if layer_s > 0 else None,
                           "activation_gib_per_token_per_layer": act_per_token_per_layer,
                           "shape": "tiny (dry mode)" if tiny else "Qwen2.5-7B layer"}
    out["recipes"] = _recipes(act_per_token_per_layer, out["tokens_per_s_per_layer"], args)
    return out


def _recipes(act_per_token_layer: float | None, tok_s_layer: float | None, args) -> list[dict[str, Any]]:
    """Per-GPU learner memory of each recipe: bf16 weights + bf16 grads + fp32 master + Adam
    (16 B/param) divided by ZeRO as DeepSpeed does, + activations (checkpointed, measured per
    token per layer) of one micro-batch + its chunked-logit peak; vs the device's memory."""
    try:
        import yaml
    except Exception:  # noqa: BLE001
        return [{"skipped": "pyyaml missing"}]
    gib = (torch.cuda.get_device_properties(0).total_memory / 2**30) if torch.cuda.is_available() else 141.0
    rows = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text()) or {}
        learner, model = doc.get("learner") or {}, str((doc.get("model") or {}).get("path", "")).lower()
        gpus = int(learner.get("num_gpus", 0))
        if gpus <= 0:
            continue
        name = next((k for k in sorted(MODEL_PARAMS, key=len, reverse=True) if k in model.replace("_", "-")), None)
        if name is None:
            rows.append({"recipe": path.name, "skipped": f"unknown model size for {model!r}"})
            continue
        p = MODEL_PARAMS[name]
        stage = int(learner.get("zero_stage", 1))
        weights = 2 * p / (gpus if stage == 3 else 1)
        grads = 2 * p / (gpus if stage >= 2 else 1)
        optim = 12 * p / (gpus if stage >= 1 else 1)
        tokens = int(learner.get("micro_batch_tokens", 8192))
        layers = 48 if "14b" in name else 28
        act = (act_per_token_layer or 0.0) * 2**30 * tokens * layers
        logits = tokens * QWEN7B["vocab_size"] * 2 * 2 + 2 * 1024 * QWEN7B["vocab_size"] * 4
        need = (weights + grads + optim + act + logits) / 2**30
        row = {"recipe": path.name, "model": name, "learner_gpus": gpus, "zero_stage": stage,
               "micro_batch_tokens": tokens, "estimated_gib_per_gpu": round(need, 1), "device_gib": round(gib, 1),
               "fits": need < 0.9 * gib}
        if act_per_token_layer is None:
            row["note"] = "activations not measured (CPU dry mode): weights, grads, optimizer and logits only"
        if tok_s_layer:
            row["estimated_train_tokens_per_s_per_gpu"] = round(tok_s_layer / layers * (7.62e9 / p), 1)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------- S4
def _tiny_policy(dtype: torch.dtype, dev: torch.device):
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
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if dev.type == "cpu" else "nccl", auto_mpi_discovery=False)
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


STAGES = {"S0": s0_probe, "S1": s1_kernels, "S2": s2_wire, "S3": s3_memory_model, "S4": s4_parity, "S5": s5_deepspeed}


def summary_text(result: dict[str, Any]) -> str:
    lines = [f"asyncrl gpu_check {result['date']} on {result['device']} (mode: {result['mode']})"]
    for name, stage in result["stages"].items():
        status = stage["status"]
        detail = stage.get("reason") or stage.get("error", "")
        lines.append(f"  {name} {STAGES[name].__name__[3:]:<14} {status:<8} {stage['seconds']:7.1f}s  {detail}")
        fig = stage.get("result") or {}
        for key, val in fig.items():
            if key in ("recipes",):
                for row in val:
                    lines.append(f"      recipe {json.dumps(row)}")
            elif key != "ok":
                lines.append(f"      {key}: {json.dumps(val) if not isinstance(val, str) else val}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="dry mode on the CPU: small shapes, every stage that can")
    parser.add_argument("--out", default=str(ROOT / "docs" / "gpu_check"), help="directory for the JSON and summary")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset, e.g. S0,S1,S2")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else torch.cuda.get_device_name(0)
    result: dict[str, Any] = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "device": device,
                              "mode": "cpu-dry" if args.cpu else "gpu", "stages": {}}
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
        print(f"{name}: {entry['status']} ({entry['seconds']:.1f}s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    stem = out / f"gpu_check-{result['date'][:10]}-{slug}{'-dry' if args.cpu else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str))
    text = summary_text(result)
    stem.with_suffix(".txt").write_text(text + "\n")
    print(text)
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.txt')}")
    return 1 if any(s["status"] == "failed" for s in result["stages"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
