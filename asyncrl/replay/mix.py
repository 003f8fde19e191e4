"""What the buffer saw, by difficulty and length: generated vs delivered vs dropped groups.

A buffer that drops stale groups, or a dynamic-sampling filter, can bias training toward short or
easy prompts (slow, long, hard groups are the ones that go stale). These counters make such a bias
visible: every group is counted once by *kind* —

- `generated`: pushed and accepted for judgement (stored, or dropped stale / filtered at ingest;
  duplicates and `full` answers, which the producer retries, are not counted);
- `delivered`: handed to the learner (what it trains, except the rare re-deliveries after a buffer
  restart that the driver drops, `train/duplicates_dropped`); a requeued delivery is uncounted;
- `dropped_stale`, `dropped_filtered`: dropped by the staleness bound or the filter;

— and by two buckets: its *difficulty* (`steps<n>` when the producer put the problem's step count
in the group's metadata as `num_steps`, as the arith task does; else `prompt<lo>-<hi>`, the
prompt's token count in power-of-two bins) and its *length* (mean policy tokens per sample, in
power-of-two bins `<lo>-<hi>`). Counts are over the run: they are part of the durable state
(`state()` / `restore()`), so a restarted buffer continues them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from asyncrl.protocol import Group

KINDS = ("generated", "delivered", "dropped_stale", "dropped_filtered")


def power_bin(value: float, floor: int = 16) -> str:
    """`<lo>-<hi>` with lo the largest power of two <= value (values under `floor` share `0-<floor-1>`)."""
    v = int(value)
    if v < floor:
        return f"0-{floor - 1}"
    lo = 1 << (v.bit_length() - 1)
    return f"{lo}-{2 * lo - 1}"


def difficulty_bucket(group: Group) -> str:
    """`steps<n>` from the group's `num_steps` metadata, else the prompt's token-count bin."""
    steps = group.metadata.get("num_steps")
    if isinstance(steps, int) and not isinstance(steps, bool):
        return f"steps{steps}"
    plen = len(group.samples[0].prompt_ids) if group.samples else 0
    return "prompt" + power_bin(plen)


class GroupMix:
    """Run counters of groups by kind x difficulty bucket and kind x length bin, plus length sums."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()  # "<kind>|d|<bucket>", "<kind>|l|<bin>", "<kind>|tokens"

    def add(self, kind: str, difficulty: str, length: float, sign: int = 1) -> None:
        """Count one group of `kind` (sign -1 takes a counted delivery back)."""
        if kind not in KINDS:
            raise ValueError(f"unknown group kind {kind!r} (one of {', '.join(KINDS)})")
        self.counts[f"{kind}|d|{difficulty}"] += sign
        self.counts[f"{kind}|l|{power_bin(length)}"] += sign
        self.counts[f"{kind}|tokens"] += sign * float(length)
        self.counts[f"{kind}|n"] += sign

    def metrics(self) -> dict[str, float]:
        """`buffer/mix/<kind>/difficulty/<bucket>`, `buffer/mix/<kind>/length/<bin>` (groups) and
        `buffer/mix/<kind>/len_mean` (policy tokens per sample)."""
        out: dict[str, float] = {}
        for key, value in sorted(self.counts.items()):
            kind, what, *rest = key.split("|")
            if what == "d":
                out[f"buffer/mix/{kind}/difficulty/{rest[0]}"] = float(value)
            elif what == "l":
                out[f"buffer/mix/{kind}/length/{rest[0]}"] = float(value)
        for kind in KINDS:
            n = self.counts.get(f"{kind}|n", 0)
            if n > 0:
                out[f"buffer/mix/{kind}/len_mean"] = self.counts[f"{kind}|tokens"] / n
        return out

    def state(self) -> dict[str, float]:
        return dict(self.counts)

    def restore(self, state: dict[str, Any] | None) -> None:
        self.counts = Counter({str(k): float(v) for k, v in (state or {}).items()})
