"""ZeroMQ replay buffer: server, clients, staleness-bounded admission and delivery, snapshots.

`ReplayBufferServer(cfg.buffer, batch_size=cfg.data.rollout_batch_size).start() -> address`;
`BufferClient(address, curve=cfg.buffer.curve)` from any process. Rules: `asyncrl.replay.state`;
wire and ZeroMQ settings: `asyncrl.replay.server`; snapshots: `asyncrl.replay.snapshot`.
"""

from asyncrl.replay.client import (
           BufferClient,
           BufferDisconnected,
           BufferFull,
           BufferRequestError,
           BufferTimeout,
)
from asyncrl.replay.server import ReplayBufferServer
from asyncrl.replay.snapshot import SnapshotError
from asyncrl.replay.state import BufferState, UnknownTicket

__all__ = ["BufferClient", "BufferDisconnected", "BufferFull", "BufferRequestError", "BufferState", "BufferTimeout",
           "ReplayBufferServer", "SnapshotError", "UnknownTicket"]
