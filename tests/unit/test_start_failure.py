"""The one start-up line (asyncrl.startup): `starting` turns any error of a component's start into a
picklable `ComponentStartError` (traceback to stderr, i.e. the component's log file), and
`start_failure` finds it again inside Ray's envelopes (a task error's cause, the text of an actor's
creation-task error or of a Serve deployment error), or falls back to the cause's type and message.
Ray's envelopes are built here with Ray's own exception classes, no cluster."""

from __future__ import annotations

import pickle
import threading

import pytest
from pydantic import BaseModel, field_validator

from asyncrl.startup import ComponentStartError, StartupError, one_line, start_failure, starting, step_timer


class _Model(BaseModel):
    n: int

    @field_validator("n")
    @classmethod
    def _small(cls, v: int) -> int:
        if v > 1:
            raise ValueError("n must be <= 1")
        return v


class Unpicklable(RuntimeError):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()  # no pickler takes a lock: Ray cannot send this error


def _fail_in(component: str) -> ComponentStartError:
    with pytest.raises(ComponentStartError) as info, starting(component):
        _Model(n=5)
    return info.value


def test_starting_makes_one_picklable_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _fail_in("rollout actor rollout-0")
    assert str(err).startswith("rollout actor rollout-0 on ") and "failed to start: ValidationError: " in str(err)
    assert "Value error, n must be <= 1" in str(err) and "\n" not in str(err)
    assert "Traceback (most recent call last)" in capsys.readouterr().err  # the traceback: this process's stderr
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_start_failure_unwraps_rays_envelopes() -> None:
    from ray.exceptions import ActorDiedError, RayTaskError

    err = _fail_in("rollout actor rollout-1")
    task = RayTaskError("RolloutActor.start", "Traceback ...\n(long remote traceback)", err, ip="10.0.0.7")
    assert start_failure("rollout actors x1", task) == str(err)
    assert start_failure("rollout actors x1", task.as_instanceof_cause()) == str(err)
    died = ActorDiedError(RayTaskError("RolloutActor.__init__", "Traceback ...\n" + f"asyncrl.startup.ComponentStartError: {err}",
                                       err, ip="10.0.0.7"))
    assert start_failure("rollout actors x1", died) == str(err)
    serve = RuntimeError(f"Deploying application verifier failed: ... replica ...\nasyncrl.startup.ComponentStartError: {err}\n")
    assert start_failure("verifier service", serve) == str(err)


def test_start_failure_without_a_component_error() -> None:
    from ray.exceptions import RayTaskError

    picklable = RayTaskError("LearnerActor.setup", "Traceback ...", KeyError("zero_stage"), ip="10.0.0.8")
    assert start_failure("learner", picklable) == "learner on 10.0.0.8 failed to start: KeyError: 'zero_stage'"
    with pytest.raises(ValueError) as info:
        _Model(n=5)
    assert start_failure("learner", RayTaskError("X.start", "...", info.value, ip="10.0.0.8")) == \
        "learner on 10.0.0.8 failed to start: ValidationError: Value error, n must be <= 1"
    # a cause Ray cannot pickle arrives as a RayError holding the text: the traceback's last line
    unpicklable = RayTaskError("X.start", "Traceback (most recent call last):\n  File ...\nUnpicklable: deep cause\n",
                               Unpicklable("deep cause"), ip="10.0.0.9")
    assert "isn't serializable" in str(unpicklable.cause)
    line = start_failure("learner", unpicklable)
    assert line == "learner on 10.0.0.9 failed to start: Unpicklable: deep cause", line
    with pytest.raises(StartupError, match=r"^data on .+ failed to start: ValueError: no column 'q'$"), step_timer("data"):
        raise ValueError("no column 'q'")


def test_one_line_is_one_line() -> None:
    assert one_line(RuntimeError("a\n  b\n\tc")) == "RuntimeError: a b c"
    assert one_line(ValueError("x" * 1000)).endswith("...") and len(one_line(ValueError("x" * 1000))) < 430
