"""asyncrl.report and asyncrl.job.status on the recorded small run (tests/fixtures/run_small, 6 learner
steps of the quick-start topology with before/after evaluations and their conversations).

Proves: the page is self-contained (no external URL, a CSP that forbids loads), carries the
before/after table with standard errors, one embedded plot per metric family, the conversation
viewer pairing the same problems before and after with [SCORE]/###STOP### marked and escaped
text, and the trained trajectories with version lag and verifier version; it also renders a
running job's directory (no summary, no after-evaluation yet). `ctl status` reads status.json
and prints a table without importing Ray; `--json` keeps JSON.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from asyncrl.job.status import format_status, read_status, write_status
from asyncrl.report import mark_verifier, moving_average, read_metrics, render

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "run_small"


def test_report_is_self_contained_with_every_section() -> None:
    page = render(FIXTURE)
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", page)  # nothing loaded from anywhere
    assert "default-src 'none'" in page
    # Before/after: guided 0.750 -> 0.750 with SE sqrt(.75 * .25 / 8) = 0.153; solver 0.625 -> 0.750.
    assert "0.750 <span class=\"se\">± 0.153</span>" in page and "+0.125" in page
    assert page.count('<img class="plot"') == 7  # six metric panels + the staleness histogram
    viewer = page[page.index('id="viewer"'):page.index("Solver-only conversations")]
    ids = re.findall(r'data-problem="([^"]+)"', viewer)
    assert ids == ["arith-test-00000", "arith-test-00001", "arith-test-00002", "arith-test-00003"]
    assert viewer.count("before training ·") == viewer.count("after training ·") == 4
    assert '<mark class="stop">###STOP###</mark>' in viewer and '<mark class="score">[SCORE] hallucination_detect=1' in viewer
    assert "&lt;answer&gt;" in viewer and "<answer>" not in viewer  # the policy's text is escaped
    trained = page[page.index('id="trained"'):page.index('id="config"')]
    assert "From the batch of learner step 6." in trained and "version lag 1" in trained
    assert "verifier arith-rule-v1" in trained
    assert "&quot;experiment_name&quot;: &quot;fixture&quot;" in page  # the resolved config, inside <details>


def test_report_of_a_running_job(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    (run / "summary.json").unlink()
    (run / "samples" / "eval_after.json").unlink()
    (run / "job.json").write_text("{}")
    page = render(run)
    assert "running: step 6/6" in page
    # 4 problems x (guided viewer + folded solver-only viewer); the after column waits for the final evaluation
    assert page.count("after training ·") == 0 and page.count("before training ·") == 8
    assert page.count("not recorded") == 8


def test_report_reads_the_effective_history_of_a_resumed_run(tmp_path: Path) -> None:
    """A `resumed_from` marker at step 1 (written by a resume or an in-job learner recovery)
    discards the earlier rows of steps 2 and 3: they were trained again, so the curves show the
    retrained step 2 (a=20) once and nothing of the rolled-back step 3; a half-written last line
    (a running job) is skipped."""
    rows = [{"step": 1, "a": 1}, {"step": 2, "a": 2}, {"step": 3, "a": 3},
            {"step": 1, "resumed_from": "checkpoints/step_1", "rolled_back_steps": 2}, {"step": 2, "a": 20}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 3, "a')
    assert [(r["step"], r["a"]) for r in read_metrics(tmp_path)] == [(1, 1), (2, 20)]


def test_mark_verifier_and_moving_average() -> None:
    assert mark_verifier("Wrong: 3 < 4.\n[SCORE] hallucination_detect=0") == (
        'Wrong: 3 &lt; 4.\n<mark class="score">[SCORE] hallucination_detect=0</mark>')
    assert mark_verifier(None).startswith('<span class="muted">')
    # trailing means over 2: [1, (1+3)/2, (3+5)/2, (5+7)/2]
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_status_file_round_trip_and_table(tmp_path: Path) -> None:
    write_status(tmp_path, {"step": 40, "max_steps": 200, "version": 40, "elapsed_s": 130.0, "eta_s": 520.0,
                            "verifier_version": "arith-rule-v1", "run_dir": str(tmp_path),
                            "actors": {"rollout-0": {"state": "running", "version": 40, "tokens_per_s": 512.0,
                                                     "groups_in_flight": 4}},
                            "latest": {"buffer/size_groups": 3, "buffer/staleness_mean": 0.95,
                                       "verifier/latency_ms_p50": 11.5, "perf/tokens_per_s": 980.0}})
    status = read_status(tmp_path)
    assert status is not None and status["step"] == 40 and "updated" in status
    table = format_status(status, now=status["updated"] + 5)
    assert "step     40/200" in table and "ETA 8m40s" in table and "status 0m05s old" in table
    assert "latency p50 11.5 ms" in table and "3 group(s) queued" in table
    assert re.search(r"rollout-0\s+running\s+40\s+512\s+4", table)


def test_ctl_status_reads_the_file_without_ray(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    code = ("import sys; from asyncrl.ctl import main; rc = main(sys.argv[1:]); "
            "assert 'ray' not in sys.modules, 'ray imported'; sys.exit(rc)")
    table = subprocess.run([sys.executable, "-c", code, "status", "--run-dir", str(run)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "step     6/6" in table.stdout and "not running" in table.stdout and "rollout-1" in table.stdout
    raw = subprocess.run([sys.executable, "-c", code, "status", "--json", "--run-dir", str(run)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert json.loads(raw.stdout)["step"] == 6
    missing = subprocess.run([sys.executable, "-m", "asyncrl.ctl", "status", "--run-dir", str(tmp_path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "status.json not found" in missing.stderr
