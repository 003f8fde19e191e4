"""`python -m asyncrl.rescore` on a finished quick-start run (tests/fixtures/run_small: 6 learner steps
of the real topology with the arith rule verifier), as a user runs it (subprocess, its own Ray).

Proves: two verifier variants deployed through Ray Serve (the run's rule oracle, and the deliberately
weaker `arith_answer_only` rule) each get a table; the oracle agrees with the run's labels and the
ground truth on every labelled turn, the answer-only rule disagrees exactly on the run's step errors;
replies are appended as they come and a rerun asks only what is missing (resumable); an unreachable
deployment is named and each of its requests counted as failed (exit 1); bad input (a run directory
without conversations, a spec that names nothing, an unknown rule) exits 2 naming it, before Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.rescore.turns import load_turns

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "run_small"


def rescore(*args: str | Path, timeout: int = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run([sys.executable, "-m", "asyncrl.rescore", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def specs(tmp_path: Path) -> dict[str, Path]:
    oracle = tmp_path / "oracle.yaml"  # a full asyncrl config
    oracle.write_text("verifier: {backend: rule, task: arith, version: oracle}\n")
    weak = tmp_path / "answer_only.yaml"  # the verifier section alone
    weak.write_text("backend: rule\ntask: arith_answer_only\nversion: answer-only\n")
    return {"oracle": oracle, "weak": weak}


def test_the_fixture_run_replays_71_turns() -> None:
    turns, _ = load_turns(FIXTURE)
    labelled = [t for t in turns if t.run_label is not None]
    # 71 verifier turns, 16 of them STOP (no score): 55 labelled, 4 of which the run scored 0
    # (eval_step_3 and eval_step_6 each hold one conversation with two wrong steps)
    assert len(turns) == 71 and len(labelled) == 55 and sum(t.run_stop for t in turns) == 16
    assert sorted(t.run_label for t in labelled).count(0) == 4
    assert all(t.truth_label == t.run_label for t in labelled)  # the run's verifier was the oracle
    train = [t for t in turns if t.key.startswith("train_")]
    assert train and all(t.reference is not None for t in train)  # found among data.train_files' rows
    assert all(t.reference is None for t in turns if t.key.startswith("eval_"))  # train_only: not in evaluation


def test_two_variants_write_both_tables_and_resume(tmp_path: Path, specs: dict[str, Path]) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    proc = rescore(run, "--verifier", specs["oracle"], "--verifier", specs["weak"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "re-scoring: 100%" in proc.stderr and "142/142" in proc.stderr  # tqdm: 2 verifiers x 71 turns
    oracle = json.loads((run / "rescore" / "oracle" / "table.json").read_text())
    weak = json.loads((run / "rescore" / "answer-only" / "table.json").read_text())
    assert (run / "rescore" / "oracle" / "table.md").read_text().startswith("# Re-scored with oracle")
    assert oracle["answered"] == weak["answered"] == 71 and oracle["failed"] == weak["failed"] == 0
    assert oracle["agreement_with_run"] == {"rate": 1.0, "n": 55} == oracle["agreement_with_truth"]
    # answer-only scores every step 1: it disagrees on the run's 4 zeros -> 51 / 55 = 0.9273
    assert weak["agreement_with_run"] == {"rate": 0.9273, "n": 55} == weak["agreement_with_truth"]
    assert oracle["score_parse_rate"]["rate"] == weak["score_parse_rate"]["rate"] == 1.0
    assert oracle["stop"]["count"] == weak["stop"]["count"] == 16 and weak["stop_matches_run"]["rate"] == 1.0
    assert oracle["tokens"]["total"] > 0 and oracle["latency_ms"]["p50"] > 0

    # Resume: drop 30 of the answer-only replies; a rerun asks for those 30 only, and an
    # unreachable deployment beside it is named and counted, 71 failures (exit 1).
    replies = run / "rescore" / "answer-only" / "replies.jsonl"
    replies.write_text("".join(replies.read_text().splitlines(keepends=True)[:41]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"  # closed when the block ends: nothing listens
    proc = rescore(run, "--verifier", specs["weak"], "--verifier", dead, "--deadline-s", "5", "--max-retries", "0")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "101/101" in proc.stderr  # 30 missing + 71 to the dead deployment
    assert len(replies.read_text().splitlines()) == 71
    assert json.loads((run / "rescore" / "answer-only" / "table.json").read_text())["agreement_with_run"] == \
        weak["agreement_with_run"]
    name = dead.split("://")[1].removesuffix("/v1").replace(":", "_")
    dead_table = json.loads((run / "rescore" / name / "table.json").read_text())
    assert dead_table["failed"] == 71 and dead_table["answered"] == 0 and "transport" in dead_table["first_error"]
    assert f"verifier {name} ({dead}): 71 of 71 requests failed" in proc.stderr


def test_bad_input_exits_2_naming_it(tmp_path: Path, specs: dict[str, Path]) -> None:
    empty = tmp_path / "empty_run"
    (empty / "samples").mkdir(parents=True)
    (empty / "config.resolved.json").write_text((FIXTURE / "config.resolved.json").read_text())
    proc = rescore(empty, "--verifier", specs["oracle"], timeout=60)
    assert proc.returncode == 2 and f"{empty} has no stored conversations" in proc.stderr, proc.stderr
    proc = rescore(tmp_path, "--verifier", specs["oracle"], timeout=60)
    assert proc.returncode == 2 and "is not a run directory (no config.resolved.json)" in proc.stderr
    proc = rescore(FIXTURE, "--verifier", "judge-9000", timeout=60)
    assert proc.returncode == 2 and "unknown verifier 'judge-9000': not a file and not an http(s):// URL" in \
        proc.stderr
    typo = tmp_path / "typo.yaml"
    typo.write_text("backend: rule\ntask: arithmetic\n")
    proc = rescore(FIXTURE, "--verifier", typo, timeout=60)
    assert proc.returncode == 2 and f"verifier {typo}: verifier.task: no rule verifier for task 'arithmetic'" in \
        proc.stderr
    assert not (FIXTURE / "rescore").exists()
