"""Every patch of a dependency's internals (asyncrl.small_machine.patches.PATCHES) still finds its
target in the installed versions: a dependency upgrade that moved a name fails here, by name,
instead of silently costing speed (each patch leaves the dependency alone where its target moved)."""

from __future__ import annotations

import importlib

from asyncrl.small_machine import patches


def test_every_patched_name_exists_in_the_installed_dependencies() -> None:
    assert patches.missing_targets() == []


def test_a_moved_name_is_reported_with_the_version_it_was_checked_against() -> None:
    moved = patches.Patch("vllm_model_class", "vllm", "0.32.0", "vllm.model_executor.models", "ModelRegistry._gone")
    [problem] = patches.missing_targets((moved,))
    assert "ModelRegistry._gone" in problem and "vllm 0.32.0" in problem


def test_each_patch_names_the_installed_version_it_was_checked_against() -> None:
    # A newer release is allowed (the test above checks the names), but the table must say which
    # version was read, and it must be the one the lock installs.
    for patch in patches.PATCHES:
        assert importlib.import_module(patch.package).__version__.split("+")[0] == patch.checked_against, patch


def test_vllm_fork_patch_is_restored() -> None:
    import vllm.utils.system_utils as vllm_system

    before = vllm_system.is_in_ray_actor
    with patches.vllm_forks_in_ray_actor():
        assert vllm_system.is_in_ray_actor() is False
    assert vllm_system.is_in_ray_actor is before


def test_the_small_machine_switch_is_derived_from_the_gpus_and_can_be_set() -> None:
    from asyncrl.config import Config

    assert Config().cluster.small_machine is True  # no role uses a GPU
    assert Config.model_validate({"rollout": {"gpus_per_actor": 1}}).cluster.small_machine is False
    assert Config.model_validate({"learner": {"num_gpus": 1}}).cluster.small_machine is False
    assert Config.model_validate({"cluster": {"small_machine": False}}).cluster.small_machine is False


def test_gc_paused_is_a_no_op_when_the_switch_is_off() -> None:
    import gc

    from asyncrl.small_machine.process import gc_paused

    assert gc.isenabled()
    with gc_paused(False):
        assert gc.isenabled()
    with gc_paused(True):
        assert not gc.isenabled()
    assert gc.isenabled()


def test_lora_sync_auto_is_resolved_once_into_the_config(tmp_path) -> None:
    """The launcher decides `model.lora.sync: auto` and every process reads the decision from the
    config it is given (the tiny policy is a Qwen2, which vLLM serves with LoRA: `adapter`)."""
    from pathlib import Path

    from asyncrl.config import Config
    from asyncrl.job.runtime import resolve_lora_sync

    policy = Path(__file__).resolve().parents[2] / "assets" / "tiny-policy"
    cfg = Config.model_validate({"model": {"path": str(policy), "lora": {"enable": True}}})
    assert cfg.model.lora.sync == "auto"
    resolve_lora_sync(cfg)
    assert cfg.model.lora.sync == "adapter"
    assert Config.model_validate_json(cfg.model_dump_json()).model.lora.sync == "adapter"
