"""Roles never import each other (README: "No role imports another"): the rollout actors
(`asyncrl/actors`), the learner (`asyncrl/learner`), the replay buffer (`asyncrl/replay`) and the
verifier service (`asyncrl/serve`) import no other role, except a service's client, the one door to
it (`replay.client`, `replay.window`, `serve.client`); `asyncrl/weights` (the wire the learner and the
actors share) imports no role at all. The driver (`asyncrl/job`) wires the roles and may import them.
A static check over the source with `ast` (function-level imports count
too), so it also holds for imports that only run on a GPU or inside an actor. Below: processes that must not import
the heavy libraries they do not use (torch, datasets, and pyarrow through Ray's serialization context),
each checked in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "asyncrl"
ROLES = ("actors", "learner", "replay", "serve")
# a role's door for the others: the modules its clients are in
CLIENTS = ("asyncrl.replay.client", "asyncrl.replay.window", "asyncrl.serve.client")
RULES = {role: tuple(f"asyncrl.{other}" for other in ROLES if other != role) for role in ROLES}
RULES["weights"] = tuple(f"asyncrl.{role}" for role in ROLES)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file; `from asyncrl import learner` counts as asyncrl.learner."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def forbidden_imports(role: str) -> list[str]:
    banned = RULES[role]
    return [f"{path.relative_to(PACKAGE.parent)}:{line} imports {mod}"
            for path in sorted((PACKAGE / role).rglob("*.py"))
            for line, mod in imported_modules(path)
            if any(mod == b or mod.startswith(b + ".") for b in banned)
            and not (role != "weights" and any(mod == c or mod.startswith(c + ".") for c in CLIENTS))]


@pytest.mark.parametrize("role", sorted(RULES))
def test_role_does_not_import_another_role(role):
    assert forbidden_imports(role) == []


def test_every_role_the_readme_names_is_checked():
    assert set(RULES) == {"actors", "learner", "replay", "serve", "weights"}
    assert all((PACKAGE / role).is_dir() for role in RULES)


def test_the_check_sees_function_level_and_from_imports(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from asyncrl import learner\n    import asyncrl.actors.engine\n")
    mods = [m for _, m in imported_modules(planted)]
    assert "asyncrl.learner" in mods and "asyncrl.actors.engine" in mods


@pytest.mark.parametrize("what, code", [
    # The `WeightStore` actor's process imports only the module of its class: with torch at that
    # module's top it spent ~1.5 CPU-s of every launch's start-up on torch, for an int and an ObjectRef.
    ("the weight store actor", "import asyncrl.weights.store"),
    # The launcher builds the job's runtime_env (with the one NCCL_CUMEM_ENABLE) before Ray starts:
    # through `weights.group` that imported torch into the launcher (1.5 s of its start-up).
    ("the launcher's runtime_env", "from asyncrl.cluster import job_runtime_env; from asyncrl.config import Config; "
                                   "job_runtime_env(Config())"),
    # The launcher's data step (rows + overlong filter, beside the start-up): AutoTokenizer and HF
    # datasets imported torch, pandas and pyarrow there (~4 CPU-s on 2 cores).
    ("the launcher's data step", "from asyncrl.config import load_config; from asyncrl.data import load_training_rows; "
                                 "load_training_rows(load_config('configs/quickstart.yaml', []))"),
    # The launcher's TensorBoard sink (the quick start's): torch.utils.tensorboard imported torch (1.5 s).
    ("the launcher's metric sinks", "import tempfile; from asyncrl.metrics import MetricLogger; "
                                    "MetricLogger(tempfile.mkdtemp(), ['jsonl', 'tensorboard'], 'p', 'e', {}).log(1, {'a': 1.0})"),
])
def test_torch_free_processes_import_no_torch(what, code):
    """A fresh interpreter runs the code and reports what came with it."""
    code += "; import sys; print(sorted(m for m in ('torch', 'datasets') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", f"{what}: {out.stdout}"


_SERIALIZATION_CONTEXT = """
import sys
{pre}
from ray.util import serialization_addons

class Recorder:  # stands in for Ray's SerializationContext: records what registers a serializer
    def __init__(self):
        self.types = []
    def _register_cloudpickle_serializer(self, cls, custom_serializer, custom_deserializer):
        self.types.append(cls.__module__.split(".")[0])
    def _register_cloudpickle_reducer(self, cls, reducer):
        self.types.append(cls.__module__.split(".")[0])

ctx = Recorder()
serialization_addons.apply(ctx)  # what Ray runs when it builds a process's serialization context
print("pyarrow" in sys.modules, "pyarrow" in ctx.types)
"""


@pytest.mark.parametrize("pre, expected", [
    # Ray's own behaviour (the reason for the hook): building the context imports pyarrow (~0.5-1 s)
    # and registers Ray Data's Arrow serializers, in every process of the job
    ("", "True True"),
    # with the hook (every worker of the job, and the launcher before ray.init): no pyarrow
    ("from asyncrl.small_machine.patches import defer_arrow_serializers; assert defer_arrow_serializers()", "False False"),
    # a process that already uses Arrow keeps Ray's serializers
    ("import pyarrow; from asyncrl.small_machine.patches import defer_arrow_serializers; defer_arrow_serializers()", "True True"),
])
def test_ray_serialization_context_imports_pyarrow_only_where_it_is_used(pre, expected):
    out = subprocess.run([sys.executable, "-c", _SERIALIZATION_CONTEXT.format(pre=pre)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == expected.split()
