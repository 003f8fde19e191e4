"""analysis/training_reward_gap.py's summary of evaluated conversations (no engine): accuracy with
its standard error over rows, the clean/rescued split, format and wrong-answer rates, by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "analysis" / "training_reward_gap.py"


def _module():
    spec = importlib.util.spec_from_file_location("training_reward_gap", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rec(correct: bool, flagged: int, answered: bool, turns: int = 3, steps: int = 2, reason: str = "verifier_stop"):
    return {"correct": correct, "flagged": flagged, "answered": answered, "turns": turns, "num_steps": steps,
            "policy_tokens": 40, "finish_reason": reason}


def test_summary_by_hand() -> None:
    # 2 rows x 2 samples, laid out sample-major as the script evaluates them: [r0s0, r1s0, r0s1, r1s1].
    # Row 0 right twice (once clean, once after a flagged turn); row 1 wrong twice (a wrong answer, then
    # no answer within the turn budget).
    recs = [rec(True, 0, True, turns=1, steps=1), rec(False, 1, True), rec(True, 2, True, steps=1),
            rec(False, 3, False, turns=4, reason="max_turns")]
    out = _module().summarize_records(recs, samples=2)
    # per-row accuracy [1, 0]: mean 0.5; sample variance ((0.5)^2 + (0.5)^2) / 1 = 0.5; SE sqrt(0.5 / 2) = 0.5
    assert out["accuracy"] == 0.5 and out["accuracy_se"] == pytest.approx(0.5)
    assert out["clean_accuracy"] == 0.25 and out["rescued_accuracy"] == 0.25 and out["one_turn_accuracy"] == 0.25
    assert out["format_rate"] == 0.75 and out["wrong_answer_rate"] == 0.25
    assert out["finish_reasons"] == {"max_turns": 1, "verifier_stop": 3}
    assert out["accuracy_by_steps"] == {"1": {"n": 2, "accuracy": 1.0}, "2": {"n": 2, "accuracy": 0.0}}
