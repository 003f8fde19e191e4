"""Ray with only what an asyncrl job uses: two parts of Ray's own start-up that cost every launch
seconds and give the job nothing. Both reach into Ray's private modules (checked against Ray 2.60);
where a name moved, each leaves Ray as it is and logs why, so a Ray upgrade costs speed, not a run.

1. **Arrow serializers** (`defer_arrow_serializers`, run in every process of the job: the job's
   `worker_process_setup_hook`, asyncrl.cluster.job_runtime_env, and the launcher before `ray.init`).
   Ray builds one serialization context per job in every worker and in the driver, and building it
   imports pyarrow (`ray.util.serialization_addons.apply` -> `ray._private.arrow_serialization.
   _register_custom_datasets_serializers`, faster reducers for Ray Data's Arrow tables). No process
   of an asyncrl job sends Arrow data through Ray, yet each paid that import, in the launcher,
   coordinator, buffer, weight store, learner and rollout actor of a quick start. The replacement registers them only
   where pyarrow is already imported (a driver that read parquet through `datasets`, say). What a
   skipped process loses: an Arrow table it returns through Ray later is pickled by pyarrow's own
   `__reduce__` (correct; a slice then carries its whole buffer). A receiving process needs no
   registration (the rebuild function travels with the data).

2. **The embedded head's idle daemons** (`lean_head`, the embedded single-host cluster only).
   - The API server: `ray.init(include_dashboard=False)` still starts `dashboard.py` with only its
     usage-stats module (Ray's own TODO: "Modules like job or state APIs should be loaded although
     dashboard is disabled") and then polls, before the raylet is even started, until that process
     has booted and written its address, on every launch's critical path (mostly `time.sleep`),
     for a process that serves nothing here (the job and state APIs
     are not loaded without the dashboard; the Makefile sets RAY_USAGE_STATS_ENABLED=0, and where
     usage stats are on they are simply not reported from an embedded job). Without it, Ray behaves
     as when the dashboard fails to start: `dashboard_url` is None.
   - The autoscaler monitor (`monitor.py`): a single host with no autoscaling config has nothing to
     scale, yet it takes CPU while the job starts and polls after. What is lost:
     `ray status` against the embedded cluster shows no autoscaler report (Ray Serve's replica
     autoscaling is its controller's, not this process's).
   - The log monitor (`log_monitor.py`), only when nothing reads what it streams: it tails every
     worker's log files to publish their lines to the driver, which prints them only with
     `log_to_driver` (asyncrl's verbose mode; quiet, the actors write to <run_dir>/logs/ and the
     driver prints its own lines); it takes CPU while the job starts and polls the log directory for
     the whole run.
   What each of these saves, measured: docs/benchmarks.md, "Start-up".
   A cluster the job joins (`cluster.ray_address`) is started by `ray start` and keeps all of them.

Tests: tests/unit/test_role_imports.py (Ray's addons with and without the deferral),
tests/integration/test_ray_embedded.py (a real embedded cluster: no API server, autoscaler monitor or
quiet-mode log monitor process, and a worker under the job's runtime_env that has not imported pyarrow).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_ARROW_REGISTER = "_register_custom_datasets_serializers"


def defer_arrow_serializers() -> bool:
    """Replace Ray's Arrow serializer registration with one that runs only where pyarrow is already
    imported. Returns whether the replacement is in place (idempotent)."""
    try:
        from ray._private import arrow_serialization
    except ImportError:
        logger.info("ray._private.arrow_serialization not found: Ray's Arrow serializers left as they are")
        return False
    register = getattr(arrow_serialization, _ARROW_REGISTER, None)
    if register is None:
        logger.info("ray._private.arrow_serialization.%s not found: left as it is", _ARROW_REGISTER)
        return False
    if getattr(register, "_asyncrl_deferred", False):
        return True

    def register_if_arrow_loaded(serialization_context: object) -> None:
        if "pyarrow" in sys.modules:
            register(serialization_context)

    register_if_arrow_loaded._asyncrl_deferred = True  # type: ignore[attr-defined]
    setattr(arrow_serialization, _ARROW_REGISTER, register_if_arrow_loaded)
    return True


def worker_setup() -> None:
    """The job's `worker_process_setup_hook`: runs in every Ray worker of the job before its first task."""
    defer_arrow_serializers()


@contextlib.contextmanager
def lean_head(log_monitor: bool) -> Iterator[list[str]]:
    """Around the `ray.init` that starts the embedded head: the head starts no API server (and
    does not wait for one), no autoscaler monitor and, unless `log_monitor` (the driver prints its
    workers' lines: `log_to_driver`), no log monitor. Yields the daemons left out (empty where Ray's
    private names moved: Ray then starts them as usual, with a log line); restores Ray after."""
    try:
        from ray._private.node import Node
    except ImportError:
        logger.info("ray._private.node.Node not found: the embedded head starts all its daemons as usual")
        yield []
        return
    daemons = ["start_api_server", "start_monitor"] + ([] if log_monitor else ["start_log_monitor"])
    originals = {name: getattr(Node, name) for name in daemons if callable(getattr(Node, name, None))}
    for name in sorted(set(daemons) - set(originals)):
        logger.info("ray._private.node.Node.%s not found: the embedded head starts it as usual", name)

    def skipping(name: str):
        def skip(self: Node, *args: object, **kwargs: object) -> None:
            logger.debug("embedded head: %s skipped (asyncrl.ray_lean.lean_head)", name)
        return skip

    for name in originals:
        setattr(Node, name, skipping(name))
    try:
        yield [name.removeprefix("start_") for name in originals]
    finally:
        for name, original in originals.items():
            setattr(Node, name, original)
