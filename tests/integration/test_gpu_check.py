"""scripts/gpu_check.py --cpu (the dry mode of the script prepared for the first GPU machine):
every stage runs or skips with a reason, none fails, the JSON and the summary are written, and the
figures that can be checked on a CPU hold: the chunked kernels equal the fp32 reference, the wire
is bit-exact, the recipes' memory model has a row per GPU recipe, DeepSpeed takes two steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_mode(tmp_path: Path) -> None:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (path,) = tmp_path.glob("gpu_check-*-cpu-dry.json")
    result = json.loads(path.read_text())
    assert path.with_suffix(".txt").read_text().startswith("asyncrl gpu_check")
    stages = result["stages"]
    assert list(stages) == ["S0", "S1", "S2", "S3", "S4", "S5"]
    assert all(s["status"] in ("ok", "skipped") for s in stages.values()), {k: s["status"] for k, s in stages.items()}
    assert stages["S0"]["result"]["imports"]["transformers"][0].isdigit()
    s1 = stages["S1"]["result"]
    assert s1["T=1.0"]["logprob_max_abs_err"] < 1e-3 and s1["T=0.7"]["entropy_max_abs_err"] < 1e-3
    s2 = stages["S2"]["result"]
    assert s2["pack_unpack_bit_exact"] and s2["gloo_round"]["bit_exact"] and s2["gloo_round"]["fingerprint_mismatch"] == 0
    recipes = stages["S3"]["result"]["recipes"]
    assert len(recipes) >= 5 and all("fits" in r for r in recipes)
    if stages["S5"]["status"] == "ok":  # deepspeed is installed here: two real steps per ZeRO stage
        s5 = stages["S5"]["result"]
        assert s5["zero0"]["finite"] and s5["zero3"]["finite"]
