"""What every process of a job runs before Ray serializes anything in it: the job's
`worker_process_setup_hook` (asyncrl.cluster.job_runtime_env) and the launcher before `ray.init`.

Ray builds one serialization context per job in every worker and in the driver, and building it
imports pyarrow (`ray.util.serialization_addons.apply` -> `ray._private.arrow_serialization.
_register_custom_datasets_serializers`, which registers faster reducers for Arrow tables and arrays
for Ray Data). No process of an asyncrl job sends Arrow data through Ray, yet each paid that import:
~0.5 CPU-s per process on this project's 2-core machine (~1 s in a slow hour), seven to nine
processes in a quick start launch (the launcher, coordinator, buffer, weight store, learner, rollout
actor, Serve's controller and replica), all of it before the first step.

`defer_arrow_serializers` keeps Ray's registration for a process that has already imported pyarrow
(a driver that read parquet through `datasets`, for example) and skips it otherwise. What a skipped
process loses: if it later imports pyarrow and returns an Arrow table through Ray, that table is
pickled by pyarrow's own `__reduce__` instead of Ray's reducer (correct, but a slice carries its
whole buffer). A process receiving Arrow data needs no registration (the reducer's rebuild function
travels with the data).

Checked against Ray 2.60 (`tests/unit/test_role_imports.py` launches a real Ray worker with the hook
and asserts it has not imported pyarrow, and that Ray Data's serializers still register where pyarrow
is already imported). If Ray renames the function, the hook leaves Ray as it is and logs why.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

_TARGET = "_register_custom_datasets_serializers"


def defer_arrow_serializers() -> bool:
    """Replace Ray's Arrow serializer registration with one that runs only where pyarrow is already
    imported. Returns whether the replacement is in place (idempotent)."""
    try:
        from ray._private import arrow_serialization
    except ImportError:  # no Ray here, or it moved the module: nothing to defer
        logger.info("ray._private.arrow_serialization not found: Ray's Arrow serializers left as they are")
        return False
    register = getattr(arrow_serialization, _TARGET, None)
    if register is None:
        logger.info("ray._private.arrow_serialization.%s not found: left as it is", _TARGET)
        return False
    if getattr(register, "_asyncrl_deferred", False):
        return True

    def register_if_arrow_loaded(serialization_context: object) -> None:
        if "pyarrow" in sys.modules:
            register(serialization_context)

    register_if_arrow_loaded._asyncrl_deferred = True  # type: ignore[attr-defined]
    setattr(arrow_serialization, _TARGET, register_if_arrow_loaded)
    return True


def setup() -> None:
    """The job's `worker_process_setup_hook`: runs in every Ray worker of the job before its first task."""
    defer_arrow_serializers()
