"""Built-in tasks with rule verifiers (the offline quick-start world `arith`).

`get_rule_verifier(task)` returns a pure, deterministic `Callable[[list[dict]], str]` taking the
OpenAI chat messages of a Guided-GRPO verifier request (docs/guided_grpo.md#verifier-request) and
returning the reply text; the Ray Serve `rule` back-end and the tests call the same object.
"""

from __future__ import annotations

from collections.abc import Callable

TASKS = ("arith", "arith_vl")


def get_rule_verifier(task: str) -> Callable[[list[dict]], str]:
    if task in ("arith", "arith_vl"):  # arith_vl: the same rule verifier (it reads the figure's caption)
        from asyncrl.tasks.arith_verifier import ArithRuleVerifier

        return ArithRuleVerifier()
    raise ValueError(f"no rule verifier for task {task!r}; known tasks: {', '.join(TASKS)}")
