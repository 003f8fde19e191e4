"""`verifier.error_reruns` is honoured by a rollout actor's real `_group`: the conversations a
verifier failure ended are run again exactly that many times (fresh seeds), then the group is
re-issued untrained (its ticket released, its prompt handed back to the coordinator) and counted;
0 re-issues at once; a negative value is refused by name. The actor is the plain class (no Ray);
the conversations come from a stand-in for `run_guided_group` whose verifier always fails, and the
coordinator and buffer are recording stand-ins."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from asyncrl.actors import group as group_module
from asyncrl.actors.rollout import RolloutWorker
from asyncrl.config import Config, ConfigError, load_config


class Remote:
    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args):
        async def answer():
            self.calls.append((self.name, *args))
        return answer()


def failed_conversation() -> SimpleNamespace:
    return SimpleNamespace(finish_reason="verifier_error", uid="",
                           turns=[SimpleNamespace(verifier_error="upstream 502")])


@pytest.mark.parametrize("reruns", [0, 1, 3])
def test_verifier_error_reruns_is_the_number_of_re_runs_before_the_group_is_re_issued(reruns, monkeypatch) -> None:
    cfg = Config.model_validate({"verifier": {"error_reruns": reruns}})
    calls: list = []
    runs: list = []  # (seed, n) of each call

    async def run_guided_group(cfg, prompt, engine, verifier, *, chat, training, n=None):
        n = cfg.rollout.n if n is None else n
        runs.append((cfg.rollout.seed, n))
        return [failed_conversation() for _ in range(n)]

    async def build_group(*args, **kwargs):
        raise AssertionError("a group whose conversations the verifier's failure ended was built for training")

    monkeypatch.setattr(group_module, "run_guided_group", run_guided_group)
    monkeypatch.setattr(group_module, "build_group", build_group)
    worker = RolloutWorker(cfg.model_dump_json(), "rollout-0", "", "test")
    worker.coordinator = SimpleNamespace(abandon=Remote(calls, "abandon"), complete=Remote(calls, "complete"))
    worker.buffer = SimpleNamespace(release_ticket=lambda t: calls.append(("release_ticket", t)))
    worker.engine = worker.verifier = worker.chat = None  # set up by the actor's start; the stand-in needs none
    try:
        asyncio.run(worker._group({"index": 5, "uid": "p5"}, 9))
    finally:
        worker._zmq.shutdown(wait=False)
    n = cfg.rollout.n
    assert len(runs) == 1 + reruns  # the first run, then `reruns` re-runs of the failed conversations
    assert [r[1] for r in runs] == [n] * (1 + reruns)
    assert len({r[0] for r in runs}) == 1 + reruns  # each re-run with a fresh seed
    assert worker._stats["conversations_rerun_verifier_error"] == n * reruns
    assert worker._stats["groups_reissued_verifier_error"] == 1
    assert ("release_ticket", 9) in calls and ("abandon", 5) in calls and ("complete", 5) not in calls


def test_a_negative_error_reruns_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="verifier.error_reruns"):
        load_config(None, ["verifier.error_reruns=-1"])
