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
