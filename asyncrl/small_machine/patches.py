"""Every use of a dependency's private internals, in one place: one function per patch, each naming
the version it was checked against (`PATCHES`). Where a name moved, each leaves the dependency as it
is and logs why, so an upgrade costs speed, not a run; tests/unit/test_patches.py fails when an
installed version no longer has a patched name, so the move is seen at once.

Ray (checked against 2.60):
1. **Arrow serializers** (`defer_arrow_serializers`, run in every process of the job: the job's
   `worker_process_setup_hook`, asyncrl.cluster.job_runtime_env, and the launcher before `ray.init`).
   Ray builds one serialization context per job in every worker and in the driver, and building it
   imports pyarrow (`ray.util.serialization_addons.apply` -> `ray._private.arrow_serialization.
   _register_custom_datasets_serializers`, faster reducers for Ray Data's Arrow tables). No process
   of an asyncrl job sends Arrow data through Ray, yet each paid that import (about half a CPU-second
   per process on a small machine). The replacement registers them only where pyarrow is already
   imported (a driver that read parquet through `datasets`, say). What a skipped process loses: an
   Arrow table it returns through Ray later is pickled by pyarrow's own `__reduce__` (correct; a
   slice then carries its whole buffer). A receiving process needs no registration.
2. **The embedded head's idle daemons** (`lean_head`, the embedded single-host cluster, small
   machines only: `cluster.small_machine`).
   - The API server: `ray.init(include_dashboard=False)` still starts `dashboard.py` with only its
     usage-stats module (Ray's own TODO: "Modules like job or state APIs should be loaded although
     dashboard is disabled") and then polls, before the raylet is even started, until that process
     has booted and written its address, for a process that serves nothing here. Without it, Ray
     behaves as when the dashboard fails to start: `dashboard_url` is None.
   - The autoscaler monitor (`monitor.py`): a single host with no autoscaling config has nothing to
     scale. What is lost: `ray status` against the embedded cluster shows no autoscaler report (Ray
     Serve's replica autoscaling is its controller's, not this process's).
   - The log monitor (`log_monitor.py`), only when nothing reads what it streams: it tails every
     worker's log files for the driver, which prints them only with `log_to_driver` (asyncrl's
     verbose mode; quiet, the actors write to <run_dir>/logs/ and the driver prints its own lines).
   A cluster the job joins (`cluster.ray_address`) is started by `ray start` and keeps all of them.

vLLM (checked against 0.32.0):
3. **An engine core forked from a Ray actor** (`vllm_forks_in_ray_actor`, used by
   `asyncrl.engine_setup.engine_core_forked` on CPU): vLLM's `get_mp_context` turns a requested fork
   into a spawn inside a Ray actor (`vllm.utils.system_utils.is_in_ray_actor`); the patch answers
   False for the duration of one engine build.
4. **Does vLLM serve an architecture with LoRA?** (`vllm_model_class`): vLLM has no public lookup of
   a model class by architecture name without building an engine; `ModelRegistry._try_load_model_cls`
   is the one it uses itself.
5. **An input embedding packed for a GEMM only when one runs** (`vllm_embedding_packs_lazily`, applied in
   every engine worker by `asyncrl.actors.worker_extension`): on CPU, vLLM's
   `UnquantizedEmbeddingMethod.process_weights_after_loading` builds a GEMM kernel (a oneDNN packed
   copy of the whole matrix) for every vocabulary embedding, also the input `embed_tokens`, whose
   forward is a lookup (`F.embedding`) that never calls it; at Qwen2.5-0.5B's 151,936 x 896 fp32 that
   is 0.54 GB of memory and a repack on every weight reload. The replacement leaves a `ParallelLMHead`
   as it was and gives any other embedding a `cpu_linear` that packs on its first call (a model that
   uses its embedding as the head still gets its kernel, once per load).

Tests: tests/unit/test_patches.py (every patched name exists in the installed versions),
tests/unit/test_role_imports.py (Ray's addons with and without the deferral),
tests/integration/test_ray_embedded.py (a real embedded cluster: no API server, autoscaler monitor or
quiet-mode log monitor process, and a worker under the job's runtime_env that has not imported pyarrow),
tests/unit/test_embedding_pack.py (patch 5 against vLLM's real embedding method) and
tests/integration/test_engine_tied.py (a tied model's logprobs after a reload, both weight paths).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass

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
            logger.debug("embedded head: %s skipped (asyncrl.small_machine.patches.lean_head)", name)
        return skip

    for name in originals:
        setattr(Node, name, skipping(name))
    try:
        yield [name.removeprefix("start_") for name in originals]
    finally:
        for name, original in originals.items():
            setattr(Node, name, original)


@dataclass(frozen=True)
class Patch:
    """One use of a dependency's internals: the module and attribute it reaches, and the version of
    the dependency it was checked against."""

    function: str
    package: str
    checked_against: str
    module: str
    attribute: str


PATCHES: tuple[Patch, ...] = (
    Patch("defer_arrow_serializers", "ray", "2.60.0", "ray._private.arrow_serialization", _ARROW_REGISTER),
    Patch("lean_head", "ray", "2.60.0", "ray._private.node", "Node.start_api_server"),
    Patch("lean_head", "ray", "2.60.0", "ray._private.node", "Node.start_monitor"),
    Patch("lean_head", "ray", "2.60.0", "ray._private.node", "Node.start_log_monitor"),
    Patch("vllm_forks_in_ray_actor", "vllm", "0.32.0", "vllm.utils.system_utils", "is_in_ray_actor"),
    Patch("vllm_model_class", "vllm", "0.32.0", "vllm.model_executor.models", "ModelRegistry._try_load_model_cls"),
    Patch("vllm_embedding_packs_lazily", "vllm", "0.32.0", "vllm.model_executor.layers.vocab_parallel_embedding",
          "UnquantizedEmbeddingMethod.process_weights_after_loading"),
    Patch("vllm_embedding_packs_lazily", "vllm", "0.32.0", "vllm.model_executor.layers.utils",
          "dispatch_cpu_unquantized_gemm"),
)


def missing_targets(patches: tuple[Patch, ...] = PATCHES) -> list[str]:
    """The patched names the installed dependencies no longer have (imports each module)."""
    import importlib

    missing = []
    for patch in patches:
        try:
            obj: object = importlib.import_module(patch.module)
        except ImportError:
            missing.append(f"{patch.module} (for {patch.function}; checked against {patch.package} {patch.checked_against})")
            continue
        for part in patch.attribute.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                missing.append(f"{patch.module}.{patch.attribute} (for {patch.function}; "
                               f"checked against {patch.package} {patch.checked_against})")
                break
    return missing


@contextlib.contextmanager
def vllm_forks_in_ray_actor() -> Iterator[None]:
    """vLLM believes it is not in a Ray actor inside, so a requested fork of its engine core stays a
    fork (`get_mp_context`). Restored after. Where the name moved, nothing is patched (vLLM then
    spawns, as it would anyway), with a log line."""
    import vllm.utils.system_utils as vllm_system

    saved = getattr(vllm_system, "is_in_ray_actor", None)
    if saved is None:
        logger.info("vllm.utils.system_utils.is_in_ray_actor not found: the engine core is spawned")
        yield
        return
    vllm_system.is_in_ray_actor = lambda: False
    try:
        yield
    finally:
        vllm_system.is_in_ray_actor = saved


def vllm_model_class(architecture: str) -> type | None:
    """vLLM's model class for `architecture` (None when vLLM does not know it), without an engine."""
    from vllm.model_executor.models import ModelRegistry

    lookup = getattr(ModelRegistry, "_try_load_model_cls", None)
    if lookup is None:
        logger.info("vllm ModelRegistry._try_load_model_cls not found: architecture %s treated as unknown", architecture)
        return None
    return lookup(architecture)


def vllm_embedding_packs_lazily(enabled: bool = True) -> bool:
    """On CPU, an embedding that is not a `ParallelLMHead` gets a `cpu_linear` that builds its GEMM
    kernel on first use instead of at every load (idempotent; `enabled=False` puts vLLM's own
    method back, for the benchmark's A/B). Returns whether the replacement is in place; where a
    name moved, vLLM is left as it is (every embedding packed, as before), with a log line."""
    import weakref

    try:
        from vllm.model_executor.layers import utils as vllm_layer_utils
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            UnquantizedEmbeddingMethod,
        )
        from vllm.platforms import current_platform
    except ImportError:
        logger.info("vllm's vocab_parallel_embedding not found: every embedding is packed at load, as before")
        return False
    current = getattr(UnquantizedEmbeddingMethod, "process_weights_after_loading", None)
    dispatch = getattr(vllm_layer_utils, "dispatch_cpu_unquantized_gemm", None)
    if current is None or dispatch is None:
        logger.info("vllm's embedding packing hooks not found: every embedding is packed at load, as before")
        return False
    original = getattr(current, "_asyncrl_original", current)
    if not enabled:
        UnquantizedEmbeddingMethod.process_weights_after_loading = original
        return False
    if original is not current:
        return True

    def process_weights_after_loading(self: object, layer: object) -> None:
        if not current_platform.is_cpu() or isinstance(layer, ParallelLMHead):
            original(self, layer)
            return
        ref = weakref.ref(layer)  # no cycle through the layer's own attribute

        def pack_then_run(x: object, weight: object, bias: object) -> object:
            owner = ref()
            dispatch(owner, remove_weight=False)  # replaces owner.cpu_linear with the packed kernel
            return owner.cpu_linear(x, weight, bias)

        layer.cpu_linear = pack_then_run  # type: ignore[attr-defined]

    process_weights_after_loading._asyncrl_original = original  # type: ignore[attr-defined]
    UnquantizedEmbeddingMethod.process_weights_after_loading = process_weights_after_loading
    return True
