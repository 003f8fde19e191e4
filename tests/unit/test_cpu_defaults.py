"""The CPU-specific defaults derived from the hardware in one place (`asyncrl.config.roles`):
vLLM's worker in-process, torch.compile off and the rollout niced on CPU, nothing changed on GPU,
each overridable."""

import subprocess
import sys

import pytest

from asyncrl.config import Config, rollout_cpu_nice
from asyncrl.engine_setup import engine_env


def test_cpu_engines_run_their_worker_in_process_unless_told_not_to(monkeypatch):
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    assert engine_env(0, None)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert engine_env(0, True)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert engine_env(0, False)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_cpu_engines_skip_torch_compile_unless_the_environment_asks_for_it(monkeypatch):
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    assert engine_env(0, None)["TORCH_COMPILE_DISABLE"] == "1"
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")  # a user who wants vLLM's compiled sampler helper
    assert engine_env(0, None)["TORCH_COMPILE_DISABLE"] == "0"


def test_the_compile_switch_reaches_an_already_imported_torch():
    """vLLM's import loads torch._dynamo.config, which reads TORCH_COMPILE_DISABLE only then: the
    switch must also be set on the module, and a torch.compile'd function then runs eagerly (no
    Dynamo frame is compiled). A fresh interpreter: the switch is process-wide."""
    code = """
import os, torch, torch._dynamo.config as dynamo
from torch._dynamo.utils import counters
from asyncrl.engine_setup import apply_engine_env, engine_env
os.environ.pop("TORCH_COMPILE_DISABLE", None)
assert not dynamo.disable
apply_engine_env(engine_env(0, None))
assert dynamo.disable and os.environ["TORCH_COMPILE_DISABLE"] == "1"
f = torch.compile(lambda x, v: (x >= v).sum(-1))
out = f(torch.tensor([[1.0, 3.0, 2.0]]), torch.tensor([[2.0]]))
assert out.tolist() == [2], out
assert counters["frames"]["total"] == 0, dict(counters["frames"])
print("ok")
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TORCH_COMPILE_DISABLE"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_gpu_engines_keep_vllms_own_choice():
    assert engine_env(1, None) == {}
    assert engine_env(4, True) == {}  # tensor parallelism needs the worker processes


def test_the_rollout_yields_the_cpu_to_the_learner_on_cpu_only():
    assert rollout_cpu_nice(0, None) == 19  # Ray's workers start at 15: only 16..19 yield to the learner
    assert rollout_cpu_nice(1, None) is None  # GPU: left as Ray started it
    assert rollout_cpu_nice(0, 0) == 0
    assert rollout_cpu_nice(2, 5) == 5


def test_the_config_fields_default_to_derived():
    cfg = Config()
    assert cfg.rollout.cpu_nice is None and cfg.rollout.engine_in_process is None


def _nice_after(code: str) -> int:
    """Niceness a fresh interpreter started at 15 (like a Ray worker) ends with after `code`."""
    import subprocess
    import sys

    out = subprocess.run(["nice", "-n", "15", sys.executable, "-c", f"import os; {code}; print(os.nice(0))"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_a_rollout_actor_renices_itself_absolutely_and_only_upwards():
    assert _nice_after("from asyncrl.small_machine.process import renice; renice(19)") == 19
    assert _nice_after("from asyncrl.small_machine.process import renice; renice(19); renice(19)") == 19  # not 38
    assert _nice_after("from asyncrl.small_machine.process import renice; renice(10)") == 15  # never lowered
    assert _nice_after("from asyncrl.small_machine.process import renice; renice(None)") == 15


def test_an_engine_built_at_rays_niceness_is_reniced_with_its_children_afterwards():
    # The rollout actor builds its engine at Ray's 15 (the first step waits for it), then gives
    # itself and the engine core it spawned meanwhile `rollout.cpu_nice`: here a child started at
    # 15 ends at 19, and one the test already put at 19 is left (never lowered).
    code = ("import subprocess, sys, psutil; from asyncrl.small_machine.process import renice, renice_children; "
            "a = subprocess.Popen(['sleep', '30']); b = subprocess.Popen(['nice', '-n', '4', 'sleep', '30']); "
            "import time; time.sleep(0.3); renice(19); renice_children(19); "
            "print(psutil.Process(a.pid).nice(), psutil.Process(b.pid).nice()); a.kill(); b.kill()")
    import subprocess
    import sys

    out = subprocess.run(["nice", "-n", "15", sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["19", "19"]


def test_a_cpu_learner_takes_back_rays_niceness_where_it_may():
    after = _nice_after("from asyncrl.small_machine.process import raise_priority; raise_priority()")
    # where a process may lower its niceness (root with CAP_SYS_NICE): back to 0; otherwise
    # unchanged, and no error
    may = _nice_after("exec('try: os.nice(-1)\\nexcept OSError: pass')") == 14
    assert after == (0 if may else 15)


def test_a_cpu_learner_builds_at_19_only_where_it_can_raise_itself_again():
    """During start-up the engine builds are the critical path: a CPU learner builds at 19 and then
    raises itself (`raise_priority`), but only where raising is permitted; otherwise a learner
    left at 19 would lose to the engines for the whole job, so it stays where Ray started it."""
    import os

    if os.geteuid() == 0:  # root (this machine, CI): builds at 19, then trains at 0
        assert _nice_after("from asyncrl.small_machine.process import yield_while_building as y, raise_priority as r; "
                           "assert y() is True and os.nice(0) == 19; r()") == 0
    unprivileged = ("import os as o; real = o.setpriority\n"
                    "def deny(which, who, prio):\n"
                    "    if prio < o.getpriority(which, who): raise PermissionError(13, 'denied')\n"
                    "    real(which, who, prio)\n"
                    "o.setpriority = deny\n"
                    "from asyncrl.small_machine.process import yield_while_building as y; assert y() is False")
    assert _nice_after(f"exec({unprivileged!r})") == 15  # not yielded: nothing changed


def test_gc_paused_turns_the_collector_off_inside_and_restores_it():
    """`asyncrl.small_machine.process.gc_paused` (around the rollout actor's and the learner's imports): off inside,
    as it was after, also after an error, and never turned on by it where it was off."""
    import gc

    from asyncrl.small_machine.process import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested (the actor's imports, then the engine's inside them)
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner one restores "off", not "on"
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("a failed import")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()


def test_the_engine_core_is_forked_with_the_collector_on():
    """The rollout actor pauses the GC around vLLM's imports and engine config, and must leave the
    pause before vLLM forks its engine core (a child forked inside would run its whole life without
    the collector). Checked on the source: the engine's construction is outside every pause."""
    import ast
    import inspect
    import textwrap

    from asyncrl.actors.engine import PolicyEngine

    tree = ast.parse(textwrap.dedent(inspect.getsource(PolicyEngine.__init__)))
    paused = [n for n in ast.walk(tree) if isinstance(n, ast.With)
              and any("gc_paused" in ast.unparse(item.context_expr) for item in n.items)]
    assert paused, "PolicyEngine no longer pauses the GC around its imports"
    inside = {ast.unparse(n) for w in paused for n in ast.walk(w) if isinstance(n, ast.Call)}
    assert not any("from_vllm_config" in call for call in inside)
    assert any("create_engine_config" in call for call in inside)
