"""Adapter directories on the engine's side: `write_adapter_dir` is atomic and round-trips the
tensors PEFT-style; `adapter_root` gives each engine process its own directory and removes the
ones of the same engine whose process is gone (a SIGKILLed actor leaks nothing into /dev/shm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from asyncrl.actors.lora import adapter_root
from asyncrl.weights.adapter import ADAPTER_CONFIG, read_adapter_tensors, write_adapter_dir


def test_write_adapter_dir_is_atomic_and_round_trips(tmp_path):
    tensors = [("base_model.model.layers.0.q_proj.lora_A.weight", torch.randn(8, 16)),
               ("base_model.model.layers.0.q_proj.lora_B.weight", torch.zeros(16, 8))]
    path = write_adapter_dir(tmp_path, "policy-v3", tensors, {"r": 8, "peft_type": "LORA"})
    assert path == tmp_path / "policy-v3" and not (tmp_path / ".tmp-policy-v3").exists()
    back = read_adapter_tensors(path)
    assert all(torch.equal(back[n], t) for n, t in tensors)
    assert json.loads((path / ADAPTER_CONFIG).read_text())["r"] == 8
    write_adapter_dir(tmp_path, "policy-v3", tensors[:1], {"r": 8})  # rewritten whole, not merged
    assert list(read_adapter_tensors(path)) == [tensors[0][0]]


def test_adapter_root_reaps_dead_processes_of_the_same_engine_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # a pid that has exited
    stale = tmp_path / f"asyncrl-lora-rollout-0-{dead}"
    alive = tmp_path / f"asyncrl-lora-rollout-0-{os.getppid()}"  # a live process (pytest's parent)
    other = tmp_path / f"asyncrl-lora-rollout-1-{dead}"  # another engine: not ours to remove
    for d in (stale, alive, other):
        (d / "policy-v1").mkdir(parents=True)
    root = adapter_root("rollout-0", str(tmp_path))
    assert root == tmp_path / f"asyncrl-lora-rollout-0-{os.getpid()}" and root.is_dir()
    assert not stale.exists() and alive.exists() and other.exists()
