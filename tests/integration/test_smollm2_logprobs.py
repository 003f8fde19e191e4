"""The converted SmolLM2-135M-Instruct checkpoint (python -m asyncrl.models.smollm2) is one model to both
engines: vLLM's CPU build and transformers give the same log-probabilities to the tokens vLLM samples,
fp32, on the task's own prompts (the contract the tiny policy keeps, here on a 30-layer tied-embedding
model), and the dequantised weights are Q4_1's: every block of 32 values of a quantised matrix takes at
most 16 distinct values.

Slow (two engines, a 538 MB model): run with -m slow. Skipped, with the reason, without the extra or
the converted checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def ckpt() -> Path:
    from asyncrl.models import smollm2

    try:
        smollm2.find_gguf()
    except smollm2.ConversionError as e:
        pytest.skip(str(e))
    return smollm2.convert()  # returns at once when already converted


def test_q4_1_grid(ckpt):
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    blocks = w.reshape(-1, 32)[:2048]
    distinct = max(len(set(b.tolist())) for b in blocks)
    assert distinct <= 16, distinct  # 4-bit codes x one scale + one min per block


def test_vllm_and_transformers_logprobs_agree(ckpt):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(ckpt)
    rows = [json.loads(line) for line in (ROOT / "assets" / "mathds" / "interpolation.jsonl").read_text().splitlines()[:4]]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["problem"]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for r in rows]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    llm = LLM(model=str(ckpt), dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=1.0, max_tokens=24, logprobs=0, seed=None), use_tqdm=False)
    del llm
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    worst = 0.0
    for p, o in zip(prompts, outs, strict=True):
        gen = list(o.outputs[0].token_ids)
        v = [lp[t].logprob for t, lp in zip(gen, o.outputs[0].logprobs, strict=True)]
        with torch.no_grad():
            logits = model(torch.tensor([p + gen])).logits[0, len(p) - 1 : -1]
        hf = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(gen)[:, None])[:, 0].tolist()
        worst = max(worst, max(abs(a - b) for a, b in zip(v, hf, strict=True)))
    print(f"max |logp_vllm - logp_hf| = {worst:.2e}")
    assert worst < 1e-3
