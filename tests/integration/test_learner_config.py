"""Learner set-up that needs no processes: the LR multiplier of every optimizer step (hand-computed
warmup and cosine values) and the DeepSpeed config derived from `learner.*` (ZeRO stage, precision,
clipping, caller-owned gradient accumulation)."""

from __future__ import annotations

import math

import pytest

from asyncrl.config import load_config
from asyncrl.learner.build import build_ds_config, lr_factor


def test_lr_factor_constant_with_warmup() -> None:
    # warmup 4: steps 0..3 -> (s + 1) / 4 = 0.25, 0.5, 0.75, 1.0; then constant 1
    assert [lr_factor(s, 10, 4, "constant", 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, 10, 0, "constant", 0.0) == 1.0  # no warmup: the first step runs at the peak LR


def test_lr_factor_cosine() -> None:
    # warmup 2, total 10, floor m = 0.1: p = (s - 2) / 8; factor = (1 + m)/2 + (1 - m)/2 cos(pi p)
    assert lr_factor(1, 10, 2, "cosine", 0.1) == 1.0  # (1 + 1) / 2, last warmup step
    assert lr_factor(2, 10, 2, "cosine", 0.1) == pytest.approx(1.0)  # p = 0
    assert lr_factor(6, 10, 2, "cosine", 0.1) == pytest.approx(0.55)  # p = 0.5: 0.55 + 0.45 cos(pi/2)
    assert lr_factor(4, 10, 2, "cosine", 0.1) == pytest.approx(0.55 + 0.45 * math.cos(math.pi / 4))
    assert lr_factor(10, 10, 2, "cosine", 0.1) == pytest.approx(0.1)  # p = 1: the floor
    assert lr_factor(50, 10, 2, "cosine", 0.1) == pytest.approx(0.1)  # past the end stays at the floor


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ds_config_from_learner_section(stage: int) -> None:
    cfg = load_config(None, [f"learner.zero_stage={stage}", "learner.max_grad_norm=0.5"])
    ds = build_ds_config(cfg.learner, world_size=2, precision=cfg.learner_precision)
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["gradient_clipping"] == 0.5
    assert ds["managed_gradient_accumulation"] is False  # the learner calls engine.step() itself
    assert ds["gradient_accumulation_steps"] == 1 and ds["train_batch_size"] == 2
    assert ds["bf16"]["enabled"] is False  # CPU default: fp32
    assert "data_types" not in ds  # fp32: gradients accumulate in fp32 anyway
    if stage == 3:
        # DeepSpeed 0.19.8 allows overlap_comm with unmanaged accumulation when gradients are
        # partitioned (stage >= 2); stage 3 overlaps its reduce-scatter with the backward
        assert ds["zero_optimization"]["overlap_comm"] is True
    gpu = load_config(None, ["learner.num_gpus=2", f"learner.zero_stage={stage}"])
    gds = build_ds_config(gpu.learner, 2, gpu.learner_precision)
    assert gds["bf16"] == {"enabled": True, "check_grad_overflow": True}
    # bf16 under ZeRO: micro-batch gradients accumulate in fp32, not in bf16 (DeepSpeed's default is
    # the model dtype); stage 0 has no accumulation buffer of DeepSpeed's and refuses the mix
    assert gds.get("data_types") == ({"grad_accum_dtype": "fp32"} if stage >= 1 else None)
