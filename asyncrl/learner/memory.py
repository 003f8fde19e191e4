"""Memory of one learner rank, by component, before anything starts.

Plain arithmetic on a model's published dimensions and the learner's settings, so it runs where
nothing else of asyncrl does (scripts/gpu_check.py on a bare GPU machine) and before a launch
starts a process. Every component is named with its bytes, so a configuration that cannot fit
says what takes the memory.

What a rank holds (DeepSpeed 0.19.8 as `asyncrl.learner.build` configures it; P = parameters,
N = ranks, w = 2 bytes in bf16, 4 in fp32; "/N" where the ZeRO stage partitions it):
- parameters: w*P (/N from stage 3);
- gradients: from stage 2 the rank's fp32 gradient partition 4*P/N (bf16 accumulates in fp32,
  `grad_accum_dtype`; each bucket's model-dtype gradient is transient); at stage 1 the full
  model-dtype .grad w*P plus the fp32 accumulation 4*P (bf16) or DeepSpeed's flat fp32 partition
  4*P/N (fp32); at stage 0 the .grad w*P;
- optimizer: fp32 master weights 4*P and Adam's two moments 8*P (/N from stage 1); in fp32 the
  master copy is still DeepSpeed's own flat partition under ZeRO 1-3 (4*P/N), none at stage 0;
- reference model (`learner.kl.enable`): a full replica in the model dtype, w*P; none with LoRA,
  whose reference is the same model with its adapter disabled;
- LoRA (`model.lora`, A adapter parameters from `lora_params`): the frozen base w*P plus the
  adapter w*A (sharded from stage 3), and gradients and optimizer state above count A, not P;
- activations with gradient checkpointing: the hidden state kept at every layer boundary
  (tokens * hidden * w per layer) plus one layer's recomputed activations during its backward
  (measured by gpu_check S3 per token; else `LAYER_ACT_FACTOR` hidden-state equivalents);
- logits: the micro-batch's logits in the model dtype and their gradient (2 * tokens * vocab * w)
  plus two fp32 chunks of the chunked log-softmax (2 * 2 * chunk_rows * vocab * 4);
- runtime: the CUDA context, NCCL and allocator slack on a GPU (`GPU_RUNTIME_BYTES`), the
  interpreter and libraries on a CPU (`CPU_RUNTIME_BYTES`).

Checked on a CPU (one fp32 rank, a 56.4M-parameter Qwen2 from scripts/make_scale_policy.py, peak
resident memory during two train_steps minus the process after its imports): ZeRO-0 1509 MB and
ZeRO-1 2018 MB against 1032 and 1483 MB estimated without the runtime term, i.e. the same ~0.5 GB
of DeepSpeed/gloo/allocator overhead in both and the ZeRO-1 difference (DeepSpeed's two fp32
partitions, 8*P = 451 MB) measured as 509 MB; the KL reference added exactly 4*P (226 MB). A
one-rank ZeRO-3 held 2832 MB, ~1.35 GB more than estimated: its flat buffers are not modelled
beyond the live gathered parameters, so ZeRO-3 estimates are optimistic until measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
GiB = 2**30
GPU_RUNTIME_BYTES = 4 * GiB  # CUDA context (~0.5-1 GiB), NCCL buffers, caching-allocator fragmentation
CPU_RUNTIME_BYTES = int(1.5 * GiB)  # python, torch, transformers, DeepSpeed, Ray worker
LAYER_ACT_FACTOR = 17  # one layer's saved activations ~ 17 hidden-state elements per token (34 h bytes in bf16)
CHUNK_ROWS = 1024  # the learner's log-softmax chunk (asyncrl.learner.losses)


@dataclass(frozen=True)
class ModelShape:
    """Published dimensions of a model (its config.json)."""

    name: str
    params: float
    layers: int
    hidden: int
    vocab: int


# From the published config.json of each model (parameter counts from the model cards).
SHAPES = {
    "qwen2.5-0.5b": ModelShape("qwen2.5-0.5b", 0.494e9, 24, 896, 151936),
    "qwen2.5-1.5b": ModelShape("qwen2.5-1.5b", 1.54e9, 28, 1536, 151936),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 7.62e9, 28, 3584, 152064),
    "qwen2.5-vl-7b": ModelShape("qwen2.5-vl-7b", 8.29e9, 28, 3584, 152064),
    "qwen3-8b": ModelShape("qwen3-8b", 8.19e9, 36, 4096, 151936),
    "qwen3-vl-8b": ModelShape("qwen3-vl-8b", 8.77e9, 36, 4096, 151936),
    "qwen3-14b": ModelShape("qwen3-14b", 14.8e9, 40, 5120, 151936),
}


def shape_for(model_path: str) -> ModelShape | None:
    """The known shape whose name appears in `model_path` (longest match), else None."""
    key = model_path.lower().replace("_", "-")
    name = next((k for k in sorted(SHAPES, key=len, reverse=True) if k in key), None)
    return SHAPES[name] if name else None


def rank_bytes(shape: ModelShape, *, ranks: int, zero_stage: int, bf16: bool, micro_batch_tokens: int,
               reference: bool, act_bytes_per_token_layer: float | None = None, gpu: bool = True,
               adapter_params: float | None = None, logit_tokens: int | None = None) -> dict[str, int]:
    """Bytes one learner rank holds at its peak, by component (see the module docstring).
    `act_bytes_per_token_layer`: one layer's recomputed activations per token, measured (S3);
    `adapter_params`: LoRA's trainable parameters (`lora_params`; None = full fine-tuning): only
    they have gradients and optimizer state, and `reference` then costs nothing (the adapter is
    disabled, no replica); `logit_tokens`: response tokens of a micro-batch (the learner keeps
    logits for those only; default `micro_batch_tokens`, an upper bound)."""
    p, n, w = shape.params, max(1, ranks), 2 if bf16 else 4
    lora = adapter_params is not None
    t = float(adapter_params) if lora else p
    shard3 = n if zero_stage >= 3 else 1
    shard1 = n if zero_stage >= 1 else 1
    if zero_stage >= 2:  # reduce-scattered per bucket into the rank's fp32 partition
        grads = 4 * t / n
    elif zero_stage == 1:  # full .grad, plus fp32 accumulation (bf16) or DeepSpeed's flat fp32 partition
        grads = w * t + (4 * t if bf16 else 4 * t / n)
    else:
        grads = w * t
    master = 4 * t / shard1 if (bf16 or zero_stage >= 1) else 0
    tokens = micro_batch_tokens
    layer_act = act_bytes_per_token_layer if act_bytes_per_token_layer else LAYER_ACT_FACTOR * shape.hidden * w
    out = {
        # stage 3: the rank's partition, plus gathered parameters that stay live (up to
        # stage3_max_live_parameters = 1e9 elements, asyncrl.learner.build)
        "parameters": w * (p + (t if lora else 0)) / shard3 + (w * min(p, 1e9) if zero_stage >= 3 and n > 1 else 0),
        "gradients": grads,
        "optimizer (fp32 master + Adam moments)": master + 8 * t / shard1,
        "reference model": w * p if reference and not lora else 0,
        "activations (checkpointed)": tokens * shape.hidden * w * shape.layers + tokens * layer_act,
        "logits (+ gradient, fp32 chunks)": 2 * (tokens if logit_tokens is None else logit_tokens) * shape.vocab * w
        + 2 * 2 * min(CHUNK_ROWS, tokens if logit_tokens is None else logit_tokens) * shape.vocab * 4,
        "runtime": GPU_RUNTIME_BYTES if gpu else CPU_RUNTIME_BYTES,
    }
    return {k: int(v) for k, v in out.items()}


ALLOCATOR_SLACK = 0.22  # glibc heap growth over a CPU learner's tensor state (measured, see cpu_learner_extras)


def cpu_learner_extras(shape: ModelShape, *, trainable: float, churn_bytes: float) -> dict[str, int]:
    """What every CPU learner rank holds beyond `rank_bytes`, measured
    at Qwen2.5-0.5B's shape (0.494e9 parameters, fp32, ZeRO-0; docs/benchmarks.md "Scale").
    Two real jobs were killed by Ray's memory monitor in step 2 with the learner at 15.2 GiB (KL
    on) and 14.5 GiB (KL off) resident (lower bounds of its peak: it was still growing) against
    11.1 and 9.2 GiB estimated by `rank_bytes` alone. An in-process learner
    (`scripts/learner_memory.py`) showed where the rest goes:
    - (rank 0 only, counted by the caller) the weight-sync host copy: the sender's `HostArena` keeps
      one whole version of what is synced for the WeightStore (full weights or the adapter), 1.84 GiB;
    - per-tensor temporaries of the optimizer step and the tied head's gradient: about two copies
      of the largest parameter (the embedding, vocab x hidden, fp32 master), 1.0 GiB;
    - glibc's heap: the process held 1.65 GiB more after three steps than with a fixed
      `MALLOC_MMAP_THRESHOLD_` (freed tensor memory kept by the allocator): 22 % of the memory
      that is freed and taken again every step (`churn_bytes`: parameters, gradients, Adam
      moments; the KL reference is loaded once and never reallocated).
    With these terms the estimates are 15.5 and 13.7 GiB.
    """
    largest = shape.vocab * shape.hidden * 4 if trainable >= shape.vocab * shape.hidden else trainable * 4
    return {"optimizer temporaries (2 x largest tensor)": int(2 * largest),
            "allocator slack (glibc heap)": int(ALLOCATOR_SLACK * churn_bytes)}


def describe(components: dict[str, int], budget: int) -> str:
    """One line: the total against `budget`, then every component largest first."""
    total = sum(components.values())
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in sorted(components.items(), key=lambda kv: -kv[1]) if v)
    return f"{total / GiB:.1f} GiB of {budget / GiB:.1f} GiB ({parts})"


def shape_from_config(config: dict, name: str = "model") -> ModelShape:
    """A decoder's shape from its config.json (the text part of a vision-language one): parameters
    counted from the dimensions (embeddings, the untied head, attention with grouped KV heads, the
    gated MLP; norms and biases are < 0.1% and left out)."""
    h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    heads = int(config.get("num_attention_heads", 1))
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    inter = int(config.get("intermediate_size", 4 * h))
    vocab = int(config["vocab_size"])
    attention = h * heads * head_dim * 2 + h * kv * head_dim * 2
    params = vocab * h * (1 if config.get("tie_word_embeddings") else 2) + layers * (attention + 3 * h * inter)
    return ModelShape(name, float(params), layers, h, vocab)


def lora_params(config: dict, rank: int, target_modules: list[str] | tuple[str, ...]) -> int:
    """Parameters of a LoRA adapter of `rank` on a decoder's config.json (its text part): every
    targeted linear of every layer adds A (rank x in) and B (out x rank), rank * (in + out), with
    the shapes of `shape_from_config`'s count (grouped KV heads, the gated MLP). Names outside the
    attention and MLP projections (refused by the config for vLLM anyway) add nothing."""
    h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    heads = int(config.get("num_attention_heads", 1))
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    inter = int(config.get("intermediate_size", 4 * h))
    dims = {"q_proj": (h, heads * head_dim), "k_proj": (h, kv * head_dim), "v_proj": (h, kv * head_dim),
            "o_proj": (heads * head_dim, h), "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    return layers * sum(rank * sum(dims[m]) for m in set(target_modules) if m in dims)


def engine_host_bytes(shape: ModelShape, kv_cache_bytes: int, *, round_bytes: float | None = None) -> dict[str, int]:
    """Host memory of one vLLM CPU engine at its peak, a weight round, by component (vLLM 0.32's
    CPU build as asyncrl loads it; V x H = the vocabulary embedding):
    - fp32 weights, 4*P: the linear layers' packed GEMM kernels (the CPU build frees the loaded
      weight after packing), the embedding (a lookup) and the norms;
    - the head's GEMM kernel, 4*V*H: packed from a copy of its matrix, which stays (tied: it is
      the embedding, counted once in P; untied: the head's own weight, counted in P), so either
      way one V x H beyond P. The input embedding is not packed
      (`asyncrl.small_machine.patches.vllm_embedding_packs_lazily`; vLLM alone packs it too);
    - a weight round: the buffered receive holds one whole synced version (`round_bytes`, default
      4*P; an adapter-only sync is small) until the load, and the layer being reloaded is
      materialised beside its kernel (at most the embedding, 4*V*H);
    - the KV cache and the runtime (interpreter, torch, vLLM, its activation buffers).
    Measured (scripts/engine_memory.py, the quick start's rollout settings, resident): 2 of
    Qwen2.5-0.5B's 24 layers (0.664 GB) built at 2.34 GiB and peaked at 3.50-3.76 GiB in each of
    50 rounds, against 2.88 and 4.00 estimated; at 24 layers the engine core held 4.54 GiB between
    rounds while vLLM still packed the embedding too (4.03 without that copy) against 4.10. The
    0.94 GiB that measurement had above weights + KV cache + runtime, once put down to fp32
    vocabulary-wide buffers for `max_num_batched_tokens`, were the two packed V x H copies."""
    vh = 4 * shape.vocab * shape.hidden
    receive = 4 * shape.params if round_bytes is None else round_bytes
    return {"weights (fp32)": int(4 * shape.params), "head GEMM kernel": int(vh),
            "weight round (received version + one layer)": int(receive + vh),
            "KV cache": int(kv_cache_bytes), "runtime": CPU_RUNTIME_BYTES}


def checkpoint_bytes(params: float, trainable: float, bf16: bool) -> int:
    """Bytes one job checkpoint takes on disk: DeepSpeed's module weights in the training dtype,
    the fp32 master copy (bf16 only) and Adam's two fp32 moments of the trainable parameters, and
    the Hugging Face export in the training dtype (the buffer snapshot and cursor are small).
    fp32, 18 of Qwen2.5-0.5B's layers (0.4046e9 parameters): 16 bytes per parameter = 6.474e9;
    measured 6,473,319,314 bytes (`bench scale`)."""
    width = 2 if bf16 else 4
    return int(params * width * 2 + trainable * (8 + (4 if bf16 else 0)))
