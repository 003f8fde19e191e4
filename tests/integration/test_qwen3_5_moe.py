"""Qwen3.5-MoE policies (tiny random checkpoints from `scripts/make_tiny_qwen3_5.py --moe`: 3 Gated
DeltaNet + 1 attention layer, every MLP a sparse block of 4 routed experts, top 2, + a gated shared
expert), on CPU with transformers' reference kernels: the learner side of the MoE path.

Proves:
- the learner's gradient reaches the routed experts (transformers 5 holds them fused: `experts.gate_up_proj`
  E x 2I x H, `experts.down_proj` E x H x I), the router, the shared expert and its gate, and the
  linear-attention parameters; one step raises the sequence log-probability (text and VL class);
- the names the learner puts on the weight wire are the checkpoint's (what the engine resolves):
  transformers saves the experts one by one (`experts.{e}.gate_proj.weight`, ...), so the export splits
  the fused tensors (`split_fused_experts`), and for the text class on the VL checkpoint also prefixes
  `model.language_model.`; every exported name is a checkpoint name, the text checkpoint's set is
  covered exactly, and every exported tensor equals the stored one bit for bit (a wrong gate/up order
  or a transposed expert would not);
- the role split's parameter count from config.json equals the model's (`param_count`);
- LoRA on the hybrid MoE policy is refused by name, and so is a MoE policy with CPU rollout engines
  (vLLM 0.32's CPU MoE kernel does not follow reloaded experts: test_qwen3_5_engine.py's xfail), not a
  dense one nor a MoE one with GPU engines.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.config.model_size import param_count
from asyncrl.learner.export import split_fused_experts, stores_per_expert
from asyncrl.weights.names import checkpoint_name_map

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location("make_tiny_qwen3_5", ROOT / "scripts" / "make_tiny_qwen3_5.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root = tmp_path_factory.mktemp("qwen3_5_moe")
    mod.build(root / "text", vl=False, seed=0, moe=True)
    mod.build(root / "vl", vl=True, seed=0, moe=True)
    return {"text": root / "text", "vl": root / "vl"}


def _load(path: Path, vl: bool):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return (AutoModelForImageTextToText if vl else AutoModelForCausalLM).from_pretrained(path, dtype=torch.float32)


def _seq_logprob(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum()


@pytest.mark.parametrize("kind", ["text", "vl"])
def test_gradient_through_experts_router_and_linear_attention(ckpts, kind: str) -> None:
    model = _load(ckpts[kind], kind == "vl")
    assert type(model).__name__ == ("Qwen3_5MoeForCausalLM" if kind == "text" else "Qwen3_5MoeForConditionalGeneration")
    ids = torch.randint(0, 380, (2, 24), generator=torch.Generator().manual_seed(0))
    before = _seq_logprob(model, ids)
    before.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if ".layers.0." in n}
    for suffix in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight",
                   "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert_gate.weight", "linear_attn.A_log",
                   "linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        (g,) = [g for n, g in grads.items() if n.endswith(suffix)]
        assert g is not None and g.abs().sum() > 0, suffix
    experts = next(g for n, g in grads.items() if n.endswith("mlp.experts.gate_up_proj"))
    assert (experts.flatten(1).abs().sum(1) > 0).sum() >= 2  # top-2 routing: at least two experts learn
    with torch.no_grad():  # one normalised gradient-ascent step on the log-probability raises it
        for p in model.parameters():
            if p.grad is not None:
                p += 1e-2 * p.grad / (p.grad.norm() + 1e-12)
        assert _seq_logprob(model, ids) > before


@pytest.mark.parametrize("trainer, ckpt", [("text", "text"), ("text", "vl"), ("vl", "vl")])
def test_exported_names_and_values_are_the_checkpoints(ckpts, trainer: str, ckpt: str) -> None:
    model = _load(ckpts[ckpt], trainer == "vl")
    items = list(model.named_parameters())
    names = [n for n, _ in items]
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)  # fused in the trainer
    stored = load_file(ckpts[ckpt] / "model.safetensors")
    assert stores_per_expert(str(ckpts[ckpt])) and any(".mlp.experts.3.up_proj.weight" in n for n in stored)
    rename = checkpoint_name_map(str(ckpts[ckpt]), names)  # what WeightExport.export_named_tensors applies
    sent = split_fused_experts([(rename(n), t.detach()) for n, t in items])
    sent_names = [n for n, _ in sent]
    assert len(sent_names) == len(set(sent_names))
    # every stored weight is sent; the text class on the VL checkpoint holds no vision tower, which the
    # engine keeps as loaded
    expected = {n for n in stored if not (trainer == "text" and n.startswith("model.visual."))}
    assert set(sent_names) == expected
    for n, t in sent:
        assert torch.equal(t, stored[n]), n


def test_dense_checkpoint_has_nothing_to_split(tmp_path: Path) -> None:
    assert not stores_per_expert(str(ROOT / "assets" / "tiny-policy")) and not stores_per_expert(str(tmp_path))
    t = torch.zeros(2, 3)
    assert split_fused_experts([("model.layers.0.mlp.gate_proj.weight", t)])[0][0] == "model.layers.0.mlp.gate_proj.weight"


@pytest.mark.parametrize("kind", ["text", "vl"])
def test_role_split_size_of_the_moe_checkpoint(ckpts, kind: str) -> None:
    model = _load(ckpts[kind], kind == "vl")
    cfg = json.loads((ckpts[kind] / "config.json").read_text())
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_lora_on_the_moe_policy_is_refused(ckpts) -> None:
    from asyncrl.learner.build import refuse_hybrid_lora

    with pytest.raises(ValueError, match="hybrid linear-attention policy"):
        refuse_hybrid_lora(_load(ckpts["text"], False))


def test_moe_with_cpu_engines_is_refused(ckpts) -> None:
    from types import SimpleNamespace

    from asyncrl.learner.build import refuse_cpu_moe_sync

    def cfg(gpus: int):
        return SimpleNamespace(rollout=SimpleNamespace(gpus_per_actor=gpus, num_actors=1))

    moe = _load(ckpts["text"], False)
    with pytest.raises(ValueError, match=r"Mixture-of-Experts policy \(4 expert layers\) with CPU rollout engines"):
        refuse_cpu_moe_sync(moe, cfg(0))
    refuse_cpu_moe_sync(moe, cfg(1))  # GPU engines: not refused
    from transformers import AutoModelForCausalLM

    refuse_cpu_moe_sync(AutoModelForCausalLM.from_pretrained(ROOT / "assets" / "tiny-policy"), cfg(0))  # dense
