"""`train/one_turn_accuracy` and `train/multi_turn_accuracy` from the trained groups' metadata, by hand."""

from __future__ import annotations

import pytest

from asyncrl.job.step_metrics import batch_metrics, turn_accuracy_metrics


def _meta(accs: list[float], turns: list[int]) -> dict:
    return {"rewards": accs, "reward_parts": [{"overall": a, "accuracy": a} for a in accs], "num_turns": turns,
            "verifier_versions": ["v1"] * len(accs), "prompt_index": 0}


def test_one_and_multi_turn_shares():
    # 6 samples: correct in 1 turn (x2), correct after 2 and 4 turns (x2), wrong after 4 turns (x2)
    metas = [_meta([1.0, 1.0, 1.0], [1, 1, 2]), _meta([1.0, 0.0, 0.0], [4, 4, 4])]
    m = turn_accuracy_metrics(metas)
    assert m == {"train/one_turn_accuracy": pytest.approx(2 / 6), "train/multi_turn_accuracy": pytest.approx(2 / 6)}
    # the raw accuracy (4/6) is their sum: moving samples from several turns to one keeps the reward
    # flat while one_turn_accuracy rises
    assert m["train/one_turn_accuracy"] + m["train/multi_turn_accuracy"] == pytest.approx(4 / 6)
    assert batch_metrics(metas, [0, 1], 1)["train/one_turn_accuracy"] == pytest.approx(2 / 6)


def test_no_accuracy_part_no_keys():
    metas = [{"rewards": [1.0], "reward_parts": [{"overall": 1.0}], "num_turns": [1]}]
    assert turn_accuracy_metrics(metas) == {}
