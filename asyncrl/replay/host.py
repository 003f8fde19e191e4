"""`BufferHost`: the replay buffer server inside a Ray actor, so a job's buffer lives in its own
process (its socket thread never competes with the driver's GIL) and is placed by Ray like any
other component. Clients still talk to it over ZeroMQ at the address `start()` returns; the actor
methods are only the control plane (version, stats, snapshot, restore, stop).

Surviving its own death (the runtime creates it with Ray `max_restarts` and task retries, on the
driver's node): with a `state_dir`, every acknowledged change goes to the durable log
`state_dir/buffer.wal` before it is acknowledged, and the bound port is pinned in
`state_dir/buffer.address` after the first start. A restarted incarnation rebuilds its state from
the log and binds the same port at once, so the address every client was given stays valid: ZeroMQ
clients reconnect by themselves (`BufferClient` resends what was in flight), control-plane calls
are retried by Ray. Snapshots are written only inside the run directory (`state_dir`'s parent);
the socket refuses snapshot, restore and version requests (only these actor methods do them).
If the socket thread stops, `stats` and `set_version` (called every step) raise `BufferUnhealthy`
naming the cause, so the job fails loudly instead of waiting on a buffer that no longer answers. `buffer/restarts` and `buffer/recovered_groups` count what happened. A fresh
(not restarted) host starts with an empty log: resuming a run restores the checkpoint's snapshot.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import ray

from asyncrl.config import BufferConfig

ADDRESS_FILE = "buffer.address"
LOG_FILE = "buffer.wal"


@ray.remote(num_cpus=0)
class BufferHost:
    def __init__(self, cfg_json: str, batch_size: int, state_dir: str = "", port_range: str | None = None,
                 vocab_size: int | None = None):
        from asyncrl.logs import redirect_output
        from asyncrl.replay.server import ReplayBufferServer

        redirect_output("buffer")
        cfg = BufferConfig.model_validate_json(cfg_json)
        self.state_dir = Path(state_dir) if state_dir else None
        self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        pinned = self._pinned_port() if self.restarted else None
        if pinned:
            cfg = cfg.model_copy(update={"port": pinned})
        log = str(self.state_dir / LOG_FILE) if self.state_dir is not None else None
        self.server = ReplayBufferServer(cfg, batch_size, port_range, log_path=log, recover=self.restarted,
                                         vocab_size=vocab_size,
                                         run_dir=str(self.state_dir.parent) if self.state_dir is not None else None)
        self.address: str | None = None
        if self.state_dir is not None:
            (self.state_dir / "buffer.pid").write_text(str(os.getpid()))
        if pinned:
            self.address = self._start_on_pinned_port()

    def _pinned_port(self) -> int | None:
        path = self.state_dir / ADDRESS_FILE if self.state_dir is not None else None
        if path is None or not path.exists():
            return None
        return int(json.loads(path.read_text())["port"])

    def _start_on_pinned_port(self, wait_s: float = 30.0) -> str:
        """Binds the port of the previous incarnation (retrying while the kernel still holds it)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.server.start()
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def start(self) -> str:
        if self.address is None:
            self.address = self.server.start()
            if self.state_dir is not None:
                tmp = self.state_dir / (ADDRESS_FILE + ".tmp")
                tmp.write_text(json.dumps({"address": self.address, "port": int(self.address.rsplit(":", 1)[1])}))
                tmp.replace(self.state_dir / ADDRESS_FILE)
        return self.address

    def where(self) -> dict[str, Any]:
        """Host and process of this incarnation (error messages, fault drills)."""
        return {"host": ray.util.get_node_ip_address(), "pid": os.getpid(), "address": self.address,
                "restarted": self.restarted}

    def _healthy(self) -> None:
        from asyncrl.replay.server import BufferUnhealthy

        if not self.server.healthy():
            raise BufferUnhealthy(self.server.failure())

    def stats(self) -> dict[str, Any]:
        self._healthy()
        return self.server.stats()

    def set_version(self, version: int) -> int:
        self._healthy()
        return self.server.set_version(version)

    def take_dropped(self) -> list[tuple[int, float]]:
        return self.server.take_dropped()

    def observe_drift(self, drift: float, budget: float) -> int:
        return self.server.observe_drift(drift, budget)

    def release_actor(self, actor_id: str) -> int:
        return self.server.release_actor(actor_id)

    def prompt_indices(self) -> list[int]:
        return self.server.prompt_indices()

    def snapshot(self, path: str) -> int:
        return self.server.snapshot(path)

    def snapshot_indices(self, path: str) -> list[int]:
        """Writes the snapshot and returns the prompt indices of the groups it holds (one lock)."""
        return self.server.snapshot(path, with_indices=True)

    def restore(self, path: str) -> int:
        return self.server.restore(path)

    def stop(self) -> None:
        self.server.stop()
