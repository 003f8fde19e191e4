"""Proves that a Guided-GRPO recipe runs here with only the module changed and means the same
experiment: each example script of the original (tests/fixtures/guided_grpo/examples, Apache-2.0,
run by bash with `python3` captured, so its real override list is used) resolves through
`python -m asyncrl.launch ... --print-config`, and the resolved config carries the original's
batches (PPO mini-batches), steps (epochs), GPUs (the role split, all of them, never a CPU
learner), evaluation data and algorithm keys (GSPO, DAPO filtering, REINFORCE++, CISPO); asyncrl
keys after the recipe win; bad input (a misspelt original key, a non-divisor batch, a GPU count
the split cannot serve) exits 2 naming the key; `asyncrl.migrate` round-trips every script.
The four node-wide-TP shapes (tests/fixtures/guided_grpo/node_wide_tp: TP 2 on 2 GPUs for a 3B/4B VL
model, TP 8 on 8 for a 30B/32B one) resolve to a split that uses every GPU with the rollout TP
narrowed by the memory rule, the change stated and its arithmetic printed; a model whose size is
unknown offline keeps the refusal, with the split the rule would choose for stated sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import Config, ConfigError, load_config, load_guided_grpo
from asyncrl.config.role_split import split_roles
from asyncrl.migrate import migrate

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "tests" / "fixtures" / "guided_grpo"  # the original's examples/ under its LICENSE
SCRIPTS = sorted(p.name for p in (RECIPES / "examples").glob("*.sh"))
NODE_WIDE_TP = sorted(p.name for p in (RECIPES / "node_wide_tp").glob("*.sh"))


def script_args(name: str, tmp_path: Path, folder: str = "examples") -> list[str]:
    """The arguments the script passes to `python3 -m verl.trainer.main`, captured by running it
    with a `python3` on PATH that records its argv (variables, conditionals and all)."""
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "python3").write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$ARGV_OUT"\n')
    (shim / "python3").chmod(0o755)
    out = tmp_path / f"{name}.argv"
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "ARGV_OUT": str(out),
           "CHECKPOINT_SAVE": "/ckpt"}
    subprocess.run(["bash", f"{folder}/{name}"], cwd=RECIPES, env=env, check=True, capture_output=True, timeout=30)
    argv = out.read_text().split("\0")[:-1]
    assert argv[:2] == ["-m", "verl.trainer.main"], argv
    return argv[2:]


def launch(args: list[str], cwd: Path = RECIPES, print_config: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "asyncrl.launch", *args] + (["--print-config"] if print_config else [])
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def resolved(args: list[str]) -> tuple[dict, str]:
    proc = launch(args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def roles(cfg: dict) -> tuple[int, int, int, float]:
    """(learner GPUs, rollout actors, GPUs per actor, verifier GPUs)."""
    v = cfg["verifier"]
    verifier = v["num_replicas"] * v["gpus_per_replica"] if cfg["rollout"]["guide"]["enable"] and \
        v["backend"] == "vllm" else 0
    return cfg["learner"]["num_gpus"], cfg["rollout"]["num_actors"], cfg["rollout"]["gpus_per_actor"], verifier


# ------------------------------------------------------------------ the example scripts, swapped module
def test_math_grpo_script_means_the_original_experiment(tmp_path: Path) -> None:
    cfg, err = resolved(script_args("qwen2_5_7b_math_grpo.sh", tmp_path))
    assert cfg["model"]["path"] == "Qwen/Qwen2.5-7B-Instruct"
    # rollout_batch_size 512 prompts / global_batch_size 128 prompts = 4 PPO updates per step
    assert cfg["learner"]["mini_batches"] == 4 and cfg["data"]["rollout_batch_size"] == 512
    # 15 epochs, max_steps null: the steps wait for the rows (derived at launch)
    assert cfg["trainer"]["max_steps"] is None and cfg["trainer"]["total_epochs"] == 15
    assert "derived at launch" in err
    # 1 x 8 GPUs, TP 2, no verifier: learner = largest power of two <= 8/2 = 4; rollout 4 = 2 x TP2
    assert roles(cfg) == (4, 2, 2, 0) and cfg["learner"]["zero_stage"] == 3
    assert "role split: 8 GPU(s) of the recipe's 8" in err
    # evaluation: the original validates on its val files (before, every 5 steps, at the end)
    assert cfg["data"]["test_files"] == cfg["data"]["val_files"] == "hiyouga/math12k@test"
    assert cfg["trainer"]["eval_before_after"] is True and cfg["trainer"]["eval_every"] == 5
    assert cfg["rollout"]["val_override_config"] == {"temperature": 0.6, "top_p": 0.95, "n": 1}
    kl = cfg["learner"]["kl"]
    assert (kl["enable"], kl["mode"], kl["estimator"], kl["coef"]) == (True, "loss", "k3", 1e-2)
    assert cfg["rollout"]["n"] == 5 and cfg["learner"]["loss_type"] == "ppo"
    assert (cfg["learner"]["clip_eps_low"], cfg["learner"]["clip_eps_high"]) == (0.2, 0.3)
    assert cfg["reward"]["function"] == "./examples/reward_function/math.py:compute_score"
    assert cfg["data"]["format_prompt"] == "./examples/format_prompt/math.jinja"
    assert cfg["trainer"]["logger"] == ["jsonl", "wandb", "tensorboard"]
    assert cfg["trainer"]["run_dir"] == "checkpoints/easy_r1" and cfg["trainer"]["resume"] == "auto"
    # one grouped message, printed once (no second copy as a Python warning)
    assert err.count("Guided-GRPO keys that asyncrl does not take as they are") == 1
    assert "UserWarning" not in err and "worker.actor.fsdp.*" in err


def test_geo3k_dapo_script(tmp_path: Path) -> None:
    cfg, err = resolved(script_args("qwen2_5_vl_7b_geo3k_dapo.sh", tmp_path))
    assert cfg["data"]["train_files"] == "hiyouga/geometry3k@train"
    assert (cfg["learner"]["clip_eps_low"], cfg["learner"]["clip_eps_high"]) == (0.2, 0.28)
    assert cfg["learner"]["kl"]["enable"] is False
    ds = cfg["buffer"]["dynamic_sampling"]
    assert (ds["enable"], ds["key"], ds["low"], ds["high"]) == (True, "overall", 0.01, 0.99)
    assert cfg["learner"]["mini_batches"] == 4 and roles(cfg) == (4, 2, 2, 0)
    assert "data.mini_rollout_batch_size: the original's generation chunk" in err
    assert "trainer.max_try_make_batch" in err  # matters with online filtering
    assert cfg["trainer"]["experiment_name"] == "qwen2_5_vl_7b_geo_dapo"


def test_geo3k_grpo_script(tmp_path: Path) -> None:
    cfg, err = resolved(script_args("qwen2_5_vl_7b_geo3k_grpo.sh", tmp_path))
    assert cfg["data"]["val_files"] == cfg["data"]["test_files"] == "hiyouga/geometry3k@test"
    assert cfg["model"]["path"] == "Qwen/Qwen2.5-VL-7B-Instruct" and cfg["learner"]["kl"]["enable"] is True
    assert "trainer.max_try_make_batch" not in err  # no online filtering: the bound changes nothing


def test_geo3k_gspo_script(tmp_path: Path) -> None:
    cfg, _ = resolved(script_args("qwen2_5_vl_7b_geo3k_gspo.sh", tmp_path))
    lc = cfg["learner"]
    assert (lc["loss_type"], lc["loss_avg_mode"], lc["clip_eps_low"], lc["clip_eps_high"]) == \
        ("gspo_token", "seq", 3e-4, 4e-4)
    assert lc["kl"]["enable"] is False


def test_geo3k_reinforce_pp_script(tmp_path: Path) -> None:
    cfg, _ = resolved(script_args("qwen2_5_vl_7b_geo3k_reinforce.sh", tmp_path))
    kl = cfg["learner"]["kl"]
    assert cfg["algorithm"]["adv_estimator"] == "reinforce_plus_plus"
    # use_kl_loss false + kl_penalty kl: a k1 penalty in the reward, beta 1e-3
    assert (kl["enable"], kl["mode"], kl["estimator"], kl["coef"]) == (True, "reward", "k1", 1e-3)


def test_qwen3_4b_math_script(tmp_path: Path) -> None:
    cfg, _ = resolved(script_args("qwen3_4b_math_grpo.sh", tmp_path))
    assert cfg["data"]["max_response_length"] == 4096 and cfg["model"]["path"] == "Qwen/Qwen3-4B"
    assert cfg["trainer"]["experiment_name"] == "qwen3_4b_math_grpo" and roles(cfg) == (4, 2, 2, 0)


def test_local_verifier_script_two_nodes(tmp_path: Path) -> None:
    args = script_args("run_guided_grpo_local_verifier.sh", tmp_path)
    assert "trainer.nnodes=2" in args and "config=examples/config_multi_turn.yaml" in args
    cfg, _ = resolved(args)
    # VERIFIER_PATH is empty in the script: the verifier stays off (enable is null in the YAML).
    # 2 x 8 = 16 GPUs, TP 1: learner 8 (largest power of two <= 16/2), rollout 8 actors x 1
    assert cfg["rollout"]["guide"]["enable"] is False and roles(cfg) == (8, 8, 1, 0)
    assert cfg["trainer"]["run_dir"] == "/ckpt/test1"  # trainer.save_checkpoint_path=${CKPT_DIR}
    assert cfg["data"]["system_prompt"].startswith("You are the student solving the math problem")
    assert (cfg["learner"]["kl"]["coef"], cfg["learner"]["optim"]["lr"], cfg["rollout"]["n"]) == (1e-3, 5e-6, 8)
    # no val files in the YAML: no before/after evaluation (and the summary says so)
    assert cfg["data"]["test_files"] == "" and cfg["trainer"]["eval_before_after"] is False
    # The same script with the verifier path filled in: a local verifier model on GPUs of its own.
    on, err = resolved(args + ["worker.rollout.verifier.enable=true",
                               "worker.rollout.verifier.model_path=/models/guided-verifier-8b"])
    # verifier: 16 // 8 = 2 replicas x 1 GPU; learner: largest power of two <= (16 - 2) / 2 = 4;
    # rollout: 16 - 2 - 4 = 10 actors x TP1
    assert roles(on) == (4, 10, 1, 2) and on["verifier"]["backend"] == "vllm"
    assert on["rollout"]["guide"]["max_turns"] == 10
    assert on["verifier"]["max_model_len"] == 20000  # the policy engine's, as the original builds it
    assert "never loads these weights" in err  # the original's local verifier ran with random weights
    assert "verifier      2  2 replica(s) x 1 GPU" in err


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_resolves_and_uses_every_gpu(name: str, tmp_path: Path) -> None:
    args = script_args(name, tmp_path)
    cfg, _ = resolved(args)
    learner, actors, tp, verifier = roles(cfg)
    nnodes = next((int(a.split("=")[1]) for a in args if a.startswith("trainer.nnodes=")), 1)
    per_node = next((int(a.split("=")[1]) for a in args if a.startswith("trainer.n_gpus_per_node=")), 8)
    assert learner >= 1 and learner & (learner - 1) == 0  # a GPU recipe never gets a CPU learner
    assert learner + actors * tp + verifier == nnodes * per_node


@pytest.mark.parametrize("name", SCRIPTS)
def test_migrate_round_trips(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """migrate -> load the YAML -> the same resolved config as the drop-in launch."""
    args = script_args(name, tmp_path)
    monkeypatch.chdir(RECIPES)
    recipe, overrides = args[0].removeprefix("config="), args[1:]
    job = tmp_path / "job.yaml"
    job.write_text(migrate(recipe, overrides))
    direct, _ = load_guided_grpo(recipe, overrides)
    assert json.loads(load_config(job).to_json()) == json.loads(direct.to_json())
    text = job.read_text()
    assert "# derived: role split of" in text and "# role split:" in text
    assert "# derived: data.rollout_batch_size 512 / worker.actor.global_batch_size" in text


def test_migrate_cli_writes_a_loadable_file(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "asyncrl.migrate", "config=examples/config.yaml",
                           "worker.actor.model.model_path=/models/qwen", "trainer.max_steps=30", "-o", str(job)],
                          cwd=RECIPES, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cfg = load_config(job)
    assert cfg.model.path == "/models/qwen" and cfg.trainer.max_steps == 30 and cfg.learner.mini_batches == 4
    assert "trainer.total_epochs=15 ignored: max_steps wins" in job.read_text()


# -------------------------------------------------------------- recipes of the original not in shared/
def test_cispo_recipe_departs_only_from_the_clamp_bug() -> None:
    cfg, conv = load_guided_grpo(RECIPES / "examples/config.yaml", [
        "worker.actor.loss_type=cispo", "worker.actor.clip_ratio_low=0", "worker.actor.clip_ratio_high=4"])
    assert cfg.learner.loss_type == "cispo" and cfg.learner.cispo_eps_high == 4
    # clip_ratio_low 0 would clamp every IS weight below 1 up to 1 in the original: unbounded here
    assert cfg.learner.cispo_eps_low is None and "CISPO paper" in conv.derived["learner.cispo_eps_low"]


def test_dapo17k_script(tmp_path: Path) -> None:
    """The original's Qwen3-14B DAPO recipe on dapo17k."""
    cfg, err = resolved(script_args("qwen3_14b_dapo17k_dapo.sh", tmp_path))
    lc = cfg["learner"]
    assert lc["mini_batches"] == 16  # rollout_batch_size 512 / global_batch_size 32
    # lr_warmup_steps counts training steps in the original: 10 steps x 16 optimizer steps each = 160
    assert lc["optim"]["warmup_steps"] == 160
    assert (lc["clip_ratio_dual"], lc["optim"]["weight_decay"], lc["kl"]["enable"]) == (10.0, 0.1, False)
    ds = cfg["buffer"]["dynamic_sampling"]
    assert ds["enable"] and ds["key"] == "accuracy_normalized"
    assert cfg["reward"]["function"] == "./examples/reward_function/dapo.py:compute_score"
    assert cfg["reward"]["kwargs"] == {"max_response_length": 20480, "overlong_buffer_length": 4096,
                                       "overlong_penalty_factor": 1.0}
    assert cfg["trainer"]["total_epochs"] == 10 and cfg["data"]["prompt_key"] == "problem"
    # evaluation: temperature/top_p kept; n 16 becomes one sample per row, warned
    assert cfg["rollout"]["val_override_config"] == {"temperature": 1.0, "top_p": 0.7, "n": 1}
    assert "worker.rollout.val_override_config.n: 16" in err and "worker.actor.optim.strategy" in err
    assert "worker.actor.ulysses_size" in err and "trainer.max_try_make_batch" in err
    # 8 GPUs, TP 4: learner 4 (largest power of two <= 8/2), rollout 4 = one TP4 engine
    assert roles(cfg) == (4, 1, 4, 0)


def test_guided_http_recipe() -> None:
    cfg, conv = load_guided_grpo(RECIPES / "examples/config_multi_turn_http.yaml",
                                 ["worker.rollout.verifier.base_url=http://10.0.0.1:8000/v1"])
    assert cfg.rollout.guide.enable and cfg.verifier.backend == "http"
    assert cfg.verifier.http.model == "ve" and cfg.verifier.http.timeout_s == 120.0
    assert cfg.verifier.http.max_retries == 1  # http_max_retries 2 = attempts in all: 1 retry after the first
    assert cfg.rollout.guide.sampling.temperature == 0.0 and cfg.rollout.guide.sampling.top_k == 0
    assert cfg.rollout.guide.enable_hallucination_score is False and cfg.rollout.limit_images == 1
    # 2 x 8 GPUs and an HTTP verifier elsewhere: learner 8, rollout 8 x TP1
    assert (cfg.learner.num_gpus, cfg.rollout.num_actors, cfg.verifier.num_replicas) == (8, 8, 1)
    assert "worker.rollout.prompt_truncation" in conv.notes["unsupported"]
    assert "console" in cfg.trainer.logger and "jsonl" in cfg.trainer.logger


def test_original_defaults_apply_to_absent_keys() -> None:
    """A bare recipe means what it meant in the original: its dataclass defaults, not asyncrl's."""
    bare = {"worker": {"actor": {"model": {"model_path": "m"}}}, "data": {"train_files": "t"}}
    with pytest.raises(ConfigError, match=r"grpo needs rollout.n > 1 \(got 1\)"):
        load_guided_grpo(bare)  # the original's default n is 1, which GRPO refuses there too
    cfg, _ = load_guided_grpo(bare, ["worker.rollout.n=4"])
    assert cfg.data.prompt_key == "prompt" and cfg.data.rollout_batch_size == 512
    assert cfg.learner.mini_batches == 2  # 512 / the original's default global_batch_size 256
    # disable_kl false (default) + use_kl_loss false (default): a k1 KL penalty in the reward, 1e-3
    assert (cfg.learner.kl.enable, cfg.learner.kl.mode, cfg.learner.kl.estimator) == (True, "reward", "k1")
    assert cfg.trainer.total_epochs == 15 and cfg.trainer.max_steps is None
    assert cfg.data.test_files == "" and cfg.data.val_files == ""  # never the quick start's files


# ------------------------------------------------------------------------------- drop-in semantics
def test_asyncrl_keys_after_the_recipe_win_and_original_overrides_convert() -> None:
    cfg, _ = resolved(["config=examples/config.yaml", "data.rollout_batch_size=256", "learner.zero_stage=2",
                       "trainer.max_steps=3", "rollout.num_actors=1"])
    assert cfg["learner"]["mini_batches"] == 2  # 256 / 128: the original's override is converted
    assert cfg["learner"]["zero_stage"] == 2 and cfg["rollout"]["num_actors"] == 1
    assert cfg["trainer"]["max_steps"] == 3


def test_the_three_entry_forms_share_one_converter() -> None:
    a, _ = resolved(["config=examples/config.yaml", "worker.rollout.n=4"])
    b, _ = resolved(["--config", "examples/config.yaml", "worker.rollout.n=4"])
    c, _ = resolved(["--config-format", "guided_grpo", "--config", "examples/config.yaml", "worker.rollout.n=4"])
    assert a == b == c and a["rollout"]["n"] == 4


def test_loggers_the_original_has_and_asyncrl_lacks_are_named() -> None:
    cfg, conv = load_guided_grpo(RECIPES / "examples/config.yaml", ["trainer.logger=[console,file,swanlab,mlflow]"])
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert conv.notes["unsupported"]["trainer.logger"].startswith("swanlab, mlflow not available (dropped); "
                                                                   "the sinks are console, file (jsonl)")


def test_asyncrl_sink_name_after_a_recipe_is_kept() -> None:
    cfg, conv = load_guided_grpo(RECIPES / "examples/config.yaml", ["trainer.logger=[jsonl]"])
    assert cfg.trainer.logger == ["jsonl"] and "trainer.logger" not in conv.notes["unsupported"]


def test_migrate_refuses_what_the_launch_refuses(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "asyncrl.migrate", "examples/config.yaml",
                           "worker.actor.global_batch_size=100", "-o", str(tmp_path / "job.yaml")],
                          cwd=RECIPES, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "worker.actor.global_batch_size=100" in proc.stderr
    assert not (tmp_path / "job.yaml").exists()


def test_config_equals_an_asyncrl_yaml_loads_it_as_asyncrl() -> None:
    quick, _ = resolved(["config=" + str(ROOT / "configs/quickstart.yaml"), "rollout.n=4"])
    assert quick["rollout"]["n"] == 4 and quick["data"]["test_files"] == "assets/arith/test.jsonl"


def test_roles_set_with_asyncrl_keys_skip_the_split() -> None:
    cfg, err = resolved(["config=examples/config.yaml", "trainer.n_gpus_per_node=2",
                         "learner.num_gpus=0", "rollout.num_actors=1", "rollout.gpus_per_actor=0"])
    assert roles(cfg) == (0, 1, 0, 0) and "role split: 0 GPU(s) of the recipe's 2" in err


def test_roles_beyond_the_recipe_gpus_are_refused() -> None:
    proc = launch(["config=examples/config.yaml", "learner.num_gpus=8"])
    assert proc.returncode == 2 and "the roles ask for 12 GPUs but the recipe has 8" in proc.stderr


# ---------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("override, needles", [
    ("worker.actor.global_batch_sise=64", ["unknown key 'worker.actor.global_batch_sise'",
                                           "did you mean 'worker.actor.global_batch_size' (Guided-GRPO)"]),
    ("trainer.n_gpu_per_node=8", ["did you mean 'trainer.n_gpus_per_node' (Guided-GRPO)"]),
    ("worker.actor.global_batch_size=100", ["data.rollout_batch_size=512 is not a multiple of "
                                            "worker.actor.global_batch_size=100"]),
    ("worker.rollout.tensor_parallel_size=16", ["one rollout engine would span nodes"]),
    ("algorithm.adv_estimator=gae", ["algorithm.adv_estimator='gae': asyncrl has no critic"]),
    ("trainer.val_only=true", ["trainer.val_only=True", "python -m asyncrl.eval"]),
    ("algorithm.kl_penalty=full", ["algorithm.kl_penalty='full'"]),
    ("worker.actor.loss_type=sapo", ["worker.actor.loss_type='sapo'", "default, gspo, gspo_token, cispo"]),
])
def test_bad_input_exits_2_naming_the_key(override: str, needles: list[str]) -> None:
    proc = launch(["config=examples/config.yaml", override])
    assert proc.returncode == 2, proc.stdout[-300:] + proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr


# ------------------------------------------------------------------------- node-wide rollout TP
# (GPUs, learner, engines, TP, change) each shape resolves to, by the rule of asyncrl.config.role_split
# (80 GB x 0.9 = 72 GB per engine GPU, 4 GB overhead, KV of 64 sequences x 4096 tokens, bf16):
NODE_WIDE_EXPECTED = {
    # 3.75B x 2 B = 7.5 GB; KV 36 layers x 2 heads x 128 x 2 (K, V) x 2 B = 36 KiB/token:
    # TP 1: 72 - 7.5 - 4 = 60.5 GB / (36 KiB x 4096) = 400 sequences >= 64 -> TP 1; learner 1, 1 engine
    "qwen2_5_vl_3b_geo3k_grpo.sh": (2, 1, 1, 1, "rollout TP 2 -> 1"),
    # 4.44B -> 8.9 GB; KV 36 x 8 x 128 x 2 x 2 = 144 KiB/token: 72 - 8.9 - 4 = 59.1 GB / 576 MiB = 97 >= 64
    "qwen3_vl_4b_geo3k_grpo.sh": (2, 1, 1, 1, "rollout TP 2 -> 1"),
    # 33.45B -> 66.9 GB; KV 64 x 8 x 128 x 2 x 2 = 256 KiB/token: TP 1: 72 - 66.9 - 4 = 1.1 GB -> 1 sequence;
    # TP 2: 72 - 33.4 - 4 = 34.6 GB / (128 KiB x 4096 = 0.537 GB) = 64.4 >= 64 -> TP 2 (near the bound: a
    # larger overhead or KV_SEQS gives TP 4); learner 4, 2 engines
    "qwen2_5_vl_32b_geo3k_grpo.sh": (8, 4, 2, 2, "rollout TP 8 -> 2"),
    # 31.07B -> 62.1 GB; KV 48 x 4 x 128 x 2 x 2 = 96 KiB/token: TP 1: 72 - 62.1 - 4 = 5.9 GB -> 14 < 64;
    # TP 2: 72 - 31.1 - 4 = 36.9 GB / (48 KiB x 4096) = 183 >= 64 -> TP 2; learner 4, 2 engines
    "qwen3_vl_30b_a3b_geo3k_grpo.sh": (8, 4, 2, 2, "rollout TP 8 -> 2"),
}


@pytest.mark.parametrize("name", NODE_WIDE_TP)
def test_node_wide_tp_recipe_narrows_the_rollout_tp(name: str, tmp_path: Path) -> None:
    total, learner, engines, tp, change = NODE_WIDE_EXPECTED[name]
    cfg, err = resolved(script_args(name, tmp_path, "node_wide_tp"))
    assert roles(cfg) == (learner, engines, tp, 0) and learner + engines * tp == total  # every GPU
    assert f"worker.rollout.tensor_parallel_size: {change} because" in err  # in the grouped message
    assert err.index("changed meaning") < err.index(change)
    assert f"-> TP {tp}, the smallest admitted" in err and "72 GB - weights" in err  # arithmetic in the table
    assert f"role split: {total} GPU(s) of the recipe's {total}" in err


def test_node_wide_tp_too_big_for_one_gpu() -> None:
    """Qwen3-32B on 2 GPUs at TP 2: one GPU cannot hold its 65.5 GB of weights and 64 sequences of KV
    (72 - 65.5 - 4 = 2.5 GB), and TP 2 leaves no learner GPU: refused with the arithmetic."""
    proc = launch(["config=examples/config.yaml", "trainer.n_gpus_per_node=2",
                   "worker.actor.model.model_path=Qwen/Qwen3-32B"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "cannot be split" in proc.stderr and "no narrower TP serves Qwen/Qwen3-32B" in proc.stderr
    assert "TP 1: 80 x 0.9 = 72 GB - weights 65.5/1" in proc.stderr and "(< 64)" in proc.stderr


def test_unknown_model_size_keeps_the_refusal_with_the_split_for_stated_sizes() -> None:
    proc = launch(["config=examples/config.yaml", "trainer.n_gpus_per_node=2",
                   "worker.actor.model.model_path=acme/mystery-7b"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    for needle in ("trainer.nnodes x trainer.n_gpus_per_node = 1 x 2 = 2 GPUs", "cannot be split",
                   "the size of 'acme/mystery-7b' is unknown offline",
                   "8B (as Qwen/Qwen2.5-7B-Instruct): TP 1, learner 1 GPU(s), 1 engine(s)",
                   "33B (as Qwen/Qwen3-32B): none (needs TP 2)"):
        assert needle in proc.stderr, proc.stderr


def test_misspelt_key_in_the_recipe_file(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("worker:\n  rollout:\n    temprature: 0.7\n")
    proc = launch([f"config={recipe}"])
    assert proc.returncode == 2
    assert "unknown Guided-GRPO key 'worker.rollout.temprature'; did you mean 'worker.rollout.temperature'?" in \
        proc.stderr


def test_unreachable_hub_dataset_fails_at_launch_with_how_to_point_at_a_copy() -> None:
    proc = launch(["config=examples/config.yaml", "worker.actor.model.model_path=" + str(ROOT / "assets/tiny-policy")],
                  print_config=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "dataset hiyouga/math12k (split train)" in proc.stderr
    assert "data.train_files=/path/to/math12k@train" in proc.stderr


# ------------------------------------------------------------------------------------- role split rule
@pytest.mark.parametrize("nnodes, per_node, tp, local_verifier, expected", [
    (1, 8, 1, False, (4, 4, 1, 0)),
    (1, 8, 2, False, (4, 2, 2, 0)),
    (1, 8, 4, False, (4, 1, 4, 0)),
    (1, 4, 2, False, (2, 1, 2, 0)),
    (1, 3, 1, False, (1, 2, 1, 0)),
    (1, 5, 2, False, (1, 2, 2, 0)),  # learner 2 would leave 3 GPUs, not whole TP2 engines: 1
    (2, 8, 1, True, (4, 10, 1, 2)),
    (4, 8, 2, True, (8, 10, 2, 4)),  # 32: verifier 4; rest 28 -> learner 8 (<= 14); rollout 20 = 10 x TP2
])
def test_role_split_rule(nnodes: int, per_node: int, tp: int, local_verifier: bool,
                         expected: tuple[int, int, int, int]) -> None:
    s = split_roles(nnodes, per_node, tp, local_verifier)
    assert (s.learner_gpus, s.rollout_actors, s.tensor_parallel_size, s.verifier_replicas) == expected


def test_role_split_uses_every_gpu_or_refuses() -> None:
    """Over 1..64 GPUs: every split uses all of them with a power-of-two learner of at most half,
    and a refusal happens only where no such split exists (checked by brute force)."""
    for total in range(1, 65):
        for tp in (1, 2, 4, 8):
            servable = any(total - 2**k >= tp and (total - 2**k) % tp == 0
                           for k in range(7) if 2 * 2**k <= total) and tp <= total
            try:
                s = split_roles(1, total, tp, False)
            except ConfigError:
                assert not servable, (total, tp)
                continue
            assert servable
            assert s.learner_gpus + s.rollout_actors * tp == total
            assert s.learner_gpus & (s.learner_gpus - 1) == 0 and 2 * s.learner_gpus <= total


def test_default_test_files_point_nowhere() -> None:
    assert Config().data.test_files == ""
    assert load_config(ROOT / "configs" / "quickstart.yaml").data.test_files == "assets/arith/test.jsonl"
