"""Stage 2 of Guided-GRPO, verifier SFT: `python -m asyncrl.sft --data DIR --init MODEL --out CKPT`.

Fine-tunes a causal LM on Stage 1's rows (asyncrl.synth's `train.jsonl`): input = the verifier's
request rendered with the model's chat template (generation prompt included), target = the
teacher's reply + the end-of-turn token; the loss is on the reply tokens only (every prompt
position is labelled -100). The trainer is transformers' `Trainer`: it is installed with asyncrl
(TRL is only in the `bench` extra), it runs on CPU as is, and a prompt/completion collator that
masks the prompt is all the SFT-specific code a verifier needs; TRL's `SFTTrainer` with a
prompt/completion dataset would compute the same loss. The checkpoint (`save_pretrained` of the
model and the tokenizer with its chat template) is what the `vllm` verifier back-end serves as is
(`verifier.backend: vllm`, `verifier.model_path: CKPT`).

After training, the held-out split (`heldout.jsonl`) is answered greedily by the trained model and
the report (`<out>/sft_report.json`, printed) holds:
- `parse_rate`: share of replies in the reply grammar (STOP, or guidance with a `[SCORE]` line);
- step-label precision / recall / F1 against the ground-truth checker (positive = hallucinated
  turn; an unparsed reply counts as "clean", the label a missing score gets), and the same for
  the un-tuned initial model (`--init`) when `--baseline` is on;
- `usefulness`: where the verifier sent guidance, the policy (`--policy`, default the source
  policy of Stage 1) is given that guidance and answers one more turn (greedy); the share of
  those next turns the checker finds clean, and the share that end in the right final answer.
  The teacher's own replies in the same places are the reference.

Exit 2, naming the file / row: a missing data directory or split, a row without `messages` or
`reply`, an `--init` model that does not load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.cli import fail

__all__ = ["main", "read_rows", "encode_row", "step_label_scores", "generate_replies"]


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a Stage-1 split; exit 2 naming the file and row when one lacks `messages` or `reply`."""
    if not path.is_file():
        fail(f"verifier SFT data: {path} does not exist (run python -m asyncrl.synth first)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as exc:
            fail(f"verifier SFT data: {path} row {i}: not JSON ({exc})")
    for i, r in enumerate(rows):
        for key in ("messages", "reply"):
            if not isinstance(r, dict) or not r.get(key):
                fail(f"verifier SFT data: {path} row {i}: no {key!r} field")
    return rows


def encode_row(tok: Any, row: dict[str, Any], max_len: int) -> dict[str, list[int]] | None:
    """input_ids / labels of one row (labels -100 on the prompt), None when longer than `max_len`."""
    prompt = _chat_ids(tok, row["messages"])
    reply = tok.encode(row["reply"], add_special_tokens=False) + [tok.eos_token_id]
    if len(prompt) + len(reply) > max_len:
        return None
    return {"input_ids": prompt + reply, "labels": [-100] * len(prompt) + reply}


def _chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


class ReplyOnlyCollator:
    """Right-pads a batch; labels padded with -100 (no loss on padding)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, feats: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        n = max(len(f["input_ids"]) for f in feats)
        ids = torch.full((len(feats), n), self.pad_id, dtype=torch.long)
        lab = torch.full((len(feats), n), -100, dtype=torch.long)
        att = torch.zeros((len(feats), n), dtype=torch.long)
        for i, f in enumerate(feats):
            k = len(f["input_ids"])
            ids[i, :k] = torch.tensor(f["input_ids"])
            lab[i, :k] = torch.tensor(f["labels"])
            att[i, :k] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}


def generate_replies(model: Any, tok: Any, conversations: list[list[dict[str, str]]], max_new_tokens: int,
                     batch_size: int = 16) -> list[str]:
    """Greedy replies (transformers `generate`, left padding) to chat `conversations`."""
    import torch

    out: list[str] = []
    model.eval()
    for i in range(0, len(conversations), batch_size):
        batch = [_chat_ids(tok, m) for m in conversations[i: i + batch_size]]
        n = max(len(b) for b in batch)
        ids = torch.full((len(batch), n), tok.pad_token_id, dtype=torch.long)
        att = torch.zeros((len(batch), n), dtype=torch.long)
        for j, b in enumerate(batch):
            ids[j, n - len(b):] = torch.tensor(b)
            att[j, n - len(b):] = 1
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        out += [tok.decode(g[n:], skip_special_tokens=True).strip() for g in gen]
    return out


def step_label_scores(predicted: list[int | None], truth: list[int]) -> dict[str, float]:
    """Precision / recall / F1 of "hallucinated" (1); a prediction of None (unparsed) counts as 0."""
    tp = sum(1 for p, t in zip(predicted, truth, strict=True) if p == 1 and t == 1)
    fp = sum(1 for p, t in zip(predicted, truth, strict=True) if p == 1 and t != 1)
    fn = sum(1 for p, t in zip(predicted, truth, strict=True) if p != 1 and t == 1)
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": round(precision, 4), "recall": round(recall, 4), "f1": round(f1, 4), "n": len(truth),
            "positives": sum(1 for t in truth if t == 1)}


def verifier_quality(model: Any, tok: Any, rows: list[dict[str, Any]], max_new_tokens: int,
                     stop_token: str = "###STOP###") -> tuple[dict[str, Any], list[str]]:
    """Parse rate and step-label P/R/F1 of `model`'s greedy replies on `rows`; and the replies."""
    from asyncrl.verifier_training.rows import reply_parses

    replies = generate_replies(model, tok, [r["messages"] for r in rows], max_new_tokens)
    parsed = [reply_parses(t, stop_token) for t in replies]
    truth = [int(r["checker_label"] if r.get("checker_label") is not None else r["step_label"]) for r in rows]
    out = {"parse_rate": round(sum(p for p, _ in parsed) / max(1, len(rows)), 4),
           "exact_match_teacher": round(sum(a.strip() == r["reply"].strip() for a, r in zip(replies, rows,
                                                                                             strict=True)) / max(1, len(rows)), 4),
           **step_label_scores([lab for _, lab in parsed], truth)}
    return out, replies


def usefulness(policy: Any, ptok: Any, rows: list[dict[str, Any]], replies: list[str], task: str,
               max_new_tokens: int, stop_token: str = "###STOP###") -> dict[str, Any]:
    """The policy's next turn after each guidance reply (module doc): share clean by the checker,
    share with the right final answer, over the rows where `replies` is guidance."""
    from asyncrl.actors.guided import parse_verifier_reply
    from asyncrl.verifier_training.rows import CHECKERS, _correct

    idx, convs = [], []
    for i, (r, text) in enumerate(zip(rows, replies, strict=True)):
        reply = parse_verifier_reply(text, stop_token)
        if reply.kind != "guidance" or not r.get("policy_messages"):
            continue
        idx.append(i)
        convs.append(r["policy_messages"] + [{"role": "user", "content": reply.guidance}])
    if not convs:
        return {"n": 0, "next_turn_clean": None, "next_turn_correct": None}
    nxt = generate_replies(policy, ptok, convs, max_new_tokens)
    checker = CHECKERS.get(task)
    clean, correct = [], []
    for i, text in zip(idx, nxt, strict=True):
        r = rows[i]
        turns = [m["content"] for m in r["policy_messages"] if m["role"] == "assistant"] + [text]
        if checker is not None:
            clean.append(1 - checker(r["problem"], turns))
        correct.append(_correct(text, r["answer"]))
    return {"n": len(idx), "next_turn_clean": round(sum(clean) / len(clean), 4) if clean else None,
            "next_turn_correct": round(sum(correct) / len(correct), 4)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m asyncrl.sft", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="Stage 1 output directory (train.jsonl, heldout.jsonl)")
    p.add_argument("--init", default="assets/tiny-policy", help="model to fine-tune (HF directory)")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--policy", default=None, help="policy for the usefulness measure (default: Stage 1's source)")
    p.add_argument("--task", default="arith", help="task of the ground-truth checker")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--max-len", type=int, default=1024, help="longest prompt + reply trained (longer rows are counted, skipped)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="reply length when evaluating")
    p.add_argument("--eval-rows", type=int, default=200, help="held-out rows evaluated (0 = all)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also evaluate the un-tuned --init model on the held-out rows")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data = Path(args.data)
    if not data.is_dir():
        fail(f"verifier SFT data: {data} is not a directory (run python -m asyncrl.synth --out {data} first)")
    train_rows = read_rows(data / "train.jsonl")
    heldout = read_rows(data / "heldout.jsonl") if (data / "heldout.jsonl").stat().st_size else []
    if not (Path(args.init) / "config.json").is_file():
        fail(f"--init {args.init}: no config.json (not a Hugging Face model directory)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed

    torch.set_num_threads(args.threads)
    set_seed(args.seed)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(args.init)
    if not getattr(tok, "chat_template", None):
        fail(f"--init {args.init}: the tokenizer has no chat template")
    feats = [e for r in train_rows if (e := encode_row(tok, r, args.max_len)) is not None]
    skipped = len(train_rows) - len(feats)
    if not feats:
        fail(f"verifier SFT data: no row of {data / 'train.jsonl'} fits --max-len {args.max_len}")
    model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    from datasets import Dataset

    train = Dataset.from_list(feats)
    targs = TrainingArguments(
        output_dir=str(Path(args.out) / "trainer"), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, warmup_steps=args.warmup, lr_scheduler_type="cosine", weight_decay=0.01,
        logging_steps=max(1, args.steps // 20), save_strategy="no", report_to=[], use_cpu=True, seed=args.seed,
        dataloader_num_workers=0, remove_unused_columns=False, max_grad_norm=1.0, disable_tqdm=False)
    trainer = Trainer(model=model, args=targs, train_dataset=train, data_collator=ReplyOnlyCollator(tok.pad_token_id))
    result = trainer.train()
    losses = [{"step": h["step"], "loss": round(h["loss"], 4)} for h in trainer.state.log_history if "loss" in h]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    import shutil

    shutil.rmtree(out / "trainer", ignore_errors=True)
    report: dict[str, Any] = {
        "data": str(data), "init": args.init, "out": str(out), "trainer": "transformers.Trainer",
        "train_rows": len(feats), "skipped_too_long": skipped, "steps": args.steps, "lr": args.lr,
        "batch_size": args.batch_size, "loss_first": losses[0]["loss"] if losses else None,
        "loss_last": losses[-1]["loss"] if losses else None, "loss_curve": losses,
        "train_s": round(result.metrics.get("train_runtime", 0.0), 1),
    }
    if heldout:
        rows = heldout[: args.eval_rows] if args.eval_rows else heldout
        quality, replies = verifier_quality(model, tok, rows, args.max_new_tokens)
        report["heldout"] = {"rows": len(rows), "sft": quality}
        policy_path = args.policy or _source_policy(data)
        if policy_path:
            policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
            ptok = AutoTokenizer.from_pretrained(policy_path)
            report["heldout"]["usefulness"] = {
                "sft": usefulness(policy, ptok, rows, replies, args.task, 64),
                "teacher": usefulness(policy, ptok, rows, [r["reply"] for r in rows], args.task, 64)}
        if args.baseline:
            base = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32)
            report["heldout"]["untuned"], base_replies = verifier_quality(base, tok, rows, args.max_new_tokens)
            if policy_path:
                report["heldout"]["usefulness"]["untuned"] = usefulness(policy, ptok, rows, base_replies, args.task, 64)
    report["wall_s"] = round(time.time() - t0, 1)
    (out / "sft_report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "loss_curve"}, indent=1))
    if losses and not math.isfinite(losses[-1]["loss"]):
        print("error: the loss is not finite", file=sys.stderr)
        return 1
    return 0


def _source_policy(data: Path) -> str | None:
    try:
        return json.loads((data / "summary.json").read_text()).get("policy")
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
