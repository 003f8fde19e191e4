"""Every metric sink reads back what `MetricLogger` wrote, with the library that owns its format:
metrics.jsonl with json, TensorBoard's event files with `tensorboard.backend.event_processing`
(scalars, and the staleness histogram as a histogram), W&B's offline run with the `wandb` package's
own reader (`wandb leet inspect --json`). Scalars reach every sink; lists and strings reach only
jsonl (and TensorBoard's histogram for `*_hist`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.metrics import MetricLogger

STEPS = {1: {"loss/pg": 0.5, "perf/step_s": 2.0, "buffer/staleness_hist": [3, 1], "verifier/versions_in_batch": "v1"},
         2: {"loss/pg": 0.25, "perf/step_s": 1.5, "buffer/staleness_hist": [4, 0]}}


def _log(run_dir: Path, sinks: list[str]) -> None:
    logger = MetricLogger(run_dir, sinks, "asyncrl-test", "sinks", {"learner": {"lr": 1e-6}})
    for step, metrics in STEPS.items():
        logger.log(step, metrics)
    logger.close()


def test_jsonl_reads_back_every_key_of_every_step(tmp_path):
    _log(tmp_path, ["jsonl"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row, (step, metrics) in zip(rows, STEPS.items(), strict=True):
        assert {k: row[k] for k in metrics} == metrics, step


def test_tensorboard_event_files_read_back_scalars_and_the_histogram(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log(tmp_path, ["tensorboard"])
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss/pg")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("perf/step_s")] == [(1, 2.0), (2, 1.5)]
    hist = events.Histograms("buffer/staleness_hist")
    # step 1: counts [3, 1] -> samples 0, 0, 0, 1 (4 groups, lags summing to 1); step 2: [4, 0] -> four 0s
    assert [(h.step, h.histogram_value.num, h.histogram_value.sum) for h in hist] == [(1, 4, 1.0), (2, 4, 0.0)]
    one = hist[0].histogram_value  # one bucket per lag, upper edge lag + 0.5, the counts as logged
    assert (one.min, one.max, one.sum_squares, list(one.bucket_limit), list(one.bucket)) == (0, 1, 1, [0.5, 1.5], [3, 1])
    assert "verifier/versions_in_batch" not in events.Tags()["scalars"]  # a string is not a scalar


def test_wandb_offline_run_reads_back_the_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # offline: nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log(tmp_path, ["wandb"])
    [record_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(record_file)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    history = [json.loads(line)["history"] for line in out.splitlines()
               if line.startswith("{") and json.loads(line).get("type") == "history"]
    items = {int(h["step"]["num"]): h["item"] for h in history}
    assert sorted(items) == [1, 2]
    for step, metrics in STEPS.items():
        assert items[step]["loss/pg"] == metrics["loss/pg"] and items[step]["perf/step_s"] == metrics["perf/step_s"]
        assert "buffer/staleness_hist" not in items[step] and "verifier/versions_in_batch" not in items[step]
