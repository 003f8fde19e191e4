"""The text boundary of the guided protocol is exactly as specified.

Proves: the verifier request renders byte-exact to the original's layout (layout, `Assistant: ` lines
for policy turns only, [IMAGE]/[VIDEO], N/A, stripped template); every kind of verifier reply (STOP, guidance, score
line, malformed) and the structural edge cases classify as documented (kind, guidance shown, score); the
final-answer detector matches the original's; score aggregation is the mean, 0.5 when none.
"""

from __future__ import annotations

import pytest

from asyncrl.actors.guided import (
    aggregate_hallucination,
    has_final_answer,
    parse_verifier_reply,
    render_verifier_messages,
)
from asyncrl.data.prompts import default_verifier_template

# ----------------------------------------------------------------------------- request rendering
GOLDEN_USER = (
    "### Problem Statement\n"
    "What is 2+3?\n"
    "\n"
    "### Reference Answer\n"
    "5\n"
    "\n"
    "### Conversation History\n"
    "Assistant: <think>2+3</think> It is 6?\n"
    "Assistant: <answer>\\boxed{5}</answer>\n"
    "\n"
    "Provide the next piece of guidance following the rules above."
)


def test_render_golden_byte_exact():
    msgs = render_verifier_messages(
        "What is 2+3?", "5", ["<think>2+3</think> It is 6?", "<answer>\\boxed{5}</answer>"], None
    )
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[1]["content"] == GOLDEN_USER
    assert msgs[0]["content"] == default_verifier_template()
    assert msgs[0]["content"].startswith('You are a professional "Verifier-Guide" teacher.\n\nYour task')
    assert msgs[0]["content"].endswith("`[SCORE] hallucination_detect=0|1`. Do not include any other scores.")


def test_render_template_is_stripped_and_reference_na():
    msgs = render_verifier_messages("P", None, [], "  \n My prompt.\n\n")
    assert msgs[0]["content"] == "My prompt."
    # no policy turn: the history section is empty, the layout is unchanged
    assert msgs[1]["content"] == (
        "### Problem Statement\nP\n\n### Reference Answer\nN/A\n\n### Conversation History\n\n\n"
        "Provide the next piece of guidance following the rules above."
    )
    assert "### Reference Answer\nN/A\n" in render_verifier_messages("P", "", ["a"], "t")[1]["content"]


def test_render_multimodal_placeholders():
    problem = [{"type": "image"}, {"type": "text", "text": "Find the angle."}, {"type": "video"},
               {"type": "text", "text": ""}]
    user = render_verifier_messages(problem, "30", ["x"], "t")[1]["content"]
    assert user.startswith("### Problem Statement\n[IMAGE]\nFind the angle.\n[VIDEO]\n\n### Reference Answer\n30\n")
    assert "Assistant: x\n\nProvide" in user


# ----------------------------------------------------------------------------- reply parsing
S = "###STOP###"
SCORE1 = "[SCORE] hallucination_detect=1"
SCORE0 = "[SCORE] hallucination_detect=0"

# (reply, expected kind, expected guidance (score hidden), expected score)
REPLY_TABLE = [
    # every kind of verifier reply and its edge cases
    ("", "stop", "", None),                                     # empty -> STOP (original too)
    ("   \n\t ", "stop", "", None),                             # whitespace -> STOP
    (None, "stop", "", None),                                   # missing text -> STOP
    (S, "stop", "", None),                                      # the stop token
    ("  ###STOP###  \n", "stop", "", None),                     # surrounded by whitespace
    ("###STOP####", "stop", "", None),                          # extra hash (original: prefix -> STOP)
    ("**###STOP###**", "stop", "", None),                       # markdown-wrapped lone token
    ("`###STOP###`.", "stop", "", None),
    ("###STOP### Well done.", "stop", "", None),                 # starts with it (the original's rule)
    (f"{S}\n{SCORE1}", "stop", "", 1),                          # STOP keeps its score (original drops it)
    (f"{SCORE0}\n{S}", "stop", "", 0),                          # leading score line no longer hides STOP
    (f"Correct.\n{S}", "stop", "", None),                       # STOP alone on its own line
    (f"Correct. {S}", "guidance", f"Correct. {S}", None),       # inline: guidance, passed on verbatim
    (f"Do not output {S} yet; fix the format.", "guidance", f"Do not output {S} yet; fix the format.", None),
    (f"<think>The answer is right.</think>{S}", "stop", "", None),  # think block removed (original: guidance)
    (f"<think>\nchecking\n</think>\n\n{S}\n{SCORE1}", "stop", "", 1),
    (f"reasoning without opening tag</think>\n{S}", "stop", "", None),  # template-opened think block
    ("<think>cut by max_tokens", "stop", "", None),             # unterminated think: nothing left
    (f"Check step 2: 3*4=12. What is next?\n{SCORE1}", "guidance", "Check step 2: 3*4=12. What is next?", 1),
    (f"<think>x</think>Fix the sign. {SCORE0}", "guidance", "Fix the sign.", 0),  # inline score removed
    ("User: Check your units.", "guidance", "Check your units.", None),  # leading user: stripped
    ("user:   Recompute 7*8.", "guidance", "Recompute 7*8.", None),
    ("User: ###STOP###", "stop", "", None),
    ("...", "stop", "", None),                                  # abnormal (no letter/digit) -> STOP
    ("!!! ???", "stop", "", None),
    (SCORE1, "stop", "", 1),                                    # only a score: nothing to show -> STOP
    ("Good.\n[SCORE] hallucination_detect = 0\n[SCORE] hallucination_detect=1", "guidance", "Good.", 0),  # first wins
    ("Good. [SCORE] hallucination_detect=2", "guidance", "Good. [SCORE] hallucination_detect=2", None),
]


@pytest.mark.parametrize("reply,kind,guidance,score", REPLY_TABLE)
def test_reply_table(reply, kind, guidance, score):
    r = parse_verifier_reply(reply, "###STOP###")
    assert (r.kind, r.guidance, r.hallucination) == (kind, guidance, score)
    if kind == "stop":
        assert r.stop_cause in ("stop_token", "empty", "abnormal")
    else:
        assert r.stop_cause == "" and "<think>" not in r.guidance and "[SCORE] hallucination_detect=" not in \
            r.guidance.replace("hallucination_detect=2", "")


def test_stop_causes():
    assert parse_verifier_reply("", S).stop_cause == "empty"
    assert parse_verifier_reply("...", S).stop_cause == "abnormal"
    assert parse_verifier_reply(S, S).stop_cause == "stop_token"


def test_show_score_to_policy_keeps_score_line():
    r = parse_verifier_reply(f"<think>t</think>User: Fix it.\n{SCORE0}", S, show_score_to_policy=True)
    assert (r.kind, r.guidance, r.hallucination) == ("guidance", f"Fix it.\n{SCORE0}", 0)


def test_custom_stop_token():
    assert parse_verifier_reply("DONE", "DONE").kind == "stop"
    assert parse_verifier_reply(S, "DONE").kind == "guidance"


# ----------------------------------------------------------------------------- final answer (1.8)
ANSWER_TABLE = [
    ("<answer>\\boxed{42}</answer>", True),
    ("<think>work</think> <answer>The result is \\boxed{42}.</answer>", True),
    ("< answer >\\boxed{42}< / answer >", True),                 # whitespace around < > / removed
    ("<answer>\n\\boxed{\\frac{1}{2}}\n</answer>", True),        # nested braces count once
    ("<answer>\\boxed{1\n2}</answer>", True),                    # dot matches newline
    ("\\boxed{42}", False),                                      # no answer tags
    ("<answer>42</answer>", False),                              # no boxed
    ("<answer>\\boxed{1} or \\boxed{2}</answer>", False),        # two boxed
    ("<answer>\\boxed{1}</answer><answer>\\boxed{1}</answer>", False),  # two answer tags
    ("</answer>\\boxed{1}<answer>", False),                      # wrong order
    ("<answer>\\boxed{}</answer>", True),                        # empty box still matches the regex
    ("<answer>\\boxed 5</answer>", False),
    ("", False),
]


@pytest.mark.parametrize("text,expected", ANSWER_TABLE)
def test_has_final_answer(text, expected):
    assert has_final_answer(text) is expected


# ----------------------------------------------------------------------------- scores (1.11)
def test_aggregate_hallucination():
    assert aggregate_hallucination([]) == 0.5  # neutral when no turn was scored
    assert aggregate_hallucination([None, None]) == 0.5
    assert aggregate_hallucination([0, None, 1, 1]) == pytest.approx(2 / 3)  # (0+1+1)/3
    assert aggregate_hallucination([0]) == 0.0


def _original_is_stop(text: str | None, stop: str = S) -> bool:
    """Guided-GRPO's classification (1.10), for comparison: normalise, then the abnormal rule."""
    import re

    t = str(text or "").strip()
    if not t or t.startswith(stop):
        return True
    if t.lower().startswith("user:"):
        t = t.split(":", 1)[1].lstrip()
    return not t.strip() or re.search(r"[A-Za-z0-9]", t) is None


FRAGMENTS = [S, "#", "\n", " ", "User:", "user: ", "Correct.", "Fix step 2?", SCORE0, SCORE1, "...", "x", "STOP"]


def test_every_original_stop_is_a_stop():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=400, deadline=None, derandomize=True)
    @hypothesis.given(st.lists(st.sampled_from(FRAGMENTS), max_size=8).map("".join))
    def check(reply: str) -> None:
        if _original_is_stop(reply):
            assert parse_verifier_reply(reply, S).kind == "stop", reply

    check()
