"""Answer grading for the math rewards: boxed extraction, the answer-format rule, and
`grade_answer(given, truth)`.

Follows Guided-GRPO (docs/guided_grpo.md#rewards, #final-answer):
- `extract_boxed_content` returns the content of the LAST `\\boxed{...}` (brace-balanced) or the
  string "None", exactly as mathruler does.
- `answer_format_ok` is the math reward's format rule, which is also the final-answer detector
  (whitespace around `<`, `>`, `/` removed; exactly one `<answer>`, one `</answer>`, one `\\boxed{.*?}` inside).

Departs (on purpose):
- The equivalence check is math-verify (parse + verify: sympy-based, covers fractions, decimals,
  intervals, sets, equations, percentages, `\\text{}`), not mathruler's PRM800K grader. Before it we
  apply the string normalisations of mathruler that math-verify does not cover (unit words such as
  `5 dollars` / `18 cm`, `\\mbox`, trailing `.`, `^\\circ` spacing variants); two answers that are
  equal after this normalisation are correct without calling sympy.
- math-verify's own timeouts use `signal.alarm`, which raises outside the main thread (rewards
  run in a thread pool). We disable them (`parsing_timeout=None`, `timeout_seconds=None`) and bound
  the time ourselves: `call_with_deadline(seconds, fn)` raises `GradingTimeout` inside the grading thread via
  `PyThreadState_SetAsyncExc` (works in any thread; sympy is pure Python so it is interrupted
  between bytecodes). A single long C-level operation (a huge integer power) cannot be
  interrupted that way, so answers with risky exponents or factorials skip the symbolic check
  (mathruler does the same). A timed-out or failed comparison counts as wrong and is counted in
  `grading_stats()`.
"""

from __future__ import annotations

import ctypes
import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

__all__ = [
    "GradingTimeout",
    "answer_format_ok",
    "call_with_deadline",
    "extract_boxed_content",
    "grade_answer",
    "grade_final_answer",
    "grading_stats",
    "normalize_answer",
    "strip_tag_whitespace",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
MAX_SYMBOLIC_CHARS = 1000
"""Answers longer than this are compared as strings only (sympy time grows badly with size)."""


class GradingTimeout(BaseException):
    """Grading one answer exceeded its time bound. A BaseException so that the broad
    `except Exception` clauses inside math-verify/sympy cannot swallow it."""


_stats_lock = threading.Lock()
_stats = {"graded": 0, "symbolic": 0, "timeouts": 0, "errors": 0, "skipped_risky": 0}


def grading_stats() -> dict[str, int]:
    """Process-wide counters: graded answers, symbolic checks, timeouts, errors, risky skips."""
    with _stats_lock:
        return dict(_stats)


def _count(key: str) -> None:
    with _stats_lock:
        _stats[key] += 1


# ------------------------------------------------------------------------------------ time bound
_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)


_REFIRE_S = 0.25  # re-raise this often while the call still runs: a delivered exception can be lost
_REFIRES = 20     # (CPython ignores exceptions raised inside gc callbacks and __del__), at most this often

T = TypeVar("T")


def _frame_running(tid: int, frame: FrameType) -> bool:
    """Whether `frame` is on the stack of thread `tid` right now."""
    top = sys._current_frames().get(tid)
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


def call_with_deadline(seconds: float | None, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)`, raising `GradingTimeout` in the calling thread if it runs longer than `seconds`.

    Any thread, no signals. Pure-Python code is interrupted within a few bytecodes; one long C call
    only when it returns. If the call keeps running after the exception was delivered (it landed in
    a gc callback or `__del__`, where CPython prints and drops exceptions, or the code swallowed it
    with a bare `except:`), it is raised again every `_REFIRE_S` seconds, up to `_REFIRES` times.

    The exception never surfaces outside this call. That is why this is a call and not a `with`
    block: the watchdog raises only while this function's own frame is on the thread's stack (it
    cannot tell a `with` block's code from the code after it, which runs in the same frame), and
    under the lock the exit path takes, which cancels an undelivered exception. So a timeout that
    lands before the `try` below, or between the body and the clean-up, surfaces from this call
    and no re-raise can follow it into the caller's next lines (the race the old context manager
    lost about once in a few thousand blocks at a 1 ms deadline).
    """
    if seconds is None or seconds <= 0:
        return fn(*args)
    tid = threading.get_ident()
    me = sys._getframe()
    lock = threading.Lock()
    wake = threading.Event()
    state = {"in_fn": False, "left": False, "fired": False}  # read and written under `lock` only

    def watchdog() -> None:
        wait, fires = seconds, 0
        while fires <= _REFIRES:
            if wake.wait(wait):
                return
            with lock:  # the exit marks `left` under the same lock: no raise after it
                if state["left"] or not _frame_running(tid, me):
                    return  # left (or the ident now belongs to another thread): never raise there
                if not state["in_fn"]:  # still inside Thread.start(): never raise into threading's code
                    wait = 0.001
                    continue
                state["fired"] = True
                _set_async_exc(tid, GradingTimeout)
            wait, fires = _REFIRE_S, fires + 1

    try:
        threading.Thread(target=watchdog, name="grading-deadline", daemon=True).start()
        with lock:
            state["in_fn"] = True
        return fn(*args)
    except GradingTimeout:
        raise GradingTimeout(f"grading exceeded {seconds:g} s") from None
    finally:
        while True:  # a re-raise that lands while we leave is caught here, never after the call
            try:
                with lock:
                    state["left"] = True
                    if state["fired"]:
                        _set_async_exc(tid, ctypes.py_object())  # NULL: cancel an undelivered exception
                break
            except GradingTimeout:
                continue
        wake.set()  # nothing can be raised any more: only ends the watchdog's wait early


# ------------------------------------------------------------------------------- extraction/format
_TAG_WS = re.compile(r"\s*([<>/])\s*")


def strip_tag_whitespace(text: str) -> str:
    """Remove whitespace adjacent to `<`, `>` and `/` (the first step of Guided-GRPO's final-answer
    rule; it also alters `a / b`)."""
    return _TAG_WS.sub(r"\1", text)


_BOXED_IN_ANSWER = re.compile(r"\\boxed\{.*?\}", re.DOTALL)
_ANSWER_BLOCK = re.compile(r"<answer>(.*)</answer>", re.DOTALL)


def answer_format_ok(response: str) -> bool:
    """Guided-GRPO's format rule = its final-answer detector (docs/guided_grpo.md#final-answer):
    exactly one `<answer>`, exactly one `</answer>`, exactly one non-greedy `\\boxed{...}` match between them."""
    r = strip_tag_whitespace(response)
    if r.count("<answer>") != 1 or r.count("</answer>") != 1:
        return False
    block = _ANSWER_BLOCK.search(r)
    return block is not None and len(_BOXED_IN_ANSWER.findall(block.group(1))) == 1


def extract_boxed_content(text: str) -> str:
    """Content of the LAST `\\boxed{` with balanced braces, stripped; "None" if absent/unbalanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return "None"
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return "None"


# ---------------------------------------------------------------------------------- normalisation
_UNITS = (
    "degree|centimeter|centimetre|cm|millimeter|millimetre|mm|kilometer|kilometre|km|meter|metre|"
    "mile|second|sec|minute|min|hour|hr|day|week|month|year|foot|feet|inch|inche|yard|liter|litre|"
    "dollar|cent|unit|point|mph|kg|gram|pound|ounce|square unit|sq unit"
)
_UNIT_RE = re.compile(rf"(?<![a-z\\])(?:square\s+)?(?:{_UNITS})(?:e?s)?(?:\s*\^\s*\{{?\d\}}?)?(?![a-z])")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SPACING = re.compile(r"\\[,;:!> ]|\\quad|\\qquad|~")


def _strip_units_and_wrappers(s: str) -> str:
    s = s.strip()
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("{,}", ",").replace(",\\!", "")
    s = _SPACING.sub(" ", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\degree|°", "", s)
    for _ in range(3):  # nested wrappers
        s2 = _TEXT_WRAP.sub(r" \1 ", s)
        if s2 == s:
            break
        s = s2
    stripped = _UNIT_RE.sub(" ", s)
    if stripped.strip():  # never strip an answer down to nothing ("cm" alone stays)
        s = stripped
    s = re.sub(r"\s+", " ", s).strip().rstrip(".").strip()
    if _THOUSANDS.fullmatch(s):  # only a whole number: "(1,234)" is a tuple, not 1234
        s = s.replace(",", "")
    return s


def normalize_answer(answer: str) -> str:
    """String-level canonical form (mathruler's string normalisation): wrappers, `$`, `%`, degrees,
    unit words, thousands separators and LaTeX spacing removed; lower-case; no spaces; `x = 5` -> `5`; integral
    decimals canonicalised (`10.0` -> `10`)."""
    s = _strip_units_and_wrappers(answer)
    if re.fullmatch(r"[a-zA-Z]\s*=\s*[^=]+", s):
        s = s.split("=", 1)[1]
    s = s.replace(" ", "").lower()
    if len(s) > 2 and s[0] == "{" and s[-1] == "}":
        s = s[1:-1]
    m = re.fullmatch(r"\(?([a-e])\)?", s)  # multiple-choice letter "(B)" -> "b"
    if m:
        s = m.group(1)
    if re.fullmatch(r"-?\d+\.0*", s):
        s = s.split(".")[0]
    if s in ("-0",):
        s = "0"
    return s


# ------------------------------------------------------------------------------------- grading
_RISKY = re.compile(r"\^\s*\{?\s*[-+]?\s*\d{4,}|\^\s*\{[^{}]*\^|\d{3,}\s*!|\\binom\s*\{\s*\d{4,}|\*\*")


def _risky(s: str) -> bool:
    return len(s) > MAX_SYMBOLIC_CHARS or bool(_RISKY.search(s))


_MV = None


def _math_verify():
    global _MV
    if _MV is None:
        import math_verify

        logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" warnings
        cfg = [math_verify.LatexExtractionConfig(boxed_match_priority=0), math_verify.ExprExtractionConfig()]
        _MV = (math_verify, cfg)
    return _MV


def _symbolic_equal(given: str, truth: str) -> bool:
    mv, cfg = _math_verify()
    gold = mv.parse("\\boxed{" + truth + "}", extraction_config=cfg, parsing_timeout=None)
    pred = mv.parse("\\boxed{" + given + "}", extraction_config=cfg, parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(mv.verify(gold, pred, timeout_seconds=None))


def grade_answer(given: str | None, truth: str | None, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> bool:
    """True iff `given` is mathematically equivalent to the reference `truth`.

    Order: empty/"None" given -> False; equal after `normalize_answer` -> True; otherwise
    math-verify on the unit/wrapper-stripped strings, bounded by `timeout_s` (timeout or error ->
    False, counted). Not symmetric in one respect, like math-verify: `truth` is the gold side.
    """
    _count("graded")
    if given is None or truth is None:
        return False
    given, truth = str(given).strip(), str(truth).strip()
    if not given or given == "None" or not truth:
        return False
    if normalize_answer(given) == normalize_answer(truth):
        return True
    g, t = _strip_units_and_wrappers(given), _strip_units_and_wrappers(truth)
    if _risky(g) or _risky(t):
        _count("skipped_risky")
        return False
    _count("symbolic")
    start = time.monotonic()
    try:
        return call_with_deadline(timeout_s, _symbolic_equal, g, t)
    except GradingTimeout:
        _count("timeouts")
        log.warning("grading timed out after %.1f s (given=%.80r, truth=%.80r)", time.monotonic() - start, given, truth)
        return False
    except Exception:  # math-verify/sympy internals: a parse failure is a wrong answer, counted
        _count("errors")
        log.debug("grading error (given=%.80r, truth=%.80r)", given, truth, exc_info=True)
        return False


def grade_final_answer(response: str | None, ground_truth: str | None,
                       timeout_s: float | None = DEFAULT_TIMEOUT_S) -> bool:
    """Accuracy of a final policy turn as the math rewards define it: the LAST `\\boxed{}`
    of the tag-whitespace-normalised response, graded against the reference."""
    if response is None or ground_truth is None:
        return False
    return grade_answer(extract_boxed_content(strip_tag_whitespace(response)), ground_truth, timeout_s=timeout_s)
