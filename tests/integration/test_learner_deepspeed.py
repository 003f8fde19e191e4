"""DeepSpeed learner on CPU (gloo), ranks as Ray actors (`LearnerGroup`), tiny random Qwen2:

- 2 ranks with ZeRO-1 and with ZeRO-2 (+ gradient checkpointing), many small micro-batches, give the same parameters after two
  learner steps (two mini-batches each) as 1 rank with one big micro-batch per mini-batch: the
  token-mode loss normalisation is exact across micro-batches and ranks; 1 rank without ZeRO (the
  quick start's) gives the same as 1 rank with ZeRO-1;
- ZeRO-3 (2 ranks) exports, bucket by bucket, full tensors equal to that reference, under the HF
  names of the saved model;
- rank 0's WeightSender fed by the ZeRO-3 export delivers exactly those tensors to a receiver;
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
import learner_probe as lp  # noqa: E402 - after the skip

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


@pytest.fixture(scope="module")
def two_ranks(model_dir: str, ray_cluster, tmp_path_factory: pytest.TempPathFactory):
    from asyncrl.learner.group import LearnerGroup

    group = LearnerGroup(_cfg(model_dir, str(tmp_path_factory.mktemp("runs")), **{
        "learner.cpu_ranks": 2, "learner.zero_stage": 1, "learner.micro_batch_tokens": 48}))
    yield group
    group.shutdown()


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


def test_zero_stages_match_single_rank(model_dir: str, two_ranks, tmp_path) -> None:
    from asyncrl.learner.group import LearnerGroup

    batches = _batches(vocab=99)
    ref = LearnerGroup(_cfg(model_dir, str(tmp_path), **{"learner.cpu_ranks": 1, "learner.zero_stage": 1,
                                                         "learner.micro_batch_tokens": 100000}))
    multi = two_ranks
    try:
        initial = lp.export_state(ref)
        ref_metrics = [lp.step(ref, b) for b in batches]
        expected = lp.export_state(ref)
        moved = _max_diff(initial, expected)
        assert moved > 1e-4  # the update is large enough for the comparison to mean something
        for stage in (1, 2):
            lp.reconfigure(multi, _cfg(model_dir, str(tmp_path), **{  # ZeRO-2 also with gradient checkpointing(_cfg(model_dir, str(tmp_path), **{  # + gradient checkpointing
                    "learner.cpu_ranks": 2, "learner.zero_stage": stage, "learner.micro_batch_tokens": 48,
                    "model.gradient_checkpointing": True}))
            metrics = [lp.step(multi, b) for b in batches]
            assert metrics[-1]["perf/micro_batches"] > 2 * 2  # really split into several micro-batches
            got = lp.export_state(multi)
            assert _max_diff(got, expected) < 2e-6 * max(1.0, moved / 1e-3), f"ZeRO-{stage}"
            for m, r in zip(metrics, ref_metrics):
                assert m["loss/pg"] == pytest.approx(r["loss/pg"], abs=1e-5)
                assert m["train/grad_norm"] == pytest.approx(r["train/grad_norm"], rel=1e-4)
                assert m["train/optimizer_steps"] == r["train/optimizer_steps"]

        # one rank without ZeRO (the quick start's: a single rank has nothing to partition, and
        # ZeRO-1's optimizer wrapper costs start-up) = the same updates as one rank with ZeRO-1
        lp.reconfigure(ref, _cfg(model_dir, str(tmp_path), **{"learner.cpu_ranks": 1, "learner.zero_stage": 0,
                                                              "learner.micro_batch_tokens": 100000}))
        metrics = [lp.step(ref, b) for b in batches]
        assert _max_diff(lp.export_state(ref), expected) < 2e-6 * max(1.0, moved / 1e-3), "ZeRO-0"
        for m, r in zip(metrics, ref_metrics):
            assert m["loss/pg"] == pytest.approx(r["loss/pg"], abs=1e-5)
            assert m["train/grad_norm"] == pytest.approx(r["train/grad_norm"], rel=1e-4)

        # ZeRO-3: bucketed gathers give the same full tensors under the HF names
        lp.reconfigure(multi, _cfg(model_dir, str(tmp_path), **{
            "learner.cpu_ranks": 2, "learner.zero_stage": 3, "learner.micro_batch_tokens": 48}))
        for b in batches:
            lp.step(multi, b)
        got3 = lp.export_state(multi, bucket_bytes=20_000)  # several buckets on this model
        assert _max_diff(got3, expected) < 2e-6 * max(1.0, moved / 1e-3)
        from safetensors.torch import load_file

        hf_names = set(load_file(f"{model_dir}/model.safetensors").keys())
        assert set(got3) == hf_names
    finally:
        ref.shutdown()


def test_non_finite_gradient_skips_step(model_dir: str, two_ranks, tmp_path) -> None:
    group = two_ranks
    for stage in (1, 0):
        lp.reconfigure(group, _cfg(model_dir, str(tmp_path), **{
            "learner.cpu_ranks": 2, "learner.zero_stage": stage, "learner.mini_batches": 1}))
        bad = synthetic_groups(2, 4, 99, (3, 8), (4, 12), seed=5)
        bad[1].samples[0].reward = float("nan")  # NaN reward -> NaN advantages -> NaN gradient
        before = lp.export_state(group)
        m = lp.step(group, bad)
        assert m["train/skipped_steps"] == 1.0 and m["train/optimizer_steps"] == 0.0, f"ZeRO-{stage}"
        assert m["train/version"] == 1.0  # the version still advances (the batch was consumed)
        assert _max_diff(before, lp.export_state(group)) == 0.0
        good = lp.step(group, synthetic_groups(2, 4, 99, (3, 8), (4, 12), seed=6))
        assert good["train/skipped_steps"] == 0.0 and good["train/skipped_steps_total"] == 1.0
        assert good["train/optimizer_steps"] == 1.0
        assert _max_diff(before, lp.export_state(group)) > 1e-5


def test_recomputed_proximal_matches_training_forward(model_dir: str, two_ranks, tmp_path) -> None:
    """pi_prox recomputed in a separate pass (2 PPO epochs) equals the training forward's own
    log-probs (1 epoch, reused): same mismatch KL to the behaviour policy, same first-epoch loss; with
    a rollout temperature != 1 and the KL-in-reward path, REINFORCE++ advantages and seq averaging."""
    over = {"learner.cpu_ranks": 2, "learner.zero_stage": 2, "learner.mini_batches": 1,
            "rollout.temperature": 0.7, "learner.loss_avg_mode": "seq"}
    batch = synthetic_groups(3, 4, 99, (3, 9), (4, 14), seed=21)
    lp.reconfigure(two_ranks, _cfg(model_dir, str(tmp_path), **over))
    one = lp.step(two_ranks, batch)
    lp.reconfigure(two_ranks, _cfg(model_dir, str(tmp_path), **over, **{"learner.ppo_epochs": 2}))
    two = lp.step(two_ranks, batch)
    assert two["train/optimizer_steps"] == 2.0 and two["perf/prox_ref_s"] > 0
    # mismatch KL(mu || pi_prox) is averaged over both epochs, pi_prox being the same in both
    assert two["train/mismatch_kl"] == pytest.approx(one["train/mismatch_kl"], rel=1e-5)
    assert one["train/ppo_kl"] == 0.0 and two["train/ppo_kl"] != 0.0  # epoch 2 moved away from pi_prox

    lp.reconfigure(two_ranks, _cfg(model_dir, str(tmp_path), **{**over, **{
        "learner.kl.enable": True, "learner.kl.mode": "reward", "learner.kl.coef": 0.1,
        "algorithm.adv_estimator": "reinforce_plus_plus", "learner.mini_batches": 2}}))
    m = lp.step(two_ranks, batch)
    assert m["train/kl_penalty"] == pytest.approx(0.0, abs=1e-6)  # reference = initial weights = pi_prox
    assert m["train/optimizer_steps"] == 2.0 and all(v == v for v in m.values())  # no NaN anywhere
    m2 = lp.step(two_ranks, synthetic_groups(3, 4, 99, (3, 9), (4, 14), seed=22))
    assert m2["train/kl_penalty"] > 0  # the policy moved away from the reference


def test_zero3_export_broadcasts_to_a_receiver(model_dir: str, two_ranks, tmp_path) -> None:
    """Rank 0's WeightSender (the learner's side of the weight wire) fed by the ZeRO-3 bucketed export of a 2-rank job delivers
    exactly the learner's full parameters, as the current version, to a receiver (here a thread of
    this process), in several buckets."""
    import threading

    from asyncrl.weights.receiver import WeightReceiver

    lp.reconfigure(two_ranks, _cfg(model_dir, str(tmp_path), **{
        "learner.cpu_ranks": 2, "learner.zero_stage": 3, "learner.weights.bucket_mb": 0.02,
        "learner.weights.timeout_s": 30}))
    lp.step(two_ranks, synthetic_groups(2, 4, 99, (3, 8), (4, 12), seed=31))
    expected = lp.export_state(two_ranks)
    address = two_ranks.start_weight_sender(0, False)
    two_ranks.add_receivers(["rx"])
    got: dict = {}

    def receive() -> None:
        rec = WeightReceiver(address, "rx", timeout_s=60)
        got.update(rec.receive(None, timeout_s=120))

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    report = two_ranks.broadcast_weights()
    t.join(timeout=120)
    assert got.get("status") == "ok" and got["version"] == 1, (got, report)
    tensors = dict(got["tensors"])
    assert _max_diff(tensors, expected) == 0.0
    assert report["buckets"] > 1 and report["acked"] == ["rx"] and report["version"] == 1
