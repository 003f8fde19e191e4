"""PolicyEngine on a REAL vLLM CPU engine (tiny untied Qwen2, fp32), one engine for the module.

Proves: behaviour logprobs from vLLM equal transformers' recompute for the same weights and
tokens; distinct seeds give distinct samples (and one seed reproduces); a bucketed broadcast of
perturbed weights (every parameter, incl. the fused qkv / gate_up sources and the untied head)
through the weight group makes vLLM's logprobs equal the perturbed model's and bumps the
engine's version; a late joiner catches up from the WeightStore (Ray object store) copy.
Every test runs on both weight paths (`rollout.weight_transfer`): the worker extension, and vLLM's
native weight-transfer API with asyncrl's engine registered in vLLM's factory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import LoopThread, wordlevel_chatml_tokenizer

pytestmark = pytest.mark.integration

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = [1, 4, 3, 10, 16, 14, 18, 2, 3, 1, 5, 3]  # <|im_start|> user \n 3 + 5 <|im_end|> \n <|im_start|> assistant \n
QUICKSTART = Path(__file__).resolve().parents[2] / "assets" / "tiny-policy"
# the production extension plus the tests' fault and read-back calls (fault_extension.py beside
# this file; vLLM imports it by name in its engine-core process)
FAULT_EXTENSION = "fault_extension.FaultInjectingExtension"


def build_tiny_qwen(path: Path, *, tie: bool = False, seed: int = 0) -> Path:
    """A 2-layer Qwen2 (hidden 64) with a small ChatML WordLevel tokenizer, saved for HF + vLLM."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    words = ["user", "assistant", "system", "\n", "+", "=", "?", "the", "answer", "is"] + [str(i) for i in range(40)]
    fast = wordlevel_chatml_tokenizer(words)
    vocab = fast.get_vocab()
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=tie, eos_token_id=vocab["<|im_end|>"], pad_token_id=0,
                      bos_token_id=None, torch_dtype="float32")
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # make the distribution peaky enough to be interesting, not degenerate
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(path, safe_serialization=True)
    json.dump({"eos_token_id": vocab["<|im_end|>"]}, open(path / "generation_config.json", "w"))
    return path


def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def perturbed(model, scale: float, seed: int):
    import copy

    g = torch.Generator().manual_seed(seed)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return new


@pytest.fixture(scope="module", params=["extension", "native"])
def setup(tmp_path_factory, request):
    from transformers import AutoModelForCausalLM

    from asyncrl.actors.engine import EngineSpec, PolicyEngine
    from asyncrl.config import RolloutConfig

    torch.set_num_threads(1)
    if (QUICKSTART / "model.safetensors").exists():  # the quick-start policy (untied Qwen2)
        from transformers import AutoTokenizer

        path = QUICKSTART
        ids = AutoTokenizer.from_pretrained(path).apply_chat_template(
            [{"role": "user", "content": "What is 3 + 5?"}], add_generation_prompt=True, tokenize=True)
        prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    else:
        path, prompt = build_tiny_qwen(tmp_path_factory.mktemp("tiny") / "policy"), PROMPT
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    cfg = RolloutConfig(cpu_kvcache_gb=0.25, max_num_seqs=16, max_num_batched_tokens=1024,
                        weight_transfer=request.param)
    lt = LoopThread()

    async def make():
        return PolicyEngine(EngineSpec(str(path), cfg, engine_id="eng0", max_model_len=256, weight_timeout_s=30,
                            worker_extension=FAULT_EXTENSION))

    engine = lt.run(make())
    print(f"\nengine on {path} (prompt of {len(prompt)} tokens, weight path {request.param})")
    yield SimpleNamespace(engine=engine, hf=hf, lt=lt, path=path, prompt=prompt, store_name=None)
    engine.shutdown()
    lt.loop.call_soon_threadsafe(lt.loop.stop)




def sample_many(s, n: int, seed0: int, temperature: float = 1.0, max_tokens: int = 24):
    async def go():
        return await asyncio.gather(*[s.engine.generate(s.prompt, max_tokens, temperature, seed=seed0 + i)
                                      for i in range(n)])
    return s.lt.run(go())


def max_logprob_diff(s, model, gens, temperature: float = 1.0) -> float:
    worst = 0.0
    for g in gens:
        ref = hf_logprobs(model, s.prompt, g.token_ids, temperature)
        worst = max(worst, float((ref - torch.tensor(g.logprobs)).abs().max()))
    return worst


def test_behaviour_logprobs_match_transformers_and_seeds_differ(setup):
    s = setup
    gens = sample_many(s, 8, seed0=100)
    assert all(len(g.token_ids) == len(g.logprobs) == len(g.versions) > 0 for g in gens)
    assert all(g.finish_reason in ("stop", "length") for g in gens)
    diff = max_logprob_diff(s, s.hf, gens)
    print(f"\nmax |logprob_vllm - logprob_hf| original weights: {diff:.2e}")
    assert diff < 1e-4
    distinct = {tuple(g.token_ids) for g in gens}
    print(f"{len(distinct)} distinct samples of 8")
    assert len(distinct) >= 6, distinct  # 8 seeds -> (almost) all different samples
    again = sample_many(s, 1, seed0=100)[0]
    assert again.token_ids == gens[0].token_ids  # a seed reproduces its sample
    ids, lps, reason = gens[0]  # the agreed 3-tuple contract
    assert ids == gens[0].token_ids and reason == gens[0].finish_reason
    # temperature != 1: logprobs of the sampled distribution = log_softmax(logits / T)
    hot = sample_many(s, 4, seed0=7, temperature=0.7)
    diff_t = max_logprob_diff(s, s.hf, hot, temperature=0.7)
    print(f"max diff at T=0.7: {diff_t:.2e}")
    assert diff_t < 1e-4


def test_broadcast_perturbed_weights_into_engine(setup):
    from asyncrl.weights.sender import WeightSender

    s = setup
    new = perturbed(s.hf, 0.05, seed=1)
    cfg = SimpleNamespace(bucket_mb=0.05, backend="gloo", timeout_s=30.0, host="127.0.0.1")
    sender = WeightSender(cfg, members=s.engine.weight_member_ids())
    box = {}
    t = threading.Thread(target=lambda: box.update(r=sender.broadcast(new.named_parameters(), 1)))
    t.start()
    res = s.lt.run(s.engine.update_weights_from_group(sender.address, timeout_s=30))
    t.join(60)
    report = box["r"]
    print(f"\nbroadcast report: {report.as_dict()}  engine: {res['status']} {res['seconds']:.3f}s")
    assert res["status"] == "ok" and s.engine.version == 1
    assert report.acked == s.engine.weight_member_ids() and report.buckets > 1
    gens = sample_many(s, 6, seed0=300)
    assert all(g.versions == [1] * len(g.token_ids) for g in gens)
    diff = max_logprob_diff(s, new, gens)
    old = max_logprob_diff(s, s.hf, gens)
    print(f"max diff vs perturbed: {diff:.2e} (vs original weights: {old:.2e})")
    assert diff < 1e-4 < old
    if s.engine.weight_transfer == "native":  # vLLM's own version follows the verified round
        assert s.lt.run(s.engine.llm.get_weight_version()) == "1"
    sender.close()


def test_failed_buffered_round_leaves_the_model_exactly_as_it_was(setup):
    # A round whose wire check fails (one element flipped where the fingerprint looks) is refused
    # before the model sees it. On the native path vLLM's layer-wise reload was already started
    # (every layer on the meta device): finishing it must put back the very same weights.
    s = setup
    before_v = s.engine.version
    before = s.lt.run(s.engine.llm.collective_rpc("asyncrl_param_sums"))[0]
    s.lt.run(s.engine.llm.collective_rpc("asyncrl_inject_fault", args=("corrupt_wire",)))
    res = _group_update(s, perturbed(s.hf, 0.05, seed=3), before_v + 1)
    print(f"\ncorrupted round: {res['status']} touched={res.get('touched')} error={res.get('error')}")
    assert res["status"] == "failed" and not res["touched"] and "recovered" not in res
    assert s.engine.version == before_v and not s.engine.unsafe
    assert s.lt.run(s.engine.llm.collective_rpc("asyncrl_param_sums"))[0] == before  # bit-identical, every parameter
    assert _group_update(s, perturbed(s.hf, 0.05, seed=4), before_v + 1)["status"] == "ok"  # and goes on
    assert s.engine.version == before_v + 1


def test_late_joiner_catches_up_from_weight_store(setup, ray_cluster):
    s = setup
    with ray_session(s, "late-joiner"):
        newer = perturbed(s.hf, 0.05, seed=2)
        _publish(s, newer, 5)  # no members: the learner publishes, nobody listens yet
        res = s.lt.run(s.engine.load_weights_from_store())
        assert res["status"] == "ok" and s.engine.version == 5
        assert s.lt.run(s.engine.load_weights_from_store())["status"] == "up_to_date"
        gens = sample_many(s, 4, seed0=500)
        diff = max_logprob_diff(s, newer, gens)
        print(f"\nlate joiner: max diff vs store weights: {diff:.2e}")
        assert diff < 1e-4 and all(set(g.versions) == {5} for g in gens)


def test_in_flight_update_stamps_both_versions(setup):
    # A long request keeps running across an update (paused, kept, resumed): its early tokens
    # carry the old version, its later ones the new, never interleaved.
    from asyncrl.weights.sender import WeightSender

    s = setup
    old_v = s.engine.version
    new = perturbed(s.hf, 0.05, seed=9)
    sender = WeightSender(SimpleNamespace(bucket_mb=1.0, backend="gloo", timeout_s=30.0, host="127.0.0.1"),
                          members=s.engine.weight_member_ids())

    async def go():
        started = asyncio.Event()

        def progress(n: int) -> None:
            if n >= 20:
                started.set()

        longs = [asyncio.ensure_future(s.engine.generate(s.prompt, 200, 1.0, seed=11 + i, ignore_eos=True,
                                                         on_tokens=progress)) for i in range(4)]
        await asyncio.wait_for(started.wait(), 60)  # update once >= 20 tokens exist
        t = threading.Thread(target=sender.broadcast, args=(new.named_parameters(), old_v + 1))
        t.start()
        res = await s.engine.update_weights_from_group(sender.address)
        t.join(60)
        return res, await asyncio.gather(*longs)

    res, gens = s.lt.run(go())
    assert res["status"] == "ok" and s.engine.version == old_v + 1
    switches = []
    for g in gens:
        assert len(g.token_ids) == 200 and g.finish_reason == "length"
        switch = g.versions.index(old_v + 1) if old_v + 1 in g.versions else len(g.versions)
        assert g.versions == [old_v] * switch + [old_v + 1] * (len(g.versions) - switch)
        switches.append(switch)
    print(f"\nin-flight update: switched after {switches} of 200 tokens ({res['seconds']:.3f}s paused)")
    assert any(0 < sw < 200 for sw in switches)
    sender.close()


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray for the module's weight-store tests; each test gets its own, empty store
    (`ray_session`). A Ray start and stop per test cost ~8 s each on the 2-core machine, ten times."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, namespace="test-engine", log_to_driver=False)
    yield
    ray.shutdown()


@contextlib.contextmanager
def ray_session(s, store: str):
    """A fresh, empty weight store named `store` (the topology starts one in a real job) that the
    engine and `_publish` use for the block; removed afterwards. Needs the `ray_cluster` fixture."""
    import ray

    from asyncrl.weights.store import start_weight_store

    assert ray.is_initialized(), "a test using ray_session must request the ray_cluster fixture"
    handle = start_weight_store("test-engine", name=f"weights-{store}")
    saved = s.engine.store_name
    s.engine.store_name = s.store_name = f"weights-{store}"
    try:
        yield
    finally:
        s.engine.store_name = saved
        s.store_name = None
        handle.shutdown()


def _publish(s, model, version: int) -> None:
    from asyncrl.weights.sender import WeightSender

    publisher = WeightSender(SimpleNamespace(bucket_mb=0.06, backend="gloo", timeout_s=30.0, host="127.0.0.1"),
                             publish=True, store_name=s.store_name)
    assert publisher.broadcast(model.named_parameters(), version).published
    publisher.close()  # waits for the background publish


def _group_update(s, model, version: int, timeout_s: float = 5.0, bucket_mb: float = 0.05) -> dict:
    """One broadcast of `model` as `version` to the engine (sender in a thread, as the learner)."""
    from asyncrl.weights.sender import WeightSender

    sender = WeightSender(SimpleNamespace(bucket_mb=bucket_mb, backend="gloo", timeout_s=timeout_s, host="127.0.0.1"),
                          members=s.engine.weight_member_ids())
    t = threading.Thread(target=sender.broadcast, args=(model.named_parameters(), version))
    t.start()
    try:
        return s.lt.run(s.engine.update_weights_from_group(sender.address, timeout_s=timeout_s))
    finally:
        t.join(120)
        sender.close()


@contextlib.contextmanager
def _streamed(s, session: str):
    """Streaming mode (the GPU default) forced on the CPU engine for one test, inside a Ray session;
    the engine goes back to buffered rounds afterwards, also on failure."""
    s.engine.weight_buffered = False
    try:
        with ray_session(s, session):
            yield
    finally:
        s.engine.weight_buffered = True


def _events_since_last_pause(engine) -> list[str]:
    names = [w for _, w in engine.load_events]
    return names[len(names) - 1 - names[::-1].index("pause"):]


def test_streamed_round_failing_half_way_never_generates_on_a_half_loaded_model(setup, ray_cluster):
    # Streaming mode (the GPU default) forced on the CPU engine: the round breaks after its
    # first bucket, when vLLM's layer-wise reload has seen part of the model. The engine must
    # reload the newest full version from the WeightStore inside the same pause, produce no
    # token in between, resume on exactly the store's weights and report the version it holds.
    s = setup
    with _streamed(s, "safe-load"):
        stored = perturbed(s.hf, 0.05, seed=21)
        _publish(s, stored, 20)
        s.lt.run(s.engine.llm.collective_rpc("asyncrl_inject_fault", args=("fail_mid_stream",)))
        token_times: list[float] = []

        async def go():
            import time as _t

            longs = [asyncio.ensure_future(s.engine.generate(s.prompt, 120, 1.0, seed=40 + i, ignore_eos=True,
                                                             on_tokens=lambda n: token_times.append(_t.monotonic())))
                     for i in range(3)]
            await asyncio.sleep(0.5)
            return longs

        longs = s.lt.run(go())
        res = _group_update(s, perturbed(s.hf, 0.05, seed=22), 21)

        async def finish():
            return await asyncio.gather(*longs)

        s.lt.run(finish())
        events = _events_since_last_pause(s.engine)
        print(f"\nfailed streamed round: {res['status']} touched={res.get('touched')} recovered="
              f"{res.get('recovered', {}).get('status')} events={events}")
        assert res["status"] == "failed" and res["touched"] and res["recovered"]["status"] == "ok"
        assert events == ["pause", "load_failed", "store_reload_ok", "resume"]
        times = dict((w, t) for t, w in s.engine.load_events[-4:])
        assert not [t for t in token_times if times["load_failed"] <= t <= times["resume"]]  # nothing generated
        assert s.engine.version == 20
        gens = sample_many(s, 4, seed0=700)
        diff = max_logprob_diff(s, stored, gens)
        print(f"after recovery: max diff vs the store's weights {diff:.2e}")
        assert diff < 1e-4 and all(set(g.versions) == {20} for g in gens)


def _bytes_through(model, last: str) -> int:
    """Bytes of the model's parameters in export order up to and including those named `last*`
    (one dtype: a bucket of exactly this size ends right after them)."""
    total, seen = 0, False
    for name, p in model.named_parameters():
        if seen and not name.startswith(last):
            return total
        seen = seen or name.startswith(last)
        total += p.numel() * p.element_size()
    raise AssertionError(f"no parameter named {last}*")


def test_round_failing_inside_a_fused_projection_leaves_every_parameter_as_the_store_version(setup, ray_cluster):
    # Streamed (the GPU default), the round breaks right after a bucket that ends inside layer 0's
    # fused qkv_proj: q_proj arrived, k_proj and v_proj did not. The engine reloads the store's
    # version inside the same pause; afterwards EVERY parameter of the vLLM model (the fused ones
    # too, which the read-back check cannot see) must be bit-identical to a clean load of it.
    # Before the extension path always finalised vLLM's layer-wise reload, the half-loaded
    # qkv_proj kept its buffered q_proj into the store reload, counted it twice, was processed
    # before k and v arrived (their rows never written) and dropped them as "excessive loading".
    s = setup
    with _streamed(s, "fused"):
        stored = perturbed(s.hf, 0.05, seed=41)
        _publish(s, stored, 40)
        assert s.lt.run(s.engine.load_weights_from_store(min_version=-1))["status"] == "ok"
        reference = s.lt.run(s.engine.llm.collective_rpc("asyncrl_param_digests"))[0]
        cut = _bytes_through(s.hf, "model.layers.0.self_attn.q_proj.")
        s.lt.run(s.engine.llm.collective_rpc("asyncrl_inject_fault", args=("fail_mid_stream",)))
        res = _group_update(s, perturbed(s.hf, 0.05, seed=42), 41, bucket_mb=cut / 2**20)
        print(f"\nround failed inside qkv_proj: {res['status']} touched={res.get('touched')} "
              f"recovered={res.get('recovered', {}).get('status')}")
        assert res["status"] == "failed" and res["touched"] and res["recovered"]["status"] == "ok"
        assert s.engine.version == 40 and not s.engine.unsafe
        after = s.lt.run(s.engine.llm.collective_rpc("asyncrl_param_digests"))[0]
        assert set(after) == set(reference)
        differ = [n for n in reference if after[n] != reference[n]]
        assert not differ, f"parameters differing from the store's version after recovery: {differ}"
        assert max_logprob_diff(s, stored, sample_many(s, 2, seed0=1000)) < 1e-4


def test_paused_engine_keeps_catching_up_until_the_store_has_a_version(setup, ray_cluster):
    # A streamed round fails while the store holds nothing (a job's store always holds version 0
    # since the topology publishes it; here it is empty on purpose): the engine cannot resume on
    # half-loaded weights, so it stays paused. It must not wait for a broadcast that a starving
    # learner never makes: it retries the store itself, and resumes once a version is there.
    import time as _t

    s = setup
    with _streamed(s, "catch-up"):
        s.lt.run(s.engine.llm.collective_rpc("asyncrl_inject_fault", args=("fail_mid_stream",)))
        res = _group_update(s, perturbed(s.hf, 0.05, seed=51), 51)
        assert res["status"] == "paused_unsafe" and res["recovered"]["status"] == "no_store" and s.engine.unsafe
        stored = perturbed(s.hf, 0.05, seed=50)
        _publish(s, stored, 50)  # nobody calls the engine: its own retry has to find this
        t0 = _t.monotonic()
        while s.engine.unsafe and _t.monotonic() - t0 < 60:
            _t.sleep(0.5)
        print(f"\npaused engine resumed on its own after {_t.monotonic() - t0:.1f}s: "
              f"{[w for _, w in s.engine.load_events[-4:]]}")
        assert not s.engine.unsafe and s.engine.version == 50
        gens = sample_many(s, 2, seed0=1100)
        assert max_logprob_diff(s, stored, gens) < 1e-4 and all(set(g.versions) == {50} for g in gens)


def test_fingerprint_mismatch_is_healed_from_the_store_and_fails_loudly_if_it_persists(setup, ray_cluster):
    from asyncrl.actors.engine import WeightIntegrityError

    s = setup
    with ray_session(s, "fingerprint"):
        stored = perturbed(s.hf, 0.05, seed=31)
        _publish(s, stored, 30)
        clean = _group_update(s, perturbed(s.hf, 0.05, seed=32), 31)  # a clean round: checked, matches
        w = clean["workers"][0]
        print(f"\nclean round: read-back checked {w['readback_checked']} parameters in {w['readback_s'] * 1e3:.2f} ms")
        assert clean["status"] == "ok" and w["readback_checked"] > 0 and s.engine.version == 31
        before = s.engine.fingerprint_mismatches
        s.lt.run(s.engine.llm.collective_rpc("asyncrl_inject_fault", args=("readback", 1)))
        res = _group_update(s, perturbed(s.hf, 0.05, seed=33), 32)
        assert res["status"] == "fingerprint_mismatch" and res["fingerprint_mismatch"] == 1
        assert s.engine.fingerprint_mismatches == before + 1
        assert res["recovered"]["status"] == "ok" and s.engine.version == 30  # healed: the store's version
        diff = max_logprob_diff(s, stored, sample_many(s, 4, seed0=800))
        assert diff < 1e-4, diff
        # persistent: the store's copy mismatches too -> loud failure, never generation
        s.lt.run(s.engine.llm.collective_rpc("asyncrl_inject_fault", args=("readback", 2)))
        with pytest.raises(WeightIntegrityError):
            _group_update(s, perturbed(s.hf, 0.05, seed=34), 33)
        assert s.engine.unsafe and _events_since_last_pause(s.engine)[-1] == "store_reload_mismatch"
        res = s.lt.run(s.engine.load_weights_from_store())  # the fault is spent: a clean reload resumes
        assert res["status"] == "ok" and not s.engine.unsafe and s.engine.version == 30
        assert max_logprob_diff(s, stored, sample_many(s, 2, seed0=900)) < 1e-4


def test_native_engine_is_registered_and_checks_its_payloads():
    # Importing the worker-extension module (vLLM does it in every worker before it builds the
    # model) registers asyncrl's transfer engine; a payload with a wrong key is refused by name.
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from asyncrl.actors import worker_extension as ext
    from asyncrl.actors.engine import NATIVE_BACKEND

    assert NATIVE_BACKEND == ext.NATIVE_BACKEND in WeightTransferEngineFactory._registry
    assert WeightTransferEngineFactory._registry[ext.NATIVE_BACKEND]() is ext.AsyncrlTransferEngine
    ext._register_native_engine()  # idempotent: a second import in the same process is fine
    engine = object.__new__(ext.AsyncrlTransferEngine)  # parsing needs no model or device
    info = engine.parse_update_info({"address": "127.0.0.1:1", "prefix": "e", "timeout_s": 3.0, "buffered": False})
    assert (info.address, info.prefix, info.timeout_s, info.buffered, info.close) == ("127.0.0.1:1", "e", 3.0, False, False)
    with pytest.raises(ValueError, match="adress"):
        engine.parse_init_info({"adress": "127.0.0.1:1", "prefix": "e"})
