"""A vLLM CPU engine's resident memory over many weight reloads, against the launch guard's estimate.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/engine_memory.py MODEL_DIR [--rounds 50] [--kv-gb 0.25]
        [--path extension|native] [--max-growth-gib 0.1]

Builds one `PolicyEngine` from MODEL_DIR (the quick start's rollout settings, fp32), then broadcasts
the model's own tensors to it `--rounds` times with a `WeightSender` (gloo, buffered receive, as in a
job). The engine core's resident memory is sampled every 0.1 s: after the build, each round's
peak and what stays after it. Prints one JSON line: those figures, the growth from the 5th round to
the last (exit 1 above `--max-growth-gib`: an engine that keeps a buffer per reload), the
median seconds of the round's `trim` phase, and
`asyncrl.learner.memory.engine_host_bytes` for the same model and settings (the preflight's
figure), by component.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GiB = 2**30


class Sampler:
    """The resident memory of this process's children (the engine core), sampled in a thread."""

    def __init__(self) -> None:
        self.peak = 0.0
        self.now = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = 0
            for child in psutil.Process().children(recursive=True):
                try:
                    rss += child.memory_info().rss
                except psutil.Error:
                    continue
            self.now = rss / GiB
            self.peak = max(self.peak, self.now)
            time.sleep(0.1)

    def reset_peak(self) -> None:
        time.sleep(0.25)
        self.peak = self.now

    def close(self) -> None:
        self._stop.set()


async def run(args: argparse.Namespace) -> dict:
    import torch
    from safetensors.torch import load_file

    from asyncrl.actors.engine import PolicyEngine
    from asyncrl.config import load_config
    from asyncrl.learner import memory as mem
    from asyncrl.weights.sender import WeightSender

    torch.set_num_threads(1)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(args.model).glob("*.safetensors")):
        state.update(load_file(str(f)))
    cfg = load_config(str(ROOT / "configs" / "quickstart.yaml"), []).rollout.model_copy(update={"weight_transfer": args.path, "cpu_kvcache_gb": args.kv_gb})
    sampler = Sampler()
    engine = PolicyEngine(args.model, cfg, engine_id="memory", max_model_len=256, weight_timeout_s=120)
    sampler.reset_peak()
    built = sampler.now
    sender = WeightSender(SimpleNamespace(bucket_mb=16, gloo_bucket_mb=16, backend="gloo", timeout_s=120.0,
                                          host="127.0.0.1"), members=engine.weight_member_ids())
    peaks, after, trim = [], [], []
    try:
        for version in range(1, args.rounds + 1):
            sampler.reset_peak()
            report, res = await asyncio.gather(asyncio.to_thread(sender.broadcast, state.items(), version),
                                               engine.update_weights_from_group(sender.address, timeout_s=120))
            assert res["status"] == "ok" and report.acked, res
            time.sleep(0.3)
            peaks.append(round(sampler.peak, 3))
            after.append(round(sampler.now, 3))
            trim.append(res.get("phases", {}).get("trim", 0.0))
    finally:
        sender.close()
        engine.shutdown()
        sampler.close()
    config = json.loads((Path(args.model) / "config.json").read_text())
    shape = mem.shape_from_config(config, args.model)
    estimate = mem.engine_host_bytes(shape, int(args.kv_gb * GiB), round_bytes=sum(t.numel() * t.element_size() for t in state.values()))
    base = after[min(4, len(after) - 1)]
    return {"model": args.model, "params": shape.params, "weight_bytes": sum(t.numel() * t.element_size()
                                                                             for t in state.values()),
            "path": args.path, "rounds": args.rounds, "built_gib": round(built, 3), "peak_gib": max(peaks),
            "round_peaks_gib": peaks, "after_round_gib": after, "growth_after_round5_gib": round(after[-1] - base, 3),
            "trim_s_median": round(sorted(trim)[len(trim) // 2], 4),
            "estimate_gib": round(sum(estimate.values()) / GiB, 3),
            "estimate": {k: round(v / GiB, 3) for k, v in estimate.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--kv-gb", type=float, default=0.25)
    parser.add_argument("--path", choices=("extension", "native"), default="extension")
    parser.add_argument("--max-growth-gib", type=float, default=0.1)
    args = parser.parse_args()
    out = asyncio.run(run(args))
    print(json.dumps(out))
    sys.exit(1 if out["growth_after_round5_gib"] > args.max_growth_gib else 0)


if __name__ == "__main__":
    main()
