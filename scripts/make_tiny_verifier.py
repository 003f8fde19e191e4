"""Build the quick start's learned verifier from scratch on CPU: Stage 1 with the arith rule oracle as
teacher, then Stage 2 on the tiny policy's checkpoint (its architecture and tokenizer).

    python scripts/make_tiny_verifier.py [--out assets/tiny-verifier] [--prompts 400] [--steps 400]

= python -m asyncrl.synth --config configs/verifier/synth_arith.yaml --out WORK/data --limit PROMPTS
  python -m asyncrl.sft --data WORK/data --init assets/tiny-policy --out OUT --steps STEPS
Stage 1 is resumable (a rerun with the same --work continues); the checkpoint directory gets the
SFT report (`sft_report.json`: loss, held-out step-label P/R/F1, parse rate, usefulness) and the
synthesis summary (`synth_summary.json`) beside the weights. configs/quickstart_learned_verifier.yaml
serves the result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="assets/tiny-verifier")
    p.add_argument("--work", default="runs/tiny-verifier-data", help="Stage 1 output (resumable)")
    p.add_argument("--config", default="configs/verifier/synth_arith.yaml")
    p.add_argument("--init", default="assets/tiny-policy")
    p.add_argument("--prompts", type=int, default=400)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-rows", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    t0 = time.time()
    data = Path(a.work) / "data"
    rc = subprocess.call([sys.executable, "-m", "asyncrl.synth", "--config", a.config, "--out", str(data),
                          "--limit", str(a.prompts)], cwd=ROOT)
    if rc:
        print(f"make_tiny_verifier: Stage 1 failed (exit {rc})", file=sys.stderr)
        return rc
    t1 = time.time()
    from asyncrl.verifier_training.sft import main as sft

    rc = sft(["--data", str(data), "--init", a.init, "--out", a.out, "--steps", str(a.steps),
              "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--eval-rows", str(a.eval_rows),
              "--seed", str(a.seed)])
    if rc:
        return rc
    shutil.copy(data / "summary.json", Path(a.out) / "synth_summary.json")
    report = json.loads((Path(a.out) / "sft_report.json").read_text())
    report["build"] = {"synth_s": round(t1 - t0, 1), "sft_s": round(time.time() - t1, 1),
                       "total_s": round(time.time() - t0, 1), "prompts": a.prompts, "command": " ".join(sys.argv)}
    (Path(a.out) / "sft_report.json").write_text(json.dumps(report, indent=1))
    print(f"make_tiny_verifier: {a.out} in {time.time() - t0:.0f}s (synthesis {t1 - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
