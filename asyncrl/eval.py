"""Evaluate a policy checkpoint on a built-in task, guided (verifier in the loop) and solver-only.

    python -m asyncrl.eval --model assets/tiny-policy --task arith --split test [--guided|--solver-only]
                           [--limit N] [--output FILE] [--max-turns 4] [--temperature 0]

Both modes run the real guided protocol (`asyncrl.actors.guided`: Conversation, PolicyChat,
GuideOptions with `training=False`, so the verifier is not shown the reference, as in Guided-GRPO
validation) on vLLM's offline engine (CPU build here), greedy by default:
- guided: the task's rule verifier answers every policy turn (docs/guided_grpo.md#turn-loop); a
  conversation ends on STOP + a formatted answer, or after `max_turns` policy turns.
- solver-only: the same loop with a verifier that always says STOP, so the policy gets only the
  continue prompt until it gives a formatted answer (the STOP-without-answer rule, docs/guided_grpo.md#final-answer), with the same
  turn budget. Its hallucination score is measured after the fact by the rule verifier on each
  turn (the policy never sees it).

Reported per mode (the quantities of the Guided-GRPO paper): accuracy (last `\\boxed{}` of the final
policy turn equals the answer) with its binomial standard error and, for rows that carry
`num_steps` (the arith task), accuracy by problem length; mean turns, mean policy / verifier
tokens per sample (verifier tokens counted with the policy tokenizer on the raw reply), format rate
(final turn has a valid final answer, #final-answer), hallucination score (#hallucination-score,
mean over samples). The JSON top level carries
`guided_accuracy`, `solver_accuracy` (and their `_se`) and, from the guided mode when run (else solver-only),
`mean_turns`, `mean_policy_tokens`, `mean_verifier_tokens`, `format_rate`, `hallucination_score`;
`guided` / `solver` hold each mode's full numbers.

`evaluate(model_path, rows, mode)` builds an engine; `evaluate_with_llm(llm, tokenizer, rows,
mode)` reuses an offline `vllm.LLM`; `evaluate_async(generate, tokenizer, rows, mode)` drives any
async `generate(prompt_ids, seed)` (e.g. a rollout actor's engine).

A training job evaluates on its rollout fleet (`evaluate_on_fleet`), the rows split over the
actors; every back-end (rule, verifier service, VL) answers `{mode: summary}` in the layout of
`summarize`, and `merge_shards` turns the actors' answers into one result of the layout of `combine`
(`merge_mode` weights each shard's numbers by its `n` and recomputes the standard error from the
merged `n`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from asyncrl.actors.guided.evaluation import (  # noqa: F401 - re-exported: the evaluation's library surface
    STOP,
    Mode,
    _boxed,
    _verifier_fn,
    accuracy_se,
    evaluate_async,
    make_conversations,
    summarize,
    transcript,
)

# The top-level numbers of an evaluation result (logged as eval/<key>, compared before/after).
EVAL_KEYS = ("guided_accuracy", "solver_accuracy", "mean_turns", "mean_policy_tokens", "mean_verifier_tokens",
             "format_rate", "hallucination_score")


def load_split(task: str, split: str, data_dir: str | None = None) -> list[dict]:
    """Rows of a built-in task split (`assets/<task>/<split>.jsonl` by default)."""
    from asyncrl.tasks.arith import read_jsonl

    root = Path(data_dir) if data_dir else Path(__file__).resolve().parents[1] / "assets" / task
    return read_jsonl(root / f"{split}.jsonl")


def evaluate_with_llm(llm: Any, tokenizer: Any, rows: Sequence[dict], mode: Mode, *, task: str = "arith",
                      max_turns: int = 4, max_tokens: int = 64, temperature: float = 0.0,
                      max_prompt_length: int | None = 256,
                      return_conversations: bool = False,
                      rewrite: Callable[[Any, list[int]], list[int]] | None = None,
                      verify_batch: Callable[[list[list[dict]]], list[str]] | None = None) -> dict:
    """Lock-step turns over all conversations with an offline `vllm.LLM` (one batched call per turn).
    `rewrite(conversation, token_ids) -> token_ids` (analysis only) may replace a generated turn
    before the conversation sees it, e.g. to measure the ceiling of a behaviour. `verify_batch`
    (guided mode) replaces the task's rule verifier: the requests of one turn in, the replies out
    (a learned verifier answering them as one batch; asyncrl.bench.method)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from asyncrl.actors.guided import GenerateStep

    convs = make_conversations(rows, tokenizer, mode, max_turns, max_prompt_length)
    verify = _verifier_fn(task, mode)
    while True:
        steps = [(c, c.next_step()) for c in convs]
        steps = [(c, s) for c, s in steps if s is not None]
        if not steps:
            break
        gen = [(c, s) for c, s in steps if isinstance(s, GenerateStep)]
        asks = [(c, s) for c, s in steps if not isinstance(s, GenerateStep)]
        if asks and verify_batch is not None and mode == "guided":
            for (c, _), reply in zip(asks, verify_batch([s.messages for _, s in asks]), strict=True):
                c.on_verified(reply)
        else:
            for c, s in asks:
                c.on_verified(verify(s.messages))
        if gen:
            # No per-request seed: on vLLM's CPU build a seeded request whose prefill is chunked
            # kills the engine ("CPU Generator does not use offset"); sampling (temperature > 0)
            # is seeded by the engine's global seed (`build_llm(seed=...)`) instead.
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens, detokenize=False)
            outs = llm.generate([TokensPrompt(prompt_token_ids=s.prompt_ids) for _, s in gen], params, use_tqdm=False)
            for (c, _), o in zip(gen, outs, strict=True):
                ids = list(o.outputs[0].token_ids)
                c.on_generated(rewrite(c, ids) if rewrite else ids, None, 0, str(o.outputs[0].finish_reason))
    out = summarize(convs, rows, tokenizer, task, mode)
    if return_conversations:
        out["conversations"] = [c.messages() for c in convs]
    return out


def build_llm(model_path: str, max_model_len: int = 1024, seed: int = 0) -> Any:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    return LLM(model=model_path, dtype="float32", enforce_eager=True, max_model_len=max_model_len, seed=seed,
               enable_prefix_caching=True)


def combine(results: dict[str, dict]) -> dict:
    """The JSON summary: top-level keys from guided (else solver), both accuracies, per-mode blocks."""
    main = results.get("guided") or results["solver"]
    out: dict[str, Any] = {
        "guided_accuracy": results["guided"]["accuracy"] if "guided" in results else None,
        "solver_accuracy": results["solver"]["accuracy"] if "solver" in results else None,
        "guided_accuracy_se": results["guided"].get("accuracy_se") if "guided" in results else None,
        "solver_accuracy_se": results["solver"].get("accuracy_se") if "solver" in results else None,
    }
    for k in ("mean_turns", "mean_policy_tokens", "mean_verifier_tokens", "format_rate", "hallucination_score"):
        out[k] = main[k]
    out.update(results)
    return out


def row_order(conv: dict[str, Any]) -> tuple[int, str]:
    """Evaluation transcripts in row-id order (numeric ids numerically), so before/after line up."""
    rid = str(conv.get("id", ""))
    return (int(rid), "") if rid.isdigit() else (1 << 62, rid)


def merge_mode(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge per-shard summaries of one eval mode (numbers weighted by each shard's `n`)."""
    n = sum(p.get("n", 0) for p in parts)
    out: dict[str, Any] = {"mode": parts[0].get("mode"), "n": n}
    for key, value in parts[0].items():
        if key in out or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        out[key] = sum(p.get(key, 0.0) * p.get("n", 0) for p in parts) / max(n, 1)
    if "accuracy" in out:  # a standard error does not average across shards: recompute it from the merged n
        out["accuracy_se"] = accuracy_se(out["accuracy"], n)
    by_steps: dict[str, dict[str, float]] = {}
    for p in parts:
        for k, v in (p.get("accuracy_by_steps") or {}).items():
            b = by_steps.setdefault(k, {"n": 0, "correct": 0.0})
            b["n"] += v["n"]
            b["correct"] += v["accuracy"] * v["n"]
    if by_steps:
        out["accuracy_by_steps"] = {k: {"n": int(b["n"]), "accuracy": round(b["correct"] / max(b["n"], 1), 4)}
                                    for k, b in sorted(by_steps.items(), key=lambda kv: int(kv[0]))}
    reasons: dict[str, int] = {}
    for p in parts:
        for r, c in (p.get("finish_reasons") or {}).items():
            reasons[r] = reasons.get(r, 0) + c
    out["finish_reasons"] = reasons
    out["wall_s"] = max(p.get("wall_s", 0.0) for p in parts)
    return out


def merge_shards(parts: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """One result from the rollout actors' per-shard answers (`{mode: summary}`, the same layout for
    every back-end): the merged result in the layout of `combine`, and each mode's transcripts
    (taken out of the shards) in row order."""
    conversations = {m: sorted((c for p in parts for c in p[m].pop("conversations", [])), key=row_order)
                     for m in parts[0]}
    return combine({m: merge_mode([p[m] for p in parts]) for m in parts[0]}), conversations


def evaluate_on_fleet(cfg: Any, fleet: Any, version: int, run_dir: Path, split: str, tag: str) -> dict[str, Any]:
    """Greedy evaluation of a training job's policy on its rollout fleet (current weights), the rows
    of `data.test_files` / `data.val_files` split over the actors: the merged result (layout of
    `combine`) plus `seconds`, `version` and `rows`; written with its transcripts to
    `<run_dir>/samples/eval_<tag>.json`, returned without them (summary.json stays small)."""
    from asyncrl.data import load_rows
    from asyncrl.startup import say

    files = cfg.data.test_files if split == "test" else cfg.data.val_files
    rows = load_rows(files, cfg.data)
    if cfg.trainer.eval_limit:
        rows = rows[: cfg.trainer.eval_limit]
    if cfg.data.prompt_key != "problem":
        rows = [{**r, "problem": r[cfg.data.prompt_key], "answer": r[cfg.data.answer_key]} for r in rows]
    t0 = time.time()
    result, conversations = merge_shards(fleet.evaluate(rows, "both", cfg.trainer.samples_per_eval))
    result.update({"seconds": time.time() - t0, "version": version, "rows": len(rows)})
    if any(conversations.values()):
        result["conversations"] = conversations
    (run_dir / "samples").mkdir(exist_ok=True)
    (run_dir / "samples" / f"eval_{tag}.json").write_text(json.dumps(result, indent=2, default=str))
    result.pop("conversations", None)
    say(f"eval {tag} (v{version}, {len(rows)} rows, {result['seconds']:.0f}s): "
        + ", ".join(f"{k} {result[k]:.3f}" for k in EVAL_KEYS if isinstance(result.get(k), float)))
    return result


def evaluate(model_path: str, rows: Sequence[dict], mode: Mode | Literal["both"] = "both", *, task: str = "arith",
             max_turns: int = 4, max_tokens: int = 64, temperature: float = 0.0, max_prompt_length: int = 256,
             llm: Any = None) -> dict:
    """Evaluate `model_path` on `rows`; returns the JSON summary (`combine`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    llm = llm or build_llm(model_path, max_model_len=max_prompt_length + max_tokens + 64)
    modes: list[Mode] = ["guided", "solver"] if mode == "both" else [mode]
    results = {}
    for m in modes:
        t0 = time.time()
        results[m] = evaluate_with_llm(llm, tokenizer, rows, m, task=task, max_turns=max_turns,
                                       max_tokens=max_tokens, temperature=temperature,
                                       max_prompt_length=max_prompt_length)
        results[m]["wall_s"] = round(time.time() - t0, 1)
    return combine(results)


def print_summary(summary: dict[str, Any]) -> None:
    """The end-of-run table on the console: each evaluation number before and after training (with
    the standard errors), then the run's steps, wall time, throughput and staleness histogram."""
    before, after = summary.get("before", {}), summary.get("after", {})
    lines = ["", "=" * 64, "asyncrl run summary", "=" * 64]
    if before or after:
        lines.append(f"{'':24}{'before':>12}{'after':>12}{'change':>12}")
        for key in EVAL_KEYS:
            b, a = before.get(key), after.get(key)
            if not isinstance(b, (int, float)) and not isinstance(a, (int, float)):
                continue
            fmt = (lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else "-")  # noqa: E731
            change = f"{a - b:+.3f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) else ""
            lines.append(f"{key:24}{fmt(b):>12}{fmt(a):>12}{change:>12}")
            se = [d.get(f"{key}_se") for d in (before, after)]
            if any(isinstance(v, float) for v in se):  # binomial standard errors of the accuracies above
                lines.append(f"{'  ± std. error':24}{fmt(se[0]):>12}{fmt(se[1]):>12}")
    lines.append(f"steps {summary.get('steps')}  wall {summary.get('wall_s', 0):.0f}s  trained tokens/s "
                 f"{summary.get('trained_tokens_per_s', 0):.0f}  weight sync {summary.get('weight_sync_s', 0):.1f}s")
    if summary.get("staleness_hist"):
        lines.append("staleness of trained groups (lag: count): "
                     + ", ".join(f"{i}: {c}" for i, c in enumerate(summary["staleness_hist"])))
    lines.append("=" * 64)
    from asyncrl.logs import echo

    echo("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m asyncrl.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="policy checkpoint (HF format)")
    p.add_argument("--task", default="arith")
    p.add_argument("--split", default="test")
    p.add_argument("--data-dir", default=None, help="directory with <split>.jsonl (default assets/<task>)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--guided", action="store_true", help="only the guided mode")
    g.add_argument("--solver-only", action="store_true", help="only the solver-only mode")
    p.add_argument("--limit", type=int, default=0, help="first N rows only")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per policy turn")
    p.add_argument("--max-prompt-length", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--output", default=None, help="write the JSON summary here")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = load_split(a.task, a.split, a.data_dir)
    if a.limit:
        rows = rows[: a.limit]
    mode: Any = "guided" if a.guided else "solver" if a.solver_only else "both"
    summary = evaluate(a.model, rows, mode, task=a.task, max_turns=a.max_turns, max_tokens=a.max_tokens,
                       temperature=a.temperature, max_prompt_length=a.max_prompt_length)
    summary.update({"model": a.model, "task": a.task, "split": a.split, "rows": len(rows)})
    text = json.dumps(summary, indent=1)
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(text + "\n")
    print(text, file=sys.stdout)


if __name__ == "__main__":
    main()
