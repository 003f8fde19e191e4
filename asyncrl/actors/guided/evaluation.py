"""The evaluation of a policy by the guided protocol, shared by `python -m asyncrl.eval` and a
training job's rollout actors (`RolloutWorker.evaluate`): conversations with `training=False` (the
verifier is not shown the reference, as in Guided-GRPO validation), guided (the task's rule verifier
answers) or solver-only (a verifier that always says STOP), and the per-mode numbers
(`summarize`: accuracy with its binomial standard error, turns, tokens, format rate, hallucination
score) and transcripts. The numbers' meaning: asyncrl.eval's module docstring.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Literal

Mode = Literal["guided", "solver"]
STOP = "###STOP###"


def _boxed(text: str) -> str | None:
    from asyncrl.tasks.arith_verifier import boxed_value

    return boxed_value(text)


def make_conversations(rows: Sequence[dict], tokenizer: Any, mode: Mode, max_turns: int,
                       max_prompt_length: int | None) -> list[Any]:
    from asyncrl.actors.guided.chat import PolicyChat
    from asyncrl.actors.guided.conversation import Conversation
    from asyncrl.actors.guided.options import GuideOptions

    chat = PolicyChat(tokenizer)
    # Solver-only has no verifier; the always-STOP stand-in carries no score, so scoring is off.
    opts = GuideOptions(max_turns=max_turns, max_prompt_length=max_prompt_length, training=False,
                        enable_hallucination_score=mode == "guided")
    return [Conversation([{"role": "user", "content": r["problem"]}], chat=chat, options=opts,
                         ground_truth=str(r["answer"]), uid=str(r.get("id", i))) for i, r in enumerate(rows)]


def _verifier_fn(task: str, mode: Mode) -> Callable[[list[dict]], str]:
    if mode == "solver":
        return lambda messages: STOP
    from asyncrl.tasks import get_rule_verifier

    return get_rule_verifier(task)


def accuracy_se(accuracy: float, n: int) -> float:
    """Binomial standard error of an accuracy over n rows: sqrt(p (1 - p) / n)."""
    return round((accuracy * (1 - accuracy) / max(1, n)) ** 0.5, 4)


def summarize(convs: Sequence[Any], rows: Sequence[dict], tokenizer: Any, task: str, mode: Mode) -> dict:
    """Per-mode numbers from finished conversations (see the module docstring)."""
    from asyncrl.tasks import get_answer_check, get_turn_verifier
    from asyncrl.verifier_protocol import has_final_answer

    verify_turns, matches = get_turn_verifier(task), get_answer_check(task)
    n = len(convs)
    correct = [matches(c.final_text, str(r["answer"])) for c, r in zip(convs, rows, strict=True)]
    turns = [c.num_turns for c in convs]
    pol_tok = [sum(len(t.token_ids) for t in c.turns) for c in convs]
    ver_tok = [sum(len(tokenizer.encode(t.verifier_text or "", add_special_tokens=False)) for t in c.turns
                   if mode == "guided") for c in convs]
    if mode == "guided":
        halluc = [c.hallucination_score for c in convs]
    else:  # measured after the fact; the policy never saw these replies
        halluc = []
        for c, r in zip(convs, rows, strict=True):
            texts = [t.text for t in c.turns]
            scores = [verify_turns(r["problem"], texts[: i + 1]).score for i in range(len(texts))]
            scored = [s for s in scores if s is not None]
            halluc.append(sum(scored) / len(scored) if scored else 0.5)
    reasons: dict[str, int] = {}
    for c in convs:
        reasons[str(c.finish_reason)] = reasons.get(str(c.finish_reason), 0) + 1

    def mean(xs: Sequence[float]) -> float:
        return round(sum(xs) / max(1, len(xs)), 4)

    by_steps: dict[str, list[bool]] = {}
    for ok, r in zip(correct, rows, strict=True):
        if "num_steps" in r:
            by_steps.setdefault(str(r["num_steps"]), []).append(ok)
    return {
        "mode": mode, "n": n, "accuracy": mean([float(x) for x in correct]),
        "accuracy_se": accuracy_se(sum(correct) / max(1, n), n),
        "accuracy_by_steps": {k: {"n": len(v), "accuracy": mean([float(x) for x in v])}
                              for k, v in sorted(by_steps.items(), key=lambda kv: int(kv[0]))},
        "mean_turns": mean(turns),
        "mean_policy_tokens": mean(pol_tok), "mean_verifier_tokens": mean(ver_tok),
        "format_rate": mean([float(has_final_answer(c.final_text)) for c in convs]),
        "hallucination_score": mean(halluc), "finish_reasons": reasons,
    }


def transcript(conv: Any, row: dict) -> dict:
    """One finished evaluation conversation for a person to read (samples/eval_*.json, the report):
    every policy turn with the verifier's raw reply (`[SCORE]`, `###STOP###` as it wrote them), the
    parsed score and stop flag, the user turn shown next; the final answer and whether it is right."""
    final = _boxed(conv.final_text)
    return {
        "id": str(row.get("id", conv.uid)), "problem": conv.problem, "answer": str(row["answer"]),
        "final_answer": final, "correct": (final or "").strip() == str(row["answer"]).strip(),
        "finish_reason": str(conv.finish_reason), "num_turns": conv.num_turns,
        "turns": [{"policy": t.text, "verifier": t.verifier_text,
                   "score": t.reply.hallucination if t.reply is not None else None,
                   "stop": bool(t.reply is not None and t.reply.kind == "stop"), "user": t.user_content}
                  for t in conv.turns],
    }


async def evaluate_async(generate: Callable[..., Any], tokenizer: Any, rows: Sequence[dict], mode: Mode, *,
                         task: str = "arith", max_turns: int = 4, max_prompt_length: int | None = 256,
                         concurrency: int = 64, keep_conversations: int = 0) -> dict:
    """Same numbers with an async `generate(prompt_ids, seed) -> (ids, logprobs, version, finish_reason)`
    (the caller binds greedy sampling and max_tokens), conversations run concurrently.
    `keep_conversations`: the `transcript` of the first N rows under `conversations`."""
    from asyncrl.actors.guided import rule_verify, run_conversation

    convs = make_conversations(rows, tokenizer, mode, max_turns, max_prompt_length)
    verify = rule_verify(_verifier_fn(task, mode))
    sem = asyncio.Semaphore(concurrency)

    async def one(c: Any) -> None:
        async with sem:
            await run_conversation(c, generate, verify)

    await asyncio.gather(*(one(c) for c in convs))
    out = summarize(convs, rows, tokenizer, task, mode)
    if keep_conversations > 0:
        out["conversations"] = [transcript(c, r) for c, r in zip(convs[:keep_conversations], rows, strict=False)]
    return out
