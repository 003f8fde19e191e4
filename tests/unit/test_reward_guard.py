"""Proves `asyncrl.rewards.guard.RewardGuard`: a reward plug-in that raises is named by its file, line,
function and message, its repeated failures are one counted kind (not one line each), and N failures
in a row set the fatal message the job stops with; a hung call fails after `call_timeout_s` naming the
function; a success resets the run of failures; and a process whose reward call hangs still exits
(the hung call's thread never holds the interpreter's exit)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncrl.rewards import load_reward_function
from asyncrl.rewards.guard import RewardCallError, RewardCallTimeout, RewardGuard

ROOT = Path(__file__).resolve().parents[2]
ITEM = {"response": "x", "response_length": 1, "ground_truth": "1"}


def _plugin(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_a_raising_reward_is_named_counted_once_and_fatal_after_n(tmp_path: Path) -> None:
    path = _plugin(tmp_path, """
        def compute_score(items):
            raise KeyError("no field 'answer' in " + items[0]["response"])
    """)
    guard = RewardGuard(load_reward_function(f"{path}:compute_score"), call_timeout_s=5, max_consecutive_failures=4)

    async def run(n: int) -> list[RewardCallError]:
        errors = []
        for _ in range(n):
            with pytest.raises(RewardCallError) as info:
                await guard.score_async([ITEM])
            errors.append(info.value)
        return errors

    errors = asyncio.run(run(3))
    msg = str(errors[0])
    assert f"{path}:3 in compute_score" in msg, msg  # file, line and function of the raise
    assert "KeyError" in msg and "no field 'answer' in x" in msg
    assert [e.first_of_kind for e in errors] == [True, False, False]
    report = guard.report()
    assert report["kinds"] == [{"error": msg, "count": 3}] and report["fatal"] is None
    asyncio.run(run(1))  # the 4th in a row
    report = guard.report()
    assert report["failed"] == report["consecutive"] == 4
    assert report["fatal"] is not None and "4 groups in a row" in report["fatal"] and "compute_score" in report["fatal"]


def test_a_success_resets_the_run_of_failures(tmp_path: Path) -> None:
    path = _plugin(tmp_path, """
        def main(items):
            if items[0]["response"] == "bad":
                raise ValueError("bad")
            return [{"overall": 1.0} for _ in items]
    """)
    guard = RewardGuard(load_reward_function(str(path)), call_timeout_s=5, max_consecutive_failures=2)

    async def run() -> None:
        with pytest.raises(RewardCallError):
            await guard.score_async([{**ITEM, "response": "bad"}])
        assert await guard.score_async([ITEM]) == [{"overall": 1.0}]
        with pytest.raises(RewardCallError):
            await guard.score_async([{**ITEM, "response": "bad"}])

    asyncio.run(run())
    assert guard.report()["consecutive"] == 1 and guard.report()["fatal"] is None


def test_a_hung_reward_call_fails_after_its_deadline_naming_the_function(tmp_path: Path) -> None:
    path = _plugin(tmp_path, """
        import threading
        def stuck(items):
            threading.Event().wait()
    """)
    guard = RewardGuard(load_reward_function(f"{path}:stuck"), call_timeout_s=0.5, max_consecutive_failures=1)
    t0 = time.monotonic()
    with pytest.raises(RewardCallTimeout) as info:
        asyncio.run(guard.score_async([ITEM]))
    assert time.monotonic() - t0 < 30  # not forever (the bound is 0.5 s; the machine is shared)
    assert f"{path}:stuck" in str(info.value) and "reward.call_timeout_s=0.5s" in str(info.value)
    assert guard.report()["hung"] == 1 and guard.report()["fatal"] is not None


def test_a_process_with_a_hung_reward_call_still_exits(tmp_path: Path) -> None:
    path = _plugin(tmp_path, """
        import time
        def stuck(items):
            while True:
                time.sleep(0.05)
    """)
    script = textwrap.dedent(f"""
        import asyncio
        from asyncrl.rewards import load_reward_function
        from asyncrl.rewards.guard import RewardGuard, RewardCallTimeout
        guard = RewardGuard(load_reward_function("{path}:stuck"), call_timeout_s=0.3)
        try:
            asyncio.run(guard.score_async([{ITEM!r}]))
        except RewardCallTimeout as exc:
            print("named:", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "named: reward function" in proc.stdout
