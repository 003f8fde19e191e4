"""The learner's state after one step, full fine-tuning vs LoRA (docs/benchmarks.md, "LoRA").

    .venv/bin/python scripts/lora_memory.py MODEL_DIR          # full fine-tuning, KL reference = a replica
    .venv/bin/python scripts/lora_memory.py MODEL_DIR --lora   # LoRA r16, KL reference = adapter disabled

One in-process `LearnerWorker` (ZeRO-1, CPU, `learner.kl.enable`), one step on synthetic groups;
prints the bytes held in real tensors (parameters, gradients, Adam moments, ZeRO's fp32 partition,
the KL reference) and the process's peak RSS. Run the two modes in separate processes.
`--build DIR` first writes the 55M-parameter Qwen2 used there (hidden 512, 8 layers, vocab 32k).
"""

from __future__ import annotations

import argparse
import resource
import socket
import tempfile

import torch

from asyncrl.bench.learner import build_tiny_qwen2, synthetic_groups
from asyncrl.config import load_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def state_mib(worker) -> dict[str, float]:
    module, opt = worker.engine.module, worker.engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    out = {
        "params": sum(p.numel() * p.element_size() for p in module.parameters()),
        "grads": sum(p.grad.numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None),
        "adam": sum(t.numel() * t.element_size() for st in inner.state.values() for t in st.values() if torch.is_tensor(t)),
        "fp32_partition": sum(t.numel() * t.element_size() for t in getattr(opt, "single_partition_of_fp32_groups", [])),
        "reference": sum(p.numel() * p.element_size() for p in worker.ref_model.parameters()) if worker.ref_model else 0,
    }
    return {k: round(v / 2**20, 2) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="an HF model directory")
    parser.add_argument("--lora", action="store_true", help="LoRA r16 on the seven projections")
    parser.add_argument("--build", action="store_true", help="first write the 55M-parameter Qwen2 to MODEL")
    args = parser.parse_args()
    if args.build:
        build_tiny_qwen2(args.model, hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408, vocab_words=32000)
    from asyncrl.learner.learner import LearnerWorker

    torch.set_num_threads(1)
    run_dir = tempfile.mkdtemp(prefix="asyncrl-lora-memory-")
    overrides = [f"model.path={args.model}", f"trainer.run_dir={run_dir}", "learner.kl.enable=true"]
    if args.lora:
        overrides += ["model.lora.enable=true", "model.lora.rank=16", "model.lora.alpha=32"]
    worker = LearnerWorker(load_config(None, overrides), 0, 1, "127.0.0.1", _free_port())
    worker.train_step(synthetic_groups(4, 4, worker.vocab_size, (8, 16), (16, 32), seed=0))
    state = state_mib(worker)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"{'lora r16' if args.lora else 'full'} {args.model}: {state} total {sum(state.values()):.1f} MiB; "
          f"peak RSS {peak} MiB")


if __name__ == "__main__":
    main()
