"""Subprocess helper of the Qwen3.5 tests: load a checkpoint in vLLM's CPU build and sample.

    python tests/integration/qwen3_5_vllm_probe.py MODEL_DIR PROMPT_IDS_JSON [--image WxH]

Builds `vllm.LLM` as asyncrl's engine does for Qwen3.5 on CPU (bf16: the CPU Gated DeltaNet kernels
take only that; prefix caching off: on a hybrid model it needs chunked prefill), samples 8 tokens
with seed 0 from the given prompt ids (with `--image`, one white image of that size as the
prompt's multimodal data), and prints one line `PROBE {"token_ids": [...], "logprobs": [...]}` (vLLM writes its own lines too).
A separate process because vLLM spawns its engine (the `__main__` guard) and its memory is returned
when it exits.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("prompt_ids", help="JSON list of token ids")
    p.add_argument("--image", help="WxH: one white image as the prompt's multimodal data")
    a = p.parse_args()
    from vllm import LLM, SamplingParams

    kw = {"limit_mm_per_prompt": {"image": 1, "video": 0}} if a.image else {}
    llm = LLM(model=a.model, dtype="bfloat16", enforce_eager=True, max_model_len=256, enable_prefix_caching=False,
              max_num_seqs=4, seed=0, **kw)
    prompt: dict = {"prompt_token_ids": json.loads(a.prompt_ids)}
    if a.image:
        from PIL import Image

        w, h = (int(x) for x in a.image.split("x"))
        prompt["multi_modal_data"] = {"image": Image.new("RGB", (w, h), (255, 255, 255))}
    out = llm.generate([prompt], SamplingParams(max_tokens=8, logprobs=0, seed=0, temperature=1.0))[0].outputs[0]
    print("PROBE " + json.dumps({"token_ids": list(out.token_ids),
                      "logprobs": [d[t].logprob for t, d in zip(out.token_ids, out.logprobs, strict=True)]}))


if __name__ == "__main__":
    main()
