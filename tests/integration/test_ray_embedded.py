"""The embedded Ray cluster starts no idle workers the job cannot use (asyncrl.job.runtime.embedded_ray_options)
and none of the head daemons it does not use (asyncrl.small_machine.patches.lean_head).

Without the option, the raylet prestarts one default worker per CPU when the driver connects; they
have no runtime_env, so the job's actors (all created under the job's runtime_env) get workers of
their own and the prestarted ones stay idle while competing for the cores during start-up."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from asyncrl.cluster import job_runtime_env, probe_this_node
from asyncrl.config import Config
from asyncrl.job.runtime import embedded_ray_options
from asyncrl.small_machine.patches import lean_head

pytestmark = pytest.mark.integration


AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _python_workers(raylet: psutil.Process) -> set[int]:
    """The raylet's Python worker processes, idle or not: titled `ray::...` once up (`ray::IDLE`,
    `ray::Probe`), `default_worker.py` while starting; its two agents excluded."""
    workers = set()
    for child in raylet.children():
        try:
            command = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if (command.startswith("ray::") or "default_worker.py" in command) and not command.startswith(AGENTS):
            workers.add(child.pid)
    return workers


DAEMONS = ("dashboard/dashboard.py", "autoscaler/_private/monitor.py", "_private/log_monitor.py")


def _ray_scripts() -> set[str]:
    """Which of Ray's optional head daemons (`DAEMONS`) this process's own cluster runs (`ray.init`
    starts them as children of the driver; other clusters on the machine, e.g. another pytest-xdist
    worker's, are not counted)."""
    running = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = proc.cmdline()
        except psutil.Error:  # ended meanwhile
            continue
        running.update(d for d in DAEMONS for part in cmdline if part.endswith(d))
    return running


def test_embedded_cluster_starts_only_the_workers_its_actors_use() -> None:
    import ray

    cfg = Config.model_validate({"model": {"path": "policy-dir"}, "rollout": {"max_num_batched_tokens": 2048}})
    options = embedded_ray_options(cfg)
    assert options["include_dashboard"] is False and options["_node_ip_address"] == "127.0.0.1"
    runtime_env = job_runtime_env(cfg)  # the job's own: the package, its env vars, its worker setup hook
    runtime_env["env_vars"]["ASYNCRL_TEST_JOB_ENV"] = "1"
    with lean_head(log_monitor=False) as skipped:  # as asyncrl.job.runtime.ray_init starts it (quiet mode)
        ray.init(**options, runtime_env=runtime_env, logging_level="WARNING", log_to_driver=False)
    try:
        # no API server (`dashboard.py`: Ray starts it even with include_dashboard=False, and waits for
        # it), no autoscaler monitor, no log monitor (a plain ray.init starts all three: checked)
        assert skipped == ["api_server", "monitor", "log_monitor"]
        assert _ray_scripts() == set()
        raylet = next(p for p in psutil.Process().children(recursive=True) if p.name() == "raylet")
        probes = probe_this_node()  # the preflight's node probe on the embedded cluster
        node = ray.nodes()[0]
        assert [(p["node_id"], p["ip"]) for p in probes] == [(node["NodeID"], node["NodeManagerAddress"])]
        assert probes[0]["resources"]["CPU"] == options["num_cpus"]
        assert probes[0]["shm_bytes"] > 0 and probes[0]["interfaces"]
        time.sleep(3)
        assert _python_workers(raylet) == set()  # a probe task (asyncrl.cluster.probe_nodes) would leave one

        @ray.remote(num_cpus=0)
        class Probe:
            def pid(self) -> int:
                return os.getpid()

            def job_env(self) -> str:
                return os.environ.get("ASYNCRL_TEST_JOB_ENV", "")

            def imported(self, name: str) -> bool:
                import sys

                return name in sys.modules

        probe = Probe.remote()
        actor_pid = ray.get(probe.pid.remote(), timeout=120)
        assert ray.get(probe.job_env.remote(), timeout=60) == "1"  # the job's runtime_env reached the actor
        # its setup hook too: Ray's serialization context (built for the calls above) imported pyarrow
        # in every worker before (asyncrl.small_machine.patches)
        assert ray.get(probe.imported.remote("pyarrow"), timeout=60) is False
        time.sleep(3)  # a prestart is issued when the driver registers; give it time to show
        assert _python_workers(raylet) == {actor_pid}  # num_cpus (>= 4) idle workers without the option
    finally:
        ray.shutdown()


def test_verbose_mode_keeps_the_log_monitor_and_ray_is_restored_after() -> None:
    # log_to_driver (asyncrl's verbose mode) needs the log monitor: it publishes the workers' lines
    import ray
    from ray._private.node import Node

    originals = (Node.start_api_server, Node.start_monitor, Node.start_log_monitor)
    with lean_head(log_monitor=True) as skipped:
        ray.init(num_cpus=1, include_dashboard=False, logging_level="WARNING", log_to_driver=True)
    try:
        assert skipped == ["api_server", "monitor"]
        assert _ray_scripts() == {"_private/log_monitor.py"}
    finally:
        ray.shutdown()
    assert (Node.start_api_server, Node.start_monitor, Node.start_log_monitor) == originals
