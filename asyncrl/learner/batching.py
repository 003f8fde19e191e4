"""Turn a step's groups into padded tensors and token-budget micro-batches.

Layout (what the learner's forward relies on)
- `flatten_groups` keeps the whole step batch as response-aligned [N, T] tensors (T = longest
  response of the batch): mask, behaviour log-probs, token versions, plus [N] rewards and dense
  group ids. Advantages are computed on these, once per step, before any split.
- A micro-batch (`collate`) left-pads prompts to its own longest prompt Pm and right-pads
  responses to its own longest response Tm, so every response starts at column Pm and the logits
  that predict response tokens are exactly the last Tm + 1 positions minus the final one
  (`logits_to_keep=Tm + 1`: the lm head runs on response positions only). Position ids count real
  tokens only, so left padding does not shift positions.
- Micro-batch cost is its padded size `n * (Pm + Tm)`; `plan_micro_batches` keeps it within
  `micro_batch_tokens` and `n <= max_micro_batch_size` (a single sample longer than the budget
  gets a micro-batch of its own). Samples are sorted by length first, which keeps padding low.

Guarantees: every sample of a mini-batch lands on exactly one rank (`shard_indices`, greedy
longest-first balancing of token counts) and in exactly one micro-batch; all ranks run the same
number of micro-batches (`balance_into` re-splits to the global maximum, and an empty slot becomes
a one-token dummy micro-batch whose loss weight is 0), which ZeRO-2/3 need because their
reductions and gathers are collectives issued inside forward/backward.

Departs from Guided-GRPO: no Karmarkar-Karp and no padding-free varlen attention (flash-attn is
not available on CPU); the micro-batch count is synchronised the same way (max over ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["FlatBatch", "MicroBatch", "flatten_groups", "split_mini_batches", "shard_indices",
           "plan_micro_batches", "balance_into", "collate"]


@dataclass
class FlatBatch:
    """The whole step batch; rows in group order, samples in their group's order."""

    prompt_ids: list[np.ndarray]
    response_ids: list[np.ndarray]
    response_mask: Tensor  # [N, T] float32, 1 = trained policy token
    behaviour_logprobs: Tensor  # [N, T] float32 (0 where mask is 0)
    token_versions: Tensor  # [N, T] int32 (-1 where mask is 0)
    rewards: Tensor  # [N] float32
    group_index: Tensor  # [N] int64 dense group id (0..G-1, batch order)
    group_sizes: list[int]  # samples per group, in order

    @property
    def num_samples(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_lengths(self) -> np.ndarray:
        return np.array([len(p) for p in self.prompt_ids], dtype=np.int64)

    @property
    def response_lengths(self) -> np.ndarray:
        return np.array([len(r) for r in self.response_ids], dtype=np.int64)


@dataclass
class MicroBatch:
    """Padded model inputs of a few samples plus their response-aligned training tensors.

    `indices` are rows of the FlatBatch (empty for a dummy micro-batch, which has one pad row,
    mask 0 and must be given loss weight 0)."""

    indices: Tensor  # [n] int64
    input_ids: Tensor  # [n, Pm + Tm]
    attention_mask: Tensor  # [n, Pm + Tm]
    position_ids: Tensor  # [n, Pm + Tm]
    response_len: int  # Tm
    response_mask: Tensor  # [n, Tm] float32

    @property
    def is_dummy(self) -> bool:
        return self.indices.numel() == 0

    @property
    def num_tokens(self) -> int:
        """Trained tokens (mask == 1)."""
        return int(self.response_mask.sum().item())

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(self.indices, self.input_ids.to(device), self.attention_mask.to(device),
                          self.position_ids.to(device), self.response_len, self.response_mask.to(device))


def flatten_groups(groups: Sequence[Any]) -> FlatBatch:
    """Groups (asyncrl.protocol.Group or anything with the same fields) -> FlatBatch."""
    samples = [s for g in groups for s in g.samples]
    if not samples:
        raise ValueError("empty batch: no samples in the given groups")
    n, t = len(samples), max(max(len(s.response_ids) for s in samples), 1)
    mask = torch.zeros(n, t, dtype=torch.float32)
    blp = torch.zeros(n, t, dtype=torch.float32)
    versions = torch.full((n, t), -1, dtype=torch.int32)
    for i, s in enumerate(samples):
        k = len(s.response_ids)
        if len(s.prompt_ids) < 1:
            raise ValueError(f"sample {getattr(s, 'uid', i)!r} has an empty prompt")
        mask[i, :k] = torch.from_numpy(np.asarray(s.response_mask, dtype=np.float32))
        blp[i, :k] = torch.from_numpy(np.asarray(s.behaviour_logprobs, dtype=np.float32))
        versions[i, :k] = torch.from_numpy(np.asarray(s.token_versions, dtype=np.int32))
    sizes = [len(g.samples) for g in groups]
    gid = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor(sizes))
    return FlatBatch(
        prompt_ids=[np.asarray(s.prompt_ids, dtype=np.int64) for s in samples],
        response_ids=[np.asarray(s.response_ids, dtype=np.int64) for s in samples],
        response_mask=mask * (blp == blp),  # a NaN behaviour log-prob never trains (protocol forbids it too)
        behaviour_logprobs=torch.nan_to_num(blp, nan=0.0),
        token_versions=versions,
        rewards=torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
        group_index=gid,
        group_sizes=sizes,
    )


def split_mini_batches(group_sizes: Sequence[int], mini_batches: int) -> list[np.ndarray]:
    """Sample rows of each mini-batch: whole groups, in order, as even as the group count allows.
    Fewer mini-batches than asked when there are fewer groups."""
    starts = np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.int64)
    chunks = np.array_split(np.arange(len(group_sizes)), min(mini_batches, len(group_sizes)))
    return [np.arange(starts[c[0]], starts[c[-1] + 1]) for c in chunks if len(c)]


def _lpt(indices: np.ndarray, cost: np.ndarray, bins: int) -> list[list[int]]:
    """Longest-processing-time-first: each item (largest cost first) goes to the lightest bin.
    Deterministic (stable sort, lowest bin index on ties)."""
    order = np.argsort(-cost, kind="stable")
    load = np.zeros(bins, dtype=np.int64)
    out: list[list[int]] = [[] for _ in range(bins)]
    for j in order:
        b = int(np.argmin(load))
        out[b].append(int(indices[j]))
        load[b] += int(cost[j])
    return out


def shard_indices(indices: np.ndarray, lengths: np.ndarray, world_size: int, rank: int) -> np.ndarray:
    """This rank's rows of a mini-batch (token-balanced across ranks; sorted). `lengths` is indexed
    by row. Every rank computes the same assignment from the same inputs."""
    if world_size == 1:
        return np.asarray(indices, dtype=np.int64)
    shards = _lpt(np.asarray(indices), lengths[np.asarray(indices)], world_size)
    return np.array(sorted(shards[rank]), dtype=np.int64)


def _padded_cost(rows: list[int], plen: np.ndarray, rlen: np.ndarray) -> int:
    return len(rows) * (int(plen[rows].max()) + int(rlen[rows].max())) if rows else 0


def plan_micro_batches(indices: np.ndarray, plen: np.ndarray, rlen: np.ndarray, token_budget: int,
                       max_seqs: int) -> list[list[int]]:
    """Split rows into micro-batches of padded size <= token_budget and <= max_seqs sequences
    (longest first; a sample over the budget on its own is kept alone)."""
    rows = sorted((int(i) for i in indices), key=lambda i: (-(plen[i] + rlen[i]), i))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in rows:
        if cur and (len(cur) + 1 > max_seqs or _padded_cost(cur + [i], plen, rlen) > token_budget):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def balance_into(indices: np.ndarray, plen: np.ndarray, rlen: np.ndarray, k: int) -> list[list[int]]:
    """Exactly k micro-batches (some possibly empty) balanced by token count; used after the
    micro-batch count was raised to the maximum over ranks. Rows of similar length share bins."""
    idx = np.asarray(sorted(int(i) for i in indices), dtype=np.int64)
    if k <= 0:
        raise ValueError("k must be positive")
    bins = _lpt(idx, (plen + rlen)[idx], k) if idx.size else [[] for _ in range(k)]
    return [sorted(b, key=lambda i: (-(plen[i] + rlen[i]), i)) for b in bins]


def collate(batch: FlatBatch, rows: Sequence[int], pad_id: int) -> MicroBatch:
    """Padded inputs for `rows` (see the module docstring for the layout). Empty rows -> dummy."""
    if len(rows) == 0:
        ids = torch.full((1, 2), pad_id, dtype=torch.long)
        return MicroBatch(torch.zeros(0, dtype=torch.long), ids, torch.ones_like(ids),
                          torch.arange(2).unsqueeze(0), 1, torch.zeros(1, 1))
    prompts = [batch.prompt_ids[i] for i in rows]
    responses = [batch.response_ids[i] for i in rows]
    pm = max(len(p) for p in prompts)
    tm = max(max(len(r) for r in responses), 1)
    n = len(rows)
    ids = torch.full((n, pm + tm), pad_id, dtype=torch.long)
    attn = torch.zeros((n, pm + tm), dtype=torch.long)
    for j, (p, r) in enumerate(zip(prompts, responses)):
        ids[j, pm - len(p):pm] = torch.from_numpy(p)
        ids[j, pm:pm + len(r)] = torch.from_numpy(r)
        attn[j, pm - len(p):pm + len(r)] = 1
    pos = (attn.cumsum(dim=1) - 1).clamp_min(0)
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    return MicroBatch(idx, ids, attn, pos, tm, batch.response_mask[idx, :tm].clone())
