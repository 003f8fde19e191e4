"""The job side of `asyncrl.ctl`: a queued command runs through the job's table of named handlers;
an unknown command or a handler that raises becomes an error result for the caller (the job goes
on), and the job knows exactly the commands the ctl client can queue."""

from types import SimpleNamespace

from asyncrl.config import load_config
from asyncrl.ctl import _parser
from asyncrl.job import commands as job_commands
from asyncrl.job.commands import execute
from asyncrl.job.loop import Trainer
from asyncrl.job.topology import Topology
from asyncrl.startup import StopFlag


def test_a_known_command_runs_its_handler_with_the_arguments():
    calls = []
    handlers = {"scale": lambda n: calls.append(n) or {"ok": True, "n": n}}
    assert execute(handlers, "scale", {"n": 3}) == {"ok": True, "n": 3}
    assert calls == [3]


def test_an_unknown_command_is_an_error_result_naming_it_and_the_known_ones():
    result = execute({"stop": dict, "scale": dict}, "rescale", {})
    assert result["ok"] is False
    assert "'rescale'" in result["error"] and "scale, stop" in result["error"]


def test_a_handler_that_raises_is_an_error_result():
    def boom(n):
        raise ValueError(f"cannot scale to {n}")

    assert execute({"scale": boom}, "scale", {"n": -1}) == {"ok": False, "error": "ValueError: cannot scale to -1"}
    assert execute({"scale": boom}, "scale", {"bad": 1})["error"].startswith("TypeError")


def _trainer(tmp_path):
    """The loop, built from a topology whose learner is at version 0 (nothing of it is called)."""
    cfg = load_config("configs/quickstart.yaml", [f"trainer.run_dir={tmp_path}", "trainer.logger=[jsonl]"])
    topo = Topology(cfg=cfg, run_dir=tmp_path, namespace="test", learner=SimpleNamespace(version=0),
                    fleet=SimpleNamespace(actors={}))
    return Trainer(cfg, topo, tmp_path, StopFlag(), resume=None)


def test_the_job_handles_every_command_the_client_queues(tmp_path):
    trainer = _trainer(tmp_path)
    sub = next(a for a in _parser()._actions if a.dest == "command")
    queued = (set(sub.choices) - {"status"}) | {"dry-run-verifier"}  # status is read, swap --dry-run is queued as dry-run
    assert set(job_commands.handlers(trainer)) == queued
    assert job_commands.handlers(trainer)["stop"].func is job_commands.stop


def test_stop_ends_the_loop_after_the_current_step(tmp_path):
    trainer = _trainer(tmp_path)
    assert trainer.stop_requested_by_ctl is False
    result = execute(job_commands.handlers(trainer), "stop", {})
    assert result == {"ok": True, "message": "stopping after step 0"} and trainer.stop_requested_by_ctl is True


def test_a_refused_verifier_swap_leaves_the_loop_config_alone(tmp_path, monkeypatch):
    from asyncrl.serve import deploy

    trainer = _trainer(tmp_path)
    before = trainer.cfg
    new = {**before.verifier.model_dump(mode="json"), "num_replicas": before.verifier.num_replicas + 1}
    for ok in (False, True):
        monkeypatch.setattr(deploy, "swap_verifier", lambda cfg, ok=ok: SimpleNamespace(to_dict=lambda: {"ok": ok}))
        assert execute(job_commands.handlers(trainer), "swap-verifier", {"verifier": new}) == {"ok": ok}
        # refused: the same config object; accepted: the loop's config carries the new verifier
        assert (trainer.cfg is before) is (not ok)
    assert trainer.cfg.verifier.num_replicas == before.verifier.num_replicas + 1
    assert trainer.cfg.trainer == before.trainer
