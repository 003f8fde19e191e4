"""Rule verifier for `arith`: a deterministic stand-in for Guided-GRPO's verifier model.

It reads the chat messages that `render_verifier_messages` builds
(docs/guided_grpo.md#verifier-request: a system prompt, then a user message `### Problem
Statement / ### Reference Answer / ### Conversation History` with one `Assistant: ...` entry
per policy turn) and answers the LATEST policy turn the way the default verifier prompt asks a
teacher to:

1. Earlier policy turns are replayed to rebuild the current expression: their steps are applied
   up to their first error (the verifier rejected the rest at the time), so the verifier needs no
   memory of its own replies, as in Guided-GRPO where it never sees them.
2. Every claimed step `a op b = c` of the latest turn is checked against the current expression
   (the operands must be adjacent there and the operator applicable under `*`-before-`+-`,
   left to right) and against arithmetic. First error -> "Error: <reason>. <how to correct>.
   <question>" and `[SCORE] hallucination_detect=0`.
3. Then the final answer, if any: a correctly formatted (`has_final_answer`) right answer ->
   exactly `###STOP###`; a formatted wrong one -> guidance + score 0; an attempted answer in the
   wrong format -> a request for the format + score 1.
4. Otherwise "Correct." + the next small objective (the next operation, never its result) +
   score 1. A turn with no step and no answer gets a nudge and score 0 (it advanced nothing and
   claimed nothing checkable; scoring it 1 would reward empty turns).

The result is never revealed: guidance names operations, never their values or the answer.
The reference answer is not needed (the problem statement defines the result), so the verifier
behaves the same when the rollout withholds it (`N/A`, Guided-GRPO validation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from asyncrl.tasks.arith import Item, apply_op, evaluate, next_step, problem_expr, reduce_at, reducible

STOP = "###STOP###"
STEP_RE = re.compile(r"(-?\d+)\s*([+\-*])\s*(-?\d+)\s*=\s*(-?\d+)")
_BOXED_RE = re.compile(r"\\boxed\{(.*?)\}")
_ANSWER_ATTEMPT_RE = re.compile(r"answer|boxed", re.IGNORECASE)
SCORE_RE = re.compile(r"\[SCORE\]\s*hallucination_detect\s*=\s*([01])")


@dataclass(frozen=True)
class Verdict:
    """One verifier reply: `text` is what is sent; `score` None only for STOP."""

    text: str
    score: int | None
    kind: str  # "stop" | "correct" | "step_error" | "wrong_answer" | "format" | "no_step"


def has_final_answer(text: str) -> bool:
    """The final-answer rule (docs/guided_grpo.md#final-answer): one <answer>, one </answer>, exactly
    one \\boxed{...} between them."""
    t = re.sub(r"\s*([</>])\s*", r"\1", text)
    if t.count("<answer>") != 1 or t.count("</answer>") != 1:
        return False
    m = re.search(r"<answer>(.*)</answer>", t, re.DOTALL)
    return bool(m) and len(_BOXED_RE.findall(m.group(1))) == 1


def boxed_value(text: str) -> str | None:
    found = _BOXED_RE.findall(text)
    return found[-1].strip() if found else None


def _step_text(items: list[Item], i: int) -> str:
    return f"{items[i - 1]} {items[i]} {items[i + 1]}"


def apply_turn(items: list[Item], text: str) -> tuple[list[Item], str | None, int]:
    """Apply the claimed steps of one policy turn to `items` until the first error.

    Returns (new items, error guidance or None, number of steps accepted).
    """
    accepted = 0
    for m in STEP_RE.finditer(text):
        a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        where = [i for i in range(1, len(items), 2) if items[i] == op and items[i - 1] == a and items[i + 1] == b]
        ok = [i for i in where if reducible(items, i)]
        nxt = next_step(items)
        if nxt is None:
            return items, f"Error: the expression is already fully computed, {a} {op} {b} is not a step. Give the final answer. What is it?", accepted
        if not where:
            return items, f"Error: {a} {op} {b} is not in the current expression. Next: {_step_text(items, nxt)}. What is it?", accepted
        if not ok:
            return items, f"Error: do * before + and -, then left to right. Next: {_step_text(items, nxt)}. What is it?", accepted
        if apply_op(a, op, b) != c:
            return items, f"Error: {a} {op} {b} is not {c}. Recompute {a} {op} {b}. What is it?", accepted
        items = reduce_at(items, ok[0])
        accepted += 1
    return items, None, accepted


def verify_turns(problem: str, policy_turns: list[str], reference: str | None = None) -> Verdict:
    """The reply to the latest of `policy_turns` (all policy turns so far, oldest first)."""
    try:
        items = problem_expr(problem)
        truth = str(evaluate(items))
    except ValueError:
        return Verdict("Error: I cannot read an expression in this problem.\n[SCORE] hallucination_detect=1", 1, "no_step")
    if not policy_turns:
        return Verdict(f"Start with the first step: {_step_text(items, next_step(items) or 1)}. What is it?\n[SCORE] hallucination_detect=1", 1, "no_step") if len(items) > 1 else Verdict("Give the final answer. What is it?\n[SCORE] hallucination_detect=1", 1, "no_step")
    for turn in policy_turns[:-1]:
        items, _, _ = apply_turn(items, turn)
    last = policy_turns[-1]
    items, error, accepted = apply_turn(items, last)
    if error:
        return Verdict(error + "\n[SCORE] hallucination_detect=0", 0, "step_error")
    nxt = next_step(items)
    if has_final_answer(last):
        if boxed_value(last) == truth:
            return Verdict(STOP, None, "stop")
        if nxt is None:
            hint = "It must match the result of your last step. What is the final answer?"
        else:
            hint = f"The expression is not finished. Next: {_step_text(items, nxt)}. What is it?"
        return Verdict(f"Error: the final answer is wrong. {hint}\n[SCORE] hallucination_detect=0", 0, "wrong_answer")
    if _ANSWER_ATTEMPT_RE.search(last):
        return Verdict("Format: write the final answer once as <answer>\\boxed{N}</answer>. What is your final answer?\n[SCORE] hallucination_detect=1", 1, "format")
    if accepted == 0:
        where = f"Next: {_step_text(items, nxt)}" if nxt is not None else "Give the final answer"
        return Verdict(f"No step found. Write steps as a op b = c. {where}. What is it?\n[SCORE] hallucination_detect=0", 0, "no_step")
    if nxt is None:
        return Verdict("Correct. Now give the final answer as <answer>\\boxed{N}</answer>. What is it?\n[SCORE] hallucination_detect=1", 1, "correct")
    return Verdict(f"Correct. Next: {_step_text(items, nxt)}. What is it?\n[SCORE] hallucination_detect=1", 1, "correct")


def parse_verifier_request(messages: list[dict]) -> tuple[str, str, list[str]]:
    """(problem, reference, policy turns) from the messages of a Guided-GRPO verifier request."""
    user = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    if user is None:
        raise ValueError("verifier request has no user message")
    content = user["content"]
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    m = re.search(
        r"### Problem Statement\n(.*?)\n\n### Reference Answer\n(.*?)\n\n### Conversation History\n(.*?)"
        r"(?:\n\nProvide the next piece of guidance[^\n]*)?\s*$",
        content,
        re.DOTALL,
    )
    if not m:
        raise ValueError("verifier request does not follow the Guided-GRPO layout "
                         "(docs/guided_grpo.md#verifier-request)")
    problem, reference, history = m.group(1), m.group(2).strip(), m.group(3)
    parts = re.split(r"(?:^|\n)Assistant: ?", history)
    turns = parts[1:] if history.startswith("Assistant:") else []
    return problem, reference, turns


class ArithRuleVerifier:
    """Callable `messages -> reply text`; pure and deterministic (safe to share across threads)."""

    name = "arith-rule"

    def __call__(self, messages: list[dict]) -> str:
        problem, reference, turns = parse_verifier_request(messages)
        return verify_turns(problem, turns, reference).text


class ArithAnswerOnlyVerifier:
    """A deliberately weaker rule (task name `arith_answer_only`): it reads only the final answer.
    Every turn without one is scored 1 and told to go on; a correct boxed answer is STOP, a wrong
    one scored 0. It never flags a wrong step, which is what `asyncrl.rescore` shows against the
    oracle (docs/rescore.md)."""

    name = "arith-answer-only"

    def __call__(self, messages: list[dict]) -> str:
        problem, _, turns = parse_verifier_request(messages)
        last = turns[-1] if turns else ""
        if has_final_answer(last):
            if boxed_value(last) == str(evaluate(problem_expr(problem))):
                return STOP
            return "Error: the final answer is wrong. What is it?\n[SCORE] hallucination_detect=0"
        return "Go on with the next step. What is it?\n[SCORE] hallucination_detect=1"
