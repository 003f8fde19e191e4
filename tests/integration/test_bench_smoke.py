"""`python -m asyncrl.bench SCENARIO --smoke` writes a valid JSON with every field, per scenario.

Default suite (about 3 minutes here): the component scenarios `buffer`, `weight-sync` and `learner`
run for real in smoke mode (subprocess, real sockets/processes/Ray) and their JSON
carries the machine, the date and a `ratio` consistent with the parts it is computed from; the
`e2e` and `sweep` JSON builders run on hand-written metrics rows with hand-derived speedups.
Slow (`-m slow`, minutes each: vLLM engines and the whole topology): `rollout`, `e2e`, `sweep` smoke,
and `simulate` (a Ray job of simulated engines: 22 s of the default suite's 15 minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def _bench(scenario: str, out: Path, *overrides: str, config: Path | None = None, timeout: int = 300) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    # overrides right after the scenario: argparse takes the positionals in one run
    cmd = [sys.executable, "-m", "asyncrl.bench", scenario, *overrides, "--smoke", "--output", str(out)]
    proc = subprocess.run(cmd + (["--config", str(config)] if config else []),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    (path,) = out.glob(f"{scenario}-*.json")
    result = json.loads(path.read_text())
    assert result["scenario"] == scenario and result["date"]
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["platform"]
    return result


# ---------------------------------------------------------------------- component scenarios (default)
def test_buffer_smoke(tmp_path: Path) -> None:
    r = _bench("buffer", tmp_path)
    assert r["ratio"] == pytest.approx(r["buffer"]["groups_per_s"] / r["bare"]["groups_per_s"])
    assert 0 < r["ratio"] < 10
    w = r["buffer_window"]  # pipelined pushes: every group delivered, figures reported
    assert w["groups"] >= 40 and w["groups_per_s"] > 0 and w["mb_per_s"] > 0 and r["window_ratio"] > 0


def test_weight_sync_smoke(tmp_path: Path) -> None:
    r = _bench("weight-sync", tmp_path)
    assert r["goal"] == 0.7 and r["smoke"] is True
    assert r["cases"] and r["bucket_sweep"]
    # ratio = flat seconds / our seconds of one of the measured cases
    assert any(r["ratio"] == pytest.approx(c["flat_s"] / c["ours_s"]) for c in r["cases"])
    assert r["ratio_min"] <= r["ratio"] and r["ratio_min"] > 0
    lora = [c for c in r["lora"] if "full_s" in c]  # LoRA: the adapter of the same model, same run
    assert lora and all(0 < c["bytes_ratio"] < 1 and c["adapter_wire_s"] > 0 for c in lora)


def test_learner_smoke(tmp_path: Path) -> None:
    r = _bench("learner", tmp_path)
    assert r["ratio"] > 0 and r["learner_tokens_per_s"] > 0 and r["bare_tokens_per_s"] > 0
    assert r["ratio_total"] == pytest.approx(r["learner_tokens_per_s"] / r["bare_tokens_per_s"])
    assert len(r["pair_ratios"]) == r["steps"]


@pytest.mark.slow
def test_simulate_smoke(tmp_path: Path) -> None:
    r = _bench("simulate", tmp_path)
    assert r["simulated"] is True and all(c["simulated"] for c in r["cells"])
    assert {c["rollout_actors"] for c in r["cells"]} == {1, 4}
    for c in r["cells"]:
        assert c["scaling_efficiency"] == pytest.approx(c["groups_per_s"] / c["model_groups_per_s"])
        assert c["steps"] >= 1 and sum(c["staleness_hist"]) >= 1
    assert r["ratio"] == r["min_scaling_efficiency_below_knee"] and 0 < r["ratio"] <= 1.5
    assert list(tmp_path.glob("simulate-*.png"))


# ---------------------------------------------------------------------- e2e / sweep JSON builders (default)
def _rows(times: list[float], step_s: float, wait_s: float, tokens: int, hist: list[list[int]]) -> list[dict]:
    return [{"time": t, "perf/step_s": step_s, "perf/batch_wait_s": wait_s, "perf/train_tokens": tokens,
             "perf/learner_idle_ratio": wait_s / step_s, "perf/rollout_idle_ratio": 0.25, "perf/weight_sync_s": 0.1,
             "buffer/staleness_hist": h, "rollout/reward_mean": 0.5} for t, h in zip(times, hist)]


def test_e2e_compare_runs_set_their_key_per_run_and_refuse_unknown_names(monkeypatch, capsys) -> None:
    # --compare weight_transfer: one run per value, in order, each with only that key changed;
    # the table's ratio is the second run's step rate over the first's (0.5 / 0.4).
    from asyncrl.bench import e2e
    from asyncrl.bench.__main__ import build_parser
    from asyncrl.config import load_config

    seen = []

    def fake_measure(cfg, steps, warmup, tag):
        seen.append((tag, cfg.rollout.weight_transfer, cfg.learner.weights.publish_mode))
        rate = 0.4 if cfg.rollout.weight_transfer == "extension" else 0.5
        return {"steps_per_s": rate, "step_s": 1 / rate, "weight_sync_s": 0.1}

    monkeypatch.setattr(e2e, "measure", fake_measure)
    cfg = load_config(QUICKSTART)
    parser = build_parser("e2e")
    out = e2e.run(cfg, parser.parse_intermixed_args(["e2e", "--smoke", "--compare", "weight_transfer"]))
    publish = cfg.learner.weights.publish_mode
    assert seen == [("weight_transfer-extension", "extension", publish), ("weight_transfer-native", "native", publish)]
    assert set(out) == {"extension", "native"} and cfg.rollout.weight_transfer == "extension"  # cfg untouched
    assert "1.25" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        parser.parse_intermixed_args(["e2e", "--compare", "weights"])
    assert exited.value.code == 2 and "argument --compare: invalid choice: 'weights'" in capsys.readouterr().err


def test_e2e_json_from_metrics_rows() -> None:
    from asyncrl.bench.e2e import figures, summarize

    # sync: 4 steps of 3 s, 2 s of them waiting for the batch; warm-up 1 -> steady rows 2..4,
    # wall = 19 - 13 + 3 = 9 s -> 3/9 steps/s, 900/9 = 100 trained tok/s; R = 2, T = 3 - 2 = 1.
    sync = figures(_rows([10, 13, 16, 19], 3.0, 2.0, 300, [[1], [1], [1], [1]]), 1, max_staleness=0,
                   rollout_actors=2)
    assert sync["steady_wall_s"] == pytest.approx(9.0) and sync["steps_per_s"] == pytest.approx(1 / 3)
    assert sync["trained_tokens_per_s"] == pytest.approx(100.0)
    assert (sync["rollout_s_per_step"], sync["train_sync_s_per_step"]) == (pytest.approx(2.0), pytest.approx(1.0))
    # async: steps every 2 s -> wall = 16 - 12 + 2 = 6 s -> 0.5 steps/s; histograms summed by lag.
    asyn = figures(_rows([10, 12, 14, 16], 2.0, 0.1, 300, [[2, 1], [1, 2, 1], [], [0, 1]]), 1, max_staleness=1,
                   rollout_actors=2)
    assert asyn["steps_per_s"] == pytest.approx(0.5) and asyn["staleness_hist"] == [3, 4, 1]
    out = summarize(sync, asyn, steps=4, warmup=1)
    # ideal = (R + T) / max(R, T) = 3 / 2 = 1.5; speedup = 0.5 / (1/3) = 1.5 -> fraction 1.0
    assert out["ideal_speedup"] == pytest.approx(1.5) and out["speedup"] == pytest.approx(1.5)
    assert out["fraction_of_ideal"] == pytest.approx(1.0)
    for key in ("sync", "async", "latency_model", "steps", "warmup"):
        assert key in out
    assert sync["driver_bytes_per_step"] is None  # rows from before the metric: not reported as 0
    rows = [{**r, "perf/driver_bytes": 0.0, "perf/batch_bytes": 1000.0 * i} for i, r in enumerate(_rows(
        [10, 12, 14], 2.0, 0.1, 300, [[1], [1], [1]]))]
    # warm-up 1 -> steady rows 1..2: driver 0 bytes, batch (1000 + 2000) / 2 = 1500 bytes per step
    fig = figures(rows, 1, max_staleness=1, rollout_actors=1)
    assert fig["driver_bytes_per_step"] == 0.0 and fig["batch_bytes_per_step"] == pytest.approx(1500.0)
    json.dumps(out)


def test_sweep_json_from_cells() -> None:
    from asyncrl.bench.e2e import figures
    from asyncrl.bench.sweep import summarize

    cells = []
    for a, s, step in [(1, 0, 4.0), (1, 1, 2.0), (2, 0, 3.0), (2, 1, 1.0)]:
        cells.append(figures(_rows([0, step, 2 * step], step, 0.5, 100, [[1]] * 3), 0, max_staleness=s,
                             rollout_actors=a))
    cells.append({"rollout_actors": 2, "max_staleness": 2, "error": "start-up timeout",
                  "trained_tokens_per_s": float("nan")})  # a failed cell is kept, reported, and skipped
    out = summarize(cells, [1, 2], [0, 1, 2])
    # tokens/s = 300 / (3 * step): base (1 actor, sync) 25; best (2 actors, s=1) 100 -> ratio 4
    assert out["best"]["rollout_actors"] == 2 and out["best"]["max_staleness"] == 1
    assert out["ratio"] == pytest.approx(4.0) and out["failed_cells"] == 1
    json.dumps(out)


# ---------------------------------------------------------------------- vLLM / whole topology (slow)
@pytest.mark.slow
def test_rollout_smoke(tmp_path: Path) -> None:
    r = _bench("rollout", tmp_path, config=QUICKSTART, timeout=900)
    (rnd,) = r["rounds"]
    assert rnd["policy_tokens"] > 0 and rnd["requests"] >= 2 * r["settings"]["n"]
    assert rnd["ratio"] == pytest.approx(rnd["actor_tokens_per_s"] / rnd["bare_tokens_per_s"])
    assert r["ratio"] == pytest.approx(rnd["ratio"])
    assert r["actor"]["push_status"] == {"stored": 3}  # warm-up group + 2 measured groups, all acknowledged
    assert 0 < r["actor"]["mean_requests_in_flight"] <= r["concurrency"]


@pytest.mark.slow
def test_e2e_smoke(tmp_path: Path) -> None:
    r = _bench("e2e", tmp_path, f"trainer.run_dir={tmp_path / 'runs'}", config=QUICKSTART, timeout=1500)
    assert r["speedup"] > 0 and r["ideal_speedup"] >= 1.0
    assert r["sync"]["max_staleness"] == 0 and r["async"]["max_staleness"] >= 1
    assert max((i for i, c in enumerate(r["sync"]["staleness_hist"]) if c), default=0) == 0  # sync: lag 0 only


@pytest.mark.slow
def test_sweep_smoke(tmp_path: Path) -> None:
    r = _bench("sweep", tmp_path, f"trainer.run_dir={tmp_path / 'runs'}", config=QUICKSTART, timeout=1800)
    assert len(r["cells"]) == len(r["actors"]) * len(r["staleness"]) and r["ratio"] > 0
