"""Synthetic guided dialogues for `arith`: the SFT data of the tiny quick-start policy.

A scripted student plays against the real rule verifier (`arith_verifier.verify_turns`), and the
verifier's reply is turned into the policy's next user turn by the real protocol code
(`parse_verifier_reply`: score line removed, as `show_score_to_policy=False` does), so the
dialogues have exactly the layout the rollout shows the policy with `guide.history="full"`:
`[user problem] [assistant A1] [user guidance 1] [assistant A2] ...`.

The student does 1-3 canonical steps per turn (`a op b = c.`), ends a turn with `Right?`, and
gives `<answer>\\boxed{N}</answer>` either after the last step or in its own turn. In `guided`
dialogues it sometimes errs (wrong result), the verifier corrects, and the next turn repairs the
step; it sometimes writes the answer in the wrong format and fixes it when asked. In `solver`
dialogues every user turn is the continue prompt (no guidance) and the student tracks the
expression itself. Erroneous turns are marked `train=False` so SFT teaches repair, not errors.

The step-count and same-turn-answer probabilities deliberately make short turns the most likely
choice; with 4 turns a greedy policy then runs out of turns on long problems, which is one
thing RL can fix (more steps per turn -> fewer turns, as Guided-GRPO reports turns falling).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from asyncrl.tasks.arith import Item, apply_op, next_step, problem_expr, reduce_at
from asyncrl.tasks.arith_verifier import has_final_answer, verify_turns

CONTINUE_PROMPT = "Please continue and provide the final answer in the required format."


@dataclass(frozen=True)
class StudentStyle:
    steps_per_turn: tuple[float, float, float] = (0.6, 0.25, 0.15)
    """Probabilities of 1, 2, 3 steps in a turn."""
    p_answer_same_turn: float = 0.35
    """Probability of writing the final answer right after the last step (else a separate turn)."""
    p_error: float = 0.12
    """Guided dialogues: probability that a step has a wrong result."""
    p_bad_format: float = 0.05
    """Guided dialogues: probability that the answer is written without <answer>/\\boxed."""


def _wrong(c: int, rng: random.Random) -> int:
    while True:
        w = c + rng.choice([-10, -2, -1, 1, 1, 2, 10]) if rng.random() < 0.8 else int(str(c)[::-1] or 0) + rng.randint(0, 3)
        if w != c and w >= 0:
            return w


def _step(items: list[Item]) -> tuple[list[Item], tuple[int, str, int, int]]:
    i = next_step(items)
    assert i is not None
    a, op, b = int(items[i - 1]), str(items[i]), int(items[i + 1])
    return reduce_at(items, i), (a, op, b, apply_op(a, op, b))


def synth_dialogue(
    problem: str,
    rng: random.Random,
    mode: str = "guided",
    max_turns: int = 4,
    style: StudentStyle = StudentStyle(),
) -> list[dict]:
    """One dialogue as chat messages; assistant messages carry `train` (bool)."""
    from asyncrl.verifier_protocol import parse_verifier_reply

    items = problem_expr(problem)
    messages: list[dict] = [{"role": "user", "content": problem}]
    turns: list[str] = []
    for _ in range(max_turns):
        parts: list[str] = []
        erred = False
        if len(items) == 1:  # everything computed: answer turn
            bad = mode == "guided" and rng.random() < style.p_bad_format and not any(
                "Format" in m["content"] for m in messages if m["role"] == "user"
            )
            parts.append(f"The answer is {items[0]}." if bad else f"<answer>\\boxed{{{items[0]}}}</answer>")
        else:
            k = rng.choices((1, 2, 3), weights=style.steps_per_turn)[0]
            for _ in range(k):
                new_items, (a, op, b, c) = _step(items)
                if mode == "guided" and rng.random() < style.p_error:
                    parts.append(f"{a} {op} {b} = {_wrong(c, rng)}.")
                    erred = True
                    break
                parts.append(f"{a} {op} {b} = {c}.")
                items = new_items
                if len(items) == 1:
                    break
            if not erred and len(items) == 1 and rng.random() < style.p_answer_same_turn:
                parts.append(f"<answer>\\boxed{{{items[0]}}}</answer>")
            elif not has_final_answer(" ".join(parts)):
                parts.append("Right?")
        text = " ".join(parts)
        turns.append(text)
        messages.append({"role": "assistant", "content": text, "train": not erred})
        if mode == "guided":
            verdict = verify_turns(problem, turns)
            reply = parse_verifier_reply(verdict.text)
            if reply.kind == "stop":
                break
            messages.append({"role": "user", "content": reply.guidance})
        else:
            if has_final_answer(text):
                break
            messages.append({"role": "user", "content": CONTINUE_PROMPT})
    return messages
