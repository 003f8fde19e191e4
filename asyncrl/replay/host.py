"""`BufferHost`: the replay buffer server inside a Ray actor, so a job's buffer lives in its own
process (its socket thread never competes with the driver's GIL) and is placed by Ray like any
other component. Clients still talk to it over ZeroMQ at the address `start()` returns; the actor
methods are only the control plane (version, stats, snapshot, restore, stop)."""

from __future__ import annotations

from typing import Any

import ray

from asyncrl.config import BufferConfig


@ray.remote(num_cpus=0)
class BufferHost:
    def __init__(self, cfg_json: str, batch_size: int, port_range: str | None = None):
        from asyncrl.logs import redirect_output
        from asyncrl.replay.server import ReplayBufferServer

        redirect_output("buffer")

        self.server = ReplayBufferServer(BufferConfig.model_validate_json(cfg_json), batch_size, port_range)

    def start(self) -> str:
        return self.server.start()

    def stats(self) -> dict[str, Any]:
        return self.server.stats()

    def set_version(self, version: int) -> int:
        return self.server.set_version(version)

    def snapshot(self, path: str) -> int:
        return self.server.snapshot(path)

    def restore(self, path: str) -> int:
        return self.server.restore(path)

    def stop(self) -> None:
        self.server.stop()
