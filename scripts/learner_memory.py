"""One CPU learner rank's resident memory by phase, at any size (issue 29's real-size accounting).

    HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu .venv/bin/python scripts/learner_memory.py MODEL_DIR [overrides]

An in-process `LearnerWorker` with the real-size run's settings (ZeRO-0, guide off, 2 groups x 2
samples, 16 response tokens; overrides after the model path, e.g. `learner.kl.enable=false`):
resident / unique / shared memory and the process's peak after building, after each of three
train_steps and after walking the weight-sync export, plus the bytes in real tensors. Run it with
`MALLOC_MMAP_THRESHOLD_=65536` too: the difference is what glibc's heap keeps
(asyncrl/learner/memory.py, `cpu_learner_extras`).
"""

from __future__ import annotations

import gc
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_memory import state_mib  # noqa: E402

from asyncrl.bench.learner import synthetic_groups  # noqa: E402
from asyncrl.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def report(tag: str) -> None:
    m = psutil.Process().memory_full_info()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{tag:34} rss {m.rss / 2**30:6.2f} GiB  uss {m.uss / 2**30:6.2f}  shared {m.shared / 2**30:5.2f}  "
          f"peak {peak:6.2f}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if len(sys.argv) > 1 else 2)
    model, extra = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(2)
    from asyncrl.learner.learner import LearnerWorker

    report("imports")
    overrides = [f"model.path={model}", f"trainer.run_dir={tempfile.mkdtemp()}", "learner.zero_stage=0",
                 "rollout.guide.enable=false", "data.rollout_batch_size=2", "rollout.n=2",
                 "data.max_response_length=16", "learner.mini_batches=1", *extra]
    worker = LearnerWorker(load_config(ROOT / "configs" / "quickstart.yaml", overrides), 0, 1, "127.0.0.1",
                           _free_port())
    report("built (model, reference, DeepSpeed)")
    print("tensors MiB", state_mib(worker), flush=True)
    for step in (1, 2, 3):
        t0 = time.time()
        worker.train_step(synthetic_groups(2, 2, worker.vocab_size, (90, 120), (12, 16), seed=step))
        report(f"after train_step {step} ({time.time() - t0:.0f}s)")
        print("tensors MiB", state_mib(worker), flush=True)
        nbytes = sum(t.numel() * t.element_size() for bucket in worker.export_sync_tensors(256 * 2**20)
                     for _, t in bucket)
        gc.collect()
        report(f"after export walk ({nbytes / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
