"""The run report as a person opens it: rendered from a recorded small run directory
(tests/fixtures/run_small: 6 learner steps of the quick-start topology, with before/after
evaluations and their conversations) and loaded in a real headless chromium (Debian's package,
installed by scripts/install.sh). Proves: the page loads offline with no console error and no
script error, its plots decode, and it shows the conversation viewer (before and after side by
side, verifier turns with [SCORE] / ###STOP### marked). A control page with a deliberate error
proves the checks can fail. A screenshot is taken (kept under the test's tmp directory).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "run_small"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.integration, pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (scripts/install.sh installs Debian's package with apt-get "
                             "when run as root; elsewhere install it by hand to run this test)")]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"  # a fresh profile per launch
    cmd = [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def load(tmp: Path, page: Path) -> tuple[str, list[str]]:
    """(serialised DOM after load, console messages chromium logged)."""
    proc = chromium(tmp, "--virtual-time-budget=5000", "--dump-dom", page.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return proc.stdout, console


def body_attr(dom: str, name: str) -> str | None:
    m = re.search(r"<body[^>]*\s" + re.escape(name) + r'="([^"]*)"', dom)
    return m.group(1) if m else None


def test_report_of_a_recorded_run_loads_cleanly_and_shows_the_conversations(tmp_path: Path) -> None:
    from asyncrl.report import write_report

    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    page = write_report(run)
    dom, console = load(tmp_path, page)
    assert console == [], console
    assert body_attr(dom, "data-js-errors") == "0"
    assert int(body_attr(dom, "data-plots-loaded") or 0) >= 1
    viewer = dom[dom.index('id="viewer"'):dom.index('id="trained"')]
    problems = re.findall(r'class="problem" data-problem="([^"]+)"', viewer)
    assert len(problems) >= 2, problems
    assert viewer.count("before training") == viewer.count("after training") == len(problems)
    assert '<mark class="stop">###STOP###</mark>' in viewer
    assert '<mark class="score">[SCORE]' in viewer
    assert re.search(r"final answer <b>[^<]+</b>", viewer)
    shot = tmp_path / "report.png"
    proc = chromium(tmp_path, "--window-size=1280,2400", f"--screenshot={shot}", page.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_the_checks_see_a_broken_page(tmp_path: Path) -> None:
    """Control: the same checks on a page with a script error and a broken plot image."""
    from asyncrl.report import HOOK

    page = tmp_path / "broken.html"
    page.write_text(f"<!DOCTYPE html><html><head><script>{HOOK}</script></head><body>"
                    "<img class='plot' src='data:image/png;base64,AAAA'><script>undefinedFunction();</script>"
                    "</body></html>")
    dom, console = load(tmp_path, page)
    assert any("undefinedFunction" in line for line in console), console
    assert body_attr(dom, "data-js-errors") != "0"
    assert body_attr(dom, "data-plots-loaded") == "0"
