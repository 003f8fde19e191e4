"""Why the quick start's sampled training reward stays flat while greedy test accuracy rises.

    # the same policy, the same rows, greedy and sampled (guided protocol, rule verifier, vLLM CPU)
    python analysis/training_reward_gap.py eval --model assets/tiny-policy --split test --limit 200 \
        --temperatures 0 0.5 --samples 4 --output before.json
    # a finished run's metrics.jsonl in windows of steps, with the trained batches' difficulty
    python analysis/training_reward_gap.py windows RUN_DIR [--window 25]

`eval` runs `asyncrl.eval.evaluate_with_llm` (the trainer's evaluation loop) once per temperature,
each row `--samples` times when sampling (the engine's global seed `--seed`), and splits the
correct conversations by what the verifier said on the way: `clean` (every policy turn checked
`correct` or `stop`) vs `rescued` (at least one turn was flagged — a wrong step, a wrong or
unformatted answer, an empty turn — and the conversation still ended right). With the quick
start's reward (`guided_math`, format and hallucination weights 0) a sample's reward IS its guided
accuracy, so `accuracy` at the training temperature on training rows is the expected
`train/reward_mean` of that policy.

`windows` reads `metrics.jsonl` and `config.resolved.json` of a run: per window, the logged reward
and its parts, turns, entropy, KL, and the mean step count of the trained prompts (each
`train/prompt_indices` draw mapped back to its row through the run's prompt stream); then a
least-squares fit of the per-step reward on the batch's mean step count and the step, so the trend
is read with the batch's difficulty held fixed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FLAGGED = ("step_error", "wrong_answer", "format", "no_step")  # verifier verdicts that correct the policy


def conversation_record(conv: Any, row: dict) -> dict[str, Any]:
    """Correctness, turns and the verifier's verdict on each policy turn of one finished conversation."""
    from asyncrl.actors.guided import has_final_answer
    from asyncrl.eval import _boxed
    from asyncrl.tasks.arith_verifier import verify_turns

    texts = [t.text for t in conv.turns]
    kinds = [verify_turns(row["problem"], texts[: i + 1]).kind for i in range(len(texts))]
    correct = (_boxed(conv.final_text) or "").strip() == str(row["answer"]).strip()
    return {"id": row.get("id"), "num_steps": row.get("num_steps"), "correct": correct, "turns": len(texts),
            "flagged": sum(k in FLAGGED for k in kinds), "kinds": kinds,
            "answered": has_final_answer(conv.final_text), "finish_reason": str(conv.finish_reason),
            "policy_tokens": sum(len(t.token_ids) for t in conv.turns)}


def summarize_records(recs: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """Accuracy (standard error over rows, each row's mean over its samples), its clean/rescued
    split, one-turn share, turns, tokens, and accuracy by the problem's step count."""
    n = len(recs)

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / max(1, len(xs)), 4)

    per_row = [mean([float(r["correct"]) for r in recs[i::n // samples]]) for i in range(n // samples)]
    m = sum(per_row) / max(1, len(per_row))
    se = (sum((p - m) ** 2 for p in per_row) / max(1, len(per_row) - 1) / max(1, len(per_row))) ** 0.5
    by_steps: dict[str, list[float]] = {}
    for r in recs:
        by_steps.setdefault(str(r["num_steps"]), []).append(float(r["correct"]))
    return {
        "n": n, "rows": n // samples, "accuracy": round(m, 4), "accuracy_se": round(se, 4),
        "clean_accuracy": mean([float(r["correct"] and r["flagged"] == 0) for r in recs]),
        "rescued_accuracy": mean([float(r["correct"] and r["flagged"] > 0) for r in recs]),
        "one_turn_accuracy": mean([float(r["correct"] and r["turns"] == 1) for r in recs]),
        "format_rate": mean([float(r["answered"]) for r in recs]),
        "wrong_answer_rate": mean([float(r["answered"] and not r["correct"]) for r in recs]),
        "finish_reasons": {k: sum(r["finish_reason"] == k for r in recs) for k in sorted({r["finish_reason"] for r in recs})},
        "flagged_turns_per_conv": mean([float(r["flagged"]) for r in recs]),
        "mean_turns": mean([float(r["turns"]) for r in recs]),
        "mean_policy_tokens": mean([float(r["policy_tokens"]) for r in recs]),
        "accuracy_by_steps": {k: {"n": len(v), "accuracy": mean(v)} for k, v in sorted(by_steps.items())},
    }


def _recorder(seen: dict[int, Any]) -> Any:
    """An `evaluate_with_llm` rewrite hook that changes nothing and keeps each conversation object."""
    def keep(conv: Any, ids: list[int]) -> list[int]:
        seen.setdefault(id(conv), conv)
        return ids
    return keep


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    """Guided evaluation of one model on the same rows at each temperature (see the module docstring)."""
    from transformers import AutoTokenizer

    from asyncrl.eval import build_llm, evaluate_with_llm, load_split

    rows = load_split("arith", args.split)
    rows = rows[args.offset: args.offset + args.limit] if args.limit else rows[args.offset:]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    llm = build_llm(args.model, max_model_len=256 + 64 + 64, seed=args.seed)
    out: dict[str, Any] = {"model": args.model, "split": args.split, "offset": args.offset, "rows": len(rows)}
    for temp in args.temperatures:
        samples = 1 if temp == 0 else args.samples
        batch = rows * samples  # sample j of row i is batch[j * len(rows) + i]
        seen: dict[int, Any] = {}
        evaluate_with_llm(llm, tokenizer, batch, "guided", temperature=temp, max_turns=args.max_turns,
                          rewrite=_recorder(seen))
        convs = list(seen.values())  # every conversation generates first, in the order of `batch`
        recs = [conversation_record(c, r) for c, r in zip(convs, batch, strict=True)]
        out[f"T={temp}"] = {"temperature": temp, "samples": samples, **summarize_records(recs, samples)}
        print(json.dumps({f"T={temp}": {k: v for k, v in out[f"T={temp}"].items() if k != "accuracy_by_steps"}}),
              file=sys.stderr)
    return out


def step_counts(run_dir: Path) -> Any:
    """draw index -> the problem's step count, through the run's own prompt stream."""
    from asyncrl.data.stream import PromptStream
    from asyncrl.tasks.arith import read_jsonl

    cfg = json.loads((run_dir / "config.resolved.json").read_text())["data"]
    path = Path(cfg["train_files"]) if Path(cfg["train_files"]).is_absolute() else ROOT / cfg["train_files"]
    rows = read_jsonl(path)
    stream = PromptStream(rows, seed=cfg["seed"], shuffle=cfg["shuffle"])
    return lambda k: rows[stream.item(k).row_index].get("num_steps")


def run_windows(args: argparse.Namespace) -> dict[str, Any]:
    """Per-window means of a run's logged training keys, and the difficulty-held trend fit."""
    import numpy as np

    run_dir = Path(args.run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "train/reward_mean" in r]
    steps_of = step_counts(run_dir)
    for r in rows:
        counts = [steps_of(k) for k in r.get("train/prompt_indices", []) if k >= 0]
        r["batch_num_steps"] = sum(counts) / len(counts) if counts else float("nan")
    keys = ["train/reward_mean", "reward/format", "train/one_turn_accuracy", "train/multi_turn_accuracy", "train/turns_mean",
            "train/response_length_mean", "train/entropy", "loss/kl", "train/staleness_mean", "batch_num_steps"]
    windows = []
    for lo in range(0, len(rows), args.window):
        part = rows[lo: lo + args.window]
        windows.append({"steps": f"{part[0]['step']}-{part[-1]['step']}",
                        **{k: round(float(np.mean([p[k] for p in part if k in p])), 4) for k in keys
                           if any(k in p for p in part)}})
    y = np.array([r["train/reward_mean"] for r in rows])
    x = np.array([r["batch_num_steps"] for r in rows])
    t = np.array([r["step"] for r in rows], dtype=float)
    design = np.column_stack([np.ones_like(t), x, t / 100.0])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    r2_steps = 1.0 - float(np.var(y - np.poly1d(np.polyfit(x, y, 1))(x)) / np.var(y))
    return {"run_dir": str(run_dir), "steps": len(rows), "windows": windows,
            "fit": {"reward ~ a + b*batch_num_steps + c*step/100": [round(float(c), 4) for c in coef],
                    "resid_sd": round(float(resid.std()), 4),
                    "r2_of_batch_num_steps_alone": round(r2_steps, 3),
                    "corr(reward, batch_num_steps)": round(float(np.corrcoef(x, y)[0, 1]), 3)}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="training_reward_gap.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eval", help="one model, the same rows, greedy and sampled")
    e.add_argument("--model", required=True)
    e.add_argument("--split", default="test")
    e.add_argument("--offset", type=int, default=0)
    e.add_argument("--limit", type=int, default=200)
    e.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.5])
    e.add_argument("--samples", type=int, default=4, help="samples per row when the temperature is > 0")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--max-turns", type=int, default=4)
    e.add_argument("--output", default=None)
    w = sub.add_parser("windows", help="a run's metrics.jsonl in windows of steps")
    w.add_argument("run_dir")
    w.add_argument("--window", type=int, default=25)
    w.add_argument("--output", default=None)
    args = p.parse_args(argv)
    result = run_eval(args) if args.cmd == "eval" else run_windows(args)
    text = json.dumps(result, indent=1)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
