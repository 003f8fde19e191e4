"""The user documentation holds together: `mkdocs build --strict` of docs/ (mkdocs.yml) succeeds, so
no page in the nav is missing and no link or anchor between pages is broken (a planted broken link
fails the same build), and README.md stays a five-minute read (at most 200 lines)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra (make install)")
pytest.importorskip("material", reason="mkdocs-material is in the dev extra (make install)")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(config), "--site-dir", str(site)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strictly(tmp_path):
    proc = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "benchmarks" / "index.html").is_file()
    assert (tmp_path / "site" / "results" / "trl-cpu2.json").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    """The strict build is a real gate: the same site with one link to a page that does not exist fails."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "mkdocs.yml").write_text((ROOT / "mkdocs.yml").read_text())
    page = tmp_path / "docs" / "troubleshooting.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no_such_page.md).\n")
    proc = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0
    assert "no_such_page.md" in proc.stderr


def test_a_broken_anchor_fails_the_build(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "mkdocs.yml").write_text((ROOT / "mkdocs.yml").read_text())
    page = tmp_path / "docs" / "troubleshooting.md"
    page.write_text(page.read_text() + "\nSee [a section that is not there](benchmarks.md#no-such-section).\n")
    proc = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0
    assert "no-such-section" in proc.stderr


def test_readme_is_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move the rest into a page under docs/"
