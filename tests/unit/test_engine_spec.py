"""Proves that a rollout actor's engine is built from the job config in one place
(`EngineSpec.from_job`): the policy, seed, weight-sync timeout and buckets, the small-machine
switch, a VL policy's image limit and the LoRA adapter slots all come from their config keys, and
the spec is immutable. No engine is started (the engine itself: tests/integration/test_engine.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from asyncrl.actors.engine import EngineSpec
from asyncrl.config import load_config

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")


def test_the_job_config_maps_onto_the_engine_spec() -> None:
    cfg = load_config(QUICKSTART, ["learner.weights.timeout_s=17", "learner.weights.bucket_mb=8",
                                   "rollout.seed=5", "cluster.small_machine=false"])
    spec = EngineSpec.from_job(cfg, "actor-3")
    assert (spec.model_path, spec.tokenizer_path, spec.engine_id) == (cfg.model.path, cfg.model.tokenizer_path,
                                                                      "actor-3")
    assert spec.rollout is cfg.rollout
    assert (spec.seed, spec.weight_timeout_s, spec.weight_bucket_mb) == (5, 17.0, 8.0)
    assert spec.small_machine is False and spec.lora_adapter is None
    assert (spec.vl, spec.limit_images) == (False, 0)  # a text policy gets no image limit
    assert EngineSpec.from_job(load_config(QUICKSTART, ["cluster.small_machine=true"]), "a").small_machine is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 6  # type: ignore[misc]


def test_a_vl_policy_gets_its_image_limit_and_adapter_sync_its_slots() -> None:
    cfg = load_config(QUICKSTART, ["rollout.limit_images=2", "model.lora.enable=true", "model.lora.sync=adapter",
                                   "buffer.max_staleness=3"])
    spec = EngineSpec.from_job(cfg, "a", vl=True)
    assert (spec.vl, spec.limit_images) == (True, 2)
    assert spec.lora_adapter is not None and spec.lora_adapter["r"] == cfg.model.lora.rank
    assert spec.lora_keep == 3 + 2  # every version a group in flight may sample from: max_staleness + 2
