"""`LocalFeed`: load named tensors (a `WeightStore` copy, a checkpoint, test weights) into this
process's own engine workers over a private loopback gloo group.

It is the same wire as the learner's broadcast (buckets, fingerprint-checked rounds, deadlines),
so a catch-up load is verified exactly as a broadcast round is. The feed listens on 127.0.0.1 on
a free port; its members are the workers' receivers, which join with the usual
`WeightReceiver` protocol at `address`.
"""

from __future__ import annotations

from collections.abc import Iterable

from asyncrl.config import WeightSyncConfig
from asyncrl.weights.sender import BroadcastReport, WeightSender
from asyncrl.weights.wire import WeightsInput

LOOPBACK = "127.0.0.1"
GLOO_BUCKET_MB = 16.0
"""Bucket size on the loopback group (gloo pipelines small buckets far better than large ones)."""


class LocalFeed:
    """A one-process weight group: `send(weights, version)` to `members` joined at `address`."""

    def __init__(self, members: Iterable[str], *, bucket_mb: float, timeout_s: float) -> None:
        cfg = WeightSyncConfig(bucket_mb=bucket_mb, gloo_bucket_mb=GLOO_BUCKET_MB, backend="gloo",
                               timeout_s=timeout_s, host=LOOPBACK, port=0)
        self.timeout_s = float(timeout_s)
        self._sender = WeightSender(cfg, port=0, members=members)

    @property
    def address(self) -> str:
        return self._sender.address

    def send(self, weights: WeightsInput, version: int) -> BroadcastReport:
        """One round to the members (they must be receiving meanwhile); never raises for a member's failure."""
        return self._sender.broadcast(weights, version)

    def close(self) -> None:
        self._sender.close()
