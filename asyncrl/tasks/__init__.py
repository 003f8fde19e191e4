"""Built-in tasks with rule verifiers (the offline quick-start world `arith`).

`get_rule_verifier(task)` returns a pure, deterministic `Callable[[list[dict]], str]` taking the
OpenAI chat messages of a Guided-GRPO verifier request (docs/guided_grpo.md#verifier-request) and
returning the reply text; the Ray Serve `rule` back-end and the tests call the same object.
"""

from __future__ import annotations

from collections.abc import Callable

TASKS = ("arith", "arith_vl", "mathds")


RULE_VARIANTS = ("arith_answer_only",)
"""Rule verifiers that are not a task's oracle: `arith_answer_only` checks only the final answer and
scores every step 1 (a deliberately weaker verifier, for comparing verifiers with asyncrl.rescore)."""


def get_rule_verifier(task: str) -> Callable[[list[dict]], str]:
    if task in ("arith", "arith_vl"):  # arith_vl: the same rule verifier (it reads the figure's caption)
        from asyncrl.tasks.arith_verifier import ArithRuleVerifier

        return ArithRuleVerifier()
    if task == "arith_answer_only":
        from asyncrl.tasks.arith_verifier import ArithAnswerOnlyVerifier

        return ArithAnswerOnlyVerifier()
    if task == "mathds":
        from asyncrl.tasks.mathds_verifier import MathdsRuleVerifier

        return MathdsRuleVerifier()
    raise ValueError(f"no rule verifier for task {task!r}; known tasks: {', '.join(TASKS + RULE_VARIANTS)}")


def get_step_checker(task: str) -> Callable[[str, list[str]], int | None] | None:
    """The task's ground-truth step label, `(problem, policy turns so far) -> 1 (the latest turn is
    sound) | 0 (it errs) | None (a correct final answer: nothing to label)`, or None when the task
    has no checker. For arith the rule verifier's verdict is exact (it evaluates the expression)."""
    if task in ("arith", "arith_vl"):
        from asyncrl.tasks.arith_verifier import verify_turns

        return lambda problem, turns: verify_turns(problem, turns).score
    return None


def get_answer_check(task: str) -> Callable[[str, str], bool]:
    """`(final policy text, reference) -> correct` for a task's evaluation: the last `\\boxed{}` equal in
    value for `mathds` (`-7/2` == `-3.5` == `-\\frac{7}{2}`), the stripped boxed string otherwise."""
    if task == "mathds":
        from asyncrl.tasks.mathds_verifier import final_answer_correct

        return final_answer_correct
    from asyncrl.tasks.arith_verifier import boxed_value

    return lambda text, reference: (boxed_value(text) or "").strip() == str(reference).strip()


def get_turn_verifier(task: str) -> Callable[..., object]:
    """`verify_turns(problem, policy_turns)` of a task (a verdict with `.score`), for scoring solver-only
    conversations after the fact."""
    if task == "mathds":
        from asyncrl.tasks.mathds_verifier import verify_turns
    else:
        from asyncrl.tasks.arith_verifier import verify_turns
    return verify_turns
