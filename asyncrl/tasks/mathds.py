"""Task `mathds`: DeepMind's Mathematics Dataset (Saxton et al., ICLR 2019), arithmetic modules.

Problems come from the PyPI package `mathematics-dataset` 1.0.1 (the `smollm2` extra), generated
offline and deterministically from a seed into `datasets`-loadable JSONL files:

- `train.jsonl`, `validation.jsonl`: the chosen modules' train generators at the chosen difficulty
  (the dataset's train-easy/-medium/-hard thirds of each module's entropy range); validation
  rows never repeat a train question.
- `interpolation.jsonl`: the same modules' test generators (the package keeps these questions out
  of its train generators by hashing).
- `extrapolation.jsonl`: the `_big` / `_longer` variants of the same modules (larger numbers,
  longer expressions), where a module has one.

Columns: `problem` (the question + `INSTRUCTION`, what the policy is shown), `question` (as
generated), `answer` (the dataset's canonical answer string: integer, decimal or `p/q`),
`module`, `split`, `id`. Guided-GRPO's data format (docs/guided_grpo.md#data-format).

`answers_match` compares exactly by value (`fractions.Fraction`): `-7/2`, `-3.5` and `-3.50` are
equal; `3.5` and `-3.5` are not; a non-number never matches.

Determinism: the package draws from Python's `random` and NumPy's global generator; both are
seeded from (seed, split, module) before each module's problems, so a file is a pure function of
(modules, difficulty, seed, sizes) for one version of the package and sympy.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import random
import sys
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path

MODULES = ("add_or_sub", "add_sub_multiple", "mul", "div", "mixed", "mul_div_multiple")
"""The arithmetic modules this task accepts (those with exact numeric answers)."""
EXTRAPOLATION = {"add_or_sub": "add_or_sub_big", "add_sub_multiple": "add_sub_multiple_longer",
                 "mul": "mul_big", "div": "div_big", "mixed": "mixed_longer",
                 "mul_div_multiple": "mul_div_multiple_longer"}
DIFFICULTIES = {"easy": 0, "medium": 1, "hard": 2}
"""The dataset's own train levels; a number f in (0, 1] instead takes the lowest fraction f of each
module's entropy range (easier than `easy` below 1/3: smaller numbers, fewer decimals)."""
SPLITS = ("train", "validation", "interpolation", "extrapolation")
INSTRUCTION = ("Solve it step by step, one operation per line as a op b = c, then write the final answer "
               "as <answer>\\boxed{N}</answer>. Example: 2 - 5 = -3 <answer>\\boxed{-3}</answer>")
"""Shown after every question: the step format the verifier checks and the answer format the reward
reads, with a one-line example (SmolLM2-135M-Instruct otherwise answers in prose)."""
EXTRA_HINT = "pip install 'mathematics-dataset==1.0.1' (or: pip install '.[smollm2]')"


class TaskError(ValueError):
    """Bad task configuration (module, difficulty, missing package): one line, exit 2."""


def check_modules(modules: Sequence[str]) -> list[str]:
    unknown = [m for m in modules if m not in MODULES]
    if unknown or not modules:
        raise TaskError(f"unknown mathds module {unknown[0] if unknown else '(none)'!r}; "
                        f"known: {', '.join(MODULES)}")
    return list(modules)


def _import_modules():
    """`mathematics_dataset.modules.modules`, after the one sympy shim it needs (MACHINE_NOTES.md).

    Its `from sympy.solvers.diophantine import base_solution_linear` fails on sympy >= 1.7 (the
    function moved to `sympy.solvers.diophantine.diophantine`); the package attribute
    `sympy.solvers.diophantine` is a function, so the module object is patched via import_module.
    """
    if importlib.util.find_spec("mathematics_dataset") is None:
        raise TaskError(f"the mathematics-dataset package is not installed: {EXTRA_HINT}")
    dio = importlib.import_module("sympy.solvers.diophantine")
    if not hasattr(dio, "base_solution_linear"):
        from sympy.solvers.diophantine.diophantine import base_solution_linear

        dio.base_solution_linear = base_solution_linear
    from mathematics_dataset.modules import modules

    return modules


def difficulty_range(difficulty: str | float) -> tuple[float, float]:
    """The fraction of a module's entropy range a difficulty draws from (TaskError if unknown)."""
    if isinstance(difficulty, str) and difficulty in DIFFICULTIES:
        level = DIFFICULTIES[difficulty]
        return level / 3, (level + 1) / 3
    try:
        f = float(difficulty)
    except (TypeError, ValueError):
        f = -1.0
    if not 0 < f <= 1:
        raise TaskError(f"unknown mathds difficulty {difficulty!r}; known: {', '.join(DIFFICULTIES)} "
                        "or a fraction in (0, 1]")
    return 0.0, f


def _entropy_fn(lo_frac: float, hi_frac: float) -> Callable[[tuple[float, float]], tuple[float, float]]:
    """A slice of a module's entropy range; the thirds are the dataset's train-easy/-medium/-hard
    (mathematics_dataset/generate.py `_make_entropy_fn`)."""

    def fn(range_: tuple[float, float]) -> tuple[float, float]:
        length = range_[1] - range_[0]
        return (range_[0] + lo_frac * length, range_[0] + hi_frac * length)

    return fn


def _seed(seed: int, split: str, module: str) -> None:
    import numpy as np

    h = int(hashlib.sha256(f"mathds/{seed}/{split}/{module}".encode()).hexdigest()[:8], 16)
    random.seed(h)
    np.random.seed(h)


def _generators(split: str, difficulty: str) -> dict[str, Callable]:
    modules = _import_modules()
    if split in ("train", "validation"):
        return modules.train(_entropy_fn(*difficulty_range(difficulty)))["arithmetic"]
    if split == "interpolation":
        return modules.test()["arithmetic"]
    return modules.test_extra()["arithmetic"]


def generate_split(split: str, n: int, modules: Sequence[str], difficulty: str | float = "easy", seed: int = 0,
                   exclude: set[str] | None = None) -> list[dict]:
    """n rows of one split, spread evenly over `modules` (module order, then round-robin)."""
    if split not in SPLITS:
        raise TaskError(f"split must be one of {SPLITS}, got {split!r}")
    difficulty_range(difficulty)
    modules = check_modules(modules)
    gens = _generators(split, difficulty)
    exclude = exclude or set()
    per_module: dict[str, list[dict]] = {}
    for k, module in enumerate(modules):
        want = n // len(modules) + (1 if k < n % len(modules) else 0)
        name = EXTRAPOLATION[module] if split == "extrapolation" else module
        _seed(seed, split, module)
        rows, seen, tries = [], set(), 0
        while len(rows) < want:
            tries += 1
            if tries > 100 * (want + 10):
                raise TaskError(f"could not draw {want} distinct {split} problems from module {name!r}")
            p = gens[name]()
            q, a = str(p.question).strip(), str(p.answer).strip()
            if q in seen or q in exclude or parse_number(a) is None:
                continue
            seen.add(q)
            rows.append({"problem": f"{q}\n{INSTRUCTION}", "question": q, "answer": a, "module": name,
                         "split": split})
        per_module[module] = rows
    out = []
    for i in range(max((len(v) for v in per_module.values()), default=0)):
        out += [v[i] for v in per_module.values() if i < len(v)]
    for i, r in enumerate(out):
        r["id"] = f"mathds-{split}-{i:05d}"
    return out


def parse_number(text: str) -> Fraction | None:
    """An exact value from `12`, `-3.50`, `-7/2`, `+4`, `1,234` (None for anything else)."""
    s = text.strip().replace(" ", "").replace(",", "").replace("\u2212", "-")
    if s.startswith("(") and s.endswith(")"):
        s = s[1:-1]
    try:
        if s.count("/") == 1:
            num, den = s.split("/")
            return Fraction(Fraction(num), Fraction(den))
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, reference: str) -> bool:
    """Exact equality of value (see the module docstring)."""
    if predicted is None:
        return False
    p, r = parse_number(predicted), parse_number(reference)
    return p is not None and r is not None and p == r


def write_splits(out_dir: str | Path, sizes: dict[str, int], modules: Sequence[str], difficulty: str | float = "easy",
                 seed: int = 0) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths, train_q = {}, set()
    for split in SPLITS:
        if split not in sizes:
            continue
        rows = generate_split(split, sizes[split], modules, difficulty, seed,
                              exclude=train_q if split == "validation" else None)
        if split == "train":
            train_q = {r["question"] for r in rows}
        paths[split] = out_dir / f"{split}.jsonl"
        with paths[split].open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write the mathds task splits (DeepMind Mathematics Dataset) as JSONL.")
    p.add_argument("--out", default="assets/mathds")
    p.add_argument("--modules", default="add_or_sub,add_sub_multiple,mul,div",
                   help=f"comma-separated, of: {', '.join(MODULES)}")
    p.add_argument("--difficulty", default="easy", help=f"one of: {', '.join(DIFFICULTIES)}, or a fraction in (0, 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--validation", type=int, default=200)
    p.add_argument("--interpolation", type=int, default=200)
    p.add_argument("--extrapolation", type=int, default=200)
    a = p.parse_args(argv)
    try:
        modules = check_modules([m.strip() for m in a.modules.split(",") if m.strip()])
        sizes = {s: getattr(a, s) for s in SPLITS}
        write_splits(a.out, sizes, modules, a.difficulty, a.seed)
    except TaskError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}/{{{','.join(SPLITS)}}}.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
