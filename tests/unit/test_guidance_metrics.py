"""`train/first_turn_accuracy` and `train/rescued_frac` from the trained groups' metadata, by hand."""

from __future__ import annotations

import pytest

from asyncrl.step_metrics import batch_metrics, guidance_metrics


def _meta(accs: list[float], turns: list[int]) -> dict:
    return {"rewards": accs, "reward_parts": [{"overall": a, "accuracy": a} for a in accs], "num_turns": turns,
            "verifier_versions": ["v1"] * len(accs), "prompt_index": 0}


def test_first_turn_and_rescued_shares():
    # 6 samples: correct in turn 1 (x2), correct after 2 and 4 turns (rescued, x2), wrong after 4 turns (x2)
    metas = [_meta([1.0, 1.0, 1.0], [1, 1, 2]), _meta([1.0, 0.0, 0.0], [4, 4, 4])]
    m = guidance_metrics(metas)
    assert m == {"train/first_turn_accuracy": pytest.approx(2 / 6), "train/rescued_frac": pytest.approx(2 / 6)}
    # the raw reward (4/6 correct) is their sum: a policy moving samples from rescued to first-turn
    # keeps the reward flat while first_turn_accuracy rises
    assert m["train/first_turn_accuracy"] + m["train/rescued_frac"] == pytest.approx(4 / 6)
    assert batch_metrics(metas, [0, 1], 1)["train/first_turn_accuracy"] == pytest.approx(2 / 6)


def test_no_accuracy_part_no_keys():
    metas = [{"rewards": [1.0], "reward_parts": [{"overall": 1.0}], "num_turns": [1]}]
    assert guidance_metrics(metas) == {}
