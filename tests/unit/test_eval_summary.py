"""Evaluation summaries: accuracy, its standard error and accuracy by problem length, per shard and merged.

The conversations are plain namespaces with the attributes `asyncrl.eval.summarize` reads (the real
Conversation needs an engine); the tokenizer is a labelled stand-in that counts characters.
"""

from types import SimpleNamespace

import pytest

from asyncrl.eval import combine, merge_mode, print_summary, summarize


class CharTokenizer:  # stand-in: one token per character
    def encode(self, text, add_special_tokens=False):
        return list(text)


def conv(final: str, turns: int = 1):
    t = SimpleNamespace(token_ids=[1, 2], verifier_text="ok", text=final)
    return SimpleNamespace(final_text=final, num_turns=turns, turns=[t] * turns, hallucination_score=1.0,
                           finish_reason="verifier_stop")


ROWS = [{"problem": "1 + 2", "answer": "3", "num_steps": 1}, {"problem": "2 + 2", "answer": "4", "num_steps": 1},
        {"problem": "1 + 2 + 2", "answer": "5", "num_steps": 2}, {"problem": "1 + 2 + 3", "answer": "6", "num_steps": 2}]
# correct, wrong, correct, correct
CONVS = [conv("\\boxed{3}"), conv("\\boxed{5}"), conv("\\boxed{5}", 2), conv("\\boxed{6}", 2)]


def test_summarize_reports_standard_error_and_accuracy_by_steps():
    out = summarize(CONVS, ROWS, CharTokenizer(), "arith", "guided")
    assert out["accuracy"] == 0.75
    # binomial SE: sqrt(0.75 * 0.25 / 4) = sqrt(0.046875) = 0.2165
    assert out["accuracy_se"] == pytest.approx(0.2165, abs=1e-4)
    # 1-step rows: 1 of 2 right; 2-step rows: 2 of 2 right
    assert out["accuracy_by_steps"] == {"1": {"n": 2, "accuracy": 0.5}, "2": {"n": 2, "accuracy": 1.0}}
    top = combine({"guided": out})
    assert top["guided_accuracy"] == 0.75 and top["guided_accuracy_se"] == out["accuracy_se"]
    assert top["solver_accuracy_se"] is None


def test_rows_without_num_steps_give_an_empty_breakdown():
    rows = [{k: v for k, v in r.items() if k != "num_steps"} for r in ROWS]
    assert summarize(CONVS, rows, CharTokenizer(), "arith", "guided")["accuracy_by_steps"] == {}


def test_merged_shards_recompute_the_standard_error_and_sum_the_breakdown():
    tok = CharTokenizer()
    a = summarize(CONVS[:2], ROWS[:2], tok, "arith", "guided")  # acc 0.5, n 2, SE sqrt(.25/2) = 0.3536
    b = summarize(CONVS[2:], ROWS[2:], tok, "arith", "guided")  # acc 1.0, n 2, SE 0
    merged = merge_mode([a, b])
    assert merged["n"] == 4 and merged["accuracy"] == pytest.approx(0.75)
    # not the mean of the shard SEs ((0.3536 + 0) / 2 = 0.1768): sqrt(0.75 * 0.25 / 4) = 0.2165
    assert merged["accuracy_se"] == pytest.approx(0.2165, abs=1e-4)
    assert merged["accuracy_by_steps"] == {"1": {"n": 2, "accuracy": 0.5}, "2": {"n": 2, "accuracy": 1.0}}


def test_terminal_summary_prints_the_standard_errors(capsys):
    before = {"guided_accuracy": 0.5, "guided_accuracy_se": 0.0158}
    after = {"guided_accuracy": 0.7, "guided_accuracy_se": 0.0145}
    print_summary({"before": before, "after": after, "steps": 3, "wall_s": 1.0})
    out = capsys.readouterr().out
    assert "+0.200" in out and "0.016" in out and "0.015" in out
