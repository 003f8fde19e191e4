"""Build a randomly initialised Qwen2 policy with a real model's public dimensions and the quick
start's tokenizer, locally (no hub): the real-size runs (`python -m asyncrl.bench scale`) and
memory probes use it to see what timeouts, copies, object-store puts and checkpoints cost at size.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_scale_policy.py --out /tmp/qwen2.5-0.5b-shape
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_scale_policy.py --out /tmp/small --layers 4 --hidden 256

Defaults are Qwen2.5-0.5B's published config.json: 24 layers, hidden 896, intermediate 4864, 14
attention heads and 2 KV heads, vocabulary 151,936, tied embeddings, rope theta 1e6. The quick
start's tokenizer uses the first few hundred ids only; the embedding rows beyond them are trained
(and synced) like any other. Weights are fp32, N(0, 0.02) as transformers initialises them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def build(out: Path, *, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int,
          tied: bool, seed: int) -> dict:
    """Write the model and the quick start's tokenizer files to `out`; returns the config written."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tiny = json.loads((ROOT / "assets" / "tiny-policy" / "config.json").read_text())
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                      max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                      bos_token_id=tiny.get("bos_token_id"), eos_token_id=tiny.get("eos_token_id"),
                      pad_token_id=tiny.get("pad_token_id"), torch_dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = ROOT / "assets" / "tiny-policy" / name
        if src.exists():
            shutil.copy(src, out / name)
    params = sum(p.numel() for p in model.parameters())
    (out / "scale_policy.json").write_text(json.dumps({"parameters": params, "seed": seed}, indent=1))
    return {"parameters": params, **cfg.to_dict()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--intermediate", type=int, default=None, help="default: Qwen2.5-0.5B's 4864 scaled with --hidden")
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--untied", action="store_true", help="separate lm_head (Qwen2.5-0.5B ties it)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        print(f"error: --hidden {args.hidden} is not a multiple of --heads {args.heads}", file=sys.stderr)
        return 2
    intermediate = args.intermediate or round(4864 * args.hidden / 896)
    info = build(Path(args.out), layers=args.layers, hidden=args.hidden, intermediate=intermediate, heads=args.heads,
                 kv_heads=args.kv_heads, vocab=args.vocab, tied=not args.untied, seed=args.seed)
    print(f"wrote {args.out}: {info['parameters'] / 1e6:.1f}M parameters, {args.layers} layers, hidden {args.hidden}, "
          f"vocab {args.vocab}, tied={not args.untied}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
