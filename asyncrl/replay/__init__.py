"""ZeroMQ replay buffer: server, clients, staleness-bounded admission and delivery, snapshots.

`ReplayBufferServer(cfg.buffer, batch_size=cfg.data.rollout_batch_size).start() -> address`;
`BufferClient(address, curve=cfg.buffer.curve, secret=cfg.buffer.secret)` from any process; `PushWindow(client, k)` keeps k
pushes of one producer in flight (`asyncrl.replay.window`). Rules: `asyncrl.replay.state`;
wire and ZeroMQ settings: `asyncrl.replay.server`; snapshots: `asyncrl.replay.snapshot`.
"""

from asyncrl.replay.client import (
           BufferClient,
           BufferDisconnected,
           BufferDiskFull,
           BufferFull,
           BufferRequestError,
           BufferTimeout,
)
from asyncrl.replay.server import BufferUnhealthy, ReplayBufferServer
from asyncrl.replay.snapshot import SnapshotError
from asyncrl.replay.state import BufferState, UnknownTicket
from asyncrl.replay.window import PushWindow

__all__ = ["BufferClient", "BufferDiskFull", "BufferDisconnected", "BufferFull", "BufferRequestError", "BufferState", "BufferTimeout",
           "BufferUnhealthy", "PushWindow", "ReplayBufferServer", "SnapshotError", "UnknownTicket"]
