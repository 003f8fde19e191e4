"""Two failure windows of the weight sync that a reading found, closed.

1. Native weight path: a CUDA error that surfaces in the device synchronize right after the
   receive (an earlier kernel's fault is reported there) is recorded as a failed, touched round
   instead of escaping `update_weights`. Escaping, vLLM 0.32's worker marks the update inactive
   and its `finish_weight_update` refuses to run, so the layer-wise reload is never finalised.
   Driven through vLLM's own worker methods (`Worker.update_weights` / `finish_weight_update`,
   the real bookkeeping) around asyncrl's transfer engine; the CUDA error is a stand-in
   (labelled: no GPU here): `torch.cuda.synchronize` patched to raise, on a `cuda` device object.
2. WeightStore: the published bytes outlive the process that published them (learner rank 0).
   A publisher actor publishes a version and is killed; a late joiner then fetches that exact
   version from the store. (With the bytes `ray.put` by the publisher, as before, Ray loses them
   with it: `OwnerDiedError`.)
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.integration


def test_cuda_error_at_the_post_receive_synchronize_still_finalises_the_reload(monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    from asyncrl.actors import worker_extension as ext

    engine = object.__new__(ext.AsyncrlTransferEngine)  # no model, no device: the lifecycle alone
    engine.device = torch.device("cuda", 0)
    engine.model = engine._default_model = torch.nn.Linear(2, 2)
    engine.model_config = engine._default_model_config = None
    engine.receivers, engine.round_hook, engine._round, engine._result = {}, ext.RoundHook(), None, None
    finalised: list[object] = []
    monkeypatch.setattr("vllm.model_executor.model_loader.reload.finalize_layerwise_reload",
                        lambda model, cfg: finalised.append(model))
    monkeypatch.setattr("vllm.model_executor.model_loader.reload.initialize_layerwise_reload", lambda model: None)

    def received(info):  # the round itself went fine: the bytes arrived and were loaded
        engine._round = (None, {"status": "ok", "version": 7, "touched": True, "phases": {"load": 0.1, "round": 0.2}})

    engine.receive_weights = received

    def cuda_error(device=None):  # stand-in for a CUDA error reported at the synchronize
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", cuda_error)
    worker = SimpleNamespace(weight_transfer_engine=engine, _weight_update_active=False, _weight_update_is_draft=False,
                             vllm_config=SimpleNamespace(), rank=0, _check_weight_transfer_engine=lambda: None,
                             _set_draft_weight_update_target=lambda: None,
                             model_runner=SimpleNamespace(reset_lora_state=lambda: None))
    Worker._start_weight_update(worker)
    Worker.update_weights(worker, {"address": "127.0.0.1:1", "prefix": "e", "timeout_s": 1.0})  # must not raise
    assert worker._weight_update_active  # so vLLM lets the finish run
    Worker.finish_weight_update(worker)
    assert finalised == [engine.model]  # the layer-wise reload was finalised
    result = engine.take_result()
    assert result["status"] == "failed" and result["touched"] and "illegal memory access" in result["error"]
    assert result["phases"]["finalize"] >= 0.0  # the finish is timed as a phase of the round


class Publisher:
    """Stands in for learner rank 0: a WeightSender that publishes to the store, and nothing else."""

    def publish(self, version: int) -> None:
        from asyncrl.weights.sender import WeightSender

        cfg = SimpleNamespace(bucket_mb=0.01, backend="gloo", timeout_s=5.0, host="127.0.0.1", publish_mode="sync")
        sender = WeightSender(cfg, publish=True)
        report = sender.broadcast(state(version).items(), version)
        assert report.published and sender.publish_errors == 0
        sender.close()


def state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"model.embed_tokens.weight": torch.randn(300, 64, generator=g),
            "model.norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
            "lm_head.weight": torch.randn(300, 64, generator=g)}


def test_a_late_joiner_gets_the_version_published_by_a_learner_that_died_since():
    ray = pytest.importorskip("ray")
    from asyncrl.weights.store import fetch_weights, start_weight_store
    from asyncrl.weights.wire import unpack_bucket

    here = os.path.dirname(os.path.abspath(__file__))  # the workers import Publisher from this module
    path = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, namespace="test-store-owner", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        store = start_weight_store("test-store-owner")
        learner = ray.remote(num_cpus=0)(Publisher).remote()
        ray.get(learner.publish.remote(3))
        ray.kill(learner, no_restart=True)  # learner rank 0 is gone; its rebuild has not published yet
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(learner.publish.remote(4), timeout=30)
        time.sleep(3)  # Ray frees a dead owner's objects once it has noticed the death
        version, buckets = fetch_weights("WeightStore", min_version=-1, timeout_s=30)
        got = {n: t for m, f in buckets for n, t in unpack_bucket(m, f)}
        assert version == 3 and set(got) == set(state(3))
        for n, t in state(3).items():
            assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
        store.shutdown()
    finally:
        ray.shutdown()
