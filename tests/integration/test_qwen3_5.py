"""Qwen3.5 policies (tiny random checkpoints from scripts/make_tiny_qwen3_5.py: 3 Gated DeltaNet layers
+ 1 attention layer; text `Qwen3_5ForCausalLM` and VL `Qwen3_5ForConditionalGeneration`).

Proves, on CPU with transformers' reference PyTorch kernels for the linear-attention layers:
- the learner's gradient reaches every linear-attention parameter (A_log, dt_bias, conv1d, in_proj_*,
  out_proj, norm) and one step moves the sequence log-probability, for the text and the VL class;
- a text-only trainer on the VL checkpoint (`AutoModelForCausalLM` gives `Qwen3_5ForCausalLM`, names
  `model.*`) computes the same logits as the checkpoint's own class, and `checkpoint_name_map` maps
  every one of its parameter names onto a name of the checkpoint (`model.language_model.*`), which is
  what the engine resolves; the text checkpoint's names map to themselves;
- multi-turn stays token-exact with the Qwen3.5-style template, whose re-rendering of assistant history
  drops `<think>` content: the ids the engine saw are the ids trained on, while a re-tokenised
  rendering of the same conversation differs (the drift asyncrl avoids); and token-exact with vLLM's
  shipped ChatML template, the closest one installed (Qwen3.5's real template is on the hub, not
  reachable offline; the builder's template reproduces its history rule, not its bytes);
- LoRA on a hybrid policy is refused by name.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from asyncrl.actors.guided import (
    Conversation,
    GenerateStep,
    GuideOptions,
    PolicyChat,
    VerifyOutcome,
    build_training_sample,
)
from asyncrl.weights.names import checkpoint_name_map

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location("make_tiny_qwen3_5", ROOT / "scripts" / "make_tiny_qwen3_5.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root = tmp_path_factory.mktemp("qwen3_5")
    mod.build(root / "text", vl=False, seed=0)
    mod.build(root / "vl", vl=True, seed=0)
    return {"text": root / "text", "vl": root / "vl"}


def _seq_logprob(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum()


@pytest.mark.parametrize("kind", ["text", "vl"])
def test_gradient_through_the_linear_attention_layers(ckpts, kind: str) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForCausalLM if kind == "text" else AutoModelForImageTextToText
    model = cls.from_pretrained(ckpts[kind], dtype=torch.float32)
    assert model.config.get_text_config().layer_types == ["linear_attention"] * 3 + ["full_attention"]
    ids = torch.randint(0, 380, (2, 24), generator=torch.Generator().manual_seed(0))
    before = _seq_logprob(model, ids)
    before.backward()
    grads = {n.split("linear_attn.")[1]: p.grad for n, p in model.named_parameters() if ".linear_attn." in n}
    assert set(grads) >= {"A_log", "dt_bias", "conv1d.weight", "in_proj_qkv.weight", "in_proj_z.weight",
                          "in_proj_b.weight", "in_proj_a.weight", "out_proj.weight", "norm.weight"}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())
    with torch.no_grad():  # one gradient-ascent step on the log-probability raises it
        for p in model.parameters():
            if p.grad is not None:
                p += 1e-2 * p.grad / (p.grad.norm() + 1e-12)
        assert _seq_logprob(model, ids) > before


def test_text_trainer_on_the_vl_checkpoint_maps_names(ckpts) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    text = AutoModelForCausalLM.from_pretrained(ckpts["vl"], dtype=torch.float32)
    full = AutoModelForImageTextToText.from_pretrained(ckpts["vl"], dtype=torch.float32)
    assert type(text).__name__ == "Qwen3_5ForCausalLM" and type(full).__name__ == "Qwen3_5ForConditionalGeneration"
    ids = torch.randint(0, 380, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(text(input_ids=ids).logits, full(input_ids=ids).logits)
    names = list(text.state_dict())
    assert "model.embed_tokens.weight" in names  # what the engine of the VL class cannot resolve
    with safe_open(ckpts["vl"] / "model.safetensors", "pt") as f:
        stored = set(f.keys())
    rename = checkpoint_name_map(str(ckpts["vl"]), names)
    assert {rename(n) for n in names} <= stored
    assert rename("model.embed_tokens.weight") == "model.language_model.embed_tokens.weight"
    assert rename("lm_head.weight") == "lm_head.weight"
    # the checkpoint's own classes need no mapping
    assert checkpoint_name_map(str(ckpts["vl"]), list(full.state_dict()))("model.x") == "model.x"
    assert checkpoint_name_map(str(ckpts["text"]), names)("model.x") == "model.x"


def shipped_chatml() -> str:
    """vLLM's own ChatML template (`vllm/transformers_utils/chat_templates/template_chatml.jinja`): the
    closest template to Qwen3.5's that ships in the installed packages (same `<|im_start|>role ... <|im_end|>`
    turns; no reasoning handling). Qwen3.5's real template is on the hub, which is not reachable here."""
    import vllm

    return (Path(vllm.__file__).parent / "transformers_utils" / "chat_templates" / "template_chatml.jinja").read_text()


@pytest.mark.parametrize("template", ["qwen3_history_rule", "vllm_chatml"])
def test_token_exact_multi_turn_with_the_template(ckpts, template: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpts["text"])
    if template == "vllm_chatml":
        tok.chat_template = shipped_chatml()
    chat = PolicyChat(tok)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    texts = ["<think>3 * 4 first</think>3 * 4 = 12. Right?", "<answer>\\boxed{14}</answer>"]
    replies = ["Correct. Next: 2 + 12. What is it?\n[SCORE] hallucination_detect=1", "###STOP###"]
    conv = Conversation([{"role": "user", "content": "Compute 2 + 3 * 4."}], chat=chat,
                        options=GuideOptions(max_turns=4, training=True), ground_truth="14", seed=1)
    seen: list[list[int]] = []
    sampled: list[list[int]] = []
    while (step := conv.next_step()) is not None:
        if isinstance(step, GenerateStep):
            seen.append(list(step.prompt_ids))
            ids = chat.encode_text(texts[len(sampled)]) + [eot]
            sampled.append(ids)
            conv.on_generated(ids, [-0.1] * len(ids), 1, "stop")
        else:
            conv.on_verified(VerifyOutcome(True, replies[len(seen) - 1], "v"))
    assert conv.finish_reason == "verifier_stop" and len(sampled) == 2
    s = build_training_sample(conv, "full_turn")
    trained = s.prompt_ids.tolist() + s.response_ids.tolist()
    # every turn: the engine's context is a prefix of the trained ids, followed by exactly its sample
    for ctx, ids in zip(seen, sampled, strict=True):
        assert trained[:len(ctx)] == ctx and trained[len(ctx):len(ctx) + len(ids)] == ids
    assert seen[1][:len(seen[0]) + len(sampled[0])] == seen[0] + sampled[0]  # append-only across turns
    if template == "vllm_chatml":  # keeps history as sent: nothing to drift from by rule
        return
    # the template re-renders the first assistant turn without its reasoning: re-tokenising drifts
    rerendered = chat.encode_text(chat.render(conv.messages(), add_generation_prompt=False))
    assert rerendered != trained and "3 * 4 first" not in tok.decode(rerendered)
    assert "3 * 4 first" in tok.decode(trained)


def test_lora_on_a_hybrid_policy_is_refused(ckpts) -> None:
    from transformers import AutoModelForCausalLM

    from asyncrl.config.sections import LoRAConfig
    from asyncrl.learner.build import apply_lora

    model = AutoModelForCausalLM.from_pretrained(ckpts["text"], dtype=torch.float32)
    with pytest.raises(ValueError, match=r"hybrid linear-attention policy \(Gated DeltaNet layers: in_proj_a, "
                                         r"in_proj_b, in_proj_qkv, in_proj_z, out_proj\)"):
        apply_lora(model, LoRAConfig(enable=True), str(ckpts["text"]))

