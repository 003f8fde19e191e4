"""Every `python -m asyncrl.bench` scenario has a working default: `--help` describes the scenario
itself, and without `--config` a scenario runs on the quick start's config (named on its first
line). The cheap scenarios (buffer, weight-sync, learner, simulate) run with no `--config` in
tests/integration/test_bench_smoke.py; `rollout` (two vLLM engines, ~85 s) is the slow one here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.bench.__main__ import GONE_ENV_PREFIX, SCENARIOS, main, scenario_doc

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
       "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}


def bench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.bench", *args], capture_output=True, text=True,
                          cwd=ROOT, env=ENV, timeout=timeout)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_help_describes_the_scenario(scenario: str) -> None:
    proc = bench(scenario, "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    first = scenario_doc(scenario).splitlines()[0]
    assert first and first in proc.stdout  # the scenario's own docstring, not the generic one


def test_help_lists_the_scenario_flags() -> None:
    proc = bench("convergence", "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--staleness", "--modes", "--seeds", "--steps", "--eval-every", "--reuse", "--reuse-only"):
        assert flag in proc.stdout


@pytest.mark.parametrize(("name", "flag"), [("STALENESS", "--staleness"), ("EVAL_EVERY", "--eval-every"),
                                            ("E2E", "e2e --compare"), ("REUSE", "--reuse or --reuse-only")])
def test_an_old_environment_option_is_refused_naming_its_flag(monkeypatch, capsys, name: str, flag: str) -> None:
    # silently running the default grid instead of the asked one would cost hours: exit 2 before anything
    monkeypatch.setenv(GONE_ENV_PREFIX + name, "1")
    with pytest.raises(SystemExit) as exited:
        main(["convergence", "--smoke"])
    assert exited.value.code == 2
    assert f"{GONE_ENV_PREFIX}{name} is gone, use {flag}" in capsys.readouterr().err


@pytest.mark.slow
def test_rollout_runs_without_config(tmp_path: Path) -> None:
    proc = bench("rollout", "--smoke", "--output", str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("rollout-*.json")
    result = json.loads(path.read_text())
    assert result["ratio"] > 0


def test_rollout_refuses_a_config_the_model_cannot_hold(tmp_path: Path) -> None:
    proc = bench("rollout", "data.max_prompt_length=2048", "data.max_response_length=2048",
                 "rollout.max_num_batched_tokens=8192", "--output", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "error: data.max_prompt_length + data.max_response_length" in proc.stderr
    assert proc.stdout.splitlines()[0].startswith("bench rollout: no --config, using the quick start's ")
    assert not list(tmp_path.glob("*.json"))
