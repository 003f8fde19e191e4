"""Bounds on every number the replay buffer takes from the wire, beyond what `asyncrl.protocol`'s
schema checks (types and shapes): a request or group that passes decoding can still carry an
infinite timeout, a batch larger than the buffer can ever hold, a token id outside the model's
vocabulary, a positive or infinite log-probability or an absurd version. Each is refused with
`OutOfRange`, whose `reason` names the counter (`buffer/refused/<reason>`) and whose message names
the field and the bound.

The bounds:
- waits (`timeout_s`): finite, 0 <= t <= `buffer.max_wait_s`;
- batch sizes: 1 <= num_groups <= `buffer.capacity_groups`; `ahead` in [0, VERSION_LEAD];
- versions: a batch request's in [0, v + VERSION_LEAD], a learner's `VersionReached` in
  [0, v + VERSION_LEAD] (and it never moves v backwards), a group's in [0, v + VERSION_LEAD], where v is the
  buffer's version (the job sets it through the actor on resume and recovery, so honest members
  are never more than a step or two ahead);
- tickets: >= -1 (-1 = untracked push);
- token ids (prompt and response): 0 <= id < vocab_size, when the buffer was given the vocabulary
  size at start;
- behaviour log-probs: finite and <= LOGPROB_TOLERANCE (log-probabilities are <= 0; engines round).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from asyncrl.protocol import Group

VERSION_LEAD = 64
LOGPROB_TOLERANCE = 1e-3


class OutOfRange(ValueError):
    """A number from the wire outside its bound; `reason` names the counter."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def model_vocab_size(model_path: str) -> int | None:
    """The vocabulary size in a local model directory's config.json (`vocab_size`, or its
    `text_config`'s for multimodal models); None when it cannot be read (ids then go unchecked)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) and size > 0 else None


def check_wait(where: str, value: float, ceiling: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and 0.0 <= value <= ceiling):
        raise OutOfRange("timeout", f"{where}.timeout_s={value!r} outside [0, {ceiling}] (buffer.max_wait_s)")
    return value


def check_int(reason: str, where: str, value: int, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise OutOfRange(reason, f"{where}={value} outside [{lo}, {hi}]")
    return value


def check_group(group: Group, version: int, vocab_size: int | None) -> None:
    """Token ids within the vocabulary, log-probs finite and <= 0, versions within the lead."""
    if group.min_version < 0:
        raise OutOfRange("version", f"Group.min_version={group.min_version} is negative")
    if group.max_version > version + VERSION_LEAD:
        raise OutOfRange("version", f"Group.max_version={group.max_version} is more than {VERSION_LEAD} "
                                    f"versions ahead of the buffer's {version}")
    for i, s in enumerate(group.samples):
        if vocab_size is not None:
            for name in ("prompt_ids", "response_ids"):
                ids = getattr(s, name)
                if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                    bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
                    raise OutOfRange("token_id", f"Group.samples[{i}].{name} holds {bad}, outside the "
                                                 f"vocabulary [0, {vocab_size})")
        lp = s.behaviour_logprobs
        if lp.size and not (np.isfinite(lp).all() and float(lp.max()) <= LOGPROB_TOLERANCE):
            bad = float(lp[~np.isfinite(lp) | (lp > LOGPROB_TOLERANCE)][0])
            raise OutOfRange("logprob", f"Group.samples[{i}].behaviour_logprobs holds {bad}: log-probs must be "
                                        f"finite and <= 0")
