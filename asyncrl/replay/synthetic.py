"""Synthetic groups with the shapes of real rollouts, for tests and the buffer benchmark.

A sample has a prompt, a response of `tokens` ids with a policy mask (a multi-turn shape: policy
spans separated by feedback spans), engine logprobs on masked tokens and per-token versions.
`produce` is a whole producer process (ticket -> group -> push), used by the multi-process tests.
"""

from __future__ import annotations

import time

import numpy as np

from asyncrl.protocol import Group, Sample


def synthetic_sample(rng: np.random.Generator, *, prompt_uid: str, uid: str, tokens: int, version: int,
                     prompt_tokens: int = 256, reward: float | None = None) -> Sample:
    mask = np.ones(tokens, dtype=np.int8)
    # feedback spans (mask 0) between policy turns, as in guided multi-turn samples
    for start in rng.integers(1, max(2, tokens - 1), size=2):
        mask[start:start + min(64, tokens // 8)] = 0
    on = mask.astype(bool)
    logprobs = np.where(on, -rng.exponential(0.5, tokens), 0.0).astype(np.float32)
    r = float(rng.integers(0, 2)) if reward is None else reward
    return Sample(uid=uid, prompt_uid=prompt_uid, prompt_ids=rng.integers(0, 150_000, prompt_tokens, dtype=np.int32),
                  response_ids=rng.integers(0, 150_000, tokens, dtype=np.int32), response_mask=mask,
                  behaviour_logprobs=logprobs, token_versions=np.where(on, version, -1).astype(np.int32),
                  reward=r, reward_parts={"accuracy": r, "format": 1.0}, num_turns=3, finish_reason="stop",
                  verifier_version="rule-v1", metadata={"turn_scores": [0.0, 0.5, r]})


def synthetic_group(rng: np.random.Generator, *, prompt_uid: str, version: int, n: int = 8,
                    min_tokens: int = 1024, max_tokens: int = 4096, actor_id: str = "synthetic",
                    rewards: list[float] | None = None) -> Group:
    samples = [synthetic_sample(rng, prompt_uid=prompt_uid, uid=f"{prompt_uid}/{i}", version=version,
                                tokens=int(rng.integers(min_tokens, max_tokens + 1)),
                                reward=None if rewards is None else rewards[i]) for i in range(n)]
    return Group.from_samples(samples, created_at=time.time(), actor_id=actor_id)


def produce(address: str, producer_id: str, num_groups: int, seed: int, deadline_s: float = 60.0,
            secret: str | None = None, n: int = 2, tokens: int = 64,
            gen_delay_s: float = 0.0) -> list[tuple[str, str, int]]:
    """A producer process: for each group take a ticket, stamp the group with the learner version
    reported with the ticket (as an actor holding those weights would), optionally 'generate' for
    gen_delay_s, push. Returns [(prompt_uid, push status, version)]."""
    from asyncrl.replay.client import BufferClient

    rng = np.random.default_rng(seed)
    out: list[tuple[str, str, int]] = []
    end = time.monotonic() + deadline_s
    with BufferClient(address, secret=secret, actor_id=producer_id, reply_grace_s=10.0) as client:
        ticket = None
        while len(out) < num_groups and time.monotonic() < end:
            if ticket is None:
                ticket = client.acquire_ticket(timeout_s=0.5)
                if ticket is None:
                    continue
            version = int(client.version or 0)
            if gen_delay_s:
                time.sleep(float(rng.uniform(0, gen_delay_s)))
            uid = f"{producer_id}-{len(out)}"
            group = synthetic_group(rng, prompt_uid=uid, version=version, n=n, min_tokens=tokens,
                                    max_tokens=tokens, actor_id=producer_id)
            reply = client.push(group, ticket, want_ticket=len(out) + 1 < num_groups)
            out.append((uid, reply.status, version))
            ticket = reply.next_ticket if reply.next_ticket >= 0 else None
    return out


def restamp(group: Group, version: int) -> Group:
    """Sets every trained token's version (and the group's range) to `version`, in place."""
    for s in group.samples:
        s.token_versions = np.where(s.response_mask.astype(bool), version, -1).astype(np.int32)
    group.min_version = group.max_version = version
    return group
