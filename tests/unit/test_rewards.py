"""Proves the answer grader and the built-in rewards are right: a table of equivalent and
non-equivalent answers (fractions, decimals, \\frac, units, \\text{}, thousands separators,
intervals, negatives, LaTeX spacing), boxed extraction and the format rule (a final turn
has a well-formed final answer), and each built-in (`math`, `guided_math`, `dapo`, `r1v`) on a table with hand-derived
`overall` values; grading works (and is time-bounded) outside the main thread."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from asyncrl.rewards import (
    answer_format_ok,
    extract_boxed_content,
    get_reward,
    grade_answer,
    grading_stats,
    math_reward,
)
from asyncrl.rewards.builtin import dapo_normalize_final_answer, dapo_overlong_penalty
from asyncrl.rewards.grading import GradingTimeout, call_with_deadline

EQUIVALENT = [
    ("3/4", r"\frac{3}{4}"),
    ("0.75", r"\frac34"),
    (r"\dfrac{3}{4}", "3/4"),
    (r"\frac{1}{2}", "0.5"),
    ("1/2", "2/4"),
    (r"-\frac{1}{2}", "-0.5"),
    (r"\frac{-1}{2}", r"-\frac12"),
    ("10", "10.0"),
    ("-3", "- 3"),
    (r"18 \text{ cm}", "18"),
    ("18", r"18 \text{cm}"),
    (r"5 \text{ meters}", "5"),
    ("5 dollars", "5"),
    (r"\$5", "5"),
    (r"24\text{ square units}", "24"),
    (r"45^\circ", "45"),
    (r"45^{\circ}", "45"),
    (r"50\%", "50"),
    ("1,000", "1000"),
    ("1{,}000", "1000"),
    ("12,345.6", "12345.6"),
    (r"1,000 \text{ dollars}", "1000"),
    ("[1,2)", "[1, 2)"),
    (r"(-\infty, 3]", r"(-\infty,3]"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    ("(1, 234)", "(1,234)"),
    (r"\{1,2\}", r"\{2,1\}"),
    (r"2\sqrt{2}", r"\sqrt{8}"),
    ("x^2+2x+1", "(x+1)^2"),
    ("x = 5", "5"),
    (r"\text{(A)}", "A"),
    (r"\text{B}", "(B)"),
    (r"\frac{1}{2}\,", r"\frac{1}{2}"),
    (r"\!\frac{3}{4}", "0.75"),
]

NOT_EQUIVALENT = [
    ("(1,2)", "[1,2)"),  # open vs half-open interval
    ("-3", "3"),  # sign
    ("0.333", "1/3"),  # math-verify rounds to 6 places: 0.333 != 0.333333
    (r"\pi", "3.14159"),
    ("1/2", "0.25"),
    ("2", "2,000"),  # thousands separator in the reference
    ("3", "4"),
    ("x+1", "x+2"),
    ("B", "C"),
    ("None", "None"),  # extraction failed
    ("", "1"),
    ("2^{100000}", "3"),  # risky exponent: never evaluated symbolically
    ("9^{9^{9}}", "1"),
]


@pytest.mark.parametrize(("given", "truth"), EQUIVALENT)
def test_equivalent_answers(given: str, truth: str) -> None:
    assert grade_answer(given, truth)


@pytest.mark.parametrize(("given", "truth"), NOT_EQUIVALENT)
def test_non_equivalent_answers(given: str, truth: str) -> None:
    assert not grade_answer(given, truth)


def test_risky_exponent_is_skipped_and_counted() -> None:
    before = grading_stats()["skipped_risky"]
    assert not grade_answer("9^{9^{9}}", "2")
    assert grading_stats()["skipped_risky"] == before + 1  # never handed to sympy to evaluate


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{3} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # the LAST box, nested braces
        (r"\boxed{ 7 }", "7"),
        ("no box here", "None"),
        (r"\boxed{unbalanced", "None"),
    ],
)
def test_extract_boxed_content(text: str, expected: str) -> None:
    assert extract_boxed_content(text) == expected


@pytest.mark.parametrize(
    ("response", "ok"),
    [
        (r"<think>a</think><answer>\boxed{1}</answer>", True),
        (r"< answer >\boxed{\frac{1}{2}}< / answer >", True),  # whitespace around < > / removed
        (r"<answer>\boxed{1} and \boxed{2}</answer>", False),  # two boxes
        (r"<answer>1</answer>", False),  # no box
        (r"\boxed{1}", False),  # no answer block
        (r"<answer>\boxed{1}</answer><answer>\boxed{1}</answer>", False),
        ("<answer>\\boxed{1\n}</answer>", True),  # the box regex matches across newlines (DOTALL)
    ],
)
def test_answer_format(response: str, ok: bool) -> None:
    assert answer_format_ok(response) is ok
    # The rollout accepts STOP with the same final-answer rule as the reward's format check: keep them identical.
    from asyncrl.verifier_protocol import has_final_answer

    assert has_final_answer(response) is ok


GOOD = r"<think>3+4</think><answer>\boxed{7}</answer>"
GOOD_NO_FORMAT = r"the answer is \boxed{7}"
WRONG = r"<answer>\boxed{8}</answer>"


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (GOOD, {"overall": 1.0, "accuracy": 1.0, "format": 1.0}),
        (GOOD_NO_FORMAT, {"overall": 0.9, "accuracy": 1.0, "format": 0.0}),  # 0.9*1 + 0.1*0
        (WRONG, {"overall": 0.1, "accuracy": 0.0, "format": 1.0}),  # 0.9*0 + 0.1*1
        ("no answer", {"overall": 0.0, "accuracy": 0.0, "format": 0.0}),
    ],
)
def test_math_builtin(response: str, expected: dict[str, float]) -> None:
    got = get_reward("math")([{"response": response, "response_length": 9, "ground_truth": "7",
                               "verifier_hallucination_score": 1.0}])[0]
    assert set(got) == set(expected)  # the shipped math reward ignores the hallucination score
    for key, value in expected.items():
        assert got[key] == pytest.approx(value)


@pytest.mark.parametrize(
    ("response", "hal", "overall"),
    [
        (GOOD, 1.0, 1.0),  # 0.8*1 + 0.1*1 + 0.1*1
        (GOOD, 0.0, 0.9),  # 0.8*1 + 0.1*1 + 0.1*0
        (GOOD, None, 0.95),  # no score -> neutral 0.5: 0.8 + 0.1 + 0.05
        (GOOD_NO_FORMAT, 0.5, 0.85),  # 0.8*1 + 0.1*0 + 0.1*0.5
        (WRONG, 1.0, 0.2),  # 0.8*0 + 0.1*1 + 0.1*1
    ],
)
def test_guided_math_builtin(response: str, hal: float | None, overall: float) -> None:
    item = {"response": response, "response_length": 9, "ground_truth": "7"}
    if hal is not None:
        item["verifier_hallucination_score"] = hal
    got = get_reward("guided_math")([item])[0]
    assert got["overall"] == pytest.approx(overall)
    assert got["hallucination"] == (0.5 if hal is None else hal)


def test_guided_math_zero_weight_reproduces_shipped_split() -> None:
    item = {"response": GOOD_NO_FORMAT, "response_length": 9, "ground_truth": "7",
            "verifier_hallucination_score": 0.0}
    got = get_reward("guided_math")([item], hallucination_weight=0.0)[0]
    assert got["overall"] == pytest.approx(0.9) and got["hallucination"] == 0.0


def test_guided_math_turn_cost_scales_with_accuracy() -> None:
    """turn_cost 0.1, weights 0 (overall = accuracy before the cost):
    right in 3 turns: 1 - 0.1*(3-1)*1 = 0.8; right in 1 turn: 1 - 0 = 1.0;
    wrong in 1 turn: 0 - 0.1*0*0 = 0.0 (never above a slow right answer); wrong in 4 turns: 0.0."""
    def item(resp: str, turns: int) -> dict:
        return {"response": resp, "response_length": 9, "ground_truth": "7", "num_turns": turns}

    got = get_reward("guided_math")([item(GOOD, 3), item(GOOD, 1), item(WRONG, 1), item(WRONG, 4)],
                                     format_weight=0.0, hallucination_weight=0.0, turn_cost=0.1)
    assert [g["overall"] for g in got] == pytest.approx([0.8, 1.0, 0.0, 0.0])
    assert got[0]["turns_penalty"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="num_turns"):
        get_reward("guided_math")([{"response": GOOD, "response_length": 9, "ground_truth": "7"}], turn_cost=0.1)


def test_math_reward_api_and_weight_validation() -> None:
    # 0.7*1 + 0.1*1 + 0.2*0.25 = 0.85
    got = math_reward(GOOD, "7", format_weight=0.1, hallucination_weight=0.2, hallucination_score=0.25)
    assert got == pytest.approx({"overall": 0.85, "accuracy": 1.0, "format": 1.0, "hallucination": 0.25})
    with pytest.raises(ValueError, match="> 1"):
        math_reward(GOOD, "7", format_weight=0.6, hallucination_weight=0.6)


def test_dapo_normalisation_and_overlong() -> None:
    assert dapo_normalize_final_answer(r"x = \frac12") == r"\frac{1}{2}"
    assert dapo_normalize_final_answer(r"\text{5 dollars}") == "5"
    assert dapo_normalize_final_answer("1,000") == "1000"
    # L_max=100, B=20 -> L_exp=80: L=80 -> 0; L=90 -> (80-90)/20 = -0.5; L=101 -> -1
    assert dapo_overlong_penalty(80, 100, 20) == 0.0
    assert dapo_overlong_penalty(90, 100, 20) == pytest.approx(-0.5)
    assert dapo_overlong_penalty(101, 100, 20) == -1.0


@pytest.mark.parametrize(
    ("response", "length", "overall", "acc"),
    [
        ("work...\nAnswer: 42", 50, 1.0, 1.0),  # correct, short: 1 + 0
        ("work...\nanswer : $42$", 90, 0.5, 1.0),  # correct, in buffer: 1 + 1.0*(-0.5)
        ("work...\nAnswer: 41", 50, -1.0, -1.0),  # wrong: -1 + 0
        ("no final line", 120, -2.0, -1.0),  # [INVALID] and over L_max: -1 + (-1)
        ("Answer: 1\n" + "x" * 400, 10, -1.0, -1.0),  # Answer line outside the last 300 chars
    ],
)
def test_dapo_builtin(response: str, length: int, overall: float, acc: float) -> None:
    got = get_reward("dapo")([{"response": response, "response_length": length, "ground_truth": "42"}],
                             max_response_length=100, overlong_buffer_length=20, overlong_penalty_factor=1.0)[0]
    assert got["overall"] == pytest.approx(overall)
    assert got["accuracy"] == acc and got["accuracy_normalized"] == (acc + 1) / 2


@pytest.mark.parametrize(
    ("response", "overall"),
    [
        ("<think>r</think> <answer>3/4</answer>", 1.0),  # 0.5*1 + 0.5*1
        ("<answer>0.75</answer>", 0.5),  # no think: 0.5*1 + 0.5*0
        ("<think>r</think><answer>1</answer>", 0.5),  # wrong: 0.5*0 + 0.5*1
        ("0.75", 0.5),  # no answer block: whole response graded, no format
        (" <think>r</think><answer>0.75</answer>", 0.5),  # fullmatch: leading space breaks format
    ],
)
def test_r1v_builtin(response: str, overall: float) -> None:
    got = get_reward("r1v")([{"response": response, "response_length": 5, "ground_truth": r"\frac{3}{4}"}])[0]
    assert got["overall"] == pytest.approx(overall)


def test_unknown_builtin_names_the_choices() -> None:
    with pytest.raises(ValueError, match="guided_math"):
        get_reward("mathh")


def test_grading_in_worker_thread() -> None:
    # math-verify's signal-based timeouts would raise here; ours are disabled and replaced.
    results: list[bool] = []
    t = threading.Thread(target=lambda: results.extend([grade_answer("x^2+2x+1", "(x+1)^2"),
                                                         grade_answer("0.5", r"\frac{1}{3}")]))
    t.start()
    t.join(30)
    assert results == [True, False]


def _spin_forever() -> None:
    while True:
        pass


def test_deadline_interrupts_python_loop_in_a_thread() -> None:
    caught: list[float] = []

    def spin() -> None:
        t0 = time.monotonic()
        try:
            call_with_deadline(0.2, _spin_forever)
        except GradingTimeout:
            caught.append(time.monotonic() - t0)

    t = threading.Thread(target=spin)
    t.start()
    t.join(10)
    assert not t.is_alive() and len(caught) == 1 and 0.15 < caught[0] < 2.0
    assert call_with_deadline(0.05, sum, [1, 2]) == 3  # a call that ends in time: its value, nothing leaks after
    time.sleep(0.2)


def test_slow_symbolic_check_times_out_in_a_thread_and_grading_recovers() -> None:
    # Expanding/simplifying (x+y+z+1)^30 - (x+y+z+2)^30 takes sympy several seconds here.
    out: list[tuple[bool, float, bool]] = []
    before = grading_stats()["timeouts"]

    def run() -> None:
        t0 = time.monotonic()
        slow = grade_answer("(x+y+z+1)^{30}", "(x+y+z+2)^{30}", timeout_s=0.3)
        elapsed = time.monotonic() - t0
        out.append((slow, elapsed, grade_answer("x^2+2x+1", "(x+1)^2", timeout_s=5)))

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert out and out[0][0] is False and out[0][1] < 2.0 and out[0][2] is True
    assert grading_stats()["timeouts"] == before + 1


def test_grade_final_answer_uses_the_last_box() -> None:
    from asyncrl.rewards import grade_final_answer

    assert grade_final_answer(r"<answer> \boxed{2} </answer> wait, \boxed{\frac{52}{2}}", "26")
    assert not grade_final_answer(r"\boxed{26} no, \boxed{25}", "26")
    assert not grade_final_answer(None, "26") and not grade_final_answer("26", None)


def test_deadline_never_leaks_an_exception_outside_its_call() -> None:
    # Calls that end right around their deadline race the watchdog; a timeout may only ever
    # surface from the call itself, never later in unrelated code. 1500 calls at 1 ms: the former
    # `with deadline(...)` context manager failed 1 run in 5 of 2000 such calls (CI, 2026-12-02):
    # when the first raise landed before its clean-up could run and a re-raise followed 0.25 s
    # later into the caller's next lines; it also once raised into its own watchdog thread and once hung).
    leaked: list[BaseException] = []
    outcomes = {"timeout": 0, "ok": 0}

    def busy(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def run() -> None:
        try:
            for i in range(1500):
                try:
                    call_with_deadline(0.001, busy, (i % 5) * 0.0025)
                    outcomes["ok"] += 1
                except GradingTimeout:
                    outcomes["timeout"] += 1
                x = 0
                for j in range(500):  # unrelated work after the call
                    x += j
            busy(0.3)  # longer than a re-raise interval
        except BaseException as exc:  # noqa: BLE001 - anything here is a leak
            leaked.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    assert not leaked and outcomes["ok"] + outcomes["timeout"] == 1500
    assert outcomes["timeout"] > 0  # the race was exercised


def test_deadline_raises_again_when_its_exception_is_swallowed() -> None:
    # The first GradingTimeout is caught inside the call (as a gc callback or a bare `except:` would
    # drop it); the watchdog must raise it again, and the second one ends the call. Without the
    # re-raise the inner loop would run its full 10 s and the call would return normally.
    caught = 0
    t0 = time.monotonic()

    def swallow_once() -> None:
        nonlocal caught
        while time.monotonic() - t0 < 10:
            try:
                while time.monotonic() - t0 < 10:
                    pass
            except GradingTimeout:
                caught += 1
                if caught == 2:
                    raise

    with pytest.raises(GradingTimeout):
        call_with_deadline(0.2, swallow_once)
    assert caught == 2


def test_deadline_never_raises_once_its_call_frame_is_gone() -> None:
    # The watchdog raises only while the call's own frame runs in that thread: a frame that is not
    # on the stack (the call left without its clean-up, or the ident now names another thread)
    # is never fired into.
    from asyncrl.rewards.grading import _frame_running

    here = sys._getframe()
    assert _frame_running(threading.get_ident(), here)
    seen: list[bool] = []
    t = threading.Thread(target=lambda: seen.append(_frame_running(threading.get_ident(), here)))
    t.start()
    t.join(5)
    assert seen == [False]
