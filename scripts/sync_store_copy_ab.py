"""A/B of the sender's store copy: taken before each bucket goes out, or after it is posted (beside
its wire time), on a real loopback gloo round to a receiver thread, every version published (the
copy is taken; the Ray put is left out), interleaved rounds (which variant goes first alternates),
phases from `asyncrl.weights.phases`.
No vLLM: the light way to see the sender's side when the machine has no room for an engine.

    python scripts/sync_store_copy_ab.py --model DIR [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch
    from safetensors.torch import load_file

    from asyncrl.weights.receiver import WeightReceiver
    from asyncrl.weights.sender import WeightSender

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    state = {}
    for f in sorted(Path(args.model).glob("*.safetensors")):
        state.update({k: v.clone() for k, v in load_file(str(f)).items()})
    cfg = SimpleNamespace(bucket_mb=args.bucket_mb, backend="gloo", timeout_s=120.0, host="127.0.0.1")
    sender = WeightSender(cfg, members=["r"], publish=True)
    sender.publish_fn = lambda buckets, version, name: None
    rec = WeightReceiver(sender.address, "r", timeout_s=120.0)
    out: dict[str, list] = {"after_post": [], "before_post": []}
    version = 0
    for r in range(args.rounds + 1):
        pair = ((True, "after_post"), (False, "before_post"))
        for overlap, key in (pair if r % 2 else pair[::-1]):  # alternate which goes first
            sender.store_copy_overlap = overlap
            version += 1
            box = {}
            th = threading.Thread(target=lambda b=box: b.update(res=rec.receive(lambda it: sum(1 for _ in it))))
            th.start()
            t = time.perf_counter()
            report = sender.broadcast(state.items(), version)
            th.join()
            seconds = time.perf_counter() - t
            assert box["res"]["status"] == "ok", box
            if r:
                out[key].append({"seconds": seconds, "send": report.phases, "recv": box["res"]["phases"]})
    sender.close()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    summary = {"bytes": nbytes, "rounds": args.rounds, "bucket_mb": args.bucket_mb}
    for key, runs in out.items():
        best = min(runs, key=lambda x: x["seconds"])
        summary[key] = {"best_s": best["seconds"], "median_s": statistics.median(x["seconds"] for x in runs),
                        "send": {k: round(v, 3) for k, v in best["send"].items()},
                        "recv": {k: round(v, 3) for k, v in best["recv"].items()}}
    summary["median_ratio_after_over_before"] = summary["after_post"]["median_s"] / summary["before_post"]["median_s"]
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
