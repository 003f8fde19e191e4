"""`python -m asyncrl.bench trl`: the TRL settings mirror asyncrl's config, the side-by-side
figures are computed as documented, and without TRL the benchmark says so instead of failing.
(The real side-by-side run is tests/integration/test_bench_trl.py, slow, where TRL is installed.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from asyncrl.bench import trl as bench_trl
from asyncrl.bench.trl_side import trl_settings
from asyncrl.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_trl_settings_mirror_the_quickstart_config():
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["trainer.save_every=50"])
    s = trl_settings(cfg, "/tmp/out")
    # B=8 prompts x G=8 samples = 64 completions, all in ONE optimiser step per generation round
    assert s["num_generations"] == 8
    assert s["per_device_train_batch_size"] == 64
    assert s["gradient_accumulation_steps"] == 1 and s["steps_per_generation"] == 1
    assert s["learning_rate"] == 5e-5 and s["lr_scheduler_type"] == "constant"
    assert s["beta"] == 0.1  # learner.kl.coef (k3 on both sides)
    assert (s["epsilon"], s["epsilon_high"]) == (0.2, 0.3)
    assert s["loss_type"] == "dapo"  # asyncrl's token mean over the batch
    assert s["temperature"] == 0.5 and s["max_completion_length"] == 64
    assert s["weight_decay"] == 0.01 and s["max_grad_norm"] == 1.0
    assert s["save_steps"] == 50 and s["max_steps"] == 150  # the quick start's trainer.max_steps


def test_kl_off_maps_to_beta_zero_and_seq_mean_to_grpo_loss():
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["learner.kl.enable=false", "learner.loss_avg_mode=seq"])
    s = trl_settings(cfg, "/tmp/out")
    assert s["beta"] == 0.0 and s["loss_type"] == "grpo"


def test_time_to_target_is_the_first_checkpoint_at_or_above_it():
    curve = [{"accuracy": 0.54, "wall_s": 10.0}, {"accuracy": 0.61, "wall_s": 50.0}, {"accuracy": 0.60, "wall_s": 90.0}]
    assert bench_trl._time_to(curve, 0.60) == 50.0
    assert bench_trl._time_to(curve, 0.70) is None


def test_without_trl_the_benchmark_skips_with_the_install_command(monkeypatch, capsys):
    real = bench_trl.importlib.util.find_spec
    monkeypatch.setattr(bench_trl.importlib.util, "find_spec", lambda name: None if name == "trl" else real(name))
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [])
    result = bench_trl.run(cfg, argparse.Namespace(output="/tmp/unused", smoke=True, repeats=1))
    assert "skipped" in result and "make bench-trl" in result["skipped"]
    assert "TRL is not installed" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["token", "seq", "seq_sum_token_mean"])
def test_every_loss_mode_has_a_trl_counterpart(mode):
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"learner.loss_avg_mode={mode}"])
    assert trl_settings(cfg, "/tmp/out")["loss_type"] in {"dapo", "grpo", "dr_grpo"}


def _side(curve: list[tuple[float, float]], step_s: float, exit_s: float) -> dict:
    return {"step_s": [step_s] * 8, "launch_to_exit_s": exit_s, "first_step_s": curve[0][1], "train_s": 8 * step_s,
            "curve": [{"accuracy": a, "se": 0.01, "wall_s": w} for a, w in curve], "split": {"time/train_s": 0.5}}


def test_compare_reports_each_sides_time_to_trls_final_accuracy():
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [])
    # asyncrl reaches TRL's final 0.60 at its second checkpoint (40 s); TRL at its last (120 s):
    # ratio 40 / 120 = 1/3. A run that never reaches it has no ratio.
    sides = {"asyncrl": _side([(0.55, 10.0), (0.62, 40.0), (0.58, 70.0)], 0.5, 80.0),
             "trl": _side([(0.55, 5.0), (0.57, 60.0), (0.60, 120.0)], 0.6, 130.0)}
    summaries, ratios, target = bench_trl._compare(sides, cfg, warmup=0)
    assert target == 0.58  # the lower final accuracy
    assert summaries["asyncrl"]["time_to_trl_final_s"] == 40.0 and summaries["trl"]["time_to_trl_final_s"] == 120.0
    assert ratios["time_to_trl_final_asyncrl_over_trl"] == pytest.approx(1 / 3)
    sides["asyncrl"]["curve"][1]["accuracy"] = 0.59
    _, ratios, _ = bench_trl._compare(sides, cfg, warmup=0)
    assert ratios["time_to_trl_final_asyncrl_over_trl"] is None


def test_repeats_report_min_median_max_of_every_ratio():
    runs = [{"ratios": {"launch_to_exit_asyncrl_over_trl": r, "same_accuracy_within_1se": True},
             "summaries": {"asyncrl": {"median_step_s": s, "time_to_trl_final_s": None}}}
            for r, s in ((1.2, 0.7), (0.9, 0.5), (1.0, 0.6))]
    spread = bench_trl._spread(runs)
    assert spread["launch_to_exit_asyncrl_over_trl"] == (0.9, 1.0, 1.2)
    assert spread["asyncrl median_step_s"] == (0.5, 0.6, 0.7)
    assert "same_accuracy_within_1se" not in spread and "asyncrl time_to_trl_final_s" not in spread


def test_the_asyncrl_sides_config_file_reads_back_and_passes_the_preflight(tmp_path):
    # The side's YAML once held every default explicitly; the preflight read data.min_pixels /
    # max_pixels as set on a text model and `make bench-trl` exited 2 before its first step.
    import yaml

    from asyncrl.checks.preflight import check_model, refusals

    side = bench_trl._side_config(load_config(ROOT / "configs" / "quickstart.yaml", ["trainer.max_steps=200"]),
                                  tmp_path, smoke=False)
    path = tmp_path / "side.yaml"
    path.write_text(yaml.safe_dump(side.model_dump(mode="json", exclude_unset=True), sort_keys=False))
    back = load_config(path, [])

    def settings(cfg):  # the job secrets are drawn afresh at every parse (asyncrl.config.roles._job_secret)
        dump = cfg.model_dump()
        dump["buffer"].pop("secret", None)
        dump["learner"]["weights"].pop("secret", None)
        return dump

    assert settings(back) == settings(side) and back.rollout.guide.enable is False
    assert refusals(check_model(back)) == []
