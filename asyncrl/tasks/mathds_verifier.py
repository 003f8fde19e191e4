"""Rule verifier for `mathds` (DeepMind Mathematics Dataset, arithmetic), in Guided-GRPO's grammar.

Reads the chat messages of a verifier request (docs/guided_grpo.md#verifier-request; parsed by
`arith_verifier.parse_verifier_request`) and answers the LATEST policy turn:

1. The problem's question (its first line; the task appends an instruction after it) is turned
   into one exact arithmetic expression (`problem_expression`): the dataset's phrasings
   ("What is 285 less than 2714?" -> `2714 - 285`, "Divide 3850 by 14." -> `3850 / 14`,
   "distance between a and b" -> `|a - b|`, bare expressions with parentheses and negatives).
   A question it cannot read raises `UnparsableProblem` (the serve back-end reports it as an error
   naming the problem) instead of guessing.
2. Every claimed step of the latest turn, written `lhs = rhs` with `lhs` an arithmetic
   expression (`a op b`, chains, parentheses, decimals, negatives; `x` is not an operator) and
   `rhs` a number or `p/q`, is checked in order with exact rational arithmetic (`fractions`):
   - its arithmetic: value(lhs) == value(rhs);
   - against the problem: every number in `lhs` (up to sign) is a number of the problem or the
     result of an accepted earlier step (this turn or an earlier one).
   The first failing step -> "Error: ..." naming the step and how to redo it (never the value),
   `[SCORE] hallucination_detect=0`.
3. The final answer `<answer>\\boxed{v}</answer>` (the original's `has_final_answer`): equal in
   value to the problem's value -> exactly `###STOP###`; a formatted wrong one -> guidance, score 0;
   an attempted answer in the wrong format ("The answer is 5.") -> a format request that shows the
   format filled with the policy's OWN number (`<answer>\\boxed{5}</answer>`; a small model copies a
   concrete example where it ignores a placeholder), score 1.
4. Otherwise steps all right -> "Correct." and a push to continue, score 1; no step and no
   answer -> the expression to compute (a restatement of the question, never a result), score 0.

Earlier turns are replayed only to learn which results they established (up to their first
error), as in `arith_verifier`: the verifier keeps no memory of its own replies.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from asyncrl.tasks.arith_verifier import STOP, parse_verifier_request
from asyncrl.tasks.mathds import parse_number
from asyncrl.verifier_protocol import has_final_answer

_NUM = r"\d+(?:\.\d+)?|\.\d+"
_TOKEN_RE = re.compile(rf"\s*({_NUM}|[-+*/()])")
_ANSWER_ATTEMPT_RE = re.compile(r"answer|boxed", re.IGNORECASE)
_RHS = r"-?\(?-?(?:\d+(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?\)?"
_STEP_RE = re.compile(rf"([0-9.(\-][0-9. \t+\-*/()]*?)[ \t]*=[ \t]*({_RHS})(?![\d.]*[ \t]*[-+*/][ \t]*[\d(])")
"""`lhs = rhs` within one line; an rhs followed by an operator is the start of a longer expression,
not a result."""
_SIGNED = r"-?(?:\d+(?:\.\d+)?|\.\d+)"
_PHRASE_TEMPLATES: list[tuple[str, str]] = [  # the dataset's templates (modules/arithmetic.py); {n} a signed number
    (r"^What is (?:the )?(?:distance|difference) between (?P<p>{n}) and (?P<q>{n})\??$", "abs"),
    (r"^What is (?P<q>{n}) less than (?P<p>{n})\??$", "-"),
    (r"^Subtract (?P<q>{n}) from (?P<p>{n})\.?$", "-"),
    (r"^What is (?P<p>{n}) (?:minus|take away) (?P<q>{n})\??$", "-"),
    (r"^(?:What is )?(?P<p>{n}) plus (?P<q>{n})\??$", "+"),
    (r"^(?:Add|Add together|Put together|Sum|Total of) (?P<p>{n}) and (?P<q>{n})\.?$", "+"),
    (r"^(?:Multiply|Product of|What is the product of) (?P<p>{n}) and (?P<q>{n})[.?]?$", "*"),
    (r"^(?:What is )?(?P<p>{n}) times (?P<q>{n})\??$", "*"),
    (r"^Divide (?P<p>{n}) by (?P<q>{n})\.?$", "/"),
    (r"^(?:What is |Calculate )?(?P<p>{n}) divided by (?P<q>{n})[.?]?$", "/"),
]
_PHRASES = [(re.compile(t.replace("{n}", _SIGNED)), op) for t, op in _PHRASE_TEMPLATES]
_LEAD_RE = re.compile(r"^(?:What is the value of|What is|Evaluate|Calculate|Work out|Compute)\s+", re.IGNORECASE)


class UnparsableProblem(ValueError):
    """The problem's question is not an arithmetic question this verifier can read."""


def evaluate(expr: str) -> Fraction:
    """Exact value of `expr` (+ - * /, parentheses, unary minus, decimals); ValueError otherwise."""
    pos, toks = 0, []
    expr = expr.strip()
    while pos < len(expr):
        m = _TOKEN_RE.match(expr, pos)
        if not m:
            raise ValueError(f"not an arithmetic expression: {expr!r}")
        toks.append(m.group(1))
        pos = m.end()
        if pos < len(expr) and not expr[pos:].strip():
            break
    i = 0

    def peek() -> str | None:
        return toks[i] if i < len(toks) else None

    def take() -> str:
        nonlocal i
        i += 1
        return toks[i - 1]

    def atom() -> Fraction:
        t = peek()
        if t == "-":
            take()
            return -atom()
        if t == "+":
            take()
            return atom()
        if t == "(":
            take()
            v = add()
            if peek() != ")":
                raise ValueError(f"unbalanced parentheses: {expr!r}")
            take()
            return v
        if t is None or not re.fullmatch(_NUM, t):
            raise ValueError(f"not an arithmetic expression: {expr!r}")
        return Fraction(take())

    def mul() -> Fraction:
        v = atom()
        while peek() in ("*", "/"):
            op, w = take(), atom()
            if op == "/" and w == 0:
                raise ValueError(f"division by zero in {expr!r}")
            v = v * w if op == "*" else v / w
        return v

    def add() -> Fraction:
        v = mul()
        while peek() in ("+", "-"):
            op, w = take(), mul()
            v = v + w if op == "+" else v - w
        return v

    if not toks:
        raise ValueError("empty expression")
    v = add()
    if i != len(toks):
        raise ValueError(f"not an arithmetic expression: {expr!r}")
    return v


def numbers_in(expr: str) -> list[Fraction]:
    return [Fraction(t) for t in re.findall(_NUM, expr)]


def normalize(text: str) -> str:
    return text.replace("\u2212", "-").replace("\u00d7", "*").replace("\u00f7", "/").replace("\u2013", "-")


@dataclass(frozen=True)
class ProblemExpr:
    """The problem as one expression: `text` is shown to the policy; `value` is exact."""

    text: str
    value: Fraction
    numbers: frozenset[Fraction] = field(default_factory=frozenset)


def problem_expression(problem: str) -> ProblemExpr:
    """The question (first line of `problem`) as an exact expression; UnparsableProblem otherwise."""
    q = normalize(problem.strip().splitlines()[0].strip() if problem.strip() else "")
    for pat, op in _PHRASES:
        m = pat.match(q)
        if m:
            p, r = m.group("p"), m.group("q")
            text = f"{p} - {_paren(r)}" if op in ("-", "abs") else f"{p} {op} {_paren(r)}"
            if op == "/" and Fraction(r) == 0:
                raise UnparsableProblem(f"division by zero in problem: {q!r}")
            value = evaluate(text)
            if op == "abs":
                text, value = f"|{text}|", abs(value)
            return ProblemExpr(text, value, frozenset(abs(x) for x in numbers_in(text)))
    body = _LEAD_RE.sub("", q).rstrip(".?").strip()
    try:
        value = evaluate(body)
    except (ValueError, ZeroDivisionError) as e:
        raise UnparsableProblem(f"cannot read an arithmetic problem in {q[:80]!r}") from e
    return ProblemExpr(body, value, frozenset(abs(x) for x in numbers_in(body)))


def _paren(n: str) -> str:
    return f"({n})" if n.startswith("-") else n


@dataclass(frozen=True)
class Step:
    lhs: str
    rhs: str
    lhs_value: Fraction
    rhs_value: Fraction


def claimed_steps(text: str) -> list[Step]:
    """Every `lhs = rhs` in `text` whose lhs is an arithmetic expression with an operator.

    A run of text before `=` that does not parse is trimmed from the left a token at a time
    (so `1. 3 + 4 = 7` and `so 3 + 4 = 7` both read as `3 + 4 = 7`)."""
    steps = []
    for m in _STEP_RE.finditer(normalize(text)):
        lhs, rhs = m.group(1), m.group(2)
        rhs_value = parse_number(rhs)
        if rhs_value is None:
            continue
        parts = lhs.split()
        for k in range(len(parts)):
            cand = " ".join(parts[k:])
            if not re.search(r"\d\s*[-+*/]\s*[-(\d.]|\)\s*[-+*/]", cand):
                break
            try:
                steps.append(Step(cand, rhs.strip(), evaluate(cand), rhs_value))
                break
            except (ValueError, ZeroDivisionError):
                continue
    return steps


@dataclass(frozen=True)
class Verdict:
    """One verifier reply: `text` is what is sent; `score` None only for STOP."""

    text: str
    score: int | None
    kind: str  # "stop" | "correct" | "step_error" | "unknown_number" | "wrong_answer" | "format" | "no_step"


def check_turn(text: str, known: set[Fraction]) -> tuple[str | None, int]:
    """Check the steps of one turn in order, adding accepted results to `known` (absolute values).
    Returns (error guidance or None, number of steps accepted)."""
    accepted = 0
    for s in claimed_steps(text):
        stranger = next((x for x in numbers_in(s.lhs) if abs(x) not in known), None)
        if stranger is not None:
            return (f"Error: {s.lhs} = {s.rhs} uses {_fmt(stranger)}, which is neither in the problem nor "
                    f"an earlier result. Use the problem's numbers. What is the next step?"), accepted
        if s.lhs_value != s.rhs_value:
            return f"Error: {s.lhs} is not {s.rhs}. Recompute {s.lhs} carefully. What is it?", accepted
        known.add(abs(s.rhs_value))
        accepted += 1
    return None, accepted


def _fmt(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    s = f"{float(x):.12g}"
    return s if Fraction(s) == x else f"{x.numerator}/{x.denominator}"


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`, braces matched (so `\\boxed{\\frac{7}{2}}` is whole)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def _boxed_number(text: str) -> Fraction | None:
    b = last_boxed(text)
    if b is None:
        return None
    b = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", b).replace("$", "").replace("\\!", "")
    b = normalize(b.replace("\\left", "").replace("\\right", "")).strip()
    v = parse_number(b)
    if v is not None:
        return v
    try:
        return evaluate(b) if re.fullmatch(r"[-+\d./()\s]+", b) else None
    except (ValueError, ZeroDivisionError):
        return None


_CLAIM_RE = re.compile(rf"answer\s*(?:is|:|=)?\s*\$?({_RHS})", re.IGNORECASE)


def _claimed_answer(text: str) -> str | None:
    """The number a turn states as its answer in prose ("The answer is -12."), as written."""
    found = _CLAIM_RE.findall(normalize(text))
    return found[-1].strip() if found else None


def final_answer_correct(text: str, reference: str) -> bool:
    """The last `\\boxed{}` of `text` equals `reference` in value (evaluation's accuracy)."""
    v, r = _boxed_number(text), parse_number(reference)
    return v is not None and r is not None and v == r


def verify_turns(problem: str, policy_turns: list[str], reference: str | None = None) -> Verdict:
    """The reply to the latest of `policy_turns` (oldest first). UnparsableProblem if the problem
    cannot be read."""
    pe = problem_expression(problem)
    start = f"Compute {pe.text} step by step, one operation per line as a op b = c."
    if not policy_turns:
        return Verdict(f"{start}\n[SCORE] hallucination_detect=1", 1, "no_step")
    known = set(pe.numbers)
    for turn in policy_turns[:-1]:
        check_turn(turn, known)
    last = policy_turns[-1]
    error, accepted = check_turn(last, known)
    if error:
        kind = "unknown_number" if "neither in the problem" in error else "step_error"
        return Verdict(error + "\n[SCORE] hallucination_detect=0", 0, kind)
    if has_final_answer(last):
        if _boxed_number(last) == pe.value:
            return Verdict(STOP, None, "stop")
        return Verdict(f"Error: the final answer is wrong. Check each step of {pe.text} again, signs and "
                       "decimal places included. What is the final answer?\n[SCORE] hallucination_detect=0",
                       0, "wrong_answer")
    if _ANSWER_ATTEMPT_RE.search(last):
        own = _claimed_answer(last)  # the policy's own number, never the verifier's: nothing is revealed
        example = f"<answer>\\boxed{{{own}}}</answer>" if own else "<answer>\\boxed{N}</answer>"
        return Verdict(f"Format: write your final answer once, exactly like {example}. "
                       "What is your final answer?\n[SCORE] hallucination_detect=1", 1, "format")
    if accepted == 0:
        return Verdict(f"No step found. {start}\n[SCORE] hallucination_detect=0", 0, "no_step")
    return Verdict("Correct. Continue, and end with the final answer as <answer>\\boxed{N}</answer>.\n"
                   "[SCORE] hallucination_detect=1", 1, "correct")


def first_unreadable(path: str | Path, prompt_key: str = "problem") -> str | None:
    """`"<file> row <n>: <reason>"` for the first row of a JSONL file whose question this verifier cannot
    read (checked before a job starts), None when every row reads."""
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                problem_expression(str(json.loads(line).get(prompt_key, "")))
            except (UnparsableProblem, json.JSONDecodeError) as e:
                return f"{path} row {n}: {e}"
    return None


class MathdsRuleVerifier:
    """Callable `messages -> reply text`; pure and deterministic (safe to share across threads)."""

    name = "mathds-rule"

    def __call__(self, messages: list[dict]) -> str:
        problem, reference, turns = parse_verifier_request(messages)
        return verify_turns(problem, turns, reference).text
