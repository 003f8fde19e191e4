"""`python -m asyncrl.bench weight-sync [--smoke] --output DIR`.

Seconds to publish a state dict with `WeightSender.broadcast` (bucketed, per-dtype, manifest
through the store, acks) to 1 and 2 receiver processes, next to ONE flat gloo broadcast of the
same bytes to the same processes in the same run (a pre-built contiguous buffer, no packing, no
manifest; timed up to the receivers' acks, like ours). `ratio` = flat seconds / our seconds for
the largest state dict with the most receivers (goal >= 0.7); `ratio_min` over every non-tiny
case. Cases: the quick-start policy (`model.path`, or a tiny Qwen2 when it is absent), synthetic
100M- and 500M-parameter bf16 state dicts (smoke: 1M and 4M); plus a bucket-size sweep. Ours
and flat run interleaved, 3 rounds (2 above 1 GiB); figures are best-of (medians also written),
because the shared machine's load spikes otherwise dominate. LoRA (`lora`): a rank-16 adapter on
the same models against their full sync in the same run (bytes and seconds as ratios, the
receiver's /dev/shm write included), and a Qwen2.5-7B rank-16 adapter's sync seconds;
`--lora-only` runs that comparison alone. `--engine` adds (`--engine-only`: runs alone) the sync
into a real vLLM engine built from `model.path` against its floor on both weight paths, every
phase timed (asyncrl.bench.sync_floor).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.bench.common import print_table
from asyncrl.weights.sender import WeightSender

HOST = "127.0.0.1"
WAIT_S = 180.0  # generous per-wait bound; a broken bench fails instead of hanging


def _receiver(address: str, port: int, rank: int, max_receivers: int) -> None:
    """Takes part in every round the driver orders through its `cmd/{rank}/{i}` keys, in order.
    Joins one plain gloo group per receiver count k >= rank (`flat{k}`, world k + 1)."""
    torch.set_num_threads(1)
    from asyncrl.weights.receiver import WeightReceiver

    store = dist.TCPStore(HOST, port, None, False, timedelta(seconds=WAIT_S), wait_for_workers=False)
    flat = {k: dist.ProcessGroupGloo(dist.PrefixStore(f"flat{k}", store), rank, k + 1, timedelta(seconds=WAIT_S))
            for k in range(rank, max_receivers + 1)}
    rec = WeightReceiver(address, f"r{rank}", timeout_s=WAIT_S)
    i = 0
    while True:
        cmd = json.loads(store.get(f"cmd/{rank}/{i}"))
        if cmd["op"] == "stop":
            return
        if cmd["op"] == "ours":
            res = rec.receive(lambda it: sum(1 for _ in it), buffered=False)
            if res["status"] == "not_member":  # newly added (scaling): asked to join, now wait for it
                res = rec.receive(lambda it: sum(1 for _ in it), buffered=False)
            assert res["status"] == "ok", res
        else:
            buf = torch.empty(cmd["numel"], dtype=torch.uint8)
            flat[cmd["k"]].broadcast([buf]).wait()
            del buf
        store.set(f"ack/{rank}/{i}", "1")
        i += 1


class Rig:
    """Receiver processes shared by every case; a WeightSender and plain gloo groups over them."""

    def __init__(self, max_receivers: int, bucket_mb: float) -> None:
        self.max = max_receivers
        cfg = SimpleNamespace(bucket_mb=bucket_mb, backend="gloo", timeout_s=WAIT_S, host=HOST)
        self.sender = WeightSender(cfg)
        self.store = dist.TCPStore(HOST, 0, None, True, timedelta(seconds=WAIT_S), wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_receiver, args=(self.sender.address, self.store.port, r, max_receivers),
                                  daemon=True) for r in range(1, max_receivers + 1)]
        for p in self.procs:
            p.start()
        self.flat_pg = {k: dist.ProcessGroupGloo(dist.PrefixStore(f"flat{k}", self.store), 0, k + 1,
                                                 timedelta(seconds=WAIT_S)) for k in range(1, max_receivers + 1)}
        self.counts = {r: 0 for r in range(1, max_receivers + 1)}
        self.k = 0

    def use(self, k: int) -> None:
        """Receivers 1..k take part from now on (a group rebuild, as when scaling)."""
        self.k = k
        self.sender.members = [f"r{r}" for r in range(1, k + 1)]
        self.sender._dirty = True

    def _order(self, cmd: dict[str, Any]) -> list[str]:
        keys = []
        for r in range(1, self.k + 1):
            i = self.counts[r]
            self.store.set(f"cmd/{r}/{i}", json.dumps(cmd))
            keys.append(f"ack/{r}/{i}")
            self.counts[r] += 1
        return keys

    def ours(self, state: dict[str, torch.Tensor], bucket_mb: float, version: int) -> float:
        self.sender.bucket_bytes = int(bucket_mb * 2**20)
        acks = self._order({"op": "ours"})
        t0 = time.perf_counter()
        report = self.sender.broadcast(state.items(), version)
        self.store.wait(acks, timedelta(seconds=WAIT_S))
        assert len(report.acked) == self.k, report
        return time.perf_counter() - t0

    def flat(self, flat: torch.Tensor) -> float:
        acks = self._order({"op": "flat", "numel": flat.numel(), "k": self.k})
        t0 = time.perf_counter()
        self.flat_pg[self.k].broadcast([flat]).wait()
        self.store.wait(acks, timedelta(seconds=WAIT_S))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.k = self.max
        self._order({"op": "stop"})
        for p in self.procs:
            p.join(30)
        self.sender.close()


def synthetic_state(params: int, dtype: torch.dtype = torch.bfloat16, hidden: int = 1024) -> dict[str, torch.Tensor]:
    """Transformer-shaped tensors (4h x h blocks plus norms) summing to about `params`."""
    state, total, i = {}, 0, 0
    while total < params:
        rows = min(4 * hidden, max(1, (params - total) // hidden))
        state[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(rows, hidden).to(dtype)
        state[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        total += rows * hidden + hidden
        i += 1
    return state


def policy_state(cfg: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """The quick-start policy's tensors (safetensors files under `model.path`), or, when it is
    absent, a tiny Qwen2-shaped state dict (2 layers, hidden 64, untied head)."""
    path = Path(cfg.model.path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if files:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return f"policy({path.name})", state
    h, v, inter = 64, 512, 128
    state = {"model.embed_tokens.weight": torch.randn(v, h), "lm_head.weight": torch.randn(v, h),
             "model.norm.weight": torch.ones(h)}
    for i in range(2):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": torch.randn(h, h), p + "self_attn.q_proj.bias": torch.zeros(h),
                      p + "self_attn.k_proj.weight": torch.randn(32, h), p + "self_attn.k_proj.bias": torch.zeros(32),
                      p + "self_attn.v_proj.weight": torch.randn(32, h), p + "self_attn.v_proj.bias": torch.zeros(32),
                      p + "self_attn.o_proj.weight": torch.randn(h, h), p + "mlp.gate_proj.weight": torch.randn(inter, h),
                      p + "mlp.up_proj.weight": torch.randn(inter, h), p + "mlp.down_proj.weight": torch.randn(h, inter),
                      p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h)})
    return "policy(tiny-qwen2)", state


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QWEN25_7B = {"hidden": 3584, "intermediate": 18944, "layers": 28, "kv_dim": 512, "params": 7_615_616_512}
"""Qwen2.5-7B's shapes (the real-size model of the GPU path; its config.json)."""


def adapter_state(state: dict[str, torch.Tensor], rank: int = 16) -> dict[str, torch.Tensor]:
    """A rank-`rank` LoRA adapter (PEFT's saved names and shapes: A [r, in], B [out, r]) on every
    2-D projection of `state` named like a LoRA target."""
    out = {}
    for name, t in state.items():
        parts = name.split(".")
        if t.dim() == 2 and parts[-1] == "weight" and parts[-2] in LORA_TARGETS:
            base = "base_model.model." + name.removesuffix(".weight")
            out[base + ".lora_A.weight"] = torch.randn(rank, t.shape[1]).to(t.dtype)
            out[base + ".lora_B.weight"] = torch.randn(t.shape[0], rank).to(t.dtype)
    return out


def qwen25_7b_adapter(rank: int = 16, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The exact tensors of a rank-`rank` adapter on all seven projections of Qwen2.5-7B."""
    h, i, kv = QWEN25_7B["hidden"], QWEN25_7B["intermediate"], QWEN25_7B["kv_dim"]
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    state = {}
    for layer in range(QWEN25_7B["layers"]):
        for mod, (out_f, in_f) in shapes.items():
            base = f"base_model.model.model.layers.{layer}.{mod}"
            state[base + ".lora_A.weight"] = torch.randn(rank, in_f).to(dtype)
            state[base + ".lora_B.weight"] = torch.randn(out_f, rank).to(dtype)
    return state


def lora_cases(rig: Rig, sizes: list[tuple[str, dict[str, torch.Tensor]]], bucket_mb: float, repeats: int,
               version: int, smoke: bool) -> list[dict[str, Any]]:
    """Adapter sync vs full sync of the same model in one run, to 1 and 2 receivers: wire seconds
    of each (same sender, same rig, interleaved), plus what the receiving engine adds for an
    adapter: writing its PEFT directory to /dev/shm (`write_adapter_dir`, the step a learner-side
    /dev/shm design would do instead of the wire). Also the Qwen2.5-7B rank-16 adapter's own
    wire seconds (its full sync, 15 GB, does not fit this machine: compare with the GPU path's)."""
    import shutil
    import tempfile

    from asyncrl.weights.adapter import fast_local_dir, write_adapter_dir

    out = []
    shm = tempfile.mkdtemp(prefix="asyncrl-bench-lora-", dir=fast_local_dir())
    cases = [(label, state, adapter_state(state)) for label, state in (sizes[0], sizes[-1])]
    if not smoke:  # 80 MB of bf16 adapter
        cases.append(("qwen2.5-7b r16 (adapter only)", None, qwen25_7b_adapter()))
    try:
        for receivers in (1, 2):
            rig.use(receivers)
            for label, full, adapter in cases:
                version += 1
                rig.ours(adapter, bucket_mb, version)  # warm-up (group rebuild)
                fns = [lambda a=adapter, v=version: rig.ours(a, bucket_mb, v),
                       lambda a=adapter: _timed(lambda: write_adapter_dir(shm, "v", a.items(), {"r": 16}))]
                if full is not None:
                    fns.append(lambda st=full, v=version: rig.ours(st, bucket_mb, v))
                t = _interleaved(fns, repeats)
                row = {"state": label, "receivers": receivers, "adapter_bytes": _nbytes(adapter),
                       "adapter_wire_s": t[0]["best"], "adapter_write_s": t[1]["best"]}
                if full is not None:
                    row.update(full_bytes=_nbytes(full), full_s=t[2]["best"],
                               bytes_ratio=_nbytes(adapter) / _nbytes(full),
                               seconds_ratio=(t[0]["best"] + t[1]["best"]) / t[2]["best"])
                out.append(row)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return out


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _interleaved(fns: list, repeats: int) -> list[dict[str, float]]:
    """Run the timed functions in turn, `repeats` rounds (so load spikes from other processes hit
    both sides alike); best-of and median seconds per function."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, acc in zip(fns, times):
            acc.append(fn())
    return [{"best": min(t), "median": statistics.median(t)} for t in times]


def add_args(parser: Any) -> None:
    parser.add_argument("--lora-only", action="store_true", help="only the LoRA adapter vs full sync comparison")
    parser.add_argument("--engine", action="store_true",
                        help="also the sync into a real vLLM engine (model.path) against its floor, both weight paths "
                             "(asyncrl.bench.sync_floor)")
    parser.add_argument("--engine-only", action="store_true", help="only the engine sync against its floor")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per path of --engine (best of)")


def run(cfg: Any, args: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    smoke = bool(args.smoke)
    if getattr(args, "engine_only", False):  # before the synthetic states below: they would stay in memory
        return _engine_floor(cfg, args)
    wcfg = cfg.learner.weights
    bucket_mb = min(wcfg.bucket_mb, wcfg.gloo_bucket_mb)  # what WeightSender uses on gloo
    name, policy = policy_state(cfg)
    sizes = [(name, policy), ("1M", synthetic_state(10**6, hidden=256)), ("4M", synthetic_state(4 * 10**6, hidden=256))] \
        if smoke else [(name, policy), ("100M", synthetic_state(10**8)), ("500M", synthetic_state(5 * 10**8))]
    sweep_mb = [0.25, 1.0, 4.0] if smoke else [4.0, 16.0, 64.0, 256.0]
    repeats = 1 if smoke else 3
    if args.lora_only:
        return _lora_only(sizes, bucket_mb, repeats, smoke)
    cases, sweep, version = [], [], 0
    rig = Rig(2, bucket_mb)
    try:
        for receivers in (1, 2):
            rig.use(receivers)
            for label, state in sizes:
                nbytes = sum(t.numel() * t.element_size() for t in state.values())
                flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
                reps = repeats if nbytes < 2**30 else 2
                version += 1
                rig.ours(state, bucket_mb, version)  # warm-up: group build, first connections
                rig.flat(flat)
                ours, fl = _interleaved([lambda st=state, v=version: rig.ours(st, bucket_mb, v),
                                         lambda f=flat: rig.flat(f)], reps)
                ours_s, flat_s = ours["best"], fl["best"]
                params = sum(t.numel() for t in state.values())
                cases.append({"state": label, "params": params, "bytes": nbytes, "receivers": receivers,
                              "bucket_mb": bucket_mb, "ours_s": ours_s, "flat_s": flat_s, "ratio": flat_s / ours_s,
                              "ours_median_s": ours["median"], "flat_median_s": fl["median"],
                              "ratio_median": fl["median"] / ours["median"],
                              "ours_gb_per_s": nbytes / ours_s / 1e9})
                if receivers == 1 and label == sizes[1][0]:
                    for mb in sweep_mb:
                        o, f2 = _interleaved([lambda st=state, m=mb, v=version: rig.ours(st, m, v),
                                              lambda f=flat: rig.flat(f)], reps)
                        sweep.append({"state": label, "receivers": receivers, "bucket_mb": mb, "ours_s": o["best"],
                                      "flat_s": f2["best"], "ratio": f2["best"] / o["best"]})
                del flat
        lora = lora_cases(rig, sizes, bucket_mb, repeats, version, smoke)
    finally:
        rig.close()
    big = [c for c in cases if c["state"] == sizes[-1][0]]
    headline = max(big, key=lambda c: c["receivers"])
    rows = [(f"{c['state']} x{c['receivers']} ours/flat s", f"{c['ours_s']:.3f} / {c['flat_s']:.3f} "
             f"(ratio {c['ratio']:.2f})") for c in cases]
    rows += [(f"sweep {s['state']} bucket {s['bucket_mb']:g} MB", f"{s['ours_s']:.3f} s (ratio {s['ratio']:.2f})")
             for s in sweep]
    rows += _lora_rows(lora)
    print_table("weight-sync", rows)
    out = {"ratio": headline["ratio"], "ratio_min": min(c["ratio"] for c in cases if c["params"] >= 10**6),
           "goal": 0.7, "smoke": smoke, "cases": cases, "bucket_sweep": sweep, "lora": lora}
    if getattr(args, "engine", False):
        out["engine_floor"] = _engine_floor(cfg, args)["engine_floor"]
    return out


def _engine_floor(cfg: Any, args: Any) -> dict[str, Any]:
    from asyncrl.bench.sync_floor import floor_rows, run_engine_floor

    res = run_engine_floor(cfg, rounds=1 if args.smoke else args.rounds)
    print_table("weight-sync into a vLLM engine vs its floor", floor_rows(res))
    return {"engine_floor": res, "ratio_extension": res["extension"]["ratio"], "ratio_native": res["native"]["ratio"],
            "goal": 1.5}


def _lora_only(sizes: list[tuple[str, dict[str, torch.Tensor]]], bucket_mb: float, repeats: int,
               smoke: bool) -> dict[str, Any]:
    rig = Rig(2, bucket_mb)
    try:
        lora = lora_cases(rig, sizes, bucket_mb, repeats, 0, smoke)
    finally:
        rig.close()
    print_table("weight-sync (LoRA)", _lora_rows(lora))
    full = [c for c in lora if "seconds_ratio" in c]
    return {"lora_seconds_ratio": max(c["seconds_ratio"] for c in full), "smoke": smoke, "lora": lora}


def _lora_rows(lora: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(f"LoRA r16 {c['state']} x{c['receivers']} adapter", f"{c['adapter_bytes'] / 2**20:.2f} MiB: "
              f"{c['adapter_wire_s']:.4f} s wire + {c['adapter_write_s']:.4f} s /dev/shm write"
              + (f" vs full {c['full_bytes'] / 2**20:.1f} MiB {c['full_s']:.3f} s "
                 f"(bytes {c['bytes_ratio']:.4f}x, seconds {c['seconds_ratio']:.4f}x)" if "full_s" in c else ""))
             for c in lora]



