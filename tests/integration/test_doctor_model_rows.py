"""`python -m asyncrl.doctor --config X` lists the launcher's model checks (asyncrl.checks.preflight) as rows
of its table, before the cluster rows, on the embedded cluster (~45 s here): with the issue's lengths
the context rows are ✘ with their fix and name the keys, every cluster row still runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~40 s (an embedded Ray cluster for the node rows): slow tier

ROOT = Path(__file__).resolve().parents[2]


def test_doctor_shows_the_model_checks_as_rows() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run([sys.executable, "-m", "asyncrl.doctor", "--config", "configs/quickstart.yaml", "verifier.port=0",
                           "data.max_prompt_length=2048", "data.max_response_length=2048",
                           "rollout.max_num_batched_tokens=8192"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln[:1] in "✔✘"]
    checks = [r[2:].split("  ")[0].strip() for r in rows]
    assert checks[:8] == ["model files", "policy context", "engine max_model_len", "engine token budget", "CPU KV cache",
                          "policy chat template", "vision settings", "secrets"], checks
    context = rows[1]
    assert context.startswith("✘ policy context") and "2048 + 2048 = 4096" in context and "1024 tokens" in context
    assert "fix: lower data.max_prompt_length + data.max_response_length to at most 1024" in proc.stdout
    assert rows[2].startswith("✘ engine max_model_len") and "10496" in rows[2]
    assert any(r.startswith("✔ ray connection") for r in rows) and any(r.startswith("✔ weight broadcast") for r in rows)
