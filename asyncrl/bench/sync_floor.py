"""The weight sync into a real vLLM engine against its floor, on both weight paths, in one run
(`python -m asyncrl.bench weight-sync --engine [--engine-only] model.path=DIR`).

asyncrl: one `WeightSender.broadcast` of the model's tensors (the safetensors of `model.path`, as
the learner exports them; the WeightStore's host copy taken as in a job, its Ray put left out)
into a `PolicyEngine` taking part with `update_weights_from_group`; its
seconds from the start of the broadcast until both sides are done, with every phase of the sender,
the receiver and the engine (`asyncrl.weights.phases`).

The floor, what any design must pay on this build, measured in the same engine in the same run:
- wire: ONE plain gloo broadcast of the same bytes (a pre-built flat buffer, no packing, no
  headers) into the engine's worker, timed in the worker from its buffer's allocation to the
  data's arrival;
- reload: vLLM's own `model_runner.reload_weights(..., is_checkpoint_format=True)` of the same
  tensors (already in the worker's memory, read from the same files beforehand, untimed), plus the
  re-tie of a tied head that every reload on this build needs.
floor = wire + reload; `ratio` = asyncrl ÷ floor (goal <= 1.5). Best of `rounds` for each. Every
round is run in each of `VARIANTS`, interleaved, the A/B of a choice against asyncrl's default:
the sender's store copy before each bucket is posted instead of after (`store_copy_before_post`),
and the input embedding packed for a GEMM at every reload as vLLM does
(`embedding_packed`; asyncrl's default packs the matrix once, for the head:
`asyncrl.small_machine.patches.vllm_embedding_packs_lazily`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.actors.worker_extension import WeightReceiverExtension, retie_head

FLOOR_EXTENSION = "asyncrl.bench.sync_floor.FloorExtension"
VARIANTS = {"store_copy_before_post": {"store_copy_overlap": False},
            "embedding_packed": {"embedding_lazy": False}}
"""The A/B variants of every round: what each changes against asyncrl's default."""


class FloorExtension(WeightReceiverExtension):
    """asyncrl's worker extension plus the two floor measurements (bench only)."""

    def asyncrl_bench_flat(self, host: str, port: int, prefix: str, numel: int) -> float:
        """Join a plain 2-rank gloo group as rank 1 and receive one flat uint8 buffer of `numel`;
        seconds from the buffer's allocation to its arrival."""
        store = dist.TCPStore(host, port, None, False, timedelta(seconds=120), wait_for_workers=False)
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 1, 2, timedelta(seconds=120))
        t = time.perf_counter()
        buf = torch.empty(numel, dtype=torch.uint8)
        pg.broadcast([buf]).wait()
        seconds = time.perf_counter() - t
        del buf, pg
        return seconds

    def asyncrl_bench_embedding_lazy(self, enabled: bool) -> bool:
        """Switch the lazy embedding packing in this worker (the next reloads follow it)."""
        from asyncrl.small_machine.patches import vllm_embedding_packs_lazily

        return vllm_embedding_packs_lazily(enabled)

    def asyncrl_bench_rss(self) -> float:
        """This worker's resident memory, GiB."""
        import psutil

        return psutil.Process().memory_info().rss / 2**30

    def asyncrl_bench_reload(self, model_dir: str) -> dict[str, float]:
        """vLLM's own reload of the model's checkpoint tensors (read first, untimed), and the
        re-tie of a tied head."""
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        t = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        reload_s = time.perf_counter() - t
        retie_head(self.model_runner.get_model())
        return {"reload": reload_s, "retie": time.perf_counter() - t - reload_s}


def _state(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


async def _one_path(model_dir: str, cfg: Any, path: str, rounds: int, bucket_mb: float) -> dict[str, Any]:
    from asyncrl.actors.engine import EngineSpec, PolicyEngine
    from asyncrl.weights.sender import WeightSender

    loaded = _state(model_dir)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in loaded.values()])
    state, at = {}, 0  # the sender's tensors are views of the flat floor buffer: one copy in memory
    for name, t in loaded.items():
        n = t.numel() * t.element_size()
        state[name] = flat[at:at + n].view(t.dtype).view(t.shape)
        at += n
    del loaded
    nbytes = flat.numel()
    rcfg = cfg.rollout.model_copy(update={"weight_transfer": path})
    engine = PolicyEngine(EngineSpec(model_dir, rcfg, engine_id=f"floor-{path}", max_model_len=256, weight_timeout_s=120,
                          worker_extension=FLOOR_EXTENSION))
    wcfg = type("W", (), {"bucket_mb": bucket_mb, "gloo_bucket_mb": bucket_mb, "backend": "gloo",
                          "timeout_s": 120.0, "host": "127.0.0.1"})()
    # every version copied for the WeightStore, as in a job (publish_every=1); the Ray put itself runs
    # in the publisher's background thread in a job and is left out here
    sender = WeightSender(wcfg, members=engine.weight_member_ids(), publish=True)
    sender.publish_fn = lambda buckets, version, name: None
    master = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120), wait_for_workers=False)
    runs: dict[str, list[dict[str, Any]]] = {"default": [], **{v: [] for v in VARIANTS}}
    wire: list[float] = []
    rss: list[float] = []  # the engine worker's resident GiB after each round's variants
    reload: list[dict[str, float]] = []
    try:
        version = 0
        for r in range(rounds + 1):  # round 0: warm-up (group build, first connections)
            for variant, acc in runs.items():
                change = VARIANTS.get(variant, {})
                sender.store_copy_overlap = change.get("store_copy_overlap", True)
                await engine.llm.collective_rpc("asyncrl_bench_embedding_lazy",
                                                args=(change.get("embedding_lazy", True),))
                version += 1
                t0 = time.perf_counter()
                report, res = await asyncio.gather(asyncio.to_thread(sender.broadcast, state.items(), version),
                                                   engine.update_weights_from_group(sender.address, timeout_s=120))
                seconds = time.perf_counter() - t0
                assert res["status"] == "ok" and report.acked, (res, report)
                if r:
                    acc.append({"seconds": seconds, "send": report.phases, "recv": res.get("phases"),
                                "engine": res.get("engine_phases")})
            await engine.llm.collective_rpc("asyncrl_bench_embedding_lazy", args=(True,))  # the floor packs once
            rss.append((await engine.llm.collective_rpc("asyncrl_bench_rss"))[0])
            prefix = f"flat{r}"
            rpc = asyncio.ensure_future(engine.llm.collective_rpc(
                "asyncrl_bench_flat", args=("127.0.0.1", master.port, prefix, flat.numel())))
            pg = await asyncio.to_thread(dist.ProcessGroupGloo, dist.PrefixStore(prefix, master), 0, 2,
                                         timedelta(seconds=120))
            await asyncio.to_thread(lambda g=pg: g.broadcast([flat]).wait())
            wire.append((await rpc)[0])
            reload.append((await engine.llm.collective_rpc("asyncrl_bench_reload", args=(model_dir,)))[0])
    finally:
        sender.close()
        engine.shutdown()
    ours = runs.pop("default")
    best = min(ours, key=lambda o: o["seconds"])
    wire_s = min(wire[1:])
    reload_best = min(reload[1:], key=lambda x: x["reload"] + x["retie"])
    floor = wire_s + reload_best["reload"] + reload_best["retie"]
    return {"path": path, "bytes": nbytes, "tensors": len(state), "bucket_mb": bucket_mb, "rounds": rounds,
            "asyncrl_s": best["seconds"], "asyncrl_median_s": statistics.median(o["seconds"] for o in ours),
            "floor_s": floor, "floor_wire_s": wire_s, "floor_reload_s": reload_best["reload"],
            "floor_retie_s": reload_best["retie"], "ratio": best["seconds"] / floor, "goal": 1.5,
            "phases": {k: best[k] for k in ("send", "recv", "engine")}, "engine_rss_gib": rss,
            **{variant: _summary(acc, floor) for variant, acc in runs.items()}}


def _summary(rounds: list[dict[str, Any]], floor: float) -> dict[str, Any]:
    best = min(rounds, key=lambda o: o["seconds"])
    return {"asyncrl_s": best["seconds"], "ratio": best["seconds"] / floor,
            "asyncrl_median_s": statistics.median(o["seconds"] for o in rounds),
            "phases": {k: best[k] for k in ("send", "recv", "engine")}}


def run_engine_floor(cfg: Any, rounds: int = 3) -> dict[str, Any]:
    """Both weight paths, one engine at a time (memory), the floor measured in each."""
    model_dir = str(cfg.model.path)
    bucket_mb = min(cfg.learner.weights.bucket_mb, cfg.learner.weights.gloo_bucket_mb)
    out = {}
    for path in ("extension", "native"):
        out[path] = asyncio.run(_one_path(model_dir, cfg, path, rounds, bucket_mb))
    return out


def floor_rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for path, r in res.items():
        rows.append((f"engine {path}: asyncrl / floor", f"{r['asyncrl_s']:.3f} / {r['floor_s']:.3f} s = "
                     f"{r['ratio']:.2f}x (floor: wire {r['floor_wire_s']:.3f} + reload {r['floor_reload_s']:.3f} "
                     f"+ retie {r['floor_retie_s']:.3f})"))
        rows.append((f"engine {path}: asyncrl median", f"{r['asyncrl_median_s']:.3f} s; engine resident GiB by "
                     f"round {', '.join(f'{g:.2f}' for g in r['engine_rss_gib'])}"))
        for variant in VARIANTS:
            b = r[variant]
            rows.append((f"engine {path}: {variant}", f"{b['asyncrl_s']:.3f} s = {b['ratio']:.2f}x "
                         f"(median {b['asyncrl_median_s']:.3f} s)"))
        for label, phases in (("", r["phases"]), *((f"({v}) ", r[v]["phases"]) for v in VARIANTS)):
            for side in ("send", "recv", "engine"):
                ph = {k: v for k, v in (phases[side] or {}).items() if v >= 0.005}
                rows.append((f"  {label}{side} phases", ", ".join(f"{k} {v:.3f}" for k, v in ph.items())))
    return rows
