"""`python -m asyncrl.bench simulate`: large fleets on one machine, SIMULATED engines and learner.

What is real: Ray actors hosting the rollout side, the ZeroMQ replay buffer server with its
admission tickets and staleness bound, msgpack groups of realistic size on the wire, and the
weight-version protocol (the learner publishes versions; every engine pays the weight-sync latency
before it generates with a new version, and stamps its tokens with the version it used).
What is simulated (labelled so in every output): generation time and training time come from a
latency model — `gen_s = gen_overhead_s + tokens / gen_tokens_per_s` per turn-batch,
`train_s = tokens / (train_tokens_per_s * ranks * rank_efficiency)`, `sync_s = sync_overhead_s +
model_bytes / sync_bytes_per_s` — calibrated from an `e2e` JSON when one is given
(`--calibration FILE`), else from defaults measured on the quick start.

Scaling efficiency = measured trained groups/s ÷ what the latency model allows
(min(rollout capacity, learner capacity, the staleness bound's pipeline capacity
(η + 1)·B / (T + L) with T = train + sync, L = sync + generation)), per cell, so the knee where
the learner saturates and the cost of our own machinery (buffer, tickets, Ray) are both visible. Weak scaling: a cell with A actors
uses B = max(data.rollout_batch_size, A) groups per batch (with a fixed small B, admission would
idle all but B actors). Cells whose model step exceeds STEP_S run on a faster clock (`time_scale`);
rates are reported in the model's time.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.bench.common import print_table

STEP_S = 1.0  # longest simulated step (train or generate) in wall seconds; longer ones run time-scaled
DEFAULT_MODEL = {
    "tokens_per_sample": 256,      # policy + feedback tokens per trajectory
    "prompt_tokens": 64,
    "gen_overhead_s": 0.05,        # per group (engine step overheads)
    "gen_tokens_per_s": 4000.0,    # per engine, batched over the group's samples
    "train_tokens_per_s": 20000.0,  # per learner rank
    "rank_efficiency": 0.9,        # data-parallel efficiency per added rank
    "sync_overhead_s": 0.02,
    "sync_bytes_per_s": 2.0e9,
    "model_bytes": 2.0e7,
}


def _calibrate(path: str | None) -> dict[str, float]:
    model = dict(DEFAULT_MODEL)
    if path:
        data = json.loads(Path(path).read_text())
        model.update({k: float(v) for k, v in data.get("latency_model", {}).items() if k in model})
    return model


def _make_group(n: int, model: dict[str, float], version: int, prompt_uid: str):
    from asyncrl.protocol import Group, Sample

    t = int(model["tokens_per_sample"])
    p = int(model["prompt_tokens"])
    samples = [Sample(uid=f"{prompt_uid}/{i}", prompt_uid=prompt_uid, prompt_ids=np.zeros(p, np.int32),
                      response_ids=np.ones(t, np.int32), response_mask=np.ones(t, np.int8),
                      behaviour_logprobs=np.full(t, -1.0, np.float32), token_versions=np.full(t, version, np.int32),
                      reward=float(i % 2), reward_parts={"overall": float(i % 2)}, num_turns=1,
                      finish_reason="verifier_stop", verifier_version="sim")
               for i in range(n)]
    return Group.from_samples(samples, created_at=time.time(), actor_id="sim")


def _sim_host_class():
    import ray

    @ray.remote(num_cpus=0)
    class SimRolloutHost:
        """Hosts `k` simulated engines as coroutines (a Ray actor per engine would not fit 2 cores)."""

        def __init__(self, address: str, k: int, n: int, model: dict[str, float], scale: float, secret: str):
            self.address, self.k, self.n, self.model, self.scale = address, k, n, model, scale
            self.secret = secret
            self.version_seen = 0
            self.published = 0
            self.stop_flag = False
            self.counts = {"groups": 0, "idle_s": 0.0, "busy_s": 0.0}

        def ready(self) -> bool:
            return True

        def publish(self, version: int) -> None:
            self.published = version

        def stop(self) -> dict[str, float]:
            self.stop_flag = True
            return self.counts

        async def run(self) -> dict[str, float]:
            await asyncio.gather(*(self._engine(i) for i in range(self.k)))
            return self.counts

        async def _engine(self, index: int) -> None:
            from asyncrl.replay import BufferClient

            m = self.model
            client = BufferClient(self.address, secret=self.secret, actor_id=f"sim-{index}")
            version = 0
            loop = asyncio.get_running_loop()
            try:
                while not self.stop_flag:
                    t0 = time.time()
                    ticket = await loop.run_in_executor(None, lambda: client.acquire_ticket(timeout_s=0.5))
                    if ticket is None:
                        self.counts["idle_s"] += time.time() - t0
                        continue
                    if self.published > version:  # weight-version protocol: pay the sync before generating
                        await asyncio.sleep(self.scale * (m["sync_overhead_s"] + m["model_bytes"] / m["sync_bytes_per_s"]))
                        version = self.published
                    self.counts["idle_s"] += time.time() - t0
                    t1 = time.time()
                    tokens = self.n * m["tokens_per_sample"]
                    await asyncio.sleep(self.scale * (m["gen_overhead_s"] + tokens / m["gen_tokens_per_s"]))
                    group = _make_group(self.n, m, version, f"{index}-{self.counts['groups']}")
                    await loop.run_in_executor(None, lambda g=group, t=ticket: client.push(g, t))
                    self.counts["groups"] += 1
                    self.counts["busy_s"] += time.time() - t1
            finally:
                client.close()

    return SimRolloutHost


def _simulated_learner(learner: Any, sims: list[Any], batch: int, seconds: float, train_s: float,
                       sync_s: float) -> tuple[int, int, list[int], float, float]:
    """The learner for `seconds` (at least 3 steps): take a batch, sleep the modelled train and sync
    time, publish the next version to every host. (steps, groups trained, lag of each trained group,
    seconds waiting for batches, elapsed seconds), counted from the first batch (steady state)."""
    version, trained, lags, wait_s = 0, 0, [], 0.0
    t_start = time.time()
    t_first = None
    while time.time() - t_start < seconds or version < 3:
        if time.time() - t_start > seconds * 4 + 30:
            break
        t0 = time.time()
        try:
            groups = learner.get_batch(batch, version, timeout_s=max(1.0, seconds))
        except Exception:  # noqa: BLE001 - timeout at the end of the window
            break
        if t_first is None:
            t_first, trained, wait_s = time.time(), -len(groups), 0.0
        else:
            wait_s += time.time() - t0
        lags += [version - g.min_version for g in groups]
        time.sleep(train_s)
        version += 1
        time.sleep(sync_s)
        for s in sims:
            s.publish.remote(version)
        trained += len(groups)
    return version, trained, lags, wait_s, time.time() - (t_first or t_start)


def run_cell(actors: int, ranks: int, staleness: int, model: dict[str, float], *, batch: int, n: int,
             seconds: float, scale: float, hosts: int = 8) -> dict[str, Any]:
    import ray

    from asyncrl.config import BufferConfig
    from asyncrl.replay import BufferClient, ReplayBufferServer

    buffer_cfg = BufferConfig(max_staleness=staleness, capacity_groups=100000, ticket_lease_s=600.0)
    server = ReplayBufferServer(buffer_cfg, batch)
    address = server.start()
    host_cls = _sim_host_class()
    hosts = min(hosts, actors)
    per = [actors // hosts + (1 if i < actors % hosts else 0) for i in range(hosts)]
    sims = [host_cls.remote(address, k, n, model, scale, buffer_cfg.secret) for k in per]
    ray.get([s.ready.remote() for s in sims], timeout=120)  # processes up before the clock starts
    runs = [s.run.remote() for s in sims]
    learner = BufferClient(address, secret=buffer_cfg.secret, actor_id="sim-learner")
    train_tokens = batch * n * model["tokens_per_sample"]
    train_s = scale * train_tokens / (model["train_tokens_per_s"] * (1 + (ranks - 1) * model["rank_efficiency"]))
    sync_s = scale * (model["sync_overhead_s"] + model["model_bytes"] / model["sync_bytes_per_s"])
    try:
        version, trained, lags, wait_s, elapsed = _simulated_learner(learner, sims, batch, seconds, train_s, sync_s)
    finally:
        for s in sims:
            s.stop.remote()
        ray.get(runs, timeout=60)
        for s in sims:
            ray.kill(s)
        learner.close()
        stats = server.stats()
        server.stop()
    # What the latency model allows (groups/s): rollout capacity, learner capacity, and the
    # staleness bound's pipeline. Admission issues batch k's tickets when the learner asks for
    # batch k-1-η, so with T = train + sync and L = engine sync + generation per group,
    # t_get(k) = max(t_get(k-1) + T, t_get(k-1-η) + T + L): a step takes max(T, (T + L)/(η + 1)).
    gen_group_s = scale * (model["gen_overhead_s"] + n * model["tokens_per_sample"] / model["gen_tokens_per_s"])
    rollout_cap = actors / gen_group_s
    learner_cap = batch / (train_s + sync_s)
    admission_cap = (staleness + 1) * batch / (train_s + sync_s + gen_group_s + sync_s)
    caps = {"rollout": rollout_cap, "learner": learner_cap, "admission": admission_cap}
    allowed = min(caps.values())
    measured = trained / max(elapsed, 1e-9)
    hist = np.bincount(np.asarray(lags, dtype=np.int64), minlength=staleness + 1).tolist() if lags else []
    return {
        "simulated": True, "rollout_actors": actors, "learner_ranks": ranks, "max_staleness": staleness,
        # rates in model time (the cell ran `scale` times faster than the latency model's clock)
        "groups_per_s": measured * scale, "model_groups_per_s": allowed * scale, "scaling_efficiency": measured / allowed,
        "rollout_capacity_groups_per_s": rollout_cap * scale, "learner_capacity_groups_per_s": learner_cap * scale,
        "admission_capacity_groups_per_s": admission_cap * scale, "binding": min(caps, key=caps.get),
        "batch_groups": batch, "time_scale": scale,
        "learner_bound": learner_cap < rollout_cap, "learner_idle_ratio": wait_s / max(elapsed, 1e-9),
        "steps": version, "staleness_hist": hist, "buffer_dropped_stale": stats.get("buffer/dropped_stale", 0.0),
        "trained_tokens_per_s_sim": measured * scale * n * model["tokens_per_sample"],
    }


def add_args(parser: Any) -> None:
    parser.add_argument("--calibration", metavar="FILE",
                        help="an e2e JSON whose `latency_model` replaces the defaults measured on the quick start")


def run(cfg, args) -> dict[str, Any]:
    import os

    import ray

    model = _calibrate(args.calibration)
    smoke = args.smoke
    fleet = [1, 4] if smoke else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    ranks_list = [1] if smoke else [1, 8, 64]
    seconds = 2.0 if smoke else 10.0
    staleness = cfg.buffer.max_staleness
    batch = cfg.data.rollout_batch_size
    n = cfg.rollout.n
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=max(4, (os.cpu_count() or 2) * 2), include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False)
    cells = []
    try:
        for ranks in ranks_list:
            for actors in fleet:
                # Weak scaling: the batch grows with the fleet (B >= actors), else admission
                # ((η + 1)·B groups issued) would idle all but B actors; time runs `scale` times
                # faster when a model step would exceed STEP_S, so large cells fit the window.
                b = max(batch, actors)
                train_s = b * n * model["tokens_per_sample"] / (
                    model["train_tokens_per_s"] * (1 + (ranks - 1) * model["rank_efficiency"]))
                gen_s = model["gen_overhead_s"] + n * model["tokens_per_sample"] / model["gen_tokens_per_s"]
                scale = min(1.0, STEP_S / max(train_s, gen_s))
                cell = run_cell(actors, ranks, staleness, model, batch=b, n=n, seconds=seconds, scale=scale)
                cells.append(cell)
                print(f"  [simulated] ranks {ranks:3d} actors {actors:4d}: {cell['groups_per_s']:.2f} groups/s "
                      f"(model {cell['model_groups_per_s']:.2f}, efficiency {cell['scaling_efficiency']:.2f}"
                      f", bound: {cell['binding']}{', learner-bound' if cell['learner_bound'] else ''})")
    finally:
        if started:
            ray.shutdown()
    below_knee = [c for c in cells if not c["learner_bound"] and c["rollout_actors"] <= 64]
    eff = min((c["scaling_efficiency"] for c in below_knee), default=float("nan"))
    print_table("simulate (SIMULATED engines and learner; real Ray, ZeroMQ buffer, version protocol)", [
        ("cells", len(cells)), ("min scaling efficiency below the knee (<= 64 actors)", eff),
        ("batch groups", batch), ("group size", n), ("max_staleness", staleness)])
    out = Path(args.output)
    _plot(cells, out)
    return {"simulated": True, "latency_model": model, "cells": cells,
            "min_scaling_efficiency_below_knee": eff, "ratio": eff}


def _plot(cells: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for ranks in sorted({c["learner_ranks"] for c in cells}):
        cs = [c for c in cells if c["learner_ranks"] == ranks]
        ax.plot([c["rollout_actors"] for c in cs], [c["groups_per_s"] for c in cs], marker="o", label=f"{ranks} ranks")
        ax.plot([c["rollout_actors"] for c in cs], [c["model_groups_per_s"] for c in cs], ls="--", alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rollout actors")
    ax.set_ylabel("trained groups/s (SIMULATED)")
    ax.set_title("simulated fleet scaling (dashed: latency-model bound)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"simulate-{time.strftime('%Y%m%d-%H%M%S')}.png", dpi=100)
    plt.close(fig)
