"""Where a policy loses guided accuracy on the arith quick-start world, and how much RL could win.

    python analysis/analyze_arith_policy.py --model assets/tiny-policy [--split test] [--limit 200]

Runs the greedy guided evaluation (`asyncrl.eval`, real vLLM CPU engine + rule verifier) and reports
- the verifier's verdict on every policy turn (`step_error`, `correct`, `stop`, ...),
- guided accuracy by the problem's number of steps (how binding the turn budget is),
- steps written per policy turn,
- near misses: for each greedy arithmetic error, the log-probability gap between the policy's wrong
  result and the right one in the same context (HF forward). A gap under ~1 nat is an argmax flip
  RL can plausibly buy; a large gap is missing knowledge (capacity, not exploration),
- the same-turn-answer ceiling: the guided accuracy if the policy wrote the final answer in the turn
  of its last step instead of asking `Right?` (the answer it would write is its own last result).

Used to diagnose the quick start's learning target (see the end-to-end issue's notes).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from typing import Any


def _near_miss_gaps(model_path: str, tokenizer: Any, rows: list[dict], conversations: list[list[dict]]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.tasks.arith import apply_op
    from asyncrl.tasks.arith_verifier import verify_turns

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()

    def answer_logprob(prefix: str, answer: str) -> float:
        ids = tokenizer(prefix + answer + ".", add_special_tokens=False)["input_ids"]
        start = len(tokenizer(prefix, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        lp = torch.log_softmax(logits[start - 1:-1].float(), -1)
        return float(lp.gather(-1, torch.tensor(ids[start:])[:, None]).sum())

    gaps = []
    for row, msgs in zip(rows, conversations, strict=True):
        turns = [m["content"] for m in msgs if m["role"] == "assistant"]
        for i, text in enumerate(turns):
            if verify_turns(row["problem"], turns[: i + 1]).kind != "step_error":
                continue
            m = re.match(r"(\d+) ([+\-*]) (\d+) = (\d+)", text)
            if not m:
                continue
            truth = str(apply_op(int(m[1]), m[2], int(m[3])))
            if truth == m[4]:
                continue  # the error is elsewhere (wrong step chosen), not the arithmetic
            prefix = tokenizer.apply_chat_template(msgs[: 1 + 2 * i], tokenize=False, add_generation_prompt=True)
            prefix += f"{m[1]} {m[2]} {m[3]} = "
            gaps.append(answer_logprob(prefix, m[4]) - answer_logprob(prefix, truth))
    return gaps


def _same_turn_ceiling(llm: Any, tokenizer: Any, rows: list[dict]) -> dict[str, float]:
    """Greedy guided eval where a turn whose accepted steps finish the expression gets the final
    answer appended (its own last result) instead of `Right?`."""
    import asyncrl.eval as ev
    from asyncrl.tasks.arith_verifier import verify_turns

    by_uid = {str(r.get("id", i)): r["problem"] for i, r in enumerate(rows)}  # make_conversations' uids

    def answer_early(conv: Any, ids: list[int]) -> list[int]:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        results = re.findall(r"= (\d+)\.", text)
        if not (text.endswith("Right?") and results):
            return ids
        verdict = verify_turns(by_uid[conv.uid], [t.text for t in conv.turns] + [text])
        if verdict.kind != "correct" or "final answer" not in verdict.text:
            return ids
        text = text[: -len("Right?")] + f"<answer>\\boxed{{{results[-1]}}}</answer>"
        return tokenizer.encode(text, add_special_tokens=False) + ids[-1:]

    out = ev.evaluate_with_llm(llm, tokenizer, rows, "guided", rewrite=answer_early)
    return {"accuracy": out["accuracy"], "mean_turns": out["mean_turns"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="assets/tiny-policy")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=0, help="first N rows only (0 = all)")
    a = p.parse_args(argv)

    from transformers import AutoTokenizer

    import asyncrl.eval as ev
    from asyncrl.tasks.arith_verifier import verify_turns

    rows = ev.load_split("arith", a.split)
    rows = rows[: a.limit] if a.limit else rows
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    llm = ev.build_llm(a.model, max_model_len=384)
    res = ev.evaluate_with_llm(llm, tokenizer, rows, "guided", return_conversations=True)
    convs = res.pop("conversations")
    kinds: collections.Counter[str] = collections.Counter()
    per_turn_steps: collections.Counter[int] = collections.Counter()
    by_steps: dict[int, list[bool]] = collections.defaultdict(list)
    for row, msgs in zip(rows, convs, strict=True):
        turns = [m["content"] for m in msgs if m["role"] == "assistant"]
        verdicts = [verify_turns(row["problem"], turns[: i + 1]).kind for i in range(len(turns))]
        kinds.update(verdicts)
        per_turn_steps.update(t.count("=") for t in turns)
        by_steps[int(row.get("num_steps", 0))].append(bool(verdicts) and verdicts[-1] == "stop")
    gaps = sorted(_near_miss_gaps(a.model, tokenizer, rows, convs))
    report = {
        "guided_accuracy": res["accuracy"], "mean_turns": res["mean_turns"],
        "turn_verdicts": dict(kinds), "steps_per_turn": dict(sorted(per_turn_steps.items())),
        "accuracy_by_num_steps": {k: round(sum(v) / len(v), 3) for k, v in sorted(by_steps.items())},
        "arith_errors": len(gaps),
        "arith_errors_within_1_nat": sum(g < 1.0 for g in gaps),
        "arith_errors_within_2_nats": sum(g < 2.0 for g in gaps),
        "median_gap_nats": round(gaps[len(gaps) // 2], 3) if gaps else None,
        "same_turn_answer_ceiling": _same_turn_ceiling(llm, tokenizer, rows),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
