"""Proves that a vLLM verifier replica forks its engine core only behind the job's
`cluster.small_machine` switch, as the rollout actors' engines do: the decision (CPU and the switch
not off; a verifier deployed without a job config keeps the switch's derived value, on without a
GPU), the switch reaching the replica's arguments from `deploy_verifier(cfg)` and from a swap, and
every back-end's constructor accepting exactly what the deployment binds. No engine is built (the
replica on a real vLLM CPU engine: tests/integration/test_serve_vllm.py)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from asyncrl.config import Config, VerifierConfig
from asyncrl.serve import app, deploy
from asyncrl.serve.backends import BACKENDS, forks_engine_core


def test_the_engine_core_forks_only_on_cpu_with_the_switch_on() -> None:
    assert forks_engine_core(on_gpu=False, small_machine=True)
    assert not forks_engine_core(on_gpu=False, small_machine=False)  # the switch off: spawned, as vLLM does
    assert forks_engine_core(on_gpu=False, small_machine=None)  # no job config: derived, on without a GPU
    assert not forks_engine_core(on_gpu=True, small_machine=True)
    assert not forks_engine_core(on_gpu=True, small_machine=None)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("small_machine", [True, False, None])
def test_every_backend_takes_what_the_deployment_binds(backend: str, small_machine: bool | None) -> None:
    cfg = VerifierConfig(backend=backend)
    kwargs = app.replica_kwargs(cfg, rule_fn=(lambda messages: "###STOP###"), small_machine=small_machine)
    inspect.signature(BACKENDS[backend]).bind(cfg.model_dump(), **kwargs)  # raises TypeError if not
    assert ("small_machine" in kwargs) == (backend == "vllm" and small_machine is not None)
    if "small_machine" in kwargs:
        assert kwargs["small_machine"] is small_machine


def test_deploy_and_swap_pass_the_jobs_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.serve

    built: list[bool | None] = []

    def fake_build_app(vcfg: VerifierConfig, **kw: Any) -> str:
        built.append(kw.get("small_machine"))
        return "app"

    monkeypatch.setattr(deploy, "build_app", fake_build_app)
    monkeypatch.setattr(deploy, "start_serve", lambda vcfg: vcfg)
    monkeypatch.setattr(deploy, "resolve_port", lambda vcfg, port_range=None: vcfg)
    monkeypatch.setattr(deploy, "serving_info", lambda name, timeout_s=30.0: {"version": "v", "config": {}})
    monkeypatch.setattr(ray.serve, "run", lambda *a, **k: "handle")
    monkeypatch.setattr(deploy, "_DEPLOYED", {})
    monkeypatch.setattr(deploy, "_SMALL_MACHINE", {})
    off = Config.model_validate({"cluster": {"small_machine": False}, "verifier": {"backend": "vllm", "model_path": "verifier-model"}})
    on = Config.model_validate({"cluster": {"small_machine": True}, "verifier": {"backend": "vllm", "model_path": "verifier-model"}})
    deploy.deploy_verifier(off, name="t")
    deploy.swap_verifier(VerifierConfig(backend="vllm"), name="t")  # a bare section keeps the job's switch
    deploy.swap_verifier(on, name="t")
    deploy.deploy_verifier(VerifierConfig(backend="vllm"), name="bare")  # `python -m asyncrl.serve`, rescore
    assert built == [False, False, True, None]
