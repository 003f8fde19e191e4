"""Build the quick-start policy: a local BPE tokenizer (ChatML) and a tiny Qwen2 decoder SFT'd on
synthetic guided `arith` dialogues (asyncrl/tasks/arith_dialogues.py).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_tiny_policy.py --out assets/tiny-policy --threads 1
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_tiny_policy.py --init assets/tiny-policy \
        --out assets/tiny-policy --seed 1 --steps 700 --lr 1.5e-3 --warmup 30      # stage 2 (shipped)

`--init` continues SFT from a checkpoint (its tokenizer and architecture) on fresh dialogues.

Deterministic given --seed (one torch thread for data order; float sums on 2 threads may differ in
the last bits, so a rerun reproduces the checkpoint within noise, not bit for bit).
Writes `train_log.json` (config, parameter count, loss curve, wall time) beside the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(corpus: list[str], vocab_size: int):
    """Byte-level BPE with digits always split one per token; ChatML specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None,
        additional_special_tokens=["<|im_start|>"], model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_dialogue(tok, messages: list[dict], max_len: int) -> tuple[list[int], list[int]]:
    """ids and labels (-100 = no loss) of a whole dialogue; loss on trainable assistant turns
    (content + <|im_end|>), exactly the tokens a rollout samples."""
    ids: list[int] = []
    labels: list[int] = []
    nl = tok.encode("\n", add_special_tokens=False)
    for m in messages:
        head = tok.encode(f"<|im_start|>{m['role']}\n", add_special_tokens=False)
        body = tok.encode(m["content"], add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
        train = m["role"] == "assistant" and m.get("train", True)
        ids += head + body + nl
        labels += [-100] * len(head) + (body if train else [-100] * len(body)) + [-100] * len(nl)
    return ids[:max_len], labels[:max_len]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="assets/tiny-policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dialogues", type=int, default=60000, help="synthetic dialogues generated (0 = steps x batch size)")
    p.add_argument("--solver-fraction", type=float, default=0.3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--vocab-size", type=int, default=384)
    p.add_argument("--max-len", type=int, default=320)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--time-budget-s", type=float, default=0, help=">0: stop training after this many seconds")
    p.add_argument("--init", default=None,
                   help="continue SFT from this checkpoint (its tokenizer and architecture; size flags ignored)")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    a = p.parse_args()

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from asyncrl.tasks.arith import generate_split
    from asyncrl.tasks.arith_dialogues import CONTINUE_PROMPT, synth_dialogue
    from asyncrl.tasks.arith_verifier import verify_turns

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    t0 = time.time()

    # Problems from the train split only (hash-disjoint from val/test), a different seed than the
    # shipped train.jsonl so the RL prompts are not memorised verbatim.
    n_dialogues = a.dialogues or a.steps * a.batch_size
    problems = [r["problem"] for r in generate_split("train", n_dialogues, seed=1000 + a.seed)]
    dialogues = [
        synth_dialogue(pr, rng, "solver" if rng.random() < a.solver_fraction else "guided") for pr in problems
    ]
    if a.init:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.init)
    else:
        corpus = [m["content"] for d in dialogues[:5000] for m in d]
        corpus += [CONTINUE_PROMPT, verify_turns("Compute 1 + 2.", ["hello"]).text,
                   *(["user", "assistant", "system"] * 50)]
        tok = build_tokenizer(corpus, a.vocab_size)
    data = [encode_dialogue(tok, d, a.max_len) for d in dialogues]
    n_tok = sum(sum(1 for x in lab if x != -100) for _, lab in data)
    print(f"{len(data)} dialogues, {n_tok} trained tokens, vocab {len(tok)}, data built in {time.time() - t0:.0f}s", flush=True)

    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False,
        bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"), eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, torch_dtype="float32",
    )
    model = Qwen2ForCausalLM.from_pretrained(a.init, torch_dtype=torch.float32) if a.init else Qwen2ForCausalLM(cfg)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warm = a.warmup

    def lr_at(step: int) -> float:
        if step < warm:
            return a.lr * (step + 1) / warm
        return a.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, a.steps - warm)))))

    model.train()
    order = list(range(len(data)))
    random.Random(a.seed).shuffle(order)
    pos, log, t_train = 0, [], time.time()
    for step in range(a.steps):
        if a.time_budget_s and time.time() - t_train > a.time_budget_s:
            print(f"time budget reached at step {step}", flush=True)
            break
        batch = []
        for _ in range(a.batch_size):
            if pos == len(order):
                pos = 0
                random.Random(a.seed + step).shuffle(order)
            batch.append(data[order[pos]])
            pos += 1
        L = max(len(i) for i, _ in batch)
        ids = torch.full((len(batch), L), tok.pad_token_id, dtype=torch.long)
        lab = torch.full((len(batch), L), -100, dtype=torch.long)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for j, (i, lb) in enumerate(batch):
            ids[j, : len(i)] = torch.tensor(i)
            lab[j, : len(lb)] = torch.tensor(lb)
            att[j, : len(i)] = 1
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == a.steps - 1:
            log.append({"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(time.time() - t0, 1)})
            print(log[-1], flush=True)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=cfg.bos_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    wall = time.time() - t0
    (out / "train_log.json").write_text(json.dumps(
        {"args": vars(a), "params": n_params, "trained_tokens": n_tok, "wall_s": round(wall, 1),
         "train_s": round(time.time() - t_train, 1), "log": log}, indent=1))
    print(f"saved {out} ({n_params} params) in {wall:.0f}s", flush=True)


if __name__ == "__main__":
    main()
