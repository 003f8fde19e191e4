"""`LearnerGroup`: the W learner ranks as Ray actors in one placement group = one DeepSpeed job.

- One bundle per rank (`learner.cpus_per_rank` CPUs, plus 1 GPU each when `learner.num_gpus > 0`),
  STRICT_PACK when one node can hold them all (else PACK), reserved before the rollout engines
  start (`reserve_placement`). Rank 0's actor picks a free port on its node; every actor gets RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT and LOCAL_RANK (0: Ray gives each actor its own CUDA_VISIBLE_DEVICES)
  in its environment before DeepSpeed starts. All ranks on one node rendezvous on 127.0.0.1.
- Every call fans out to all ranks (the worker's methods contain collectives) and waits for all of
  them, bounded by `cluster.startup_timeout_s` for start-up and `learner.batch_timeout_s` per call;
  results come from rank 0 (metrics are identical on every rank).
- The step's data (`asyncrl.learner.feed`): rank 0 fetches the groups' frames from the buffer
  itself (`fetch` returns only their metadata to the driver), decodes them for its own step and
  puts the frames once in the object store for the other ranks (`train_fetched`); it asks for the
  next batch while the current step trains (`learner.prefetch`). No pickled Python objects and no
  sample bytes pass through the driver.
- Weights: `start_weight_sender()` creates an `asyncrl.weights.WeightSender` on rank 0 (returns
  the address receivers join), `add_receivers` / `remove_receivers` manage its members, and
  `broadcast_weights()` streams the export bucket by bucket: every rank walks the same buckets (the
  ZeRO-3 gathers are collectives), rank 0 broadcasts them as the current version and publishes
  the store copy into the job's `WeightStore` (started by the topology, found by name, so a
  rebuilt learner publishes into the same store).
- Checkpoints: `save_checkpoint(step, fill)` makes the temporary directory, has every rank write
  its part, calls `fill(tmp_dir)` (the lead adds the buffer snapshot and data cursor there), then
  commits atomically and prunes to `trainer.save_limit`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.learner import checkpoint as ckpt

__all__ = ["LearnerGroup", "LearnerActor"]


class LearnerActor:
    """Ray actor body: holds one `LearnerWorker` (built by `setup`, rebuildable with a new config)."""

    def __init__(self) -> None:
        from asyncrl.logs import redirect_output

        redirect_output(f"learner-{os.environ.get('RANK', '0')}")  # DeepSpeed/torch output to <run_dir>/logs/
        self.worker: Any = None
        self.sender: Any = None
        self.feed: Any = None  # rank 0: learner.feed.BatchFeed, made by the first fetch_batch
        self._batch: list[Any] = []  # rank 0: the decoded groups of the step being prepared

    def node_address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def setup(self, cfg_json: str, rank: int, world_size: int, master_addr: str, master_port: int) -> int:
        from asyncrl.small_machine.process import gc_paused, raise_priority, yield_while_building
        from asyncrl.startup import starting

        cfg = Config.model_validate_json(cfg_json)
        os.environ.setdefault("LOCAL_RANK", "0")
        if self.worker is not None:
            self.worker.close()
        if cfg.cluster.small_machine:
            yield_while_building()
        # torch's, DeepSpeed's and transformers' imports and the build without the cyclic GC (less CPU)
        with gc_paused(bool(cfg.cluster.small_machine)), starting(f"learner rank {rank}"):  # one line for the driver, the traceback in learner-N.log
            import torch

            if cfg.learner.num_gpus == 0:
                torch.set_num_threads(max(1, int(cfg.learner.cpus_per_rank)))
            from asyncrl.learner.learner import LearnerWorker

            self.worker = LearnerWorker(cfg, rank, world_size, master_addr, master_port)
        if cfg.cluster.small_machine:  # built at 19 where permitted (else at Ray's 15): now train first
            raise_priority()
        state = cfg.run_path / "state"
        if state.is_dir():  # which process is which rank (fault drills)
            (state / f"learner_rank_{rank}.pid").write_text(str(os.getpid()))
        return self.worker.version

    # ---------------------------------------------------------------- the step's data (feed.py)
    def fetch_batch(self, address: str, num_groups: int, version: int, timeout_s: float) -> list[dict[str, Any]]:
        """Rank 0: fetch groups for `version` from the buffer at `address` into its `BatchFeed`
        and return their metadata (the driver never sees the samples)."""
        from asyncrl.learner.feed import BatchFeed

        if self.feed is None or self.feed.address != address:
            if self.feed is not None:
                self.feed.close()
            cfg = self.worker.cfg
            self.feed = BatchFeed(address, cfg.buffer.curve if cfg.buffer.curve.enable else None,
                                  secret=cfg.buffer.secret if cfg.buffer.auth else None,
                                  max_frame_bytes=int(cfg.buffer.max_frame_mb * 2**20))
        return self.feed.fetch(num_groups, version, timeout_s)

    def prepare_batch(self, ids: list[int]) -> list[Any]:
        """Rank 0: the step's batch = the fetched groups named by `ids`; returns [ObjectRef of their
        frames] for the other ranks (one `ray.put`), [None] at world size 1. The ref is wrapped in a
        list so that the driver passes it on without resolving it."""
        import ray

        frames, self._batch = self.feed.take(ids)
        return [ray.put(frames) if self.worker.world_size > 1 else None]

    def train_step(self, frames: list[bytes] | None = None, prefetch: tuple[int, int, float] | None = None,
                   ) -> dict[str, float]:
        """One step on this step's encoded groups `frames` (Ray resolved rank 0's object-store copy);
        None: the batch `prepare_batch` already decoded (rank 0). `prefetch` = (num_groups,
        version, timeout_s): rank 0 first asks the buffer for the next batch in the background."""
        from asyncrl.protocol import decode

        if frames is None:
            groups, self._batch = self._batch, []
        else:
            groups = [decode(f) for f in frames]
        if prefetch is not None and self.feed is not None:
            self.feed.start_prefetch(*prefetch)
        return self.worker.train_step(groups)

    def held_prompts(self) -> list[int]:
        """Rank 0: prompt indices of the groups its feed took from the buffer and has not trained."""
        return self.feed.held_prompts() if self.feed is not None else []

    def sample_records(self, limit: int) -> list[dict[str, Any]]:
        """Rank 0: up to `limit` decoded trajectories of its latest batch (JSON-ready, small)."""
        from asyncrl.learner.feed import sample_records

        return sample_records(self.feed.last_batch if self.feed is not None else [], limit)

    def save_checkpoint(self, directory: str) -> None:
        self.worker.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> int:
        self.worker.load_checkpoint(directory)
        return self.worker.version

    def start_weight_sender(self, port: int = 0, publish: bool = True) -> str | None:
        """Rank 0: create the `WeightSender` and return its address; others: None."""
        self.sender = None
        if self.worker.rank != 0:
            return None
        from asyncrl.weights.sender import WeightSender

        cfg = self.worker.cfg
        self.sender = WeightSender(cfg.learner.weights, port, publish=publish, port_range=cfg.cluster.port_range)
        return self.sender.address

    def add_receivers(self, ids: list[str]) -> None:
        """Rank 0: schedule weight-group members to join (the group is rebuilt at the next broadcast)."""
        if self.worker.rank == 0:
            self.sender.add_receivers(ids)

    def remove_receivers(self, ids: list[str]) -> None:
        """Rank 0: take members out of the weight group (they are told at once, the group is rebuilt lazily)."""
        if self.worker.rank == 0:
            self.sender.remove_receivers(ids)

    def broadcast_weights(self) -> dict[str, Any] | None:
        """All ranks: export bucket by bucket (same bucket size everywhere, so ZeRO-3 gathers line
        up); rank 0 broadcasts them as the current version and returns the report."""
        bucket_bytes = max(1, int(self.worker.cfg.learner.weights.bucket_mb * 2**20))
        buckets = self.worker.export_sync_tensors(bucket_bytes)  # full weights, or the LoRA adapter alone
        if self.worker.rank == 0:
            return self.sender.broadcast(buckets, self.worker.version).as_dict()
        for _ in buckets:  # take part in the gathers (ZeRO-3); a no-op walk otherwise
            pass
        return None

    def version(self) -> int:
        return self.worker.version

    def set_version(self, version: int) -> int:
        self.worker.version = int(version)
        return self.worker.version


def rank_bundles(cfg: Config) -> list[dict[str, float]]:
    """One placement bundle per learner rank: `learner.cpus_per_rank` CPUs, 1 GPU on GPU jobs,
    plus `cluster.resources.learner` (e.g. pin the ranks to a node)."""
    lc = cfg.learner
    bundle: dict[str, float] = {"CPU": lc.cpus_per_rank}
    if lc.num_gpus > 0:
        bundle["GPU"] = 1
    bundle.update(cfg.cluster.resources.get("learner", {}))
    return [dict(bundle) for _ in range(cfg.learner_world_size)]


def placement_strategy(bundles: list[dict[str, float]], nodes: list[dict[str, Any]]) -> str:
    """STRICT_PACK (every rank on one node: ZeRO's per-micro-batch collectives stay on the
    node's links) when some alive node has the resources of all the bundles together; else PACK
    (a learner larger than any node, spread as little as Ray can)."""
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    fits = any(n.get("Alive") and all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in need.items()) for n in nodes)
    return "STRICT_PACK" if fits else "PACK"


def reserve_placement(cfg: Config) -> Any:
    """Reserve the learner's placement group and wait until it is placed (bounded by
    `cluster.startup_timeout_s`). The topology calls it BEFORE the rollout actors start: reserved
    later, Ray's default policy has already spread the engines over the nodes and the learner
    (PACK is best effort) is split across them."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = rank_bundles(cfg)
    pg = placement_group(bundles, strategy=placement_strategy(bundles, ray.nodes()))
    try:
        ray.get(pg.ready(), timeout=cfg.cluster.startup_timeout_s)
    except BaseException:
        remove_placement_group(pg)
        raise
    return pg


def rank_env(cfg: Config) -> dict[str, str]:
    """Environment of every learner rank's process (RANK / WORLD_SIZE are added per rank). It
    carries the job's one NCCL_CUMEM_ENABLE (`weights.nccl_env.job_nccl_env`, also in the job's
    runtime_env): DeepSpeed's `init_distributed` creates the rank's first NCCL communicator, and
    NCCL reads the variable then and never again."""
    from asyncrl.weights.nccl_env import job_nccl_env

    lc = cfg.learner
    return {"DS_ACCELERATOR": "cuda" if lc.num_gpus > 0 else "cpu", "LOCAL_RANK": "0",
            "OMP_NUM_THREADS": str(max(1, int(lc.cpus_per_rank))), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0"),
            **job_nccl_env()}


class LearnerGroup:
    """The learner job. `fetch` + `train_fetched` -> metrics (rank 0's), `version`, checkpoints, weights."""

    def __init__(self, cfg: Config, name: str = "learner", placement: Any = None) -> None:
        """`placement`: the group's placement group, reserved beforehand (`reserve_placement`,
        which the topology calls before the rollout engines start); None reserves it here."""
        self.cfg = cfg
        self.world_size = cfg.learner_world_size
        self._pg = placement if placement is not None else reserve_placement(cfg)
        self._name = name
        self._spawn()
        self._setup(cfg)

    def _spawn(self) -> None:
        """One actor per rank in the placement group; rank 0's node + a free port is the rendezvous."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        lc = self.cfg.learner
        timeout = self.cfg.cluster.startup_timeout_s
        ray.get(self._pg.ready(), timeout=timeout)
        env = rank_env(self.cfg)
        remote = ray.remote(LearnerActor)
        self.actors = []
        for rank in range(self.world_size):
            env_r = dict(env, RANK=str(rank), WORLD_SIZE=str(self.world_size))
            self.actors.append(remote.options(
                name=None, num_cpus=lc.cpus_per_rank, num_gpus=1 if lc.num_gpus > 0 else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env_r},
            ).remote())
        addrs = ray.get([a.node_address.remote() for a in self.actors], timeout=timeout)
        self.hosts = [a for a, _ in addrs]  # node address of each rank (error messages)
        master_addr, master_port = addrs[0]
        if len({a for a, _ in addrs}) == 1:
            master_addr = "127.0.0.1"  # one node: keep the rendezvous on loopback
        self._master = (master_addr, master_port)

    def rebuild(self, checkpoint: str | os.PathLike[str] | None = None) -> int:
        """A rank died: the survivors' collectives are broken, so every rank's process is replaced
        (same placement group, fresh rendezvous), then the state is loaded from `checkpoint` (None:
        the initial model). Returns the version. Raises if the ranks cannot be placed again (e.g.
        their node is gone): then the job stops and is resumed from the checkpoint."""
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        self._spawn()
        self._setup(self.cfg)
        if checkpoint is not None:
            self.load_checkpoint(checkpoint)
        return self.version

    def set_version(self, version: int) -> None:
        """Relabels the current weights (after `rebuild`: a version number never names two policies)."""
        self._all("set_version", int(version))
        self.version = int(version)

    def _setup(self, cfg: Config) -> None:
        import ray

        self.cfg = cfg
        cfg_json = cfg.model_dump_json()
        addr, port = self._master
        refs = [a.setup.remote(cfg_json, r, self.world_size, addr, port) for r, a in enumerate(self.actors)]
        versions = ray.get(refs, timeout=self.cfg.cluster.startup_timeout_s)
        self.version = int(versions[0])

    def _all(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        import ray

        refs = [getattr(a, method).remote(*args) for a in self.actors]
        return ray.get(refs, timeout=timeout or self.cfg.learner.batch_timeout_s)

    def fetch(self, address: str, num_groups: int, version: int, timeout_s: float) -> list[dict[str, Any]]:
        """Rank 0 fetches up to num_groups groups for `version` from the buffer at `address` (or
        takes its prefetch); returns their metadata (`learner.feed.group_meta`)."""
        import ray

        grace = 300.0  # the buffer client's reply grace and reconnect window (a restarting buffer)
        return ray.get(self.actors[0].fetch_batch.remote(address, num_groups, version, timeout_s),
                       timeout=timeout_s + grace)

    def train_fetched(self, ids: list[int], prefetch: tuple[int, int, float] | None = None) -> dict[str, float]:
        """One step on the fetched groups named by `ids` (the others fetched are dropped). The
        frames reach ranks 1..W-1 through rank 0's object-store copy; the driver only passes the
        ref. `prefetch` = (num_groups, version, timeout_s) of the next batch, asked for while this
        step trains."""
        import ray

        timeout = self.cfg.learner.batch_timeout_s
        [ref] = ray.get(self.actors[0].prepare_batch.remote(list(ids)), timeout=timeout)
        refs = [a.train_step.remote(None, prefetch) if r == 0 else a.train_step.remote(ref)
                for r, a in enumerate(self.actors)]
        metrics = ray.get(refs, timeout=timeout)
        self.version = int(metrics[0]["train/version"])
        return metrics[0]

    def held_prompts(self) -> list[int]:
        """Prompt indices of the groups rank 0 took from the buffer and has not trained (prefetched)."""
        import ray

        return ray.get(self.actors[0].held_prompts.remote(), timeout=self.cfg.learner.batch_timeout_s)

    def sample_records(self, limit: int) -> list[dict[str, Any]]:
        """Up to `limit` decoded trajectories of the latest trained batch (rank 0's, small JSON)."""
        import ray

        return ray.get(self.actors[0].sample_records.remote(int(limit)), timeout=self.cfg.learner.batch_timeout_s)

    def start_weight_sender(self, port: int = 0, publish: bool = True) -> str:
        """Create rank 0's WeightSender; returns the address receivers join."""
        return self._all("start_weight_sender", port, publish)[0]

    def add_receivers(self, ids: Sequence[str]) -> None:
        """Members (engine ids `{actor}/tp{r}`) to join the weight group at the next broadcast."""
        import ray

        ray.get(self.actors[0].add_receivers.remote(list(ids)), timeout=self.cfg.learner.batch_timeout_s)

    def remove_receivers(self, ids: Sequence[str]) -> None:
        """Members to leave the weight group (withdrawn or replaced actors)."""
        import ray

        ray.get(self.actors[0].remove_receivers.remote(list(ids)), timeout=self.cfg.learner.batch_timeout_s)

    def broadcast_weights(self) -> dict[str, Any]:
        """Publish the current version to the weight group (and the WeightStore); rank 0's report."""
        return self._all("broadcast_weights")[0]

    def checkpoint_root(self) -> Path:
        return self.cfg.run_path / "checkpoints"

    def save_checkpoint(self, step: int | None = None, fill: Callable[[Path], None] | None = None,
                        root: Path | None = None) -> Path:
        """Atomic `checkpoints/step_N` (N = current version by default; under `root` instead, e.g. the
        emergency directory when the run's disk is full); `fill(tmp)` may add the buffer snapshot
        (`tmp/buffer/`) and `tmp/data_cursor.json` before the commit."""
        step = self.version if step is None else step
        tmp = ckpt.begin(root or self.checkpoint_root(), step)
        self._all("save_checkpoint", str(tmp))
        if fill is not None:
            fill(tmp)
        return ckpt.commit(tmp, self.cfg.trainer.save_limit)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        self.version = int(self._all("load_checkpoint", str(path))[0])
        return self.version

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a)
        self.actors = []
        remove_placement_group(self._pg)
