"""Task `arith`: seeded multi-step integer arithmetic, the offline quick-start world.

A problem is an expression of 2-5 small non-negative integers joined by `+ - *`, written
`Compute 7 + 3 * 4 - 2.` with the answer as a string (`"17"`), in Guided-GRPO's data format
(docs/guided_grpo.md#data-format: columns `problem`, `answer`; extra columns are carried along
untouched).

Guarantees
- `generate_split(split, n, seed, difficulty)` is a pure function of its arguments.
- Splits never overlap: a problem's split is a function of its expression text alone
  (`split_of`, a SHA-1 bucket), so no seed or size can put one expression in two splits.
- The canonical evaluation (all `*` left to right, then `+ -` left to right) never produces a
  negative or a value above `Difficulty.max_value`, so every intermediate fits a few digits.

The expected student behaviour (taught by SFT, checked by `arith_verifier`) is a few steps per
turn, each written `a op b = c`, a short checkpoint question, and finally
`<answer>\\boxed{N}</answer>` (the format the original's student prompt asks for).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

Item = int | str  # an expression is a flat list: number, op, number, op, ..., number
SPLITS = ("train", "val", "test")
_SPLIT_BUCKETS = {"train": range(0, 90), "val": range(90, 95), "test": range(95, 100)}
_EXPR_RE = re.compile(r"Compute:?\s*([0-9+\-*\s]+?)\s*(?:\.|\?|$|\n)")
_TOKEN_RE = re.compile(r"\d+|[+\-*]")


@dataclass(frozen=True)
class Difficulty:
    """The difficulty knob: sizes of operands and of the expression."""

    min_operands: int = 2
    max_operands: int = 5
    max_add: int = 20
    """Operands next to `+`/`-` only are drawn from 1..max_add."""
    max_mul: int = 9
    """Operands next to a `*` are drawn from 2..max_mul."""
    p_mul: float = 0.35
    """Probability that an operator is `*` (the rest split evenly between `+` and `-`)."""
    max_value: int = 199
    """Upper bound on every intermediate value of the canonical evaluation."""


DIFFICULTY = {
    1: Difficulty(min_operands=2, max_operands=3, max_add=9, max_mul=5, max_value=99),
    2: Difficulty(),
    3: Difficulty(min_operands=3, max_operands=5, max_add=50, max_mul=12, max_value=999),
}


def apply_op(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def format_expr(items: list[Item]) -> str:
    return " ".join(str(x) for x in items)


def parse_expr(text: str) -> list[Item]:
    """`"7 + 3 * 4"` -> `[7, "+", 3, "*", 4]`; raises ValueError on anything else."""
    toks = _TOKEN_RE.findall(text)
    if not toks or "".join(toks) != re.sub(r"\s+", "", text):
        raise ValueError(f"not an arith expression: {text!r}")
    items: list[Item] = [int(t) if t.isdigit() else t for t in toks]
    ok = len(items) % 2 == 1 and all(isinstance(x, int) == (i % 2 == 0) for i, x in enumerate(items))
    if not ok:
        raise ValueError(f"not an arith expression: {text!r}")
    return items


def problem_expr(problem: str) -> list[Item]:
    """The expression of a problem statement (`Compute <expr>.` anywhere in the text)."""
    m = _EXPR_RE.search(problem)
    if not m:
        raise ValueError(f"no `Compute <expr>` in problem: {problem[:80]!r}")
    return parse_expr(m.group(1))


def reducible(items: list[Item], i: int) -> bool:
    """Whether the operator at index i may be applied now without changing the value.

    `*` always may (it binds tightest and is associative); `+`/`-` may when neither neighbour
    operator is `*` and the operator on the left is not `-` (left associativity).
    """
    op = items[i]
    if op == "*":
        return True
    left = items[i - 2] if i >= 2 else None
    right = items[i + 2] if i + 2 < len(items) else None
    return left not in ("*", "-") and right != "*"


def reduce_at(items: list[Item], i: int) -> list[Item]:
    a, op, b = items[i - 1], items[i], items[i + 1]
    return items[: i - 1] + [apply_op(int(a), str(op), int(b))] + items[i + 2 :]


def next_step(items: list[Item]) -> int | None:
    """Index of the operator the canonical order applies next (first `*`, else first op); None when done."""
    if len(items) == 1:
        return None
    for i in range(1, len(items), 2):
        if items[i] == "*":
            return i
    return 1


def canonical_steps(items: list[Item]) -> list[tuple[int, str, int, int]]:
    """All steps `(a, op, b, c)` of the canonical evaluation."""
    steps = []
    while (i := next_step(items)) is not None:
        a, op, b = int(items[i - 1]), str(items[i]), int(items[i + 1])
        items = reduce_at(items, i)
        steps.append((a, op, b, int(items[i - 1])))
    return steps


def evaluate(items: list[Item]) -> int:
    steps = canonical_steps(items)
    return steps[-1][3] if steps else int(items[0])


def split_of(expr: str) -> str:
    """The split an expression belongs to (90 / 5 / 5 % by SHA-1 of the text)."""
    bucket = int(hashlib.sha1(expr.encode()).hexdigest()[:8], 16) % 100
    return next(s for s, r in _SPLIT_BUCKETS.items() if bucket in r)


def sample_expr(rng: random.Random, diff: Difficulty) -> list[Item]:
    """One expression whose canonical evaluation stays within [0, diff.max_value]."""
    while True:
        n = rng.randint(diff.min_operands, diff.max_operands)
        p_add = (1 - diff.p_mul) / 2
        ops = rng.choices("*+-", weights=[diff.p_mul, p_add, p_add], k=n - 1)
        nums = []
        for j in range(n):
            near_mul = (j > 0 and ops[j - 1] == "*") or (j < n - 1 and ops[j] == "*")
            nums.append(rng.randint(2, diff.max_mul) if near_mul else rng.randint(1, diff.max_add))
        items: list[Item] = [nums[0]]
        for op, x in zip(ops, nums[1:], strict=True):
            items += [op, x]
        values = [c for *_, c in canonical_steps(items)]
        if all(0 <= v <= diff.max_value for v in values):
            return items


def make_row(items: list[Item], split: str, index: int, difficulty: int) -> dict:
    expr = format_expr(items)
    return {
        "problem": f"Compute {expr}.",
        "answer": str(evaluate(items)),
        "expression": expr,
        "num_steps": len(items) // 2,
        "difficulty": difficulty,
        "id": f"arith-{split}-{index:05d}",
    }


def generate_split(split: str, n: int, seed: int = 0, difficulty: int = 2) -> list[dict]:
    """n distinct problems of one split; deterministic in (split, n, seed, difficulty)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"arith/{seed}/{difficulty}/{split}")
    diff = DIFFICULTY[difficulty]
    seen: set[str] = set()
    rows: list[dict] = []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 1000 * (n + 10):
            raise RuntimeError(f"could not find {n} distinct {split} problems at difficulty {difficulty}")
        items = sample_expr(rng, diff)
        expr = format_expr(items)
        if expr in seen or split_of(expr) != split:
            continue
        seen.add(expr)
        rows.append(make_row(items, split, len(rows), difficulty))
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def write_splits(out_dir: str | Path, sizes: dict[str, int], seed: int = 0, difficulty: int = 2) -> None:
    for split, n in sizes.items():
        write_jsonl(generate_split(split, n, seed, difficulty), Path(out_dir) / f"{split}.jsonl")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write the arith task splits as JSONL.")
    p.add_argument("--out", default="assets/arith")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--difficulty", type=int, default=2, choices=sorted(DIFFICULTY))
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--val", type=int, default=200)
    p.add_argument("--test", type=int, default=1000)
    a = p.parse_args(argv)
    write_splits(a.out, {"train": a.train, "val": a.val, "test": a.test}, a.seed, a.difficulty)
    print(f"wrote {a.out}/{{train,val,test}}.jsonl")


if __name__ == "__main__":
    main()
