"""`model.lora`: every LoRA setting vLLM cannot serve is refused before anything starts, by key and
with the reason (the launcher exits 2 without a traceback); the adapter config the learner and the
engines share is PEFT's; `sync_kind` says what a version is on the wire without asking vLLM when
the answer is fixed by the config.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.weights.adapter import adapter_config, is_adapter_param, peft_saved_name, sync_kind

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("overrides, needle", [
    (["model.lora.rank=12"], "model.lora.rank=12 is not a rank vLLM serves"),
    (["model.lora.target_modules=[q_proj,embed_tokens]"], "model.lora.target_modules: embed_tokens"),
    (["model.lora.target_modules=[lm_head]"], "model.lora.target_modules: lm_head"),
    (["model.lora.target_modules=[]"], "model.lora.target_modules is empty"),
    (["model.lora.modules_to_save=[lm_head]"], "model.lora.modules_to_save must be empty"),
    (["model.lora.use_dora=true"], "model.lora.use_dora=true: vLLM 0.32 cannot serve DoRA"),
    (["model.lora.bias=lora_only"], "model.lora.bias=lora_only: vLLM 0.32 serves no trained biases"),
    (["model.lora.dropout=1.0"], "model.lora.dropout"),
    (["model.lora.ranks=8"], "did you mean 'model.lora.rank'"),
])
def test_unservable_lora_settings_are_refused_by_key(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.lora.enable=true", *overrides])
    assert needle in str(err.value)


def test_launcher_refuses_a_bad_lora_config_with_exit_2():
    proc = subprocess.run([sys.executable, "-m", "asyncrl.launch", "model.lora.enable=true", "model.lora.rank=4",
                           "model.lora.use_dora=true"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "model.lora.rank=4" in proc.stderr and "model.lora.use_dora=true" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_adapter_config_is_peft_lora_with_the_configured_shape():
    cfg = load_config(None, ["model.lora.enable=true", "model.lora.rank=32", "model.lora.alpha=64",
                             "model.lora.target_modules=[v_proj,q_proj]"])
    conf = adapter_config(cfg.model.lora, "base/path")
    assert conf["peft_type"] == "LORA" and conf["r"] == 32 and conf["lora_alpha"] == 64
    assert conf["target_modules"] == ["q_proj", "v_proj"] and conf["bias"] == "none" and not conf["use_dora"]
    assert conf["base_model_name_or_path"] == "base/path" and conf["modules_to_save"] is None


def test_sync_kind_from_the_config_and_peft_names():
    assert sync_kind(load_config(None, [])) == "full"  # no LoRA: full weights, vLLM not consulted
    assert sync_kind(load_config(None, ["model.lora.enable=true", "model.lora.sync=merged"])) == "merged"
    assert sync_kind(load_config(None, ["model.lora.enable=true", "model.lora.sync=adapter"])) == "adapter"
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert is_adapter_param(name) and peft_saved_name(name) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert not is_adapter_param("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
