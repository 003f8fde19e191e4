"""The job-wide NCCL environment of the weight group, without torch: the launcher reads it to build every
Ray process's runtime_env before anything imports torch (`asyncrl.cluster.job_runtime_env`), and the
sender and receivers compare it across members.
NCCL_CUMEM_ENABLE must be one value in every process of the group: NCCL reads it once, at a process's
first communicator, and processes that disagree cannot connect."""

from __future__ import annotations

import os
from collections.abc import Mapping

CUMEM_VAR = "NCCL_CUMEM_ENABLE"
CUMEM_DEFAULT = "0"


def job_nccl_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The job-wide NCCL_CUMEM_ENABLE: the launching process's value if it has one, else
    `CUMEM_DEFAULT`. It goes into the runtime_env of every Ray process of the job (learner ranks,
    rollout actors and the engine processes they spawn), so each has it before its first NCCL
    communicator; setting it later in a process changes nothing (NCCL caches it)."""
    environ = os.environ if environ is None else environ
    return {CUMEM_VAR: environ.get(CUMEM_VAR, CUMEM_DEFAULT)}


def nccl_cumem() -> str | None:
    """This process's NCCL_CUMEM_ENABLE (None: unset, NCCL's own default)."""
    return os.environ.get(CUMEM_VAR)


def cumem_mismatch(mine: str | None, theirs: dict[str, str | None], who: str) -> str | None:
    """A message naming every member whose NCCL_CUMEM_ENABLE differs from `mine` (None: all agree)."""
    bad = {m: v for m, v in theirs.items() if v != mine}
    if not bad:
        return None
    shown = ", ".join(f"{m}={v if v is not None else 'unset'}" for m, v in sorted(bad.items()))
    return (f"weight group: NCCL_CUMEM_ENABLE={mine if mine is not None else 'unset'} on {who} but {shown}; "
            "NCCL cannot connect processes that disagree on it: set one value for the whole job (asyncrl puts "
            f"the launcher's value, default {CUMEM_DEFAULT}, into every role's environment; something in these "
            "processes overrides it)")
