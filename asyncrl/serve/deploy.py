"""Deploy the verifier application and swap its version live.

`deploy_verifier(cfg)` starts Serve's HTTP proxy on `verifier.host:verifier.port` (if Serve is not
running yet; none with `verifier.ingress=false`) and runs the `verifier` application; it returns
the application's handle.

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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from asyncrl.addresses import WILDCARDS, bind_and_advertise, free_port, is_loopback
from asyncrl.config import Config, VerifierConfig
from asyncrl.logs import serve_logging_config
from asyncrl.serve.app import APP_NAME, build_app

logger = logging.getLogger("asyncrl.serve")

# What this process deployed last, per app name: needed to roll back a failed swap when the old
# config carried a custom rule function (the replicas' own `info()` is the fallback).
_DEPLOYED: dict[str, tuple[VerifierConfig, Callable | None]] = {}
# Extra Ray resources of the replicas (`cluster.resources.verifier`), kept for later swaps.
_RESOURCES: dict[str, dict[str, float]] = {}
_SMALL_MACHINE: dict[str, bool | None] = {}  # app name -> the job's cluster.small_machine (swaps keep it)


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


def ingress_hosts(cfg: VerifierConfig) -> tuple[str, str, str | None]:
    """`(bind, advertise, proxy_location)` of the HTTP ingress (rule of asyncrl.addresses). A
    node address or a wildcard puts Serve's one proxy on the head node and advertises the head's
    IP; loopback keeps Serve's default placement (a proxy per node, each on its own loopback)."""
    if cfg.host == "node" or cfg.host in WILDCARDS:
        head = head_node_ip()
        return (head if cfg.host == "node" else "0.0.0.0"), head, "HeadOnly"
    bind, advertise = bind_and_advertise(cfg.host)
    return bind, advertise, None


def head_node_ip() -> str:
    import ray

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


def resolve_port(cfg: VerifierConfig, port_range: str | None = None) -> VerifierConfig:
    """`port=0` -> a free port (from `port_range` when set; Serve's proxy needs a concrete one)."""
    if cfg.port != 0 or not cfg.ingress:
        return cfg
    bind = "127.0.0.1" if is_loopback(bind_and_advertise(cfg.host)[0]) else "0.0.0.0"
    return cfg.model_copy(update={"port": free_port(bind, port_range)})


def start_serve(cfg: VerifierConfig) -> VerifierConfig:
    """Start Serve (controller + HTTP proxy on the ingress address) unless it runs already; returns
    `cfg` with `host` = the advertised address. One Ray cluster has one Serve: if Serve already
    runs, its host/port stay (Serve logs a warning). `ingress=False`: the controller only, no proxy
    (Serve's `proxy_location=Disabled`); the application is reached through handles."""
    from ray import serve

    if not cfg.ingress:
        serve.start(proxy_location="Disabled", logging_config=serve_logging_config())
        return cfg
    bind, advertise, location = ingress_hosts(cfg)
    serve.start(http_options={"host": bind, "port": cfg.port}, logging_config=serve_logging_config(),
                **({"proxy_location": location} if location else {}))
    return cfg.model_copy(update={"host": advertise})


def deploy_verifier(cfg: Config | VerifierConfig, *, name: str = APP_NAME, route_prefix: str = "/",
                    rule_fn: Callable[[list[dict]], str] | None = None) -> Any:
    """Run the verifier application (Ray must be initialised); returns its DeploymentHandle.
    Raises RuntimeError with Serve's message when the version cannot start."""
    from ray import serve

    port_range = cfg.cluster.port_range if isinstance(cfg, Config) else None
    if isinstance(cfg, Config) and cfg.cluster.resources.get("verifier"):
        _RESOURCES[name] = cfg.cluster.resources["verifier"]
    _SMALL_MACHINE[name] = cfg.cluster.small_machine if isinstance(cfg, Config) else None
    vcfg = start_serve(resolve_port(_verifier_cfg(cfg), port_range))
    try:
        handle = serve.run(build_app(vcfg, rule_fn=rule_fn, resources=_RESOURCES.get(name),
                                     small_machine=_SMALL_MACHINE[name]), name=name,
                           route_prefix=route_prefix, logging_config=serve_logging_config())
    except RuntimeError as exc:  # Serve's sentence; the replica's own error (asyncrl.startup) is in its status
        raise RuntimeError(f"{exc}\n{_deployment_status(name)}") from exc
    _DEPLOYED[name] = (vcfg, rule_fn)
    logger.info("verifier %s (%s) serving at %s", vcfg.version, vcfg.backend, verifier_url(name))
    return handle


def verifier_url(name: str = APP_NAME, route_prefix: str = "/") -> str | None:
    """OpenAI base URL of an application this process deployed (None if it deployed none, or
    without an HTTP ingress)."""
    if name not in _DEPLOYED or not _DEPLOYED[name][0].ingress:
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
    if isinstance(new_cfg, Config):
        _SMALL_MACHINE[name] = new_cfg.cluster.small_machine
    small = _SMALL_MACHINE.get(name)
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
        serve.run(build_app(vcfg, rule_fn=rule_fn, resources=_RESOURCES.get(name), small_machine=small), name=name,
                  route_prefix=route_prefix, logging_config=serve_logging_config())
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}" + _deployment_message(name)
        logger.error("verifier %s failed to start: %s", vcfg.version, error)
        if old_cfg is None:
            return SwapReport(False, None, vcfg.version, None, time.perf_counter() - t0, error)
        # Serve kept the old replicas; redeploy the old config so the app is healthy again.
        serve.run(build_app(old_cfg, rule_fn=old_rule_fn, resources=_RESOURCES.get(name), small_machine=small),
                  name=name,
                  route_prefix=route_prefix, logging_config=serve_logging_config())
        _DEPLOYED[name] = (old_cfg, old_rule_fn)
        return SwapReport(False, old_cfg.version, vcfg.version, serving_info(name)["version"],
                          time.perf_counter() - t0, error, rolled_back=True)
    _DEPLOYED[name] = (vcfg, rule_fn)
    return SwapReport(True, old_cfg.version if old_cfg else None, vcfg.version, serving_info(name)["version"],
                      time.perf_counter() - t0)


def _deployment_status(name: str) -> str:
    """Serve's status message of the `Verifier` deployment (with the replica's traceback), or ""."""
    from ray import serve

    from asyncrl.serve.app import DEPLOYMENT_NAME

    try:
        return serve.status().applications[name].deployments[DEPLOYMENT_NAME].message or ""
    except Exception as exc:  # the caller still has Serve's own error
        logger.warning("could not read the deployment status of %s: %s", name, exc)
        return ""


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
