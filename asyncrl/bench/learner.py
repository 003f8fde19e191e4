"""`python -m asyncrl.bench learner [--smoke] --output DIR`: learner step throughput.

Measures tokens/s of `LearnerWorker.train_step` (DeepSpeed engine, batching, log-prob
recomputation, advantages, the configured loss, clipping, LR schedule) next to a bare torch loop
(forward, token-mean NLL-style loss, backward, AdamW step) over the SAME micro-batches, in the
same process and run. `ratio` = learner tokens/s / bare tokens/s (goal >= 0.9), the median over
steps of the per-batch ratio (each batch runs through both sides back to back, the order
alternating), which is robust to load spikes on a shared machine; `ratio_total` is the ratio of
the summed times. Tokens are the real (unpadded) prompt + response tokens of the batch.

When `model.path` does not exist, a tiny random Qwen2 is built in a temporary directory
(`build_tiny_qwen2`, also used by the tests). The run is one DeepSpeed rank in this process
(world size 1, gloo on CPU).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["build_tiny_qwen2", "synthetic_groups", "run"]

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_qwen2(path: str | os.PathLike[str], *, vocab_words: int = 96, hidden: int = 64, layers: int = 2,
                     heads: int = 2, kv_heads: int = 1, intermediate: int = 128, seed: int = 0) -> Path:
    """A random Qwen2 (untied embeddings) + a WordLevel ChatML tokenizer, saved with save_pretrained.
    Loads in transformers and vLLM (keep head_dim = hidden / heads >= 32: vLLM's CPU attention has
    no kernel for head_dim 16). Returns the directory."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    words = [str(i) for i in range(10)] + list("+-*/=()?.,:") + ["\n", " ", "[UNK]", "user", "assistant", "system"]
    words += [f"w{i}" for i in range(max(0, vocab_words - len(words)))]
    vocab = {w: i for i, w in enumerate(_SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=r"\s+|\d|[^\w\s]", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>", additional_special_tokens=_SPECIALS[1:])
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      pad_token_id=vocab["<|endoftext|>"], eos_token_id=vocab["<|im_end|>"],
                      bos_token_id=None, torch_dtype="float32")
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def synthetic_groups(num_groups: int, group_size: int, vocab_size: int, prompt_len: tuple[int, int],
                     response_len: tuple[int, int], seed: int = 0, version: int = 0) -> list[Any]:
    """Random groups with varied lengths, binary rewards and plausible behaviour log-probs."""
    from asyncrl.protocol import Group, Sample

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        p = rng.integers(3, vocab_size, size=int(rng.integers(*prompt_len)))
        samples = []
        for i in range(group_size):
            t = int(rng.integers(*response_len))
            mask = np.ones(t, dtype=np.int8)
            mask[: int(rng.integers(0, max(1, t // 4)))] = 0  # some untrained (e.g. guidance) tokens
            mask[-1] = 1
            samples.append(Sample(
                uid=f"g{g}-s{i}", prompt_uid=f"g{g}", prompt_ids=p.astype(np.int32),
                response_ids=rng.integers(3, vocab_size, size=t).astype(np.int32), response_mask=mask,
                behaviour_logprobs=np.where(mask == 1, -rng.uniform(2.0, 6.0, t), 0.0).astype(np.float32),
                token_versions=np.where(mask == 1, version, -1).astype(np.int32),
                reward=float(rng.integers(0, 2)),
            ))
        groups.append(Group.from_samples(samples))
    return groups


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bare_step(model: Any, opt: Any, micro: list[Any], temperature: float) -> None:
    """Plain torch: forward, token-mean loss on response tokens, backward, clip, AdamW step."""
    import torch

    total = sum(mb.num_tokens for mb in micro)
    for mb in micro:
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                    logits_to_keep=mb.response_len + 1, use_cache=False)
        logits = out.logits[:, :-1].float() / temperature
        target = mb.input_ids[:, -mb.response_len:]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        loss = -(logp * mb.response_mask).sum() / max(total, 1)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


# Per size tier: the policy built when `model.path` is absent, groups x samples per batch, and the
# (prompt, response) length ranges of the synthetic groups.
TIER_MODEL = {"smoke": dict(hidden=64, layers=2, intermediate=128),
              "cpu": dict(hidden=256, layers=4, intermediate=704),
              "gpu": dict(hidden=1024, layers=8, intermediate=2816, heads=16, kv_heads=4, vocab_words=32000)}
TIER_BATCH = {"smoke": (2, 4), "cpu": (4, 8), "gpu": (16, 8)}
TIER_LENGTHS = {"smoke": ((4, 12), (8, 24)), "cpu": ((32, 96), (64, 192)), "gpu": ((128, 512), (256, 1024))}


def run(cfg: Any, args: Any) -> dict[str, Any]:
    import torch

    from asyncrl.bench.common import print_table
    from asyncrl.learner.learner import LearnerWorker

    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    smoke = bool(args.smoke)
    tmp = tempfile.TemporaryDirectory(prefix="asyncrl-bench-learner-")
    on_gpu = torch.cuda.is_available() and cfg.learner.num_gpus > 0
    tier = "smoke" if smoke else ("gpu" if on_gpu else "cpu")
    _one_rank_config(cfg, tier, Path(tmp.name))
    num_groups, n = TIER_BATCH[tier]
    steps = 2 if smoke else 6
    worker = LearnerWorker(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=_free_port())
    batches = [synthetic_groups(num_groups, n, worker.vocab_size, *TIER_LENGTHS[tier], seed=s) for s in range(steps + 1)]
    bare = BareLoop(cfg, worker, batches)
    learner_s, bare_s, tokens, pair_ratios = _interleaved(worker, bare, batches)
    learner_tps, bare_tps = tokens / learner_s, tokens / bare_s
    worker.close()
    tmp.cleanup()
    result = {
        "ratio": float(np.median(pair_ratios)),
        "ratio_total": learner_tps / bare_tps,
        "pair_ratios": [round(r, 4) for r in pair_ratios],
        "learner_tokens_per_s": learner_tps,
        "bare_tokens_per_s": bare_tps,
        "learner_s": learner_s,
        "bare_s": bare_s,
        "tokens": tokens,
        "steps": steps,
        "samples_per_step": num_groups * n,
        "zero_stage": cfg.learner.zero_stage,
        "precision": worker.precision,
        "device": str(worker.device),
        "off_policy_mode": cfg.learner.off_policy.mode,
        "note": "learner recomputes pi_prox only when mini_batches * ppo_epochs > 1 (else the training "
                "forward's detached log-probs are pi_prox); bare loop has no IS/clip/advantage math",
    }
    print_table("learner", [(k, v) for k, v in result.items() if not isinstance(v, (dict, list))])
    return result


def _one_rank_config(cfg: Any, tier: str, tmp: Path) -> None:
    """One learner rank (one GPU at most), runs in `tmp`; the tier's tiny policy when `model.path` is absent."""
    if not Path(cfg.model.path).exists():
        cfg.model.path = str(build_tiny_qwen2(tmp / "policy", **TIER_MODEL[tier]))
    cfg.learner.cpu_ranks = 1
    cfg.learner.num_gpus = min(cfg.learner.num_gpus, 1)
    cfg.trainer.run_dir = str(tmp)


class BareLoop:
    """The baseline: a plain HF model + AdamW stepping on the learner's own micro-batches (same
    planner, same token budget), same precision and device."""

    def __init__(self, cfg: Any, worker: Any, batches: list[list[Any]]):
        import torch
        from transformers import AutoModelForCausalLM

        from asyncrl.learner.batching import collate, flatten_groups, plan_micro_batches

        self.device, self.temperature = worker.device, cfg.rollout.temperature
        dtype = torch.bfloat16 if worker.precision == "bf16" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype).to(self.device)
        self.model.train()
        if cfg.model.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.learner.optim.lr)
        self.micro_sets = []
        for b in batches:
            flat = flatten_groups(b)
            plan = plan_micro_batches(np.arange(flat.num_samples), flat.prompt_lengths, flat.response_lengths,
                                      cfg.learner.micro_batch_tokens, cfg.learner.max_micro_batch_size)
            self.micro_sets.append([collate(flat, rows, worker.pad_id).to(self.device) for rows in plan])

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def step(self, i: int) -> float:
        """Seconds of one bare step on batch `i`'s micro-batches."""
        self.sync()
        t0 = time.perf_counter()
        _bare_step(self.model, self.opt, self.micro_sets[i], self.temperature)
        self.sync()
        return time.perf_counter() - t0


def _timed_learner_step(worker: Any, bare: BareLoop, batch: list[Any]) -> tuple[float, int]:
    """Seconds and trained tokens of one learner step."""
    bare.sync()
    t0 = time.perf_counter()
    m = worker.train_step(batch)
    bare.sync()
    return time.perf_counter() - t0, int(m["perf/learner_tokens"])


def _interleaved(worker: Any, bare: BareLoop, batches: list[list[Any]]) -> tuple[float, float, int, list[float]]:
    """Warm both up on batch 0, then per batch one learner step and one bare step, alternating which
    goes first, so load drift on a shared machine hits both sides alike. (learner s, bare s, tokens,
    bare/learner seconds per pair)."""
    worker.train_step(batches[0])
    bare.step(0)
    learner_s = bare_s = 0.0
    tokens = 0
    pair_ratios = []
    for i in range(1, len(batches)):
        if i % 2 == 1:  # alternate which side goes first (the first measured pair: learner first)
            (tl, tok), tb = _timed_learner_step(worker, bare, batches[i]), bare.step(i)
        else:
            tb = bare.step(i)
            tl, tok = _timed_learner_step(worker, bare, batches[i])
        learner_s += tl
        bare_s += tb
        tokens += tok
        pair_ratios.append(tb / tl)
    return learner_s, bare_s, tokens, pair_ratios
