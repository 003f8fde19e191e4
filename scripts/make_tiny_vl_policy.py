"""Build tiny RANDOM vision-language policies for tests (no training): Qwen2-VL and Qwen2.5-VL.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_tiny_vl_policy.py --out assets/tiny-vl-policy
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_tiny_vl_policy.py --arch qwen2_5_vl --out assets/tiny-vl-policy-2_5

Each checkpoint: 2 text layers (hidden 128, 4 heads of 32, 2 KV heads, mRoPE sections [4, 6, 6]),
2 vision blocks (embed 64), untied embeddings, float32, every matrix scaled by --scale (4); a local byte-level BPE tokenizer (ChatML
plus Qwen's vision special tokens `<|vision_start|> <|vision_end|> <|image_pad|> <|video_pad|>`)
with a Qwen2-VL-shaped chat template (image items -> `<|vision_start|><|image_pad|><|vision_end|>`);
a `Qwen2VLProcessor` (Qwen2.5-VL: `Qwen2_5_VLProcessor`) with `Qwen2VLImageProcessor` (patch 14,
merge 2: one image token per 28x28 pixels) and `Qwen2VLVideoProcessor`. A few hundred KB on disk.

Deterministic given --seed (weights from torch.manual_seed; the BPE trainer is deterministic).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c or 'image_url' in c %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' or 'video' in c %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in c %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Small MIN/MAX pixels: a 28x28 patch group = 1 token; 4..256 tokens per image.
MIN_PIXELS = 4 * 28 * 28
MAX_PIXELS = 256 * 28 * 28


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from asyncrl.tasks.arith import generate_split

    corpus = [r["problem"] for r in generate_split("train", 2000, seed=7)]
    corpus += ["Compute the expression shown in the image.", "<answer>\\boxed{12}</answer>", "<think>",
               "Correct. Next: 3 + 4 = 7. What is it?", "user assistant system"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None,
        additional_special_tokens=SPECIALS[1:2] + SPECIALS[3:], model_max_length=4096)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(arch: str, out: Path, seed: int, vocab_size: int, scale: float = 4.0) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    torch.manual_seed(seed)
    tok = build_tokenizer(vocab_size)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    vocab = len(tok)
    text = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                tie_word_embeddings=False, use_sliding_window=False)
    special = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                   vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                   tie_word_embeddings=False)
    if arch == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

        vision = dict(depth=2, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        cfg = Qwen2VLConfig(text_config=text, vision_config=vision, **special)
        model_cls, proc_cls = Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    elif arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1], tokens_per_second=2)
        cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
        model_cls, proc_cls = Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    elif arch == "qwen3_vl":
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

        text = dict(text, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [6, 5, 5], "mrope_interleaved": True})
        text.pop("use_sliding_window")
        for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
            text.pop(k)
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256,
                      deepstack_visual_indexes=[0])
        cfg = Qwen3VLConfig(text_config=text, vision_config=vision, **special)
        model_cls, proc_cls = Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    else:
        raise SystemExit(f"unknown --arch {arch}")
    cfg.dtype = "float32"
    model = model_cls(cfg).float()
    with torch.no_grad():  # peakier than the 0.02-std init, so positions and pixels visibly matter
        for prm in model.parameters():
            if prm.dim() > 1:
                prm.mul_(scale)
    model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                                               bos_token_id=ids["<|im_start|>"])
    patch = 16 if arch == "qwen3_vl" else 14
    lo, hi = MIN_PIXELS * patch * patch // (14 * 14), MAX_PIXELS * patch * patch // (14 * 14)
    improc = Qwen2VLImageProcessor(min_pixels=lo, max_pixels=hi, patch_size=patch, merge_size=2, temporal_patch_size=2)
    if arch == "qwen3_vl":
        from transformers import Qwen3VLVideoProcessor

        vidproc = Qwen3VLVideoProcessor(size={"shortest_edge": lo, "longest_edge": hi}, patch_size=patch, merge_size=2,
                                        temporal_patch_size=2)
    else:
        vidproc = Qwen2VLVideoProcessor(min_pixels=lo, max_pixels=hi, patch_size=patch, merge_size=2,
                                        temporal_patch_size=2)
    processor = proc_cls(image_processor=improc, tokenizer=tok, video_processor=vidproc, chat_template=CHAT_TEMPLATE)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"saved {arch} to {out}: {n} params, {size / 1e6:.2f} MB, vocab {vocab}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"], default="qwen2_vl")
    p.add_argument("--out", default="assets/tiny-vl-policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=400)
    p.add_argument("--scale", type=float, default=4.0, help="multiplier of every matrix after the random init")
    a = p.parse_args()
    build(a.arch, Path(a.out), a.seed, a.vocab_size, a.scale)


if __name__ == "__main__":
    main()
