"""Build tiny RANDOM Qwen3.5 policies for tests, offline (no hub): text and vision-language.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_tiny_qwen3_5.py --out /tmp/tiny-qwen3_5
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_tiny_qwen3_5.py --vl --out /tmp/tiny-qwen3_5-vl
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_tiny_qwen3_5.py --moe --out /tmp/tiny-qwen3_5-moe

Shape (both): 4 text layers, hybrid as Qwen3.5 is: `layer_types` = 3 Gated DeltaNet
(`linear_attention`) layers then 1 `full_attention` layer (transformers' default interval of 4);
hidden 64, 4 query / 2 KV heads of 64, linear attention 2 key / 4 value heads of 128 (Qwen3.5's own linear head size: vLLM's CPU GDN kernels refuse 16 ("multiples of 32") and 32 ("Unexpected head dim size"); its CPU attention refuses head_dim 16), conv kernel 4,
MLP 128, untied embeddings (vLLM's CPU build does not refresh a tied head after a reload:
MACHINE_NOTES), float32. `--vl` adds a 2-block vision tower (hidden 32, patch 16, merge 2) and saves
`Qwen3_5ForConditionalGeneration` (how real Qwen3.5 checkpoints ship, text-only use included);
without it, `Qwen3_5ForCausalLM` (model_type `qwen3_5_text`). `--moe` makes the Qwen3.5-MoE variant
(`Qwen3_5MoeForCausalLM`, with `--vl` `Qwen3_5MoeForConditionalGeneration`): every layer's MLP is a sparse
block of 4 routed experts (top 2, expert MLP 32) plus a gated shared expert (MLP 32), as Qwen3.5-MoE's.

Tokenizer: the quick start's (assets/tiny-policy, a 384-token BPE) with Qwen3.5's special tokens
added (`<|vision_start|> <|vision_end|> <|image_pad|> <|video_pad|>`, and `<think> </think>` as plain
added tokens, as Qwen3's tokenizers keep them) and a
Qwen3-style chat template that renders assistant history with an empty think block stripped, the
behaviour that makes re-tokenised multi-turn prefixes drift (docs/models.md). The VL checkpoint also
gets a processor (`Qwen3VLProcessor`: Qwen3.5 reuses Qwen3-VL's image and video processors).
Deterministic given --seed. A few hundred KB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
THINK = ["<think>", "</think>"]  # added tokens but not special (as in Qwen3's tokenizers): decoding keeps them
# Qwen3's convention, which Qwen3.5 keeps: the last assistant turn may carry its reasoning; earlier
# assistant turns are re-rendered without it (`content.split('</think>')[-1]`), and every assistant
# turn after the last user query opens with a think block.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query=messages|length - 1) -%}"
    "{%- for m in messages[::-1] -%}{%- if m.role == 'user' and ns.last_query == messages|length - 1 -%}"
    "{%- set ns.last_query = messages|length - 1 - loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.content is string -%}{%- set content = m.content -%}{%- else -%}{%- set content = namespace(t='') -%}"
    "{%- for c in m.content -%}{%- if c.type == 'image' or 'image' in c -%}"
    "{%- set content.t = content.t + '<|vision_start|><|image_pad|><|vision_end|>' -%}"
    "{%- elif c.type == 'video' or 'video' in c -%}{%- set content.t = content.t + '<|vision_start|><|video_pad|><|vision_end|>' -%}"
    "{%- elif 'text' in c -%}{%- set content.t = content.t + c.text -%}{%- endif -%}{%- endfor -%}"
    "{%- set content = content.t -%}{%- endif -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set answer = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- if loop.index0 > ns.last_query -%}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + answer + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + answer + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
)


def build_tokenizer(out: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "assets" / "tiny-policy")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.add_tokens(THINK, special_tokens=False)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return tok


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def text_config(tok, moe: bool = False) -> dict:
    extra = dict(MOE) if moe else {}
    return dict(**extra, vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=1024,
                tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                bos_token_id=None, dtype="float32")


def build(out: Path, vl: bool, seed: int, moe: bool = False) -> None:
    import torch
    import transformers

    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    Qwen3_5Config = getattr(transformers, f"{prefix}Config")  # noqa: N806 (a class)
    Qwen3_5TextConfig = getattr(transformers, f"{prefix}TextConfig")  # noqa: N806
    Qwen3_5ForCausalLM = getattr(transformers, f"{prefix}ForCausalLM")  # noqa: N806
    Qwen3_5ForConditionalGeneration = getattr(transformers, f"{prefix}ForConditionalGeneration")  # noqa: N806

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tok = build_tokenizer(out)
    torch.manual_seed(seed)
    if vl:
        ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
        cfg = Qwen3_5Config(
            text_config=text_config(tok, moe),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                               spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                               num_position_embeddings=64),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False)
        model = Qwen3_5ForConditionalGeneration(cfg)
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_config(tok, moe)))
    model.to(torch.float32).save_pretrained(out)
    if vl:
        from transformers import Qwen3VLProcessor
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        size = {"shortest_edge": 4 * 32 * 32, "longest_edge": 256 * 32 * 32}
        proc = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2, size=size),
                                video_processor=Qwen3VLVideoProcessor(patch_size=16, merge_size=2, size=size),
                                tokenizer=tok, chat_template=CHAT_TEMPLATE)
        proc.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {type(model).__name__}, {n} parameters, layer_types {model.config.get_text_config().layer_types}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--vl", action="store_true", help="with a vision tower (Qwen3_5ForConditionalGeneration)")
    p.add_argument("--moe", action="store_true", help="the Qwen3.5-MoE variant (4 routed experts, top 2, + a shared one)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    build(Path(a.out), a.vl, a.seed, a.moe)


if __name__ == "__main__":
    main()
