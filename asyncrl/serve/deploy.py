"""Deploy the verifier application and swap its version live.

`deploy_verifier(cfg)` starts Serve's HTTP proxy on `verifier.host:verifier.port` (if Serve is not
running yet) and runs the `verifier` application; it returns the application's handle.

`swap_verifier(new_cfg)` replaces the running version by Ray Serve's rolling update of the one
`Verifier` deployment. Guarantees (what the tests check):
- requests in flight finish on the old replicas (graceful drain up to `client.deadline_s`), new
  requests reach the new replicas once they are ready; none fail: with `max_surge_percent=100`
  Serve starts the new replicas before it stops any old one;
- if the new version cannot start (its constructor raises, e.g. a bad model path or an unknown
  task), Serve marks the rollout failed and keeps the surviving old replicas; the swap then
  redeploys the old config (again surge-first, so the old version serves throughout) to bring
  the application back to a healthy state, and the report says why the new version failed.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from asyncrl.config import Config, VerifierConfig
from asyncrl.logs import serve_logging_config
from asyncrl.serve.app import APP_NAME, build_app

logger = logging.getLogger("asyncrl.serve")

# What this process deployed last, per app name: needed to roll back a failed swap when the old
# config carried a custom rule function (the replicas' own `info()` is the fallback).
_DEPLOYED: dict[str, tuple[VerifierConfig, Callable | None]] = {}


@dataclass
class SwapReport:
    ok: bool
    """True when the new version serves every replica."""
    old_version: str | None
    new_version: str
    serving_version: str | None
    """Version answering requests after the swap (the new one, or the old one after a failure)."""
    seconds: float
    """From the call to the application being healthy again."""
    error: str | None = None
    """Why the new version failed to start (Serve's message, with the replica's exception)."""
    rolled_back: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what `asyncrl.ctl swap-verifier` prints)."""
        return asdict(self)

    def get(self, key: str, default: Any = None) -> Any:
        """Mapping-style access, so callers may treat the report as a dict."""
        return getattr(self, key, default)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


def _verifier_cfg(cfg: Config | VerifierConfig) -> VerifierConfig:
    return cfg.verifier if isinstance(cfg, Config) else cfg


def resolve_port(cfg: VerifierConfig) -> VerifierConfig:
    """`port=0` -> a free port on `cfg.host` (Serve's proxy needs a concrete one)."""
    if cfg.port != 0:
        return cfg
    with socket.socket() as s:
        s.bind((cfg.host, 0))
        return cfg.model_copy(update={"port": s.getsockname()[1]})


def start_serve(cfg: VerifierConfig) -> None:
    """Start Serve (controller + HTTP proxy on cfg.host:cfg.port) unless it runs already. One Ray
    cluster has one Serve proxy: if Serve already runs, its host/port stay (Serve logs a warning)."""
    from ray import serve

    serve.start(http_options={"host": cfg.host, "port": cfg.port}, logging_config=serve_logging_config())


def deploy_verifier(cfg: Config | VerifierConfig, *, name: str = APP_NAME, route_prefix: str = "/",
                    rule_fn: Callable[[list[dict]], str] | None = None) -> Any:
    """Run the verifier application (Ray must be initialised); returns its DeploymentHandle.
    Raises RuntimeError with Serve's message when the version cannot start."""
    from ray import serve

    vcfg = resolve_port(_verifier_cfg(cfg))
    start_serve(vcfg)
    handle = serve.run(build_app(vcfg, rule_fn=rule_fn), name=name, route_prefix=route_prefix,
                       logging_config=serve_logging_config())
    _DEPLOYED[name] = (vcfg, rule_fn)
    logger.info("verifier %s (%s) serving at %s", vcfg.version, vcfg.backend, verifier_url(name))
    return handle


def verifier_url(name: str = APP_NAME, route_prefix: str = "/") -> str | None:
    """OpenAI base URL of an application this process deployed (None if it deployed none)."""
    if name not in _DEPLOYED:
        return None
    c = _DEPLOYED[name][0]
    return f"http://{c.host}:{c.port}{route_prefix.rstrip('/')}/v1"


def serving_info(name: str = APP_NAME, timeout_s: float = 30.0) -> dict[str, Any]:
    """`info()` of one replica of the running application (version, back-end, config)."""
    from ray import serve

    return serve.get_app_handle(name).info.remote().result(timeout_s=timeout_s)


def swap_verifier(new_cfg: Config | VerifierConfig, *, name: str = APP_NAME, route_prefix: str = "/",
                  rule_fn: Callable[[list[dict]], str] | None = None) -> SwapReport:
    """Deploy `new_cfg` over the running version with a rolling update; never leaves the app down."""
    from ray import serve

    vcfg = _verifier_cfg(new_cfg)
    old_cfg, old_rule_fn = _DEPLOYED.get(name, (None, None))
    try:
        info = serving_info(name)
        if old_cfg is None or old_cfg.version != info["version"]:
            old_cfg, old_rule_fn = VerifierConfig.model_validate(info["config"]), None
    except Exception as exc:  # nothing serves yet: a swap is then a plain deploy
        logger.warning("swap_verifier: no running %s application (%s); deploying %s", name, exc, vcfg.version)
        old_cfg = None
    t0 = time.perf_counter()
    try:
        serve.run(build_app(vcfg, rule_fn=rule_fn), name=name, route_prefix=route_prefix,
                  logging_config=serve_logging_config())
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}" + _deployment_message(name)
        logger.error("verifier %s failed to start: %s", vcfg.version, error)
        if old_cfg is None:
            return SwapReport(False, None, vcfg.version, None, time.perf_counter() - t0, error)
        # Serve kept the old replicas; redeploy the old config so the app is healthy again.
        serve.run(build_app(old_cfg, rule_fn=old_rule_fn), name=name, route_prefix=route_prefix,
                  logging_config=serve_logging_config())
        _DEPLOYED[name] = (old_cfg, old_rule_fn)
        return SwapReport(False, old_cfg.version, vcfg.version, serving_info(name)["version"],
                          time.perf_counter() - t0, error, rolled_back=True)
    _DEPLOYED[name] = (vcfg, rule_fn)
    return SwapReport(True, old_cfg.version if old_cfg else None, vcfg.version, serving_info(name)["version"],
                      time.perf_counter() - t0)


def _deployment_message(name: str) -> str:
    """The cause from Serve's status of the `Verifier` deployment: the last line of the replica's
    traceback (e.g. `ValueError: no rule verifier for task 'x'`) and Serve's summary sentence."""
    from ray import serve

    from asyncrl.serve.app import DEPLOYMENT_NAME

    try:
        dep = serve.status().applications[name].deployments[DEPLOYMENT_NAME]
    except Exception as exc:  # the report still carries Serve's own error
        logger.warning("could not read the deployment status of %s: %s", name, exc)
        return ""
    message = dep.message or ""
    summary, _, trace = message.partition("Error:")
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    cause = lines[-1] if lines else ""
    return f" -- cause: {cause} ({dep.status}: {summary.strip()})" if cause else f" ({dep.status}: {summary.strip()})"


def shutdown_verifier(name: str = APP_NAME) -> None:
    """Delete the application (its replicas drain first)."""
    from ray import serve

    serve.delete(name)
    _DEPLOYED.pop(name, None)
