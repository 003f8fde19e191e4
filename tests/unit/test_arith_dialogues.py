"""The synthetic SFT dialogues of the quick-start policy agree with the rule verifier and the
protocol: every trained assistant turn is accepted by the verifier (no error is ever a target),
every erroneous turn is followed by the verifier's correction and is masked from training,
guided dialogues that give a formatted answer end with STOP, and solver dialogues contain only
the continue prompt as user turns."""

from __future__ import annotations

import random

from asyncrl.tasks.arith import generate_split
from asyncrl.tasks.arith_dialogues import CONTINUE_PROMPT, synth_dialogue
from asyncrl.tasks.arith_verifier import verify_turns
from asyncrl.verifier_protocol import has_final_answer


def test_guided_dialogues_are_consistent_with_the_verifier():
    rng = random.Random(0)
    n_err = n_stop = 0
    for row in generate_split("train", 300, seed=7):
        msgs = synth_dialogue(row["problem"], rng, "guided")
        assert msgs[0] == {"role": "user", "content": row["problem"]}
        turns: list[str] = []
        for i, m in enumerate(msgs[1:], start=1):
            if m["role"] != "assistant":
                continue
            turns.append(m["content"])
            v = verify_turns(row["problem"], turns)
            assert (v.kind == "step_error") == (not m["train"])
            n_err += v.kind == "step_error"
            if v.kind == "stop":
                assert i == len(msgs) - 1 and f"\\boxed{{{row['answer']}}}" in m["content"]
                n_stop += 1
            else:
                assert msgs[i + 1]["role"] == "user" and "[SCORE]" not in msgs[i + 1]["content"]
        assert sum(m["role"] == "assistant" for m in msgs) <= 4
    assert n_err > 10 and n_stop > 150  # errors and repairs occur; most dialogues finish


def test_solver_dialogues_get_only_the_continue_prompt():
    rng = random.Random(1)
    for row in generate_split("train", 100, seed=8):
        msgs = synth_dialogue(row["problem"], rng, "solver")
        assert all(m["content"] == CONTINUE_PROMPT for m in msgs[2::2])
        assert all(m["train"] for m in msgs[1::2])
        if has_final_answer(msgs[-1]["content"]):
            assert f"\\boxed{{{row['answer']}}}" in msgs[-1]["content"]
