"""`python -m asyncrl.bench convergence`: the grid plan, the figures of one run, the time to the
synchronous run's final accuracy and the seed averages, on hand-written metrics rows with
hand-derived values (default suite, no processes); and, `slow` (the whole topology twice, minutes
on 2 cores), the command itself on a tiny grid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.bench import convergence as cv
from asyncrl.bench.__main__ import build_parser
from asyncrl.config import Config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _rows(step_s: float, accs: dict[int, float], eval_s: float, steps: int = 4, t0: float = 100.0) -> list[dict]:
    """metrics.jsonl rows: training rows every `step_s`, an eval row after each step in `accs`
    (the evaluation takes `eval_s`, so the next step ends eval_s later)."""
    rows, t = [], t0
    for k in range(1, steps + 1):
        t += step_s
        rows.append({"step": k, "time": t, "perf/step_s": step_s, "train/mismatch_kl": 1e-3 * k,
                     "train/is_weight_mean": 1.0, "perf/learner_idle_ratio": 0.5})
        if k in accs:
            t += eval_s
            rows.append({"step": k, "time": t, "eval/guided_accuracy": accs[k]})
    return rows


def _cell(eta: int, mode: str, seed: int, step_s: float, accs: dict[int, float], test: float) -> dict:
    summary = {"after": {"guided_accuracy": test, "guided_accuracy_se": 0.02, "rows": 500},
               "before": {"guided_accuracy": 0.5}, "staleness_hist": [3, 1][: eta + 1]}
    return {"max_staleness": eta, "mode": mode, "seed": seed,
            **cv.cell_figures(_rows(step_s, accs, 3.0), summary, {k: 3.0 for k in accs})}


def _flags(*flags: str):
    """The command line's flags, parsed as `python -m asyncrl.bench convergence ...` parses them."""
    return build_parser("convergence").parse_intermixed_args(["convergence", *flags])


def test_plan_runs_sync_once_per_seed() -> None:
    cfg = Config()
    p = cv.plan(cfg, _flags())
    # default grid: η {0, 1, 2} x {none, tis, decoupled} x seeds {1, 2}, η = 0 once per seed
    assert p["staleness"] == [0, 1, 2] and p["seeds"] == [1, 2] and len(p["runs"]) == 2 * (1 + 2 * 3)
    assert [r for r in p["runs"] if r["max_staleness"] == 0] == [
        {"seed": 1, "max_staleness": 0, "mode": cfg.learner.off_policy.mode},
        {"seed": 2, "max_staleness": 0, "mode": cfg.learner.off_policy.mode}]
    assert p["runs"][0]["seed"] == 1 and p["runs"][6]["seed"] == 1 and p["runs"][7]["seed"] == 2  # seed by seed
    full = cv.plan(cfg, _flags("--full"))
    assert full["staleness"] == [0, 1, 2, 4] and full["steps"] == 200 and len(full["runs"]) == 2 * (1 + 3 * 3)
    p = cv.plan(cfg, _flags("--staleness", "2,1", "--sync-all-modes"))
    assert p["staleness"] == [0, 1, 2] and len(p["runs"]) == 2 * 3 * 3  # η = 0 added, every mode at η = 0
    assert cv.estimate_s(p, 1000) > 0


def test_cell_figures_exclude_eval_time() -> None:
    # step_s 2, evals (3 s each) after steps 2 and 4: row times 102, 104, [eval], 109, 111
    # training seconds exclude evaluations: step 2 -> 104 - 100 = 4, step 4 -> 111 - 100 - 3 = 8
    c = _cell(0, "tis", 1, 2.0, {2: 0.5, 4: 0.6}, 0.7)
    assert [(p["step"], p["train_s"], p["accuracy"]) for p in c["val_curve"]] == [(2, 4.0, 0.5), (4, 8.0, 0.6)]
    assert c["train_wall_s"] == 8.0 and c["steps_per_s"] == 0.5 and c["final_val_accuracy"] == 0.6
    assert c["test_accuracy"] == 0.7 and c["test_accuracy_se"] == 0.02 and c["staleness_hist"] == [3]
    # mismatch_kl mean of 1e-3 x [1, 2, 3, 4] = 2.5e-3
    assert c["mismatch_kl_mean"] == pytest.approx(2.5e-3)


def test_time_to_sync_accuracy_and_seed_averages() -> None:
    p = {"staleness": [0, 1], "modes": ["none", "tis"], "seeds": [1, 2], "sync_all_modes": False}
    cells = [
        # seed 1: sync reaches its final 0.6 at step 4 = 8 s; η=1 tis (1 s steps) reaches 0.6 at step 2:
        # 2 s -> ratio 2 / 8 = 0.25; η=1 none peaks at 0.55: not reached
        _cell(0, "tis", 1, 2.0, {2: 0.5, 4: 0.6}, 0.70),
        _cell(1, "tis", 1, 1.0, {2: 0.6, 4: 0.55}, 0.72),
        _cell(1, "none", 1, 1.0, {2: 0.5, 4: 0.55}, 0.66),
        # seed 2: sync final 0.5 reached already at step 2 (4 s); η=1 tis reaches it at step 4:
        # 1 + 1 + 3 (eval) + 1 + 1 - 3 = 4 s -> ratio 1.0
        _cell(0, "tis", 2, 2.0, {2: 0.5, 4: 0.5}, 0.68),
        _cell(1, "tis", 2, 1.0, {2: 0.4, 4: 0.5}, 0.74),
        {"max_staleness": 1, "mode": "none", "seed": 2, "error": "RuntimeError: start-up failed"},
    ]
    r = cv.summarize(cells, p)
    by = {(c["max_staleness"], c["mode"], c["seed"]): c for c in r["cells"] if "error" not in c}
    assert by[(1, "tis", 1)]["time_to_sync_s"] == 2.0 and by[(1, "tis", 1)]["time_to_sync_ratio"] == 0.25
    assert by[(1, "none", 1)]["time_to_sync_s"] is None and by[(1, "none", 1)]["time_to_sync_ratio"] is None
    assert by[(1, "tis", 2)]["time_to_sync_s"] == 4.0 and by[(1, "tis", 2)]["time_to_sync_ratio"] == 1.0
    assert by[(0, "tis", 1)]["time_to_sync_ratio"] == 1.0
    table = {(t["max_staleness"], t["mode"]): t for t in r["table"]}
    assert set(table) == {(0, "(any: η=0)"), (1, "none"), (1, "tis")} and r["failed_cells"] == 1
    tis = table[(1, "tis")]
    # test accuracy over seeds: mean(0.72, 0.74) = 0.73, SE = stdev / sqrt(2) = 0.014142 / 1.414214 = 0.01
    assert tis["test_accuracy_mean"] == pytest.approx(0.73) and tis["test_accuracy_se_across_seeds"] == pytest.approx(0.01)
    assert tis["reached_sync"] == "2/2" and tis["time_to_sync_ratio_mean"] == pytest.approx(0.625)
    assert table[(1, "none")]["reached_sync"] == "0/1" and table[(1, "none")]["test_accuracy_se_across_seeds"] is None
    assert table[(0, "(any: η=0)")]["seeds"] == [1, 2]
    json.dumps(r)  # the result is JSON as written
    cv.print_grid(r)


def test_variance_grid_plan_and_mode_specs(capsys: pytest.CaptureFixture[str]) -> None:
    p = cv.plan(Config(), _flags("--variance"))
    # per seed: η = 0 once, decoupled at η 1, 2, 4, 8, each of the 5 other modes at η 4 and 8 -> 1 + 4 + 10
    assert p["staleness"] == [0, 1, 2, 4, 8] and p["modes"] == cv.VARIANCE_MODES
    assert len(p["runs"]) == 2 * (1 + 4 + 5 * 2)
    assert {r["max_staleness"] for r in p["runs"] if r["mode"] == "m2po"} == {4, 8}
    assert cv.mode_overrides("decoupled+lr_scale=ess+lag_decay=0.5") == {"mode": "decoupled", "lr_scale": "ess",
                                                                          "lag_decay": 0.5}
    assert cv.mode_overrides("m2po") == {"mode": "m2po"}
    assert cv.mode_overrides("decoupled+buffer.staleness=drift") == {"mode": "decoupled", "buffer.staleness": "drift"}
    built = {r["mode"]: cv.cell_config(Config(), r, p, "val.jsonl") for r in p["runs"] if r["max_staleness"] == 8}
    assert built["m2po"].learner.off_policy.mode == "m2po" and built["m2po"].buffer.max_staleness == 8
    assert built["decoupled+lr_scale=ess"].learner.off_policy.lr_scale == "ess"
    assert built["decoupled+buffer.staleness=drift"].buffer.staleness == "drift"
    assert built["decoupled+buffer.staleness=drift"].learner.off_policy.mode == "decoupled"
    assert len({c.trainer.experiment_name for c in built.values()}) == len(built)  # one run dir per cell
    with pytest.raises(ValueError, match="lr_scale=ess"):  # a refused combination fails by name
        cv.cell_config(Config(), {"seed": 1, "max_staleness": 4, "mode": "none+lr_scale=ess"}, p, "val.jsonl")
    with pytest.raises(SystemExit) as exited:  # a malformed spec is refused by the flag, before any run
        _flags("--modes", "decoupled,tis+cap")
    assert exited.value.code == 2 and "argument --modes: mode spec 'tis+cap': 'cap' is not key=value" in capsys.readouterr().err


def test_grid_flags_override_the_defaults_and_refuse_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    p = cv.plan(Config(), _flags("--staleness", "4", "--modes", "m2po", "--seeds", "3", "--steps", "20",
                                 "--eval-every", "5", "--val-rows", "0", "--test-rows", "50", "--reuse"))
    # η 0 is added to the asked 4; one seed, so 2 runs: η 0 with the config's mode, η 4 with m2po
    assert p["staleness"] == [0, 4] and p["modes"] == ["m2po"] and p["seeds"] == [3]
    assert [(r["max_staleness"], r["mode"]) for r in p["runs"]] == [(0, Config().learner.off_policy.mode), (4, "m2po")]
    # --val-rows 0 means every row (None); the others as given
    assert (p["steps"], p["eval_every"], p["val_rows"], p["test_rows"], p["reuse"]) == (20, 5, None, 50, "finished")
    assert cv.plan(Config(), _flags("--reuse-only"))["reuse"] == "only"
    with pytest.raises(SystemExit):
        _flags("--staleness", "1,x")
    assert "argument --staleness: expected comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _flags("--reuse", "--reuse-only")
    assert "not allowed with argument" in capsys.readouterr().err


def test_variance_figures_explain_a_cell() -> None:
    # two steps: ESS per step = (mean w)^2 / mean w^2: 0.9^2 / 0.9 = 0.9 and 1 / 1 = 1 -> mean 0.95
    rows = [{"train/version_lag_mean": 3.0, "train/is_clipped_frac": 0.1, "train/m2po_masked_frac": 0.02,
             "train/seq_is_weight_mean": 0.9, "train/seq_is_weight_sq_mean": 0.9, "train/lr_scale": 0.5},
            {"train/version_lag_mean": 5.0, "train/is_clipped_frac": 0.3, "train/m2po_masked_frac": 0.04,
             "train/seq_is_weight_mean": 1.0, "train/seq_is_weight_sq_mean": 1.0, "train/lr_scale": 0.7}]
    f = cv.variance_figures(rows)
    assert f["lag_mean"] == pytest.approx(4.0) and f["masked_frac"] == pytest.approx(0.2)
    assert f["m2po_masked_frac"] == pytest.approx(0.03) and f["ess_mean"] == pytest.approx(0.95)
    assert f["lr_scale_mean"] == pytest.approx(0.6) and f["drift_masked_frac"] is None


@pytest.mark.slow
def test_convergence_smoke(tmp_path: Path) -> None:
    """The command on the real system: η 0 and 1 (tis), 2 learner steps each, 8 val/test rows."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "asyncrl.bench", "convergence", f"trainer.run_dir={tmp_path / 'runs'}",
           "verifier.port=0", "--smoke", "--modes", "tis", "--output", str(tmp_path),
           "--config", str(ROOT / "configs/quickstart.yaml")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    (path,) = tmp_path.glob("convergence-2*.json")
    r = json.loads(path.read_text())
    assert r["failed_cells"] == 0 and len(r["cells"]) == 2
    for c in r["cells"]:
        assert c["steps"] == 2 and c["val_curve"] and 0 <= c["test_accuracy"] <= 1
        assert sum(c["staleness_hist"]) == 2 * 8  # 2 steps x rollout_batch_size 8 groups
    sync = next(c for c in r["cells"] if c["max_staleness"] == 0)
    assert sync["time_to_sync_ratio"] == 1.0 and abs(sync["mismatch_kl_mean"]) < 1e-4
    assert list(tmp_path.glob("convergence-*.png"))
