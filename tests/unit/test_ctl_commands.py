"""The job side of `asyncrl.ctl`: a queued command runs through the job's table of named handlers;
an unknown command or a handler that raises becomes an error result for the caller (the job goes
on), and the job knows exactly the commands the ctl client can queue."""

from types import SimpleNamespace

from asyncrl.config import load_config
from asyncrl.ctl import _parser, execute
from asyncrl.startup import StopFlag
from asyncrl.topology import Topology
from asyncrl.trainer import Trainer


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


def test_the_job_handles_every_command_the_client_queues(tmp_path):
    # the loop is built from a topology whose learner is at version 0 (the table only binds methods:
    # nothing of the topology is called)
    cfg = load_config("configs/quickstart.yaml", [f"trainer.run_dir={tmp_path}", "trainer.logger=[jsonl]"])
    topo = Topology(cfg=cfg, run_dir=tmp_path, namespace="test", learner=SimpleNamespace(version=0),
                    fleet=SimpleNamespace(actors={}))
    trainer = Trainer(cfg, topo, tmp_path, StopFlag(), resume=None)
    sub = next(a for a in _parser()._actions if a.dest == "command")
    queued = (set(sub.choices) - {"status"}) | {"dry-run-verifier"}  # status is read, swap --dry-run is queued as dry-run
    assert set(trainer.ctl_handlers()) == queued
    assert trainer.ctl_handlers()["stop"].__func__ is Trainer.cmd_stop
