"""`bench startup` reads a launch's console: the figures come from the launcher's own step lines."""

from __future__ import annotations

import subprocess
import sys
import time

from asyncrl.bench.startup import cpu_by_role, parse_console, summarize

LAUNCH = [  # (seconds since launch, console line), as the launcher prints them (abridged)
    (0.4, "[asyncrl] starting ray (embedded) ...\n"),
    (3.9, "[asyncrl] ray (embedded) ready (3.3s)\n"),
    (4.1, "[asyncrl] learner placement (1 rank(s), reserved before the engines) ready (0.0s)\n"),
    (4.2, "[asyncrl] rollout actors x1: engines building while the other services start\n"),
    (6.0, "[asyncrl] coordinator ready (1.8s)\n"),
    (12.5, "[asyncrl] learner (1 rank(s), ZeRO-1) ready (5.9s)\n"),
    (20.0, "[asyncrl]   rollout-0 on 192.0.2.2: engine up in 10.5s (weights v0)\n"),
    (20.1, "[asyncrl] rollout actors x1 ready (7.6s)\n"),
    (24.3, "[asyncrl] step 1/2 | reward 0.055 | acc 0.047 | step_s 3.2\n"),
    (25.0, "[asyncrl] step 2/2 | reward 0.06 | step_s 0.6\n"),
]


def test_one_launch_is_read_from_its_step_lines():
    got = parse_console(LAUNCH)
    assert got["first_step_s"] == 24.3  # the first `step 1/` line, not step 2
    assert got["engine_up_s"] == 10.5 and got["fleet_launched_s"] == 4.2
    # a component is named without its parenthesised detail: "learner (1 rank(s), ZeRO-1)" -> "learner"
    assert got["components"]["learner"] == {"ready_at_s": 12.5, "step_s": 5.9}
    assert got["components"]["ray"] == {"ready_at_s": 3.9, "step_s": 3.3}
    assert set(got["components"]) == {"ray", "learner placement", "coordinator", "learner", "rollout actors x1"}


def test_launches_are_summarized_by_their_medians():
    later = [(t + (2.0 if "step 1/" in s else 0.0), s) for t, s in LAUNCH]  # a launch whose first step came 2 s later
    runs = [dict(parse_console(LAUNCH), launch_to_exit_s=30.0), dict(parse_console(later), launch_to_exit_s=31.0),
            dict(parse_console(LAUNCH[:3] + LAUNCH[8:]), launch_to_exit_s=40.0)]  # no learner line in this one
    s = summarize(runs)
    assert s["first_step_s"] == 24.3 and s["first_step_each_s"] == [24.3, 26.3, 24.3]
    assert s["launch_to_exit_s"] == 31.0
    assert s["components"]["learner"]["ready_at_s"] == 12.5  # median of the two launches that printed it


def test_cpu_is_summed_by_role_over_the_whole_process_tree():
    """A parent spinning ~0.3 CPU-s with two children of one role spinning too: the children are
    found below it (recursively), named by their script, summed together, and the total adds up."""
    spin = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    parent = ("import subprocess, sys, time\n"
              f"for _ in range(2): subprocess.Popen([sys.executable, '-c', {spin!r}])\n"
              "t = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        time.sleep(3.0)
        got = cpu_by_role(proc.pid)
    finally:
        for child in __import__("psutil").Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
    assert got["launcher"] >= 0.3
    (child_role,) = set(got) - {"launcher", "total"}  # both children under one role
    assert got[child_role] >= 0.6
    assert abs(got["total"] - got["launcher"] - got[child_role]) < 0.02
    runs = [dict(parse_console(LAUNCH), launch_to_exit_s=30.0, cpu_s={"raylet": 1.0, "total": 5.0}),
            dict(parse_console(LAUNCH), launch_to_exit_s=30.0, cpu_s={"raylet": 3.0, "total": 9.0})]
    assert summarize(runs)["cpu_s"] == {"raylet": 2.0, "total": 7.0}
