"""The test process leaves with pytest's own status, skipping interpreter finalization
(tests/conftest.py `pytest_unconfigure`): a failing run still exits 1, a green one 0, an empty one 5."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


@pytest.mark.parametrize(("body", "status"), [("assert 1", 0), ("assert 0", 1), (None, 5)])
def test_the_exit_status_is_pytests(tmp_path: Path, body: str | None, status: int) -> None:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    if body is not None:
        (tmp_path / "test_one.py").write_text(f"def test_one():\n    {body}\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == status, proc.stdout[-2000:]
