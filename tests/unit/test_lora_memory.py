"""The learner memory model under LoRA (`asyncrl.learner.memory`, used by the launch-time memory
guard): the adapter's size is counted from the model's dimensions; gradients and optimizer state
hold the adapter only; the KL reference is the policy with its adapter disabled, so it costs no
replica. Numbers derived by hand from assets/tiny-policy's config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.checks.preflight import memory_rows, read_model
from asyncrl.config import load_config
from asyncrl.learner import memory as mem

ROOT = Path(__file__).resolve().parents[2]
TINY = json.loads((ROOT / "assets" / "tiny-policy" / "config.json").read_text())
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# tiny-policy: hidden 128, 4 heads of 32, 2 KV heads (64 wide), MLP 384, 4 layers, vocab 384, untied.
# P = 2 * 384 * 128 (embeddings + head) + 4 * (2 * 128*128 (q, o) + 2 * 128*64 (k, v) + 3 * 128*384)
#   = 98304 + 4 * (32768 + 16384 + 147456) = 884736
P = 884_736
# rank 16 on all seven: per layer 16 * ((128+128) q + (128+64) k + (128+64) v + (128+128) o
#   + (128+384) gate + (128+384) up + (384+128) down) = 16 * 2432 = 38912; 4 layers: 155648
A16 = 155_648


def test_adapter_parameters_from_the_dimensions():
    assert mem.shape_from_config(TINY).params == P
    assert mem.lora_params(TINY, 16, ALL7) == A16
    # rank 8 on q and v only: 4 layers * 8 * ((128+128) + (128+64)) = 4 * 8 * 448 = 14336
    assert mem.lora_params(TINY, 8, ["q_proj", "v_proj"]) == 14_336


def _tiny_rank(**kw) -> dict[str, int]:
    return mem.rank_bytes(mem.shape_from_config(TINY), ranks=1, zero_stage=1, bf16=False, micro_batch_tokens=256,
                          gpu=False, **kw)


def test_lora_rank_holds_the_adapter_states_and_no_reference_replica():
    full = _tiny_rank(reference=True)
    lora = _tiny_rank(reference=True, adapter_params=A16)
    # fp32 (w = 4), ZeRO-1, one rank. Full: gradients = .grad 4P + DeepSpeed's fp32 partition 4P = 8P;
    # optimizer = master 4P + Adam moments 8P = 12P; reference = the replica 4P.
    assert full["gradients"] == 8 * P and full["optimizer (fp32 master + Adam moments)"] == 12 * P
    assert full["reference model"] == 4 * P and full["parameters"] == 4 * P
    # LoRA: the same terms over A = 155648 adapter parameters; the base stays as parameters beside
    # the adapter, 4 (P + A) = 4 * 1040384; the reference is the base with the adapter disabled: 0.
    assert lora["parameters"] == 4 * (P + A16) == 4_161_536
    assert lora["gradients"] == 8 * A16 == 1_245_184
    assert lora["optimizer (fp32 master + Adam moments)"] == 12 * A16 == 1_867_776
    assert lora["reference model"] == 0
    for same in ("activations (checkpointed)", "logits (+ gradient, fp32 chunks)", "runtime"):
        assert lora[same] == full[same]
    # saved: 4P (reference) + 8 (P - A) + 12 (P - A) - 4A = 24P - 24A = 17,498,112 bytes
    assert sum(full.values()) - sum(lora.values()) == 24 * (P - A16) == 17_498_112


@pytest.mark.parametrize("kl", [True, False])
def test_memory_guard_counts_the_lora_quick_start_with_the_adapter(kl):
    cfg = load_config("configs/quickstart_lora.yaml", [f"learner.kl.enable={str(kl).lower()}"])
    (row,) = memory_rows(cfg, read_model("model.path", cfg.model.path, None), 24 * 2**30)
    assert row.ok and "reference model" not in row.result  # a zero component is not listed
    full = load_config("configs/quickstart.yaml", ["learner.kl.enable=true"])
    (full_row,) = memory_rows(full, read_model("model.path", full.model.path, None), 24 * 2**30)
    assert "reference model" in full_row.result
