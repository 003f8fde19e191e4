"""LoRA with adapter-only sync on the REAL stack: a DeepSpeed learner (in process, ZeRO-1, PEFT
LoRA), the real weight group and WeightStore, and a real vLLM CPU engine loading each version as a
new LoRA adapter.

Proves:
- after each adapter sync the engine's sampled-token logprobs equal the learner's (adapter
  applied) within the full-weight sync's tolerance (1e-4), and the adapter really moved the
  policy (the base model's logprobs differ);
- what travels is the adapter alone (bytes = the lora_A/lora_B matrices, not the model);
- at most `keep` versions stay loaded in vLLM, and unloaded versions' files are gone one load later;
- an engine that missed versions catches up from the WeightStore's copy of the adapter;
- a round whose adapter arrives corrupted (fingerprint) is refused and healed from the store;
- an update while requests run is taken in flight: each response's tokens carry the version of the
  adapter that sampled them (old, then new), and both parts match the learner at that version.
"""

from __future__ import annotations

import asyncio
import copy
import socket
import threading
import uuid

import pytest
import torch
from test_engine import LoopThread, hf_logprobs
from weight_faults import InjectedFaults

from asyncrl.bench.learner import build_tiny_qwen2, synthetic_groups
from asyncrl.config import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ray = pytest.importorskip("ray")
KEEP = 3
PROMPT = [1, 4, 13, 5, 17, 20, 2, 1, 30, 31, 32, 33]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from asyncrl.actors.engine import EngineSpec, PolicyEngine
    from asyncrl.learner.learner import LearnerWorker
    from asyncrl.weights.adapter import adapter_config
    from asyncrl.weights.sender import WeightSender
    from asyncrl.weights.store import start_weight_store

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("lora")
    path = str(build_tiny_qwen2(tmp / "policy"))
    cfg = load_config(None, [f"model.path={path}", "model.lora.enable=true", "model.lora.rank=8",
                             "model.lora.alpha=16", "learner.optim.lr=0.05", "learner.kl.enable=true",
                             f"trainer.run_dir={tmp}", "learner.weights.timeout_s=30", "learner.weights.host=127.0.0.1"])
    namespace = f"test-lora-{uuid.uuid4().hex[:8]}"
    ray.init(num_cpus=2, include_dashboard=False, namespace=namespace, log_to_driver=False)
    start_weight_store(namespace)
    worker = LearnerWorker(cfg, 0, 1, "127.0.0.1", _free_port())
    assert worker.sync_kind == "adapter"
    lt = LoopThread()

    async def make():
        return PolicyEngine(EngineSpec(path, cfg.rollout.model_copy(update={"cpu_kvcache_gb": 1, "max_num_seqs": 16}),
                            engine_id="lora-eng", max_model_len=256, weight_timeout_s=30,
                            lora_adapter=adapter_config(cfg.model.lora, path), lora_keep=KEEP))

    engine = lt.run(make())
    sender = WeightSender(cfg.learner.weights, publish=True, members=engine.weight_member_ids())
    state = {"batch": 0}

    def train_and_sync(join: bool = True) -> dict:
        """One learner step, then one broadcast of its adapter (the engine joins if `join`)."""
        worker.train_step(synthetic_groups(3, 4, worker.vocab_size, (3, 9), (4, 16), seed=state["batch"]))
        state["batch"] += 1
        if not join:  # a publisher-only sender: the version reaches the store, the engine misses it
            lone = WeightSender(cfg.learner.weights, publish=True)
            report = lone.broadcast(worker.export_sync_tensors(), worker.version).as_dict()
            lone.close()
            return {"report": report}
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(r=sender.broadcast(worker.export_sync_tensors(),
                                                                          worker.version).as_dict()))
        t.start()
        res = lt.run(engine.update_weights_from_group(sender.address, timeout_s=30))
        t.join(60)
        sender.flush()
        return {"report": box["r"], "engine": res}

    yield type("Stack", (), dict(worker=worker, engine=engine, lt=lt, path=path, sender=sender,
                                 sync=staticmethod(train_and_sync)))
    sender.close()
    engine.shutdown()
    lt.loop.call_soon_threadsafe(lt.loop.stop)
    ray.shutdown()


def _policy(worker):
    """The learner's PEFT model (adapter applied), in eval mode."""
    return worker.engine.module.eval()


def _sample(s, n: int, seed0: int, max_tokens: int = 24):
    async def go():
        return await asyncio.gather(*[s.engine.generate(PROMPT, max_tokens, 1.0, seed=seed0 + i) for i in range(n)])
    return s.lt.run(go())


def _max_diff(model, gens) -> float:
    return max(float((hf_logprobs(model, PROMPT, g.token_ids) - torch.tensor(g.logprobs)).abs().max()) for g in gens)


def test_adapter_sync_matches_learner_and_bounds_loaded_versions(stack):
    s = stack
    worker = s.worker
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in worker.engine.module.named_parameters()
                        if ".lora_" in n)
    model_bytes = sum(p.numel() * p.element_size() for p in worker.engine.module.parameters())
    for step in range(1, 5):
        out = s.sync()
        assert out["engine"]["status"] == "ok", out
        assert s.engine.version == worker.version == step
        assert out["report"]["bytes"] == adapter_bytes  # the adapter alone travels
        gens = _sample(s, 6, seed0=100 * step)
        assert all(set(g.versions) == {step} for g in gens)
        policy = _policy(worker)
        diff = _max_diff(policy, gens)
        with policy.disable_adapter():
            moved = _max_diff(policy, gens)
        print(f"\nv{step}: |logprob_vllm - logprob_learner| {diff:.2e}; vs the base model {moved:.2e}; "
              f"{adapter_bytes / 1e3:.1f} kB synced instead of {model_bytes / 1e6:.2f} MB")
        assert diff < 1e-4
        assert moved > 1e-3  # the adapter changed the policy, so the equality above means something
        worker.engine.module.train()
    loaded = s.lt.run(s.engine.llm.list_loras())
    assert sorted(loaded) == [2, 3, 4] and s.engine.adapters.loaded[0][0] == 2  # keep = 3 versions
    on_disk = sorted(p.name for p in s.engine.adapters.root.iterdir())
    # v1 was unloaded at the v4 load: its files stay until the next load deletes them
    assert on_disk == ["policy-v1", "policy-v2", "policy-v3", "policy-v4"]
    s.sync()
    on_disk = sorted(p.name for p in s.engine.adapters.root.iterdir())
    assert on_disk == ["policy-v2", "policy-v3", "policy-v4", "policy-v5"]  # v1 deleted, v2 unloaded


def test_missed_versions_are_caught_up_from_the_store(stack):
    s = stack
    before = s.engine.version
    s.sync(join=False)
    s.sync(join=False)  # two versions the engine never saw
    assert s.engine.version == before
    res = s.lt.run(s.engine.load_weights_from_store())
    assert res["status"] == "ok" and s.engine.version == s.worker.version == before + 2
    diff = _max_diff(_policy(s.worker), _sample(s, 4, seed0=7))
    s.worker.engine.module.train()
    print(f"\ncaught up from the store to v{s.engine.version}: logprob diff {diff:.2e}")
    assert diff < 1e-4


def test_in_flight_update_stamps_both_versions(stack):
    s = stack
    old_v = s.engine.version
    old_policy = copy.deepcopy(_policy(s.worker))
    s.worker.engine.module.train()

    async def go():
        started = asyncio.Event()

        def progress(n: int) -> None:
            if n >= 10:
                started.set()

        longs = [asyncio.ensure_future(s.engine.generate(PROMPT, 200, 1.0, seed=11 + i, ignore_eos=True,
                                                         on_tokens=progress)) for i in range(3)]
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.to_thread(s.sync, False)  # the learner's next version reaches the store
        res = await s.engine.load_weights_from_store()  # ... and the engine, while the requests run
        return res, await asyncio.gather(*longs)

    res, gens = s.lt.run(go())
    assert res["status"] == "ok" and s.engine.version == old_v + 1
    new_policy = _policy(s.worker)
    switches = []
    for g in gens:
        assert len(g.token_ids) == 200 and g.finish_reason == "length"
        k = g.versions.index(old_v + 1) if old_v + 1 in g.versions else len(g.versions)
        assert g.versions == [old_v] * k + [old_v + 1] * (200 - k)
        switches.append(k)
        ref_old = hf_logprobs(old_policy, PROMPT, g.token_ids)[:k]
        ref_new = hf_logprobs(new_policy, PROMPT, g.token_ids)[k:]
        got = torch.tensor(g.logprobs)
        assert torch.allclose(ref_old, got[:k], rtol=0, atol=1e-4)
        assert torch.allclose(ref_new, got[k:], rtol=0, atol=1e-4)
    s.worker.engine.module.train()
    print(f"\nin-flight adapter update: switched after {switches} of 200 tokens")
    assert any(0 < k < 200 for k in switches)


def test_corrupted_adapter_round_is_refused_then_healed_from_the_store(stack):
    # the wire fingerprint covers the adapter: one flipped element fails the round, the engine
    # keeps serving its current adapter, and the store's copy (published by the same broadcast)
    # brings it to the new version, as the rollout actor does after a failed round
    s = stack
    before = s.engine.version
    [rx] = [r for (addr, _), r in s.engine._adapter_receivers.items() if addr == s.sender.address]
    rx.hook = InjectedFaults("corrupt_wire")
    out = s.sync()
    assert out["engine"]["status"] == "failed" and out["engine"]["fingerprint_mismatch"] == 1
    assert s.engine.version == before
    res = s.lt.run(s.engine.load_weights_from_store())
    assert res["status"] == "ok" and s.engine.version == s.worker.version == before + 1
    diff = _max_diff(_policy(s.worker), _sample(s, 4, seed0=3))
    s.worker.engine.module.train()
    assert diff < 1e-4
