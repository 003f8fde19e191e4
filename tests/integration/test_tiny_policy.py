"""The shipped quick-start policy (assets/tiny-policy) is what the rest of the system assumes:
a small untied-embedding Qwen2 in fp32 with a ChatML tokenizer that splits digits one per token;
it loads and generates a well-formed turn in transformers; it loads in vLLM's CPU build, where
its greedy tokens equal transformers' greedy tokens; and its greedy guided accuracy on the test
split is within tolerance of the number recorded in assets/tiny-policy/eval_test.json (python -m asyncrl.eval)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "assets" / "tiny-policy"
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tok():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def _prompt(tok, problem: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": problem}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)  # as PolicyChat.encode_prompt does


def test_assets_size_and_config():
    total = sum(p.stat().st_size for d in ("tiny-policy", "arith") for p in (ROOT / "assets" / d).rglob("*") if p.is_file())
    assert total <= 20 * 2**20
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["model_type"] in ("qwen2", "qwen3") and cfg["tie_word_embeddings"] is False


def test_tokenizer_chatml_and_digits(tok):
    msgs = [{"role": "user", "content": "Compute 12 + 3."}, {"role": "assistant", "content": "12 + 3 = 15."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>user\nCompute 12 + 3.<|im_end|>\n<|im_start|>assistant\n12 + 3 = 15.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    pieces = tok.convert_ids_to_tokens(tok.encode("1234", add_special_tokens=False))
    assert pieces == ["1", "2", "3", "4"]
    s = "3 * 4 = 12. <answer>\\boxed{17}</answer>"
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s


def test_transformers_generates_a_turn(tok):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) <= 5_000_000
    ids = torch.tensor([_prompt(tok, "Compute 7 + 3 * 4 - 2.")])
    out = model.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out[-1] == tok.eos_token_id  # the turn ends with <|im_end|>
    text = tok.decode(out, skip_special_tokens=True)
    assert "=" in text  # a step `a op b = c`


@pytest.mark.slow
def test_vllm_matches_transformers_and_recorded_accuracy(tok):
    """vLLM CPU: greedy tokens equal transformers'; guided accuracy on the recorded split."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from asyncrl.eval import build_llm, evaluate_with_llm, load_split

    torch.set_num_threads(1)
    recorded = json.loads((MODEL / "eval_test.json").read_text())
    rows = load_split("arith", "test")[: recorded["rows"]]
    llm = build_llm(str(MODEL), max_model_len=512)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    for r in rows[:3]:
        p = _prompt(tok, r["problem"])
        hf = model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p):].tolist()
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == hf
    got = evaluate_with_llm(llm, tok, rows, "guided", max_turns=4, max_tokens=64, max_prompt_length=256)
    # greedy and fp32: only batch-dependent rounding in vLLM can move a few conversations
    assert abs(got["accuracy"] - recorded["guided_accuracy"]) <= 0.03, (got, recorded)
    assert got["mean_turns"] > 1.0


def test_evaluate_async_with_a_transformers_engine(tok):
    """`asyncrl.eval.evaluate_async` drives any async generate(prompt_ids, seed); here the
    shipped policy greedy in transformers, guided and solver-only, on 6 test problems."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.eval import evaluate_async, load_split

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

    async def generate(prompt_ids, seed):
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=64, do_sample=False)[0, len(prompt_ids):]
        ids = out.tolist()
        return ids, None, 0, "stop" if ids[-1] == tok.eos_token_id else "length"

    rows = load_split("arith", "test")[:6]
    for mode in ("guided", "solver"):
        res = asyncio.run(evaluate_async(generate, tok, rows, mode, concurrency=1))
        assert res["n"] == 6 and sum(res["finish_reasons"].values()) == 6
        assert 1 <= res["mean_turns"] <= 4 and 0 <= res["accuracy"] <= 1
        assert (res["mean_verifier_tokens"] > 0) == (mode == "guided")
