"""DeepSpeed learner on CPU (gloo), ranks as Ray actors (`LearnerGroup`), tiny random Qwen2:

- 2 ranks with ZeRO-1 and with ZeRO-2 (+ gradient checkpointing), many small micro-batches, give the same parameters after two
  learner steps (two mini-batches each) as 1 rank with one big micro-batch per mini-batch: the
  token-mode loss normalisation is exact across micro-batches and ranks;
- ZeRO-3 (2 ranks) exports, bucket by bucket, full tensors equal to that reference, under the HF
  names of the saved model;
- a non-finite gradient skips the optimizer step (weights unchanged, counted) with ZeRO-1 (DeepSpeed's
  overflow path) and with ZeRO-0 (the learner's own pre-check); the next step trains normally.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from asyncrl.bench.learner import build_tiny_qwen2, synthetic_groups
from asyncrl.config import load_config

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_qwen2(tmp_path_factory.mktemp("tiny") / "policy"))


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, namespace=f"test-learner-{uuid.uuid4().hex[:8]}",
             log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(model_dir: str, tmp: str, **over: object):
    items = {
        "model.path": model_dir, "trainer.run_dir": tmp, "learner.optim.lr": 1e-3, "learner.optim.eps": 1e-6,
        "learner.mini_batches": 2, "learner.cpus_per_rank": 0.5, "cluster.startup_timeout_s": 240,
        "learner.batch_timeout_s": 240, "learner.off_policy.mode": "tis", "learner.max_grad_norm": 100.0,
    }
    items.update({k: v for k, v in over.items()})
    return load_config(None, [f"{k}={v}" for k, v in items.items()])


def _batches(vocab: int) -> list[list]:
    return [synthetic_groups(4, 4, vocab, (3, 10), (4, 20), seed=s) for s in (11, 12)]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_zero_stages_match_single_rank(model_dir: str, ray_cluster, tmp_path) -> None:
    from asyncrl.learner.group import LearnerGroup

    batches = _batches(vocab=99)
    ref = LearnerGroup(_cfg(model_dir, str(tmp_path), **{"learner.cpu_ranks": 1, "learner.zero_stage": 1,
                                                         "learner.micro_batch_tokens": 100000}))
    multi = LearnerGroup(_cfg(model_dir, str(tmp_path), **{"learner.cpu_ranks": 2, "learner.zero_stage": 1,
                                                           "learner.micro_batch_tokens": 48}))
    try:
        initial = ref.export_state()
        ref_metrics = [ref.step(b) for b in batches]
        expected = ref.export_state()
        moved = _max_diff(initial, expected)
        assert moved > 1e-4  # the update is large enough for the comparison to mean something
        for stage in (1, 2):
            if stage != 1:
                multi.reconfigure(_cfg(model_dir, str(tmp_path), **{  # + gradient checkpointing
                    "learner.cpu_ranks": 2, "learner.zero_stage": stage, "learner.micro_batch_tokens": 48,
                    "model.gradient_checkpointing": True}))
            metrics = [multi.step(b) for b in batches]
            assert metrics[-1]["perf/micro_batches"] > 2 * 2  # really split into several micro-batches
            got = multi.export_state()
            assert _max_diff(got, expected) < 2e-6 * max(1.0, moved / 1e-3), f"ZeRO-{stage}"
            for m, r in zip(metrics, ref_metrics):
                assert m["loss/pg"] == pytest.approx(r["loss/pg"], abs=1e-5)
                assert m["train/grad_norm"] == pytest.approx(r["train/grad_norm"], rel=1e-4)
                assert m["train/optimizer_steps"] == r["train/optimizer_steps"]

        # ZeRO-3: bucketed gathers give the same full tensors under the HF names
        multi.reconfigure(_cfg(model_dir, str(tmp_path), **{
            "learner.cpu_ranks": 2, "learner.zero_stage": 3, "learner.micro_batch_tokens": 48}))
        for b in batches:
            multi.step(b)
        got3 = multi.export_state(bucket_bytes=20_000)  # several buckets on this model
        assert _max_diff(got3, expected) < 2e-6 * max(1.0, moved / 1e-3)
        from safetensors.torch import load_file

        hf_names = set(load_file(f"{model_dir}/model.safetensors").keys())
        assert set(got3) == hf_names
    finally:
        ref.shutdown()
        multi.shutdown()


def test_non_finite_gradient_skips_step(model_dir: str, ray_cluster, tmp_path) -> None:
    from asyncrl.learner.group import LearnerGroup

    group = LearnerGroup(_cfg(model_dir, str(tmp_path), **{"learner.cpu_ranks": 2, "learner.zero_stage": 1,
                                                           "learner.mini_batches": 1}))
    try:
        for stage in (1, 0):
            if stage == 0:
                group.reconfigure(_cfg(model_dir, str(tmp_path), **{
                    "learner.cpu_ranks": 2, "learner.zero_stage": 0, "learner.mini_batches": 1}))
            bad = synthetic_groups(2, 4, 99, (3, 8), (4, 12), seed=5)
            bad[1].samples[0].reward = float("nan")  # NaN reward -> NaN advantages -> NaN gradient
            before = group.export_state()
            m = group.step(bad)
            assert m["train/skipped_steps"] == 1.0 and m["train/optimizer_steps"] == 0.0, f"ZeRO-{stage}"
            assert m["train/version"] == 1.0  # the version still advances (the batch was consumed)
            assert _max_diff(before, group.export_state()) == 0.0
            good = group.step(synthetic_groups(2, 4, 99, (3, 8), (4, 12), seed=6))
            assert good["train/skipped_steps"] == 0.0 and good["train/skipped_steps_total"] == 1.0
            assert good["train/optimizer_steps"] == 1.0
            assert _max_diff(before, group.export_state()) > 1e-5
    finally:
        group.shutdown()
