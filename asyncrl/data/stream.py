"""The training prompt stream: an endless, deterministic, resumable order over the rows.

Order: draw k of the infinite stream is row `perm_e[k mod N]` of epoch `e = k div N`, where
`perm_e` is a numpy permutation seeded by `(seed, e)` (the original uses a torch RandomSampler;
the order differs, but is equally deterministic and needs no replay to jump to any epoch). Epochs
roll over forever; every epoch visits every row exactly once. One owner draws from it: the job's
coordinator (asyncrl.job.coordinator), which hands prompts to rollout actors one group at a time and
keeps the bookkeeping of issued, buffered and re-issued prompts; the stream's own state is just
its cursor (`state_dict()` / `load_state_dict()` resume it exactly: no prompt skipped or repeated).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.config import DataConfig
from asyncrl.data.messages import build_messages, load_format_prompt

__all__ = ["PromptItem", "PromptStream", "make_item"]

log = logging.getLogger(__name__)


@dataclass
class PromptItem:
    """One draw of the stream. `index` is the draw number k (unique for the stream's whole life,
    across epochs); `uid` = f"{name}/{k}"; `row_index` the row in `rows`."""

    index: int
    uid: str
    messages: list[dict[str, Any]]
    ground_truth: str
    images: list[Any] | None
    row: dict[str, Any]
    epoch: int = 0
    row_index: int = 0
    videos: list[Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (what actors receive; `row` included, media carried as stored)."""
        return dataclasses.asdict(self)


def make_item(rows: Sequence[Mapping[str, Any]], row_index: int, cfg: DataConfig, index: int,
              name: str, epoch: int = 0) -> PromptItem:
    """The item of row `row_index` as draw `index` of stream `name` (evaluation numbers rows as draws)."""
    row = dict(rows[row_index])
    answer = row.get(cfg.answer_key)
    return PromptItem(index=index, uid=f"{name}/{index}", messages=build_messages(row, cfg),
                      ground_truth="" if answer is None else str(answer), images=row.get(cfg.image_key) or None,
                      row=row, epoch=epoch, row_index=row_index, videos=row.get(cfg.video_key) or None)


_STATE_FORMAT = 1


def _fingerprint(rows: Sequence[Mapping[str, Any]], cfg: DataConfig) -> str:
    """Cheap content check for resume: row count + prompts of up to 8 evenly spaced rows."""
    n = len(rows)
    picks = sorted({int(i) for i in np.linspace(0, n - 1, num=min(8, n))}) if n else []
    h = hashlib.sha1(str(n).encode())
    for i in picks:
        h.update(str(rows[i].get(cfg.prompt_key)).encode())
    return h.hexdigest()[:16]


class PromptStream:
    """An endless, deterministic, resumable stream of prompts over `rows`.

    Draw k (k = 0, 1, 2, ...) is row `perm_e[k mod N]`, epoch e = k div N. Guarantees: the same
    (rows, seed, shuffle) give the same draws; after `load_state_dict(state_dict())` the stream
    continues with the very next draw, so no draw is served twice and none is skipped across a
    resume. `item(k)` rebuilds any earlier draw (the coordinator re-issues prompts by their draw
    number). Not thread-safe: one owner.
    """

    def __init__(self, rows: Sequence[Mapping[str, Any]], seed: int = 1, shuffle: bool = True,
                 cfg: DataConfig | None = None, *, name: str = "train"):
        if len(rows) == 0:
            raise ValueError(f"prompt stream {name!r}: no rows (all filtered out?)")
        self.rows, self.seed, self.shuffle = rows, int(seed), bool(shuffle)
        self.cfg = cfg or DataConfig()
        self.name = name
        self.num_rows = len(rows)
        self.fingerprint = _fingerprint(rows, self.cfg)
        self._cursor = 0  # the next draw
        self._perms: dict[int, np.ndarray] = {}
        load_format_prompt(self.cfg.format_prompt)  # fail now on a bad template, not at the first draw

    def permutation(self, epoch: int) -> np.ndarray:
        """Row order of `epoch` (identity when not shuffling)."""
        if epoch not in self._perms:
            if len(self._perms) >= 4:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = (np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
                                  if self.shuffle else np.arange(self.num_rows))
        return self._perms[epoch]

    def item(self, k: int) -> PromptItem:
        """Draw k, without moving the cursor."""
        epoch, pos = divmod(int(k), self.num_rows)
        return make_item(self.rows, int(self.permutation(epoch)[pos]), self.cfg, int(k), self.name, epoch)

    def next(self) -> PromptItem:
        """The next draw."""
        k = self._cursor
        self._cursor += 1
        return self.item(k)

    def take(self, n: int) -> list[PromptItem]:
        """The next `n` draws."""
        return [self.next() for _ in range(n)]

    @property
    def epoch(self) -> int:
        """Epoch of the next draw."""
        return self._cursor // self.num_rows

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state; with the same rows, `load_state_dict` resumes at the very next draw."""
        return {"format": _STATE_FORMAT, "name": self.name, "num_rows": self.num_rows, "seed": self.seed,
                "shuffle": self.shuffle, "fingerprint": self.fingerprint, "cursor": self._cursor}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore a state from `state_dict()`. Raises ValueError when it was made for other data,
        seed or order; `strict=False` only downgrades a changed content fingerprint (same row
        count) to a warning."""
        _check_compatible(state, self, strict)
        self._cursor = int(state["cursor"])


def _check_compatible(state: Mapping[str, Any], stream: PromptStream, strict: bool) -> None:
    if state.get("format") != _STATE_FORMAT:
        raise ValueError(f"unknown stream state format {state.get('format')!r}")
    for key in ("name", "num_rows", "seed", "shuffle"):
        if state[key] != getattr(stream, key):
            raise ValueError(f"stream state was made with {key}={state[key]!r}, this stream has "
                             f"{getattr(stream, key)!r}")
    if state["fingerprint"] != stream.fingerprint:
        msg = "stream state was made for different data (content fingerprint differs)"
        if strict:
            raise ValueError(msg + "; pass strict=False to resume anyway")
        log.warning(msg)
