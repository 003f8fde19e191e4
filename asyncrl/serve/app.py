"""The Ray Serve application `verifier`: one deployment, whose class is the configured back-end.

What each replica answers and guarantees is replica.py's; the back-ends are backends.py's. This
module only derives the deployment from the verifier config and binds it:
- The deployment is always named `Verifier`, whatever the back-end, so that a swap - even to
  another back-end - is a rolling update of one deployment. `max_surge_percent=100` makes Serve
  start the new replicas before stopping old ones (old ones drain their requests), and keeps the
  old replicas serving if the new version cannot start (see deploy.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from asyncrl.config import VerifierConfig
from asyncrl.serve.backends import BACKENDS

__all__ = ["APP_NAME", "DEPLOYMENT_NAME", "build_app", "deployment_options"]

APP_NAME = "verifier"
DEPLOYMENT_NAME = "Verifier"


def deployment_options(cfg: VerifierConfig, resources: dict[str, float] | None = None) -> dict[str, Any]:
    """Serve deployment options derived from the verifier config (replicas, resources, rollout);
    `resources`: extra Ray resources per replica (`cluster.resources.verifier`)."""
    actor: dict[str, Any] = {"num_cpus": cfg.cpus_per_replica, "num_gpus": cfg.gpus_per_replica}
    if resources:
        actor["resources"] = dict(resources)
    if cfg.backend == "vllm" and cfg.gpus_per_replica == 0:
        # vLLM's CPU build: a small KV cache and one OpenMP thread unless the user set them.
        actor["runtime_env"] = {"env_vars": {
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }}
    opts: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": actor,
        # A verifier request is cheap to queue on a replica; vLLM batches whatever it is given.
        "max_ongoing_requests": {"rule": 64, "vllm": 256, "http": max(8, 2 * cfg.http.concurrency)}[cfg.backend],
        # Start replacements before stopping old replicas; a failed version leaves the old serving.
        "max_surge_percent": 100,
        # Old replicas drain in-flight requests for up to one client deadline (longer is useless).
        "graceful_shutdown_timeout_s": cfg.client.deadline_s,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 5.0,
    }
    if cfg.autoscaling is not None:
        a = cfg.autoscaling
        opts["autoscaling_config"] = {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
                                      "target_ongoing_requests": a.target_ongoing_requests,
                                      "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s}
    else:
        opts["num_replicas"] = cfg.num_replicas
    return opts


def replica_kwargs(cfg: VerifierConfig, rule_fn: Callable[[list[dict]], str] | None = None,
                   small_machine: bool | None = None) -> dict[str, Any]:
    """The replica's arguments beside its config: the rule back-end's `rule_fn`, the vLLM back-end's
    `small_machine` (the job's resolved `cluster.small_machine`; None when no job config is known)."""
    if cfg.backend == "rule":
        return {"rule_fn": rule_fn} if rule_fn is not None else {}
    if cfg.backend == "vllm" and small_machine is not None:
        return {"small_machine": small_machine}
    return {}


def build_app(cfg: VerifierConfig, *, rule_fn: Callable[[list[dict]], str] | None = None,
              resources: dict[str, float] | None = None, small_machine: bool | None = None) -> Any:
    """The Serve application for `cfg` (not yet running; deploy.py runs it).

    `rule_fn` replaces `asyncrl.tasks.get_rule_verifier(cfg.task)` in the rule back-end (tests,
    custom tasks); it travels to the replicas with cloudpickle inside the cluster only.
    `small_machine`: `cluster.small_machine` of the job, for the vLLM back-end's engine core.
    """
    from ray import serve

    cls = serve.ingress()(BACKENDS[cfg.backend])
    deployment = serve.deployment(**deployment_options(cfg, resources))(cls)
    return deployment.bind(cfg.model_dump(), **replica_kwargs(cfg, rule_fn, small_machine))
