"""A component that fails to start is one line on the console, first, with its traceback in its
log file: a real launch (Ray, data, coordinator, buffer, verifier, learner) whose rollout engine
cannot be built. The model is the tiny policy with an architecture vLLM does not know
(`NoSuchForCausalLM`): it passes the driver's checks and transformers (which builds by
model_type), and vLLM rejects it with a pydantic ValidationError that Ray cannot pickle, the case
that used to reach the console as a 90-line remote traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~95 s here

ROOT = Path(__file__).resolve().parents[2]


def test_rollout_actor_that_cannot_start_is_one_line(tmp_path: Path) -> None:
    model = tmp_path / "policy"
    shutil.copytree(ROOT / "assets" / "tiny-policy", model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["NoSuchForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("ASYNCRL_VERBOSE", None)
    proc = subprocess.run([sys.executable, "-m", "asyncrl.launch", "--config", "configs/quickstart.yaml",
                           f"model.path={model}", f"trainer.run_dir={tmp_path}", "trainer.max_steps=1",
                           "trainer.eval_before_after=false", "verifier.port=0"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in (proc.stderr + proc.stdout).splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    log = tmp_path / "quickstart" / "logs" / "rollout-0.log"
    line = errors[0]
    assert line.startswith("error: rollout actor rollout-0 on ") and " failed to start: ValidationError: " in line
    assert "NoSuchForCausalLM" in line and line.endswith(f"(traceback: {log})")
    assert proc.stderr.strip() == line  # nothing else on stderr: no remote traceback, no Ray envelope
    assert "Traceback" not in proc.stdout and "RayTaskError" not in proc.stdout
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "NoSuchForCausalLM" in text
    assert "Traceback" in (tmp_path / "quickstart" / "logs" / "driver.log").read_text()
