"""Weight broadcast between real processes over gloo (no vLLM here; see test_engine.py for that).

Proves: a bucketed broadcast (mixed dtypes, input as (name, tensor) pairs or as the learner's
buckets) reproduces every tensor bit-exactly in 2 receiver processes, round after round; a member
that never joins, one that stops taking part, and one that hangs inside a collective do not stall
the sender beyond the watchdog bound, are reported dropped, and the others keep receiving; a
dropped member that comes back rejoins and receives the next version; the WeightStore copy
(Ray object store) serves a late joiner the newest version exactly; a round broken on arrival
(a flipped element) or after a bucket (a streamed cut) is failed, through the receiver's seam.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from weight_faults import InjectedFaults

from asyncrl.weights.sender import WeightSender
from asyncrl.weights.store import fetch_weights, start_weight_store
from asyncrl.weights.wire import PREFIX, pack_buckets, unpack_bucket

pytestmark = pytest.mark.integration
TIMEOUT = 5.0  # generous: the shared 2-core machine can starve a process for seconds


def cfg(bucket_mb: float = 0.05, timeout_s: float = TIMEOUT) -> SimpleNamespace:
    return SimpleNamespace(bucket_mb=bucket_mb, backend="gloo", timeout_s=timeout_s, host="127.0.0.1")


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(100, 32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(32, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(64, 32, generator=g),
        "model.norm.weight": torch.randn(32, generator=g).half(),
        "lm_head.weight": torch.randn(100, 32, generator=g),
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def death_marker(address: str, member: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"asyncrl-test-{address.replace(':', '_')}-{member}.died")


def _saved(tensors: dict[str, torch.Tensor]) -> bytes:
    buf = io.BytesIO()  # by value: torch's fd sharing breaks once this process has exited
    torch.save(tensors, buf)
    return buf.getvalue()


def receiver_main(address: str, member: str, actions: list, q) -> None:
    """Scripted member: "recv" = take part in a round; ("sleep", s) = be busy for s seconds;
    "enter_and_hang" = join and enter the round, then never take part in the collective."""
    torch.set_num_threads(1)
    from asyncrl.weights.receiver import WeightReceiver

    rec = WeightReceiver(address, member, timeout_s=TIMEOUT)
    q.put(("up", member, None, None))
    for action in actions:
        if action == "recv":
            res = rec.receive(None, timeout_s=4 * TIMEOUT)
            tensors = {n: t.clone() for n, t in res.pop("tensors", None) or []}
            q.put((member, res["status"], res["version"], _saved(tensors)))
        elif action == "recv_corrupt":  # one element flipped on arrival: the fingerprint must catch it
            rec.hook = InjectedFaults("corrupt_wire")
            res = rec.receive(None, timeout_s=4 * TIMEOUT)
            q.put((member, res["status"], res.get("fingerprint_mismatch"), _saved({})))
        elif action == "recv_cut":  # streamed; the round breaks right after the loader took bucket 0
            rec.hook = InjectedFaults("fail_mid_stream")
            loaded: dict[str, torch.Tensor] = {}
            res = rec.receive(lambda it, out=loaded: out.update((n, t.clone()) for n, t in it),
                              timeout_s=4 * TIMEOUT, buffered=False)
            q.put((member, res["status"], res.get("touched"), _saved(loaded)))
        elif action == "die_mid_broadcast":  # streaming: take the first bucket, then the process dies
            def load(it):
                next(it)
                with open(death_marker(address, member), "w") as f:
                    f.write(repr(time.time()))
                os._exit(1)
            rec.receive(load, timeout_s=4 * TIMEOUT, buffered=False)
        elif action == "ready_then_die":  # in the plan, then gone before the communicator exists
            g = int(rec._wait_get("gen", time.monotonic() + 4 * TIMEOUT))
            rec._wait_get(f"g{g}/plan", time.monotonic() + 4 * TIMEOUT)
            rec.store.set(f"asyncrl_w/g{g}/ready/{member}", json.dumps({"nccl_cumem": None}))
            os._exit(1)
        elif action == "enter_and_hang":
            assert rec._join(time.monotonic() + 4 * TIMEOUT)
            rec.store.set(f"asyncrl_w/g{rec.generation}/r1/enter/{member}", "1")
            time.sleep(6 * TIMEOUT)
        else:
            time.sleep(action[1])


def start(sender: WeightSender, plans: dict[str, list]):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=receiver_main, args=(sender.address, m, a, q), daemon=True) for m, a in plans.items()]
    for p in procs:
        p.start()
    for _ in procs:  # process start-up (importing torch) is not what the watchdog bounds
        assert q.get(timeout=120)[0] == "up"
    return q, procs


def collect(q, n: int) -> dict[str, tuple]:
    out = {}
    for _ in range(n):
        member, status, version, payload = q.get(timeout=60)
        out.setdefault(member, []).append((status, version, torch.load(io.BytesIO(payload))))
    return out


def assert_exact(tensors: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(tensors) == set(ref)
    for name, t in ref.items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name


def test_pack_unpack_roundtrip_and_bucket_sizes():
    sd = state_dict(0)
    buckets = list(pack_buckets(sd.items(), bucket_bytes=4096))
    assert all(len({m["dtype"] for m in [b[0]]}) == 1 for b in buckets)
    assert len(buckets) > 4  # small buckets -> several per dtype
    got = {n: t for m, f in buckets for n, t in unpack_bucket(m, f)}
    assert_exact(got, sd)
    # the learner's format (lists of pairs) packs to the same bytes
    as_lists = list(pack_buckets([list(sd.items())[:3], list(sd.items())[3:]], bucket_bytes=4096))
    assert [m for m, _ in as_lists] == [m for m, _ in buckets] or len(as_lists) == len(buckets)
    assert_exact({n: t for m, f in as_lists for n, t in unpack_bucket(m, f)}, sd)


def test_broadcast_exact_to_two_receivers_over_rounds():
    sender = WeightSender(cfg(), members=["a", "b"])
    q, procs = start(sender, {"a": ["recv"] * 3, "b": ["recv"] * 3})
    for version in (1, 2, 3):
        sd = state_dict(version)
        weights = sd.items() if version != 2 else [list(sd.items())[:4], list(sd.items())[4:]]
        report = sender.broadcast(weights, version)
        assert report.acked == ["a", "b"] and not report.dropped, report
        got = collect(q, 2)
        for member in "ab":
            status, v, tensors = got[member][0]
            assert status == "ok" and v == version
            assert_exact(tensors, sd)
    assert report.rebuilds == 0 and sender.generation == 1  # one group, reused
    from asyncrl.weights.receiver import announced_version

    assert announced_version(sender.address) == 3
    for p in procs:
        p.join(10)
    sender.close()


def test_member_that_never_joins_is_dropped_within_timeout():
    sender = WeightSender(cfg(), members=["a", "ghost"])
    q, procs = start(sender, {"a": ["recv", "recv"]})
    t0 = time.monotonic()
    report = sender.broadcast(state_dict(1).items(), 1)
    elapsed = time.monotonic() - t0
    print(f"\nnever-joined member: broadcast returned after {elapsed:.2f}s (timeout {TIMEOUT}s): {report.as_dict()}")
    assert report.dropped == ["ghost"] and report.acked == ["a"]
    assert elapsed < 2 * TIMEOUT + 5  # process start (~s) + one watchdog period, not a hang
    assert sender.dropped_total == 1 and "ghost" not in sender.members
    assert collect(q, 1)["a"][0][:2] == ("ok", 1)
    report = sender.broadcast(state_dict(2).items(), 2)  # next round: no waiting on the ghost
    assert report.acked == ["a"] and report.members == ["a"] and report.dropped == []  # not planned, not dropped again
    assert collect(q, 1)["a"][0][:2] == ("ok", 2)
    for p in procs:
        p.join(10)
    sender.close()


def test_member_dying_before_the_communicator_exists_is_dropped_within_the_deadline():
    # 'dead' joins the plan (its ready key is there, so the group is built) and dies before
    # creating the communicator. Creation runs under the sender's deadline (`connect_group`):
    # 'dead' is dropped after about one timeout and 'a' receives the round in a new generation.
    # Gloo was bounded before too (its constructor gives up at the rendezvous store's timeout);
    # NCCL, which creates its communicator inside the first collective with no bound of its own,
    # is what the deadline is for: scripts/gpu_check.py S6 measures that case on a GPU.
    sender = WeightSender(cfg(), members=["a", "dead"])
    q, procs = start(sender, {"a": ["recv"], "dead": ["ready_then_die"]})
    t0 = time.monotonic()
    report = sender.broadcast(state_dict(1).items(), 1)
    elapsed = time.monotonic() - t0
    print(f"\nmember dead before connecting: broadcast returned after {elapsed:.2f}s: {report.as_dict()}")
    assert report.dropped == ["dead"] and report.acked == ["a"]
    assert elapsed < 2 * TIMEOUT + 5, elapsed  # one deadline + the heartbeat grace, not the 50 s backstop
    status, version, tensors = collect(q, 1)["a"][0]
    assert (status, version) == ("ok", 1)
    assert_exact(tensors, state_dict(1))
    for p in procs:
        p.join(10)
    sender.close()


def test_nccl_cumem_disagreement_stops_the_group_loudly(monkeypatch):
    # NCCL cannot connect a learner and an engine that disagree on NCCL_CUMEM_ENABLE: every
    # round would fail and fall back to the store. Each member sends its value with its ready
    # key; the sender refuses to build the group and raises naming the member, and so does the
    # member. (The plan says "nccl"; the check runs before any NCCL call, so it runs on a CPU.)
    from asyncrl.weights.group import NcclEnvMismatch
    from asyncrl.weights.receiver import WeightReceiver

    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    sender = WeightSender(cfg(), members=["eng/tp0"])
    sender.backend = "nccl"  # what a GPU learner plans; its value was read at construction
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")  # the engine's process, say, overrides it
    box: dict = {}

    def member() -> None:
        try:
            WeightReceiver(sender.address, "eng/tp0", timeout_s=TIMEOUT).receive(None, timeout_s=2 * TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            box["error"] = exc

    t = threading.Thread(target=member, daemon=True)
    t.start()
    with pytest.raises(NcclEnvMismatch, match="NCCL_CUMEM_ENABLE=0 on learner rank 0 but eng/tp0=1"):
        sender.broadcast(state_dict(1).items(), 1)
    t.join(3 * TIMEOUT)
    assert isinstance(box.get("error"), NcclEnvMismatch), box
    assert "eng/tp0=1" in str(box["error"])
    sender.close()


def test_busy_member_is_dropped_then_rejoins():
    # b takes part in round 1, is busy during round 2 (dropped), then calls receive again:
    # it is no longer a member, asks to rejoin, and receives round 3 with everyone else.
    sender = WeightSender(cfg(), members=["a", "b"])
    q, procs = start(sender, {"a": ["recv"] * 3, "b": ["recv", ("sleep", TIMEOUT + 1.5), "recv", "recv"]})
    assert sender.broadcast(state_dict(1).items(), 1).acked == ["a", "b"]
    collect(q, 2)
    t0 = time.monotonic()
    report = sender.broadcast(state_dict(2).items(), 2)
    print(f"\nbusy member: round took {time.monotonic() - t0:.2f}s: {report.as_dict()}")
    assert report.dropped == ["b"] and report.acked == ["a"]
    assert time.monotonic() - t0 < 2 * TIMEOUT + 2
    assert collect(q, 1)["a"][0][:2] == ("ok", 2)
    got = collect(q, 1)  # b wakes up: not a member any more -> catch up from the store, ask to rejoin
    assert got["b"][0][0] == "not_member"
    time.sleep(0.2)
    report = sender.broadcast(state_dict(3).items(), 3)
    assert sorted(report.acked) == ["a", "b"], report
    got = collect(q, 2)
    for member in "ab":
        assert got[member][0][:2] == ("ok", 3)
        assert_exact(got[member][0][2], state_dict(3))
    for p in procs:
        p.join(10)
    sender.close()


def test_member_hung_inside_collective_is_dropped():
    # 'hang' joins and enters the round but never takes part in the collective; the 64 MiB
    # bucket cannot be absorbed by socket buffers, so the sender's collective hits the watchdog.
    sender = WeightSender(cfg(bucket_mb=64), members=["a", "hang"])
    q, procs = start(sender, {"a": ["recv", "recv"], "hang": ["enter_and_hang"]})
    big = {"w": torch.randn(16 * 2**20)}
    t0 = time.monotonic()
    report = sender.broadcast(big.items(), 1)
    elapsed = time.monotonic() - t0
    print(f"\nhung member: broadcast returned after {elapsed:.2f}s: {report.as_dict()}")
    assert report.dropped == ["hang"] and report.acked == [] and elapsed < 3 * TIMEOUT + 5
    assert collect(q, 1)["a"][0][0] == "failed"  # a failed round leaves a's weights untouched
    report = sender.broadcast(state_dict(2).items(), 2)  # the group is rebuilt without 'hang'
    assert report.acked == ["a"] and report.rebuilds == 1 and "hang" not in report.members
    res = collect(q, 1)["a"][0]
    assert res[:2] == ("ok", 2)
    assert_exact(res[2], state_dict(2))
    for p in procs:
        p.kill() if p.is_alive() and p.name else None
    sender.close()


def test_member_killed_mid_broadcast_is_dropped_and_rejoins_from_the_store():
    # "training": one broadcast per step, v1..v6. b's process dies while v2 streams in (after its
    # first bucket). The sender must drop b within the deadline, a must keep receiving every
    # version, the sender process must survive, and a restarted b (same member id, as a Ray
    # restart) is told it is not a member (-> the store copy), asks to rejoin and is back in the
    # group for the next step with exact weights. The store here is a dict (publish_fn): the real
    # WeightStore (Ray) is covered by test_weight_store_serves_late_joiner and test_engine.py.
    store: dict[int, list] = {}
    sender = WeightSender(cfg(bucket_mb=4), members=["a", "b"], publish=True)
    sender.publish_fn = lambda buckets, version, name: store.__setitem__(version, buckets)
    q, procs = start(sender, {"a": ["recv"] * 6, "b": ["recv", "die_mid_broadcast"]})
    big = {f"w{i}": torch.randn(2**20, generator=torch.Generator().manual_seed(i)) for i in range(8)}  # 8 x 4 MiB
    times, reports = [], []
    for version in range(1, 7):
        sd = {n: t + version for n, t in big.items()}
        t0 = time.monotonic()
        reports.append(sender.broadcast(sd.items(), version))
        times.append(time.monotonic() - t0)
        got = collect(q, 2 if version == 1 else 1)
        status = got["a"][0][0]
        # v2: a's copy may be lost with the failed round (it is in the store then); never hung
        assert status == "ok" or (version == 2 and status == "failed"), got["a"][0][:2]
        if status == "ok":
            assert got["a"][0][1] == version
            assert_exact(got["a"][0][2], sd)
        if version == 2:
            died_at = float(open(death_marker(sender.address, "b")).read())
            dropped_at = [t for t, m, _ in sender.drop_log if m == "b"][0]
            assert reports[-1].dropped == ["b"], reports[-1]
            print(f"\nkilled member: dropped {dropped_at - died_at:.2f}s after its death "
                  f"(deadline {TIMEOUT}s); round report {reports[-1].as_dict()}")
            assert dropped_at - died_at < TIMEOUT + 3
            q2, procs2 = start(sender, {"b": ["recv"] * 5})  # the restarted b
            assert q2.get(timeout=60)[1] == "not_member"  # -> catches up from the store, asks to rejoin
        if version >= 3:
            res = q2.get(timeout=60)
            assert res[1:3] == ("ok", version), res[:3]
            assert_exact(torch.load(io.BytesIO(res[3])), sd)
    sender.flush()
    assert max(store) == 6 and sorted(store) == list(range(1, 7))  # every version reached the store, in order
    assert all(sorted(r.acked) == ["a", "b"] for r in reports[2:]), [r.as_dict() for r in reports[2:]]
    print("step (broadcast) seconds around the death: " + ", ".join(f"v{i + 1} {t:.2f}" for i, t in enumerate(times)))
    for p in procs + procs2:
        p.kill() if p.is_alive() else None
    sender.close()


def test_corrupted_round_is_caught_by_the_fingerprint():
    sender = WeightSender(cfg(), members=["a"])
    q, procs = start(sender, {"a": ["recv_corrupt", "recv"]})
    report = sender.broadcast(state_dict(1).items(), 1)
    member, status, mismatches, _ = q.get(timeout=60)
    assert status == "failed" and mismatches == 1  # exactly the one flipped element's tensor
    assert report.acked == [] and report.dropped == ["a"]  # nacked: re-fed from the store, rejoins
    # the nack ended the wait for its ack: the ack key is there, and says no (a timeout finds none)
    ack = f"{PREFIX}/g{sender.generation}/r{sender.seq}/ack/a"
    assert sender.store.check([ack]) and sender.store.get(ack) == b"0"
    report = sender.broadcast(state_dict(2).items(), 2)
    assert collect(q, 1)["a"][0][0] == "not_member"
    for p in procs:
        p.join(10)
    sender.close()


def test_streamed_round_cut_after_a_bucket_fails_touched_with_that_bucket_loaded():
    # the receiver's seam breaks a streamed round where a dying link would: the loader has bucket
    # 0 (the model is touched), nothing after it, and the round is failed and nacked
    sender = WeightSender(cfg(bucket_mb=0.01), members=["a"])
    q, procs = start(sender, {"a": ["recv_cut"]})
    sd = state_dict(1)
    buckets = list(pack_buckets(sd.items(), bucket_bytes=int(0.01 * 2**20)))  # the sender's packing
    assert len(buckets) > 2
    report = sender.broadcast(sd.items(), 1)
    (status, touched, loaded), = collect(q, 1)["a"]
    assert status == "failed" and touched is True
    assert_exact(loaded, {n: sd[n] for n, _ in unpack_bucket(*buckets[0])})
    assert report.acked == [] and report.dropped == ["a"]
    for p in procs:
        p.join(10)
    sender.close()


def test_scaling_adds_and_removes_members():
    # a is in the group from the start; b is added by scaling (add_receivers) before round 2;
    # then a is removed (scale down): round 3 goes to b only, and a's pending receive ends.
    sender = WeightSender(cfg(), members=["a"])
    q, procs = start(sender, {"a": ["recv", "recv", "recv"], "b": ["recv", "recv", "recv"]})
    assert sender.broadcast(state_dict(1).items(), 1).acked == ["a"]
    got = collect(q, 2)  # b is not a member yet: told so at once (it would catch up from the store)
    assert got["a"][0][:2] == ("ok", 1) and got["b"][0][0] == "not_member"
    sender.add_receivers(["b"])
    report = sender.broadcast(state_dict(2).items(), 2)
    assert sorted(report.acked) == ["a", "b"] and report.rebuilds == 1
    got = collect(q, 2)
    assert got["a"][0][:2] == ("ok", 2) and got["b"][0][:2] == ("ok", 2)
    sender.remove_receivers(["a"])
    report = sender.broadcast(state_dict(3).items(), 3)
    assert report.acked == ["b"] and report.members == ["b"] and not report.dropped
    got = collect(q, 2)
    assert got["b"][0][:2] == ("ok", 3) and got["a"][0][0] == "not_member"
    for p in procs:
        p.join(10)
    sender.close()


@pytest.mark.slow  # ~20 s of Ray start-up; test_engine.py covers publish + fetch in the default suite
def test_weight_store_serves_late_joiner():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, namespace="test-weights-store", log_to_driver=False)
    try:
        assert fetch_weights(min_version=-1) is None  # no store yet: nothing published
        store = start_weight_store("test-weights-store")
        sender = WeightSender(cfg(), publish=True)  # no members: publish only
        assert fetch_weights(min_version=-1) is None
        for version in (1, 2):
            report = sender.broadcast(state_dict(version).items(), version)
            assert report.published and report.members == []
        sender.flush()  # publishing runs in a background thread: wait until version 2 is in the store
        version, buckets = fetch_weights(min_version=0)
        assert version == 2
        assert_exact({n: t for m, f in buckets for n, t in unpack_bucket(m, f)}, state_dict(2))
        assert fetch_weights(min_version=2) is None  # nothing newer
        sender.close()
        store.shutdown()
        assert fetch_weights(min_version=-1) is None  # shut down with its job
    finally:
        ray.shutdown()


def test_a_group_being_built_never_holds_the_members_own_store_client():
    # A TCPStore client runs one request at a time and keeps the connection for the whole of a
    # blocking wait; gloo's constructor waits there for every peer's key, up to the group's
    # backstop (here 4*1+30 = 34 s). Built on the member's own client, a peer that never comes
    # stalled that member's heartbeats and the sender's bookkeeping for the whole backstop (CI, on
    # the test above: 'a' dropped after 56 s). Each group gets its own client (`group_store`):
    # with the peer absent, the deadline fires at 1 s and the shared client answers at once.
    from asyncrl.weights.group import CollectiveTimeout, connect_group, group_store, make_group, make_store

    master = make_store("127.0.0.1", 0, is_master=True, timeout_s=5.0)
    member = make_store("127.0.0.1", master.port, is_master=False, timeout_s=5.0)
    # rank 1 of 2 never comes: the deadline ends the wait (gloo's own give-up at the 34 s backstop
    # would surface as its constructor's error, not as this one)
    with pytest.raises(CollectiveTimeout, match="passed its deadline"):
        connect_group(lambda: make_group(group_store("127.0.0.1", master.port, 1.0), 1, 0, 2, "gloo", 1.0),
                      None, time.monotonic() + 1.0, backstop_s=34.0, tick=lambda: member.add("alive", 1))
    ticks = member.add("alive", 0)  # the constructor is still waiting for rank 1 in its thread
    assert ticks >= 2  # the heartbeat ran while the group was being built (every 0.2 s)
