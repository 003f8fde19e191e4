"""The `gpu` and `flash` extras of pyproject.toml resolve on PyPI: every exact pin names a release
that exists and ships a file, every lower bound admits at least one release, and the CUDA stack's
pins agree with each other (vLLM's own torch pin is what the CPU stack installs too); the gpu
extra pins the DeepSpeed the GPU check carries, and requirements/lock-gpu.txt agrees with the extra.

The checks read PyPI's JSON index (no download of the multi-hundred-MB vLLM wheel); without
network access to PyPI the test is skipped with the reason, so a broken pin fails where PyPI is
reachable (CI) and never silently passes elsewhere.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def extra(name: str) -> list[Requirement]:
    return [Requirement(r) for r in tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"][name]]


def releases(project: str) -> dict[str, list[dict]]:
    url = f"https://pypi.org/pypi/{project}/json"
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            return json.load(resp)["releases"]
    except Exception as exc:  # noqa: BLE001 - no network: skip with the reason, never pass
        pytest.skip(f"PyPI unreachable ({url}: {type(exc).__name__}: {exc}); gpu extra pins not checked")


def test_gpu_extra_is_pinned_and_has_no_source_only_packages():
    names = {r.name: r for r in extra("gpu")}
    assert str(names["vllm"].specifier).startswith("==0.32."), "engine.py is written against vLLM 0.32"
    assert "flash-attn" not in names, "flash-attn builds from source against torch: keep it in the `flash` extra"
    ds = names["deepspeed"].specifier
    wheelhouse = (PYPROJECT.parent / "scripts" / "gpu_wheelhouse.sh").read_text()
    assert len(ds) == 1 and next(iter(ds)).operator == "==", "pin the DeepSpeed the GPU check exercises"
    assert f'"deepspeed{ds}"' in wheelhouse, "the gpu extra and scripts/gpu_wheelhouse.sh name one DeepSpeed"
    assert Version(next(iter(ds)).version) >= Version("0.19.4"), "managed_gradient_accumulation needs >= 0.19.4"


def test_gpu_lock_agrees_with_the_gpu_extra():
    lock = dict(line.split("==", 1) for line in (PYPROJECT.parent / "requirements" / "lock-gpu.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    for req in extra("gpu"):
        assert req.name in lock and Version(lock[req.name]) in req.specifier, (req, lock.get(req.name))
    assert lock["torch"] == "2.13.0" and lock["nvidia-cuda-runtime"].startswith("13.")  # CUDA 13: driver >= 580


@pytest.mark.parametrize("extra_name", ["gpu", "flash"])
def test_every_pin_resolves_on_pypi(extra_name):
    for req in extra(extra_name):
        files = releases(req.name)
        admitted = [v for v, f in files.items() if f and Version(v) in req.specifier]
        assert admitted, f"{extra_name} extra: no release of {req.name} satisfies {req} (pyproject.toml)"
        for spec in req.specifier:
            if spec.operator == "==":
                assert files.get(spec.version), f"{extra_name} extra: {req} names no published release"
            if spec.operator == ">=":
                assert files.get(spec.version), f"{extra_name} extra: lower bound {req} is not a release"
