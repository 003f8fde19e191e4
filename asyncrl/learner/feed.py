"""`BatchFeed`: learner rank 0 takes each step's groups from the replay buffer itself.

The data path of a step: producers push encoded Group frames; the buffer stores and forwards them
byte for byte; rank 0's feed receives them (`BufferClient.get_batch_frames`), decodes them once for
its own step and reports only small per-group metadata (`group_meta`) to the driver, which keeps
the prompt accounting, the deadline and the metrics. The other ranks get the same frames through
one `ray.put` by rank 0: one copy in the object store of each node, read from shared memory by the
ranks on that node and moved between nodes by Ray, never through the driver. World size 1 needs no
`ray.put` at all.

Why rank 0 fetches the whole batch instead of each rank fetching its own shard: the learner shards
samples by tokens across ranks (`asyncrl.learner.batching`) and normalises the loss over the
global batch, which needs every sample's length before any rank can pick its rows; and W ranks
asking the buffer each step would fan W requests into one buffer process per step (64 ranks: 64
round trips and a partial-batch race between them), where one request and one object-store copy
per node scale with the number of nodes instead.

Prefetch: `start_prefetch(n, version)` asks for the next step's batch in a background thread while
the current step trains (`BatchRequest.ahead=1`: the staleness bound is that of the version the
groups are trained at, admission is not advanced before the weights are out). `fetch` for that
version first takes what the prefetch brought. Groups taken from the buffer and not yet trained
(held here) are lost if this process dies: the coordinator still lists their prompts as buffered,
so the driver re-issues them (`Coordinator.reissue_lost`) when it rebuilds the learner, and a
checkpoint's cursor re-issues them on resume (they are not in the buffer snapshot).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from asyncrl.protocol import Group, ProtocolError, decode

__all__ = ["BatchFeed", "group_meta", "sample_records"]


def group_meta(gid: int, g: Group, nbytes: int) -> dict[str, Any]:
    """What the driver needs of one fetched group: identity, prompt accounting, staleness, rewards,
    turns, verifier versions and policy-token counts (small: a few numbers per sample)."""
    return {
        "id": gid, "prompt_index": int(g.metadata.get("prompt_index", -1)), "min_version": int(g.min_version),
        "bytes": int(nbytes), "rewards": [float(s.reward) for s in g.samples],
        "reward_parts": [{k: float(v) for k, v in s.reward_parts.items()} for s in g.samples],
        "num_turns": [int(s.num_turns) for s in g.samples],
        "verifier_versions": [str(s.verifier_version) for s in g.samples],
        "tokens": [int(s.response_mask.sum()) for s in g.samples],
    }


def sample_records(groups: list[Group], limit: int) -> list[dict[str, Any]]:
    """Up to `limit` decoded trajectories of `groups` as JSON-ready dicts, for a person to read."""
    out: list[dict[str, Any]] = []
    for g in groups:
        for smp in g.samples:
            if len(out) >= limit:
                return out
            meta = smp.metadata
            out.append({"prompt_uid": smp.prompt_uid, "reward": smp.reward, "reward_parts": smp.reward_parts,
                        "num_turns": smp.num_turns, "finish_reason": smp.finish_reason,
                        "verifier_version": smp.verifier_version, "min_version": g.min_version,
                        "turn_versions": meta.get("turn_versions"),
                        "hallucination_scores": meta.get("hallucination_scores"),
                        "messages": meta.get("messages"), "verifier_texts": meta.get("verifier_texts")})
    return out


class BatchFeed:
    """Rank 0's connection to the buffer: fetched groups are held (frame + decoded group) under an id
    until the driver names the ones of the step (`take`); the rest are dropped (duplicates)."""

    def __init__(self, address: str, curve: Any = None, *, secret: str | None = None,
                 max_frame_bytes: int = 256 * 2**20) -> None:
        from asyncrl.replay.client import BufferClient

        self.address = address
        self.client = BufferClient(address, curve, secret=secret, actor_id="learner", max_frame_bytes=max_frame_bytes)
        self._ids = itertools.count()
        self._held: dict[int, tuple[bytes, Group]] = {}
        self._unreported: list[int] = []
        self._prefetch: threading.Thread | None = None
        self._prefetch_version: int | None = None
        self._prefetch_error: BaseException | None = None
        self._prefetched: list[bytes] = []
        self.last_batch: list[Group] = []  # the groups of the latest `take` (sample dumps)

    def _hold(self, frames: list[bytes]) -> None:
        for frame in frames:
            g = decode(frame, max_bytes=self.client.max_frame_bytes)
            if not isinstance(g, Group):
                raise ProtocolError(f"batch reply carried a {type(g).__name__}")
            gid = next(self._ids)
            self._held[gid] = (frame, g)
            self._unreported.append(gid)

    def _report(self) -> list[dict[str, Any]]:
        out = [group_meta(gid, self._held[gid][1], len(self._held[gid][0])) for gid in self._unreported]
        self._unreported = []
        return out

    def fetch(self, num_groups: int, version: int, timeout_s: float) -> list[dict[str, Any]]:
        """Metadata of the groups newly fetched for `version` (at most num_groups from the buffer in
        this call; fewer, maybe none, at timeout_s). A prefetch for `version` is waited for first
        (up to timeout_s) and its groups are reported instead of asking the buffer again."""
        if self._prefetch_version is not None:  # a prefetch was made ahead for this version
            if version != self._prefetch_version:
                raise RuntimeError(f"fetch for v{version} while the prefetch is for v{self._prefetch_version}")
            self.client.set_version(version)  # the learner reached `version`: admission advances now
            self._prefetch_version = None
        if self._prefetch is not None:
            self._prefetch.join(timeout_s)
            if self._prefetch.is_alive():
                return self._report()  # still waiting for the rollouts: nothing new yet
            self._finish_prefetch()
        if self._unreported:
            return self._report()
        self._hold(self.client.get_batch_frames(num_groups, version, timeout_s=timeout_s))
        return self._report()

    def start_prefetch(self, num_groups: int, version: int, timeout_s: float) -> None:
        """Asks for the groups of `version` in the background (the step before it is training)."""
        if self._prefetch is not None:
            return
        self._prefetch_version, self._prefetched, self._prefetch_error = version, [], None

        def run() -> None:
            try:
                self._prefetched = self.client.get_batch_frames(num_groups, version, timeout_s=timeout_s, ahead=1)
            except BaseException as exc:  # noqa: BLE001 - raised by the next `fetch` on the caller's thread
                self._prefetch_error = exc

        self._prefetch = threading.Thread(target=run, name="batch-prefetch", daemon=True)
        self._prefetch.start()

    def _finish_prefetch(self) -> None:
        self._prefetch = None
        if self._prefetch_error is not None:
            err, self._prefetch_error = self._prefetch_error, None
            raise err
        frames, self._prefetched = self._prefetched, []
        self._hold(frames)

    def held_prompts(self) -> list[int]:
        """Prompt indices of the groups taken from the buffer and not trained yet (held here, or
        brought by a finished prefetch): after a buffer restart they are not lost, only not there."""
        if self._prefetch is not None and not self._prefetch.is_alive() and self._prefetch_error is None:
            self._finish_prefetch()
        return [int(g.metadata.get("prompt_index", -1)) for _, g in self._held.values()]

    def take(self, ids: list[int]) -> tuple[list[bytes], list[Group]]:
        """The step's batch: the held groups named by `ids`, in that order. Every other group held
        from before is dropped (the driver chose not to train it: a re-delivered duplicate)."""
        batch = [self._held.pop(i) for i in ids]
        self._held.clear()
        self._unreported = []
        self.last_batch = [g for _, g in batch]
        return [f for f, _ in batch], self.last_batch

    @property
    def held(self) -> int:
        return len(self._held)

    def close(self) -> None:
        self.client.close()
