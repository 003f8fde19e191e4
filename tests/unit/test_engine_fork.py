"""`asyncrl.engine_setup.engine_core_forked`: when vLLM's engine-core process is forked instead of spawned,
what the context changes and restores, and what a forked child keeps of its parent's descriptors.
The engine itself, forked from a Ray actor, is built in tests/integration/test_fleet_launch.py."""

from __future__ import annotations

import os
import socket

import pytest

import asyncrl.engine_setup as engine

pytest.importorskip("vllm")


def test_forks_only_around_the_build_and_restores_what_it_changed(monkeypatch) -> None:
    import vllm.utils.system_utils as vllm_system

    monkeypatch.setattr(engine, "_torch_threads", lambda: 1)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what vLLM's CPU platform leaves
    check = vllm_system.is_in_ray_actor
    with engine.engine_core_forked(True):
        assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
        assert vllm_system.is_in_ray_actor() is False
        assert engine._FORKING_ENGINE_CORE
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert vllm_system.is_in_ray_actor is check
    assert not engine._FORKING_ENGINE_CORE


def test_an_error_in_the_build_still_restores(monkeypatch) -> None:
    monkeypatch.setattr(engine, "_torch_threads", lambda: 1)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    with pytest.raises(RuntimeError, match="build failed"), engine.engine_core_forked(True):
        raise RuntimeError("build failed")
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
    assert not engine._FORKING_ENGINE_CORE


@pytest.mark.parametrize("enabled, threads", [(False, 1), (True, 2)])
def test_no_fork_when_disabled_or_torch_runs_several_threads(monkeypatch, caplog, enabled, threads) -> None:
    """Forked after OpenMP started its threads, the child hangs in its first parallel region
    (reproduced: torch at 2 threads, a matmul, fork, a matmul in the child: never returns)."""
    monkeypatch.setattr(engine, "_torch_threads", lambda: threads)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    with caplog.at_level("INFO", logger="asyncrl.engine_setup"), engine.engine_core_forked(enabled):
        assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
        assert not engine._FORKING_ENGINE_CORE
    assert ("spawned, not forked" in caplog.text) == enabled


def _child_descriptors(flag: bool, fds: dict[str, int]) -> dict[str, bool]:
    """Fork with the build flag set to `flag`; the child reports which of `fds` it still has open."""
    read, write = os.pipe()
    engine._FORKING_ENGINE_CORE = flag
    try:
        pid = os.fork()
        if pid == 0:  # the child: report and leave without running the parent's cleanup
            try:
                alive = []
                for name, fd in fds.items():
                    try:
                        os.fstat(fd)
                        alive.append(name)
                    except OSError:
                        pass
                os.write(write, (",".join(alive) + f"|{int(engine._FORKING_ENGINE_CORE)}").encode())
            finally:
                os._exit(0)
    finally:
        engine._FORKING_ENGINE_CORE = False
    os.close(write)
    report = os.read(read, 4096).decode()
    os.close(read)
    os.waitpid(pid, 0)
    names, flag_in_child = report.split("|")
    return {name: name in names.split(",") for name in fds} | {"flag_in_child": flag_in_child == "1"}


def test_a_child_forked_for_the_engine_closes_its_copies_of_the_parents_sockets(tmp_path) -> None:
    """The raylet learns of a worker's death from its socket closing: a forked engine core that
    kept the actor's sockets would hide the actor's death. Pipes and files stay (multiprocessing's
    sentinel pipe, the logs); the parent's sockets stay open and usable."""
    left, right = socket.socketpair()
    listener = socket.create_server(("127.0.0.1", 0))
    pipe_r, pipe_w = os.pipe()
    log_file = open(tmp_path / "log", "w")  # noqa: SIM115 (closed below)
    fds = {"socketpair": left.fileno(), "listener": listener.fileno(), "pipe": pipe_w, "file": log_file.fileno()}
    try:
        during = _child_descriptors(True, fds)
        assert during == {"socketpair": False, "listener": False, "pipe": True, "file": True, "flag_in_child": False}
        other = _child_descriptors(False, fds)  # any other fork of the process: untouched
        assert other == {"socketpair": True, "listener": True, "pipe": True, "file": True, "flag_in_child": False}
        left.sendall(b"still connected")  # the parent's copies were not touched
        assert right.recv(64) == b"still connected"
    finally:
        for s in (left, right, listener):
            s.close()
        os.close(pipe_r)
        os.close(pipe_w)
        log_file.close()


def test_work_beside_the_build_starts_in_the_parent_after_the_fork_once(monkeypatch) -> None:
    """`after_fork` (the rollout actor's verifier warm-up thread) must not exist when the engine core
    is forked (a thread holding an import lock at the fork hangs the child): it runs in the parent
    right after the fork, once, never in the child, and not at all for a build that failed first."""
    monkeypatch.setattr(engine, "_torch_threads", lambda: 1)
    calls: list[tuple[int, bool]] = []

    def after_fork() -> None:
        calls.append((os.getpid(), engine._FORKING_ENGINE_CORE))

    with engine.engine_core_forked(True, after_fork=after_fork):
        assert calls == []  # not before the fork
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report whether the callback ran here, then leave
            os.write(write, b"1" if calls else b"0")
            os._exit(0)
        os.close(write)
        ran_in_child = os.read(read, 8)
        os.close(read)
        os.waitpid(pid, 0)
        second = os.fork()  # another fork during the build: the callback does not run again
        if second == 0:
            os._exit(0)
        os.waitpid(second, 0)
    assert ran_in_child == b"0"
    assert calls == [(os.getpid(), True)]
    with pytest.raises(RuntimeError), engine.engine_core_forked(True, after_fork=after_fork):
        raise RuntimeError("build failed before its fork")
    pid = os.fork()  # a later fork of the process runs nothing
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert len(calls) == 1


def test_work_beside_a_spawned_build_starts_before_it(monkeypatch) -> None:
    monkeypatch.setattr(engine, "_torch_threads", lambda: 2)  # no fork: vLLM spawns, threads are safe
    calls: list[str] = []
    with engine.engine_core_forked(True, after_fork=lambda: calls.append("started")):
        assert calls == ["started"]
