"""The arith task and its rule verifier: the generator is deterministic, its splits are disjoint
and well-formed, and the verifier answers a table of policy turns as the guided protocol requires
(step errors caught with score 0, correct steps affirmed with score 1 and a next objective,
format requests, exactly `###STOP###` for a right formatted answer, the result never revealed)."""

from __future__ import annotations

import random
import re

import pytest

from asyncrl.tasks import get_rule_verifier
from asyncrl.tasks.arith import (
    DIFFICULTY,
    canonical_steps,
    evaluate,
    generate_split,
    parse_expr,
    problem_expr,
    read_jsonl,
    split_of,
    write_splits,
)
from asyncrl.tasks.arith_verifier import STOP, verify_turns
from asyncrl.verifier_protocol import parse_verifier_reply, render_verifier_messages

P = "Compute 7 + 3 * 4 - 2."  # canonical steps: 3 * 4 = 12, 7 + 12 = 19, 19 - 2 = 17


def test_generator_is_deterministic_and_seeded():
    a = generate_split("train", 50, seed=3)
    assert a == generate_split("train", 50, seed=3)
    assert a != generate_split("train", 50, seed=4)


def test_splits_disjoint_and_rows_wellformed(tmp_path):
    write_splits(tmp_path, {"train": 300, "val": 60, "test": 60}, seed=0)
    exprs = {s: [r["expression"] for r in read_jsonl(tmp_path / f"{s}.jsonl")] for s in ("train", "val", "test")}
    for s, xs in exprs.items():
        assert len(xs) == len(set(xs))
        assert all(split_of(x) == s for x in xs)
    assert not set(exprs["train"]) & set(exprs["val"])
    assert not set(exprs["train"]) & set(exprs["test"])
    assert not set(exprs["val"]) & set(exprs["test"])
    for r in read_jsonl(tmp_path / "test.jsonl"):
        items = problem_expr(r["problem"])
        assert 2 <= len(items) // 2 + 1 <= 5
        assert str(evaluate(items)) == r["answer"]
        assert all(0 <= c <= DIFFICULTY[2].max_value for *_, c in canonical_steps(items))


def test_difficulty_knob_changes_sizes():
    easy = generate_split("train", 100, difficulty=1)
    hard = generate_split("train", 100, difficulty=3)
    assert max(r["num_steps"] for r in easy) <= 2 and min(r["num_steps"] for r in hard) >= 2
    assert max(int(r["answer"]) for r in hard) > max(int(r["answer"]) for r in easy)


def test_precedence_evaluation():
    assert evaluate(parse_expr("7 + 3 * 4 - 2")) == 17
    assert evaluate(parse_expr("20 - 5 - 3")) == 12  # left to right, not 20 - (5 - 3)
    assert evaluate(parse_expr("2 * 3 * 4 + 1")) == 25


TABLE = [
    # (policy turns, expected kind, expected score, required substring)
    (["3 * 4 = 12. Right?"], "correct", 1, "Next: 7 + 12"),
    (["3 * 4 = 13. Right?"], "step_error", 0, "3 * 4 is not 13"),
    (["3 * 4 = 12. 7 + 12 = 20. Right?"], "step_error", 0, "7 + 12 is not 20"),  # second step wrong
    (["7 + 3 = 10. Right?"], "step_error", 0, "* before +"),  # order of operations
    (["5 * 4 = 20. Right?"], "step_error", 0, "not in the current expression"),
    (["3 * 4 = 12. 7 + 12 = 19. 19 - 2 = 17. Right?"], "correct", 1, "final answer"),
    (["3 * 4 = 12. 7 + 12 = 19. 19 - 2 = 17. <answer>\\boxed{18}</answer>"], "wrong_answer", 0, "wrong"),
    (["3 * 4 = 12. 7 + 12 = 19. 19 - 2 = 17. The answer is 17."], "format", 1, "<answer>\\boxed{N}</answer>"),
    (["3 * 4 = 12. 7 + 12 = 19. 19 - 2 = 17. <answer>17</answer>"], "format", 1, "Format"),
    (["3 * 4 = 12. 7 + 12 = 19. 19 - 2 = 17. <answer>\\boxed{17}</answer>"], "stop", None, ""),
    (["hello"], "no_step", 0, "a op b = c"),
    # earlier turns are replayed up to their first error: 3 * 4 was rejected, so it is still there
    (["3 * 4 = 13. Right?", "3 * 4 = 12. Right?"], "correct", 1, "Next: 7 + 12"),
    (["3 * 4 = 12. 7 + 12 = 19.", "19 - 2 = 17.", "<answer>\\boxed{17}</answer>"], "stop", None, ""),
    (["3 * 4 = 12.", "3 * 4 = 12."], "step_error", 0, "not in the current expression"),
]


@pytest.mark.parametrize("turns,kind,score,needle", TABLE)
def test_rule_verifier_table(turns, kind, score, needle):
    v = verify_turns(P, turns)
    assert v.kind == kind and v.score == score
    if kind == "stop":
        assert v.text == STOP
        return
    assert needle in v.text
    lines = v.text.split("\n")
    assert lines[-1] == f"[SCORE] hallucination_detect={score}"  # score line on every non-STOP reply
    assert "17" not in v.text  # the result is never given away
    assert STOP not in v.text


def test_through_the_protocol_messages():
    """The callable reads render_verifier_messages' layout, with or without a reference."""
    verifier = get_rule_verifier("arith")
    for ref in ("17", None):
        msgs = render_verifier_messages(P, ref, ["3 * 4 = 12.", "7 + 12 = 19.\n19 - 2 = 17. <answer>\\boxed{17}</answer>"], None)
        assert verifier(msgs) == STOP
    reply = parse_verifier_reply(verifier(render_verifier_messages(P, "17", ["3 * 4 = 11."], None)))
    assert reply.kind == "guidance" and reply.hallucination == 0
    with pytest.raises(ValueError):
        get_rule_verifier("nope")


def test_random_canonical_solutions_always_stop_and_never_leak():
    rng = random.Random(0)
    verifier = get_rule_verifier("arith")
    for row in generate_split("val", 40):
        steps = canonical_steps(problem_expr(row["problem"]))
        turns, k = [], 0
        while k < len(steps):
            n = rng.randint(1, 3)
            turns.append(" ".join(f"{a} {op} {b} = {c}." for a, op, b, c in steps[k : k + n]) + " Right?")
            k += n
            reply = verifier(render_verifier_messages(row["problem"], row["answer"], turns, None))
            assert reply.startswith("Correct.") and reply.endswith("hallucination_detect=1")
            assert not re.search(rf"\b{row['answer']}\b", reply.split("Next:")[0].split("[SCORE]")[0])
        turns.append(f"<answer>\\boxed{{{row['answer']}}}</answer>")
        assert verifier(render_verifier_messages(row["problem"], "N/A", turns, None)) == STOP
