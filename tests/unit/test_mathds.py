"""Task `mathds` (DeepMind Mathematics Dataset arithmetic) and its rule verifier.

Proves: exact answer comparison (rationals, decimals, signs); an unknown module is a one-line error
(exit 2 from the CLI); the split files are deterministic in the seed, load with `datasets`, and every
generated question is read by the verifier to the dataset's own answer; the verifier's replies on
hand-derived turns (kind, score line, STOP), that it never states the value it asks for, that it reads
the original's request layout (render_verifier_messages) and that a problem it cannot read is a clear error.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from asyncrl.tasks import get_answer_check, get_rule_verifier
from asyncrl.tasks.arith_verifier import STOP
from asyncrl.tasks.mathds import INSTRUCTION, TaskError, answers_match, check_modules, main, parse_number
from asyncrl.tasks.mathds_verifier import (
    UnparsableProblem,
    claimed_steps,
    evaluate,
    problem_expression,
    verify_turns,
)
from asyncrl.verifier_protocol import parse_verifier_reply, render_verifier_messages


@pytest.mark.parametrize("pred, ref, ok", [
    ("-7/2", "-7/2", True), ("-3.5", "-7/2", True), ("-3.50", "-3.5", True), ("3.5", "-3.5", False),
    ("0.1", "1/10", True), ("2429", "2429", True), ("2429.0", "2429", True), ("+4", "4", True),
    ("-0", "0", True), ("0.333", "1/3", False), ("abc", "1", False), (None, "1", False), ("1/0", "1", False),
])
def test_answers_match_exactly(pred, ref, ok):
    assert answers_match(pred, ref) is ok
    assert get_answer_check("mathds")(f"<answer>\\boxed{{{pred}}}</answer>", ref) is ok


def test_answer_check_reads_latex_fractions():
    check = get_answer_check("mathds")
    assert check("so <answer>\\boxed{-\\frac{7}{2}}</answer>", "-7/2")
    assert not check("no box: -7/2", "-7/2")
    assert get_answer_check("arith")("<answer>\\boxed{17}</answer>", "17")


def test_parse_number():
    assert parse_number("(-12)") == Fraction(-12)
    assert parse_number("1,234.5") == Fraction(2469, 2)
    assert parse_number("\u22125") == Fraction(-5)  # a typographic minus


def test_unknown_module_is_one_line_error(capsys):
    with pytest.raises(TaskError, match="unknown mathds module 'polynomials'"):
        check_modules(["add_or_sub", "polynomials"])
    assert main(["--modules", "add_or_sub,nope", "--out", "/nonexistent/never"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'nope'" in err


def test_difficulty_ranges():
    from asyncrl.tasks.mathds import difficulty_range

    assert difficulty_range("easy") == (0.0, 1 / 3) and difficulty_range("hard") == (2 / 3, 1.0)
    assert difficulty_range("0.1") == (0.0, 0.1) and difficulty_range(1) == (0.0, 1.0)


def test_bad_difficulty_is_error():
    pytest.importorskip("mathematics_dataset")
    from asyncrl.tasks.mathds import generate_split

    for bad in ("insane", "0", "1.5"):
        with pytest.raises(TaskError, match=f"difficulty '{bad}'"):
            generate_split("train", 2, ["mul"], difficulty=bad)


def test_splits_deterministic_loadable_and_readable(tmp_path):
    pytest.importorskip("mathematics_dataset")
    import datasets

    from asyncrl.tasks.mathds import write_splits

    sizes = {"train": 24, "validation": 8, "interpolation": 8, "extrapolation": 8}
    mods = ["add_or_sub", "add_sub_multiple", "mul", "div"]
    write_splits(tmp_path / "a", sizes, mods, "easy", seed=3)
    write_splits(tmp_path / "b", sizes, mods, "easy", seed=3)
    write_splits(tmp_path / "c", {"train": 24}, mods, "easy", seed=4)
    a = (tmp_path / "a" / "train.jsonl").read_text()
    assert a == (tmp_path / "b" / "train.jsonl").read_text()
    assert a != (tmp_path / "c" / "train.jsonl").read_text()
    ds = datasets.load_dataset("json", data_files={s: str(tmp_path / "a" / f"{s}.jsonl") for s in sizes})
    assert {s: len(ds[s]) for s in sizes} == sizes
    train_q = set(ds["train"]["question"])
    assert not train_q & set(ds["validation"]["question"])
    assert {r["module"] for r in ds["extrapolation"]} == {"add_or_sub_big", "add_sub_multiple_longer", "mul_big", "div_big"}
    for split in sizes:
        for line in (tmp_path / "a" / f"{split}.jsonl").read_text().splitlines():
            row = json.loads(line)
            assert row["problem"] == f"{row['question']}\n{INSTRUCTION}"
            # the verifier's reading of the question gives the dataset's own answer
            assert problem_expression(row["problem"]).value == parse_number(row["answer"]), row


@pytest.mark.parametrize("question, text, value", [
    # hand-derived: 2714 - 285 = 2429 (the dataset's example)
    ("What is 285 less than 2714?", "2714 - 285", Fraction(2429)),
    ("(1 - -13) + -125 + 92", "(1 - -13) + -125 + 92", Fraction(-19)),  # 14 - 125 + 92 = -19
    ("Subtract -3 from 4.", "4 - (-3)", Fraction(7)),
    ("What is the distance between -0.95 and 0.407?", "|-0.95 - 0.407|", Fraction("1.357")),
    ("Calculate -7 divided by 2.", "-7 / 2", Fraction(-7, 2)),
    ("Divide 3850 by 14.", "3850 / 14", Fraction(275)),
    ("What is -0.01529 times -0.2?", "-0.01529 * (-0.2)", Fraction("0.003058")),
    ("Sum 0.3 and -12.", "0.3 + (-12)", Fraction("-11.7")),
    ("Evaluate -5 + (-3 - (-2 + -9)).", "-5 + (-3 - (-2 + -9))", Fraction(3)),  # -2-9=-11; -3+11=8; -5+8=3
    ("-11*-9166", "-11*-9166", Fraction(100826)),
])
def test_problem_expression(question, text, value):
    pe = problem_expression(f"{question}\n{INSTRUCTION}")
    assert (pe.text, pe.value) == (text, value)


@pytest.mark.parametrize("problem", ["What is the square root of 16?", "Solve 2*x = 4 for x.", "", "Divide 3 by 0."])
def test_unparsable_problem_is_a_clear_error(problem):
    with pytest.raises(UnparsableProblem, match="cannot read|division by zero"):
        verify_turns(problem, ["1 + 1 = 2"])


def test_claimed_steps():
    steps = claimed_steps("1. 3 + 4 = 7\nSo -0.015 - 115.56 = -115.575, then (2 - -3) * 2 = 10; x = 5; 7 / 2 = 7/2")
    assert [(s.lhs, s.rhs) for s in steps] == [("3 + 4", "7"), ("-0.015 - 115.56", "-115.575"),
                                                ("(2 - -3) * 2", "10"), ("7 / 2", "7/2")]
    assert evaluate("2 - 3 * 4") == -10 and evaluate("-(1.5)") == Fraction(-3, 2)
    with pytest.raises(ValueError):
        evaluate("2 +")


P = "What is 115.56 less than -0.015?\n" + INSTRUCTION  # -0.015 - 115.56 = -115.575


@pytest.mark.parametrize("turns, kind, score, needle", [
    (["-0.015 - 115.56 = -115.575\n<answer>\\boxed{-115.575}</answer>"], "stop", None, None),
    (["<answer>\\boxed{-115.5750}</answer>"], "stop", None, None),           # no steps needed; equal value
    (["-0.015 - 115.56 = -115.565"], "step_error", 0, "Recompute -0.015 - 115.56"),  # off by 0.01
    (["7 + 3 = 10"], "unknown_number", 0, "neither in the problem"),          # 7 and 3 are not the problem's
    (["-0.015 - 115.56 = -115.575"], "correct", 1, "Correct."),
    (["<answer>\\boxed{115.575}</answer>"], "wrong_answer", 0, "signs"),       # sign flipped
    (["The answer is -115.5."], "format", 1, "exactly like <answer>\\boxed{-115.5}</answer>"),  # its own number
    (["So the answer: 7"], "format", 1, "exactly like <answer>\\boxed{7}</answer>"),
    (["I give my answer in words"], "format", 1, "<answer>\\boxed{N}</answer>"),
    (["To solve this we use the distributive property."], "no_step", 0, "Compute -0.015 - 115.56"),
    # 1 is neither a number of the problem nor a result: a made-up operand
    (["-0.015 - 115.56 = -115.575", "-115.575 * 1 = -115.575"], "unknown_number", 0, "uses 1,"),
    # an earlier turn's rejected result may not
    (["-0.015 - 115.56 = -115.5", "-115.5 + 0 = -115.5"], "unknown_number", 0, "-115.5"),
])
def test_verifier_table(turns, kind, score, needle):
    v = verify_turns(P, turns)
    assert (v.kind, v.score) == (kind, score), v
    if kind == "stop":
        assert v.text == STOP
        return
    assert v.text.splitlines()[-1] == f"[SCORE] hallucination_detect={score}"
    assert needle in v.text
    assert "115.575" not in v.text.replace(turns[-1], "")  # the value is never given away


def test_fractions_and_multi_step():
    p = "Evaluate (-4297 - -4316) + (-1 - 40).\n" + INSTRUCTION  # 19 + -41 = -22
    assert verify_turns(p, ["-4297 - -4316 = 19\n-1 - 40 = -41\n19 + -41 = -22\n<answer>\\boxed{-22}</answer>"]).kind == "stop"
    assert verify_turns(p, ["-4297 - -4316 = 19\n-1 - 40 = -39"]).kind == "step_error"
    # an earlier turn's accepted result (19) may be used in a later turn
    assert verify_turns(p, ["-4297 - -4316 = 19", "-1 - 40 = -41\n19 + -41 = -22\n<answer>\\boxed{-22}</answer>"]).kind == "stop"
    d = "Calculate -7 divided by 2.\n" + INSTRUCTION
    for boxed in ("-7/2", "-3.5", "-\\frac{7}{2}", "\\frac{-7}{2}"):
        assert verify_turns(d, [f"-7 / 2 = -3.5\n<answer>\\boxed{{{boxed}}}</answer>"]).kind == "stop", boxed
    assert verify_turns(d, ["<answer>\\boxed{-3}</answer>"]).kind == "wrong_answer"


def test_through_the_original_request_and_reply_grammar():
    verifier = get_rule_verifier("mathds")
    for ref in ("-115.575", None):
        msgs = render_verifier_messages(P, ref, ["-0.015 - 115.56 = -115.575", "<answer>\\boxed{-115.575}</answer>"], None)
        assert verifier(msgs) == STOP
        assert parse_verifier_reply(verifier(msgs)).kind == "stop"
    reply = parse_verifier_reply(verifier(render_verifier_messages(P, "-115.575", ["-0.015 - 115.56 = -116"], None)))
    assert reply.kind == "guidance" and reply.hallucination == 0 and "[SCORE]" not in reply.guidance
    with pytest.raises(UnparsableProblem):
        verifier(render_verifier_messages("Is 7 prime?", None, ["yes"], None))


def test_first_unreadable_row_names_file_and_row(tmp_path):
    from asyncrl.tasks.mathds_verifier import first_unreadable

    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps({"problem": "Divide 3850 by 14.\n" + INSTRUCTION}) + "\n"
                 + json.dumps({"problem": "What is the square root of 16?"}) + "\n")
    msg = first_unreadable(f)
    assert msg.startswith(f"{f} row 2: ") and "square root" in msg and "\n" not in msg
    f.write_text(json.dumps({"problem": "Divide 3850 by 14."}) + "\n")
    assert first_unreadable(f) is None
