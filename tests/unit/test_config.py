"""The config tree: every shipped config validates; defaults < file < overrides; each error class
gives a message naming the key (and exit status 2 through the CLI); the Guided-GRPO key map's targets
exist (the recipes themselves: test_guided_grpo_recipes.py); importing the config loads no torch/ray/vllm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import (
    GUIDED_GRPO_KEY_MAP,
    Config,
    ConfigError,
    check_files,
    load_config,
    parse_overrides,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    first = path.read_text().splitlines()[0]
    assert first.startswith("#"), f"{path.name} must start with a comment saying what it trains"
    assert "Command:" in path.read_text() and "Hardware:" in path.read_text()


def test_quickstart_files_exist_when_assets_are_built() -> None:
    cfg = load_config(ROOT / "configs/quickstart.yaml")
    if not (ROOT / cfg.model.path).exists():
        pytest.skip("tiny policy not built yet")
    assert check_files(cfg) == []


def test_overrides_scalars_lists_nested_and_precedence(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("rollout: {n: 4, temperature: 0.7}\nlearner: {optim: {lr: 1.0e-5}}\n")
    cfg = load_config(f, ["rollout.n=6", "learner.optim.lr=2e-6", "trainer.logger=[console, wandb]",
                          "learner.optim.betas=[0.9, 0.95]", "rollout.guide.train_scope=full_turn"])
    assert cfg.rollout.n == 6  # override beats file
    assert cfg.rollout.temperature == 0.7  # file beats default (1.0)
    assert cfg.learner.optim.lr == 2e-6
    assert cfg.trainer.logger == ["console", "wandb"]
    assert cfg.learner.optim.betas == (0.9, 0.95)
    assert cfg.rollout.guide.train_scope == "full_turn"
    assert cfg.rollout.top_p == 1.0  # untouched default


def test_parse_overrides_yaml_values() -> None:
    tree = parse_overrides(["a.b=1", "a.c=true", "d=[1, 2]", "e=null", "f=text"])
    assert tree == {"a": {"b": 1, "c": True}, "d": [1, 2], "e": None, "f": "text"}
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_overrides(["novalue"])


def test_derived_max_model_len() -> None:
    cfg = load_config(None, ["data.max_prompt_length=100", "data.max_response_length=20",
                             "rollout.guide.max_turns=3", "rollout.guide.sampling.max_tokens=10"])
    # prompt + turns x (response + verifier reply) = 100 + 3 x (20 + 10) = 190
    assert cfg.rollout.max_model_len == 190


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["rollout.nn=3"], "unknown key 'rollout.nn'; did you mean 'rollout.n'?"),
        (["learner.optim.learning_rate=1"], "unknown key 'learner.optim.learning_rate'"),
        (["rollout.n=abc"], "'rollout.n': Input should be a valid integer"),
        (["rollout.n=1"], "needs rollout.n > 1"),
        (["verifier.backend=http"], "verifier.backend=http requires verifier.http.base_url"),
        (["rollout.guide.train_scope=full_turn", "rollout.guide.history=guided_grpo"], "requires rollout.guide.history=full"),
        (["rollout.max_num_batched_tokens=10"], "rollout.max_num_batched_tokens (10) must be >="),
        (["learner.loss_type=foo"], "'learner.loss_type'"),
    ],
)
def test_error_messages_name_the_key(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert expected in str(info.value)


def test_typo_suggestion_in_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("buffer:\n  max_stalenes: 2\n")
    with pytest.raises(ConfigError, match=r"did you mean 'buffer.max_staleness'\?"):
        load_config(f)


def test_missing_file_is_reported() -> None:
    cfg = load_config(None, ["data.train_files=./nope/train.jsonl", "model.path=./no-model"])
    missing = check_files(cfg)
    assert any("data.train_files" in m and "nope/train.jsonl" in m for m in missing)
    assert any(m.startswith("model.path") for m in missing)
    # A hub id is not a local file and is not checked here.
    assert not any("hub" in m for m in check_files(load_config(None, ["model.path=Qwen/Qwen2.5-7B"])))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncrl.launch", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["rollout.nn=3"], "did you mean 'rollout.n'"),
        (["rollout.n=abc"], "rollout.n"),
        (["rollout.n=1"], "needs rollout.n > 1"),
        (["--config", "does/not/exist.yaml"], "config file not found"),
        (["data.train_files=./missing.jsonl"], "data.train_files: no such file"),
    ],
)
def test_cli_config_errors_exit_2_without_traceback(args: list[str], needle: str) -> None:
    proc = _cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_help_and_print_config() -> None:
    proc = _cli("--help")
    assert proc.returncode == 0 and "--print-config" in proc.stdout
    proc = _cli("--config", "configs/quickstart.yaml", "--print-config", "rollout.n=4")
    assert proc.returncode == 0
    assert '"n": 4' in proc.stdout


def test_import_config_loads_no_heavy_modules() -> None:
    code = ("import sys, asyncrl.config, asyncrl.launch, asyncrl.cli; "
            "heavy = [m for m in ('torch', 'ray', 'vllm', 'deepspeed', 'transformers') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_engine_dtype_is_derived_once() -> None:
    assert Config().rollout.engine_dtype == "float32"  # vLLM's CPU build: float32 is 3x faster than bf16
    gpu = Config.model_validate({"rollout": {"gpus_per_actor": 1}, "verifier": {"gpus_per_replica": 1}})
    assert gpu.rollout.engine_dtype == "auto" and gpu.verifier.engine_dtype == "auto"  # the checkpoint's dtype
    pinned = Config.model_validate({"rollout": {"dtype": "bfloat16"}, "verifier": {"dtype": "float16"}})
    assert pinned.rollout.engine_dtype == "bfloat16" and pinned.verifier.engine_dtype == "float16"


def test_key_map_targets_exist() -> None:
    """Every mapped asyncrl key is a real field (guards the map against config renames)."""
    for src, dst in GUIDED_GRPO_KEY_MAP.items():
        if dst is None:
            continue
        node = Config()
        for part in dst.split("."):
            assert hasattr(node, part), f"{src} -> {dst}: no field {part}"
            node = getattr(node, part)


def test_config_reference_doc_is_current() -> None:
    """docs/config.md is generated from the schema; regenerate with scripts/gen_config_docs.py."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's schema, not an installed copy's
    proc = subprocess.run([sys.executable, "scripts/gen_config_docs.py"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (ROOT / "docs/config.md").read_text(), "run: python scripts/gen_config_docs.py > docs/config.md"


def test_rollout_gpu_defaults_are_derived_and_overridable():
    from asyncrl.config import Config

    cpu = Config()
    assert cpu.rollout.enforce_eager is True and cpu.rollout.gpu_memory_utilization == 0.6
    gpu = Config.model_validate({"rollout": {"gpus_per_actor": 1}})
    assert gpu.rollout.enforce_eager is False and gpu.rollout.gpu_memory_utilization == 0.9  # CUDA graphs on
    pinned = Config.model_validate({"rollout": {"gpus_per_actor": 2, "enforce_eager": True,
                                                "gpu_memory_utilization": 0.5}})
    assert pinned.rollout.enforce_eager is True and pinned.rollout.gpu_memory_utilization == 0.5
    assert Config.model_validate({"rollout": {"enforce_eager": False}}).rollout.enforce_eager is False
    assert Config().learner.weights.publish_mode == "background" and Config().learner.weights.publish_every == 1
