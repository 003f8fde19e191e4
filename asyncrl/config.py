"""The one typed configuration tree of asyncrl (pydantic v2).

Precedence: field defaults < YAML file < dotted command-line overrides (`rollout.n=8`).
Every section forbids unknown keys; `load_config` turns pydantic's errors into one short
message that names the full key path, the expected type and the given value, and suggests the
closest valid key for a typo. Cross-field rules (GUIDED_GRPO.md 6.9 plus asyncrl's own) run as
one validator on the root after parsing, and derived values are filled in there too, so nothing
downstream re-derives them.

Importing this module imports no torch, ray or vllm (a unit test checks it), so `--help` and
`--print-config` answer at once.

Guided-GRPO YAMLs (`data.*`, `algorithm.*`, `worker.*`, `trainer.*`) load through
`from_guided_grpo`, whose key map is `GUIDED_GRPO_KEY_MAP` below; keys with no equivalent are
reported by name (see docs/config.md).
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "parse_overrides",
    "from_guided_grpo",
    "check_files",
]


class ConfigError(ValueError):
    """A configuration problem, phrased for the user (no traceback needed)."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, protected_namespaces=())


# --------------------------------------------------------------------------------------------- data
class DataConfig(Section):
    train_files: str = "assets/arith/train.jsonl"
    """Training data: a local .json/.jsonl/.parquet file or directory, or a hub id, with an optional
    `@split` suffix (default split `train`), as in Guided-GRPO."""
    val_files: str = "assets/arith/val.jsonl"
    """Validation data, same syntax; used every `trainer.eval_every` steps. Empty = no validation."""
    test_files: str = "assets/arith/test.jsonl"
    """Held-out data for the before/after evaluation of a run (summary.json). Empty = skip."""
    prompt_key: str = "problem"
    """Column holding the question text (Guided-GRPO's shipped configs use `problem`)."""
    answer_key: str = "answer"
    """Column holding the reference answer; becomes `ground_truth`."""
    image_key: str = "images"
    """Column holding a list of images (PIL, path, bytes or {"bytes": ...})."""
    video_key: str = "videos"
    """Column holding a list of videos."""
    image_dir: str | None = None
    """Directory joined to string image/video paths."""
    video_fps: float = 2.0
    """Frames per second sampled from videos."""
    max_prompt_length: int = Field(512, gt=0)
    """Tokens of the policy prompt at any turn (P); longer prompts are filtered or truncated."""
    max_response_length: int = Field(512, gt=0)
    """Tokens per policy turn (R)."""
    rollout_batch_size: int = Field(8, gt=0)
    """Groups (prompts) per learner step: the B of the staleness rule. Each group has `rollout.n` samples."""
    format_prompt: str | None = None
    """Jinja2 template file applied to the question (variable `content`), or a built-in name
    (`math`, `r1v`, `guided_math`); None = the question as is."""
    system_prompt: str | None = None
    """Optional system message; `guided` selects the Guided-GRPO student prompt shipped in asyncrl/data."""
    override_chat_template: str | None = None
    """Replaces the tokenizer's chat template."""
    shuffle: bool = True
    """Shuffle the training stream (deterministic by `seed`)."""
    seed: int = 1
    """Seed of the data order."""
    min_pixels: int = 262144
    """Images smaller than this area are upscaled."""
    max_pixels: int = 4194304
    """Images larger than this area are downscaled."""
    filter_overlong_prompts: bool = True
    """Drop rows whose initial prompt exceeds `max_prompt_length` (counted and logged)."""


# ---------------------------------------------------------------------------------------- algorithm
class AlgorithmConfig(Section):
    adv_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                           "grpo_passk", "remax"] = "grpo"
    """Advantage estimator. Group estimators need `rollout.n > 1`."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of REINFORCE++ token returns."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda (kept for Guided-GRPO compatibility; no critic in asyncrl)."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's (unbiased) std; False gives Dr.GRPO's numerator."""
    turn_score_coef: float = Field(0.0, ge=0)
    """Guided process advantage (asyncrl extension, not in Guided-GRPO): add coef x the verifier's
    step score of each policy turn (`[SCORE] hallucination_detect`), normalised over the group's
    scored turns, to every token of that turn. Dense per-turn credit; 0 = outcome advantage only."""
    turn_score_accept: float | None = Field(1.0, ge=0, le=1)
    """Process score of the final policy turn when the verifier accepted it (`###STOP###` after a
    formatted final answer), which carries no `[SCORE]` line. 1.0 counts acceptance as a correct
    step, so the process advantage does not favour one more checkpoint turn over finishing; None
    leaves that turn unscored (it then gets no process advantage)."""


# -------------------------------------------------------------------------------------------- model
class ModelConfig(Section):
    path: str = "assets/tiny-policy"
    """Policy checkpoint (HF format, local dir or hub id); used by the learner, the reference model
    and every rollout engine."""
    tokenizer_path: str | None = None
    """Tokenizer/processor; defaults to `path`."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the checkpoint."""
    override_config: dict[str, Any] = Field(default_factory=dict)
    """HF config overrides applied when loading."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, ~30% slower."""
    freeze_vision_tower: bool = False
    """VL policies: keep the vision encoder frozen."""


# ------------------------------------------------------------------------------------------ rollout
class GuideSamplingConfig(Section):
    temperature: float = Field(0.2, ge=0)
    """Verifier sampling temperature."""
    top_p: float = Field(0.95, gt=0, le=1)
    """Verifier nucleus sampling."""
    top_k: int = -1
    """Verifier top-k (-1 or 0 = off)."""
    max_tokens: int = Field(256, gt=0)
    """Tokens per verifier reply."""


class GuideConfig(Section):
    enable: bool = True
    """Guided multi-turn rollout (Guided-GRPO); False = single-turn GRPO."""
    max_turns: int = Field(10, gt=0)
    """Policy turns per conversation at most."""
    stop_token: str = "###STOP###"
    """Verifier's stop signal; recognised when it stands alone on a line."""
    prompt_template: str | None = None
    """Verifier system prompt; None = Guided-GRPO's default, shipped byte-identical in asyncrl/data."""
    continue_prompt: str = "Please continue and provide the final answer in the required format."
    """User turn sent when the verifier stops but the policy has not given a final answer."""
    enable_hallucination_score: bool = True
    """Parse `[SCORE] hallucination_detect=0|1` from verifier replies."""
    show_score_to_policy: bool = False
    """Keep the score line in the guidance the policy sees (Guided-GRPO shows it)."""
    train_scope: Literal["final_turn", "full_turn"] = "final_turn"
    """`final_turn`: train on the last policy turn (Guided-GRPO). `full_turn`: train on every policy
    turn, verifier tokens masked out."""
    on_error: Literal["stop", "continue", "drop_group"] = "stop"
    """What a verifier error does to a conversation; always counted (`finish_reason=verifier_error`)."""
    verifier_sees_reference: Literal["train_only", "always", "never"] = "train_only"
    """Whether the verifier is given the reference answer (Guided-GRPO: training only)."""
    history: Literal["full", "guided_grpo"] = "full"
    """`full`: append-only conversation (token-exact); `guided_grpo`: the original's text rewriting."""
    sampling: GuideSamplingConfig = Field(default_factory=GuideSamplingConfig)
    """Verifier sampling."""


def rollout_device_defaults(gpus_per_actor: int) -> tuple[bool, float]:
    """(enforce_eager, gpu_memory_utilization) when the config leaves them None: fast on GPU
    (CUDA graphs, 0.9 of a GPU the rollout actor owns), eager on CPU."""
    return (False, 0.9) if gpus_per_actor > 0 else (True, 0.6)


class RolloutConfig(Section):
    num_actors: int = Field(2, ge=0)
    """Rollout actors (each owns one vLLM engine); scaled live with `asyncrl.ctl scale N`."""
    gpus_per_actor: int = Field(0, ge=0)
    """GPUs per rollout actor (= tensor parallel size on GPU); 0 = vLLM's CPU build."""
    cpus_per_actor: float = Field(1.0, gt=0)
    """Ray CPUs reserved per rollout actor."""
    max_restarts: int = Field(3, ge=-1)
    """Ray restarts of a crashed actor (-1 = unlimited)."""
    n: int = Field(8, gt=0)
    """Samples per group (G)."""
    temperature: float = Field(1.0, gt=0)
    """Policy sampling temperature; the learner divides logits by it too."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Policy nucleus sampling."""
    top_k: int = -1
    """Policy top-k (-1 = off)."""
    seed: int = 1
    """Base seed; sample i of prompt p gets its own seed derived from (seed, p, i)."""
    ignore_eos: bool = False
    """Generate past EOS (benchmarks only)."""
    limit_images: int = Field(0, ge=0)
    """>0: at most this many images per prompt (trimmed identically for rollout and learner)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype; auto = float32 on CPU (3x faster than bf16 there), bfloat16 on GPU."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """vLLM GPU memory fraction; None = derived: 0.9 with gpus_per_actor > 0 (the rollout actor
    owns its GPUs), else 0.6."""
    cpu_kvcache_gb: float = Field(1.0, gt=0)
    """vLLM CPU build: KV cache size (VLLM_CPU_KVCACHE_SPACE)."""
    enforce_eager: bool | None = None
    """Disable CUDA graphs; None = derived: False (CUDA graphs on: 2-3x faster decode; vLLM's
    in-place reload keeps their storage valid) with gpus_per_actor > 0, True on CPU."""
    enable_prefix_caching: bool = True
    """Reuse KV of shared prefixes (multi-turn); reset after every weight update."""
    max_model_len: int | None = None
    """Engine context length; None = derived (prompt + turns x response)."""
    max_num_batched_tokens: int = Field(8192, gt=0)
    """Engine scheduler token budget; must be >= max_prompt_length + max_response_length."""
    max_num_seqs: int = Field(64, gt=0)
    """Sequences batched by one engine at once."""
    groups_in_flight: int = Field(2, gt=0)
    """Groups one actor runs concurrently (continuous batching across groups)."""
    weight_update_mode: Literal["between_groups", "in_flight"] = "in_flight"
    """`in_flight`: running conversations continue on new weights (tokens carry both versions);
    `between_groups`: they finish on the weights they started with."""
    prompt_truncation: Literal["left", "right", "error"] = "left"
    """Which end of an overlong prompt is cut."""
    val_override_config: dict[str, Any] = Field(default_factory=lambda: {"temperature": 0.0, "n": 1})
    """Sampling overrides for evaluation (greedy by default)."""
    guide: GuideConfig = Field(default_factory=GuideConfig)
    """Guided multi-turn protocol (Guided-GRPO's `worker.rollout.verifier.*`)."""


# ----------------------------------------------------------------------------------------- verifier
class VerifierHTTPConfig(Section):
    base_url: str = ""
    """External OpenAI-compatible endpoint (e.g. http://host:8000/v1)."""
    model: str = "verifier"
    """Model name sent in requests."""
    api_key: str = ""
    """Bearer token for the external endpoint; `env:NAME` reads it from the environment."""
    timeout_s: float = Field(120.0, gt=0)
    """Per-request socket timeout."""
    max_retries: int = Field(2, ge=0)
    """Retries after the first attempt."""
    concurrency: int = Field(16, gt=0)
    """Concurrent requests per replica to the external endpoint."""


class VerifierClientConfig(Section):
    deadline_s: float = Field(60.0, gt=0)
    """Total time budget of one verifier call, retries included."""
    max_retries: int = Field(3, ge=0)
    """Retries after the first attempt (exponential backoff with jitter)."""
    backoff_s: float = Field(0.2, ge=0)
    """First backoff; doubles per retry."""
    backoff_max_s: float = Field(5.0, ge=0)
    """Backoff ceiling."""
    max_concurrency: int = Field(64, gt=0)
    """Concurrent verifier calls per rollout actor."""


class AutoscalingConfig(Section):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, gt=0)
    target_ongoing_requests: float = Field(16.0, gt=0)
    """Requests in flight per replica that Serve aims at: the rollout backlog drives the count."""
    upscale_delay_s: float = Field(30.0, ge=0)
    """How long the backlog must stay above the target before a replica is added."""
    downscale_delay_s: float = Field(600.0, ge=0)
    """How long it must stay below before one is removed."""


class VerifierConfig(Section):
    backend: Literal["rule", "vllm", "http"] = "rule"
    """`rule`: a built-in task's rule verifier; `vllm`: a verifier model served by vLLM;
    `http`: pass-through to an external OpenAI-compatible endpoint."""
    version: str = "v1"
    """Label stamped on every reply and every sample it guided; change it to swap live."""
    task: str = "arith"
    """Rule back-end: the built-in task whose verifier to serve."""
    model_path: str | None = None
    """vllm back-end: verifier checkpoint (real weights are loaded)."""
    tokenizer_path: str | None = None
    """vllm back-end: tokenizer; defaults to model_path."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """vllm back-end engine dtype."""
    max_model_len: int = Field(4096, gt=0)
    """vllm back-end context length."""
    num_replicas: int = Field(1, ge=1)
    """Serve replicas (ignored when autoscaling is set)."""
    cpus_per_replica: float = Field(0.25, gt=0)
    """Ray CPUs per replica."""
    gpus_per_replica: float = Field(0, ge=0)
    """GPUs per replica (vllm back-end)."""
    autoscaling: AutoscalingConfig | None = None
    """Ray Serve autoscaling; None = fixed `num_replicas`."""
    request_ring: int = Field(256, ge=0)
    """Answered requests each replica keeps (with its reply) for `asyncrl.ctl swap-verifier
    --dry-run` to replay through a candidate version; 0 = none."""
    host: str = "auto"
    """HTTP bind address of the OpenAI-compatible ingress (Serve's proxy on the head node): `auto` =
    loopback on an embedded cluster, the head node's address on a joined cluster; `node`, a
    wildcard (advertises the node IP) or an address (asyncrl.addresses). Rollout actors reach the
    verifier through Serve handles, not this port."""
    port: int = Field(8000, ge=0, le=65535)
    """HTTP port of the ingress; 0 = a free one (from `cluster.port_range` when set)."""
    api_key: str = ""
    """If set, the ingress requires `Authorization: Bearer <key>`; `env:NAME` reads the environment."""
    http: VerifierHTTPConfig = Field(default_factory=VerifierHTTPConfig)
    """http back-end settings."""
    client: VerifierClientConfig = Field(default_factory=VerifierClientConfig)
    """Client used by rollout actors: deadlines, retries, concurrency."""


# ------------------------------------------------------------------------------------------- buffer
class CurveConfig(Section):
    enable: bool = False
    """CurveZMQ authentication + encryption (multi-host)."""
    server_secret_key_file: str | None = None
    """Server's secret key file (zmq.auth format)."""
    server_public_key_file: str | None = None
    """Server's public key file (clients need it)."""
    client_secret_key_file: str | None = None
    """This client's secret key file."""
    authorized_clients_dir: str | None = None
    """Directory of client public keys allowed to connect."""


class DynamicSamplingConfig(Section):
    enable: bool = False
    """DAPO dynamic sampling: drop groups whose mean reward is outside (low, high), counted."""
    key: str = "overall"
    """Reward part used for the filter."""
    low: float = 0.01
    """Keep groups with mean > low."""
    high: float = 0.99
    """... and mean < high."""


class DurableConfig(Section):
    enable: bool = True
    """Append every acknowledged change (stored groups, tickets, counters) to a log on the buffer
    host's local disk before acknowledging it, so a restarted buffer process loses nothing."""
    fsync: Literal["always", "interval", "never"] = "always"
    """`always`: fsync before each acknowledgement (also survives a host crash); `interval`: at most
    every `fsync_interval_s`; `never`: leave it to the OS. Every policy survives a process death."""
    fsync_interval_s: float = Field(1.0, gt=0)
    """fsync period for `fsync: interval`."""
    compact_min_mb: float = Field(64.0, gt=0)
    """The log is rewritten with only the live groups once it exceeds max(this, 2 x buffered MiB)."""
    restored_lease_s: float = Field(300.0, gt=0)
    """After a restart, tickets leased before the death stay leased at most this long."""


class BufferConfig(Section):
    max_staleness: int = Field(1, ge=0)
    """Learner versions a group may lag behind (v - min_version); higher = more throughput, more
    off-policy noise. 0 = synchronous on-policy."""
    capacity_groups: int = Field(1024, gt=0)
    """Buffered groups at most; producers are told "full" beyond it (never a silent drop)."""
    capacity_mb: float = Field(1024.0, gt=0)
    """Buffered bytes at most (MiB)."""
    max_frame_mb: float = Field(256.0, gt=0)
    """Largest accepted frame (MiB); larger frames are rejected and counted."""
    host: str = "auto"
    """Bind address of the ROUTER: `auto` = loopback on an embedded cluster, the hosting node's
    address on a joined cluster; `node`, a wildcard (advertises the node IP) or an address
    (asyncrl.addresses). Beyond loopback, enable CurveZMQ."""
    port: int = Field(0, ge=0, le=65535)
    """ROUTER port for producers and the learner; 0 = pick a free one (from `cluster.port_range`)."""
    hwm: int = Field(64, gt=0)
    """ZeroMQ high-water mark (messages queued per peer before back-pressure)."""
    push_window: int = Field(4, ge=1)
    """Unacknowledged pushes a rollout actor keeps in flight (each group still acknowledged on its
    own); 1 = one round trip per group. Bounded by the groups it runs at once."""
    ticket_lease_s: float = Field(1800.0, gt=0)
    """Admission ticket lease: a ticket not pushed or released within this time frees its slot
    (a dead actor's tickets never block admission forever); a later push is still accepted."""
    curve: CurveConfig = Field(default_factory=CurveConfig)
    """CurveZMQ security."""
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    """DAPO group filter at ingest."""
    reissue_stale: bool = True
    """Issue the prompt of a group dropped by the staleness bound again (`buffer/reissued_stale`), so
    long rollouts, which age out first, are not skipped for the epoch."""
    durable: DurableConfig = Field(default_factory=DurableConfig)
    """Durable log of acknowledged groups (survives the buffer process's death)."""


# ------------------------------------------------------------------------------------------ learner
class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW decoupled weight decay."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """Schedule, stepped once per optimizer step."""
    warmup_steps: int | None = None
    """Linear warmup steps; overrides warmup_ratio."""
    warmup_ratio: float = Field(0.0, ge=0, le=1)
    """Warmup as a fraction of the total optimizer steps."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Cosine floor as a fraction of lr."""


class OffPolicyConfig(Section):
    mode: Literal["none", "bypass", "tis", "mis", "rs", "seq_tis", "seq_mis", "seq_rs", "decoupled"] = "tis"
    """Correction between behaviour (engine) and proximal (learner at step start) policies, weight w
    of r = pi_prox/mu: tis min(r, cap); mis (masked IS) r * 1[low <= r <= high]; rs (rejection only)
    1[low <= r <= high]; seq_* the same on the sequence ratio (`seq_ratio`); decoupled r * 1[r <= cap]."""
    cap: float = Field(2.0, gt=0)
    """tis/seq_tis: upper clamp C of the importance weight; decoupled: tokens whose pi_prox/mu
    exceeds it get weight 0 (AReaL's behav_imp_weight_cap; AReaL uses 5)."""
    low: float = Field(0.5, ge=0)
    """mis/rs/seq_mis/seq_rs: tokens (or sequences) with ratio below this are masked."""
    high: float = Field(2.0, gt=0)
    """mis/rs/seq_mis/seq_rs: tokens (or sequences) with ratio above this are masked."""
    seq_ratio: Literal["geometric_mean", "product"] = "geometric_mean"
    """seq_tis/seq_mis/seq_rs: the sequence ratio. geometric_mean = exp(mean_t log r_t) (AReaL's
    choice: a bound means the same for short and long sequences); product = prod_t r_t (the exact
    sequence importance weight, as verl and TRL define sequence-level TIS; its spread grows with length)."""


class KLConfig(Section):
    enable: bool = False
    """Regularise against a frozen reference model (the initial policy)."""
    estimator: Literal["k1", "abs", "k2", "k3"] = "k3"
    """KL estimator; k3 = Guided-GRPO's `low_var_kl` (clamped)."""
    coef: float = Field(1e-3, ge=0)
    """beta (initial beta when adaptive)."""
    mode: Literal["loss", "reward"] = "loss"
    """Add the KL as a loss term or as a per-token reward penalty."""
    type: Literal["fixed", "adaptive"] = "fixed"
    """Fixed beta or the adaptive controller."""
    target: float = Field(0.1, gt=0)
    """Adaptive controller target KL."""
    horizon: float = Field(10000.0, gt=0)
    """Adaptive controller horizon."""


class WeightSyncConfig(Section):
    bucket_mb: float = Field(256.0, gt=0)
    """Flat per-dtype bucket size of the broadcast."""
    gloo_bucket_mb: float = Field(16.0, gt=0)
    """Bucket cap on the gloo (CPU) path, which uses min(bucket_mb, this): measured here, 4-16 MB
    buckets beat one flat gloo broadcast 1.5-2.4x, 32 MB and up lose (copy + gloo large-message cost)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective back-end; auto = nccl on GPU, gloo on CPU."""
    timeout_s: float = Field(60.0, gt=0)
    """Watchdog bound on every weight collective; a member past it is dropped and re-fed from the
    object store."""
    host: str = "auto"
    """Advertised address of the weight group's rendezvous TCPStore on learner rank 0: `auto` =
    loopback on an embedded cluster, rank 0's node address on a joined cluster (asyncrl.addresses)."""
    port: int = Field(0, ge=0, le=65535)
    """Rendezvous port; 0 = a free one (from `cluster.port_range` when set)."""
    publish_mode: Literal["background", "sync"] = "background"
    """How the WeightStore copy (late joiners, fallbacks) is published: from a background thread
    (the next learner step does not wait for it; versions still reach the store in order) or
    inside the broadcast."""
    publish_every: int = Field(1, ge=1)
    """Publish every N-th broadcast to the WeightStore (1 = every version)."""


class LearnerConfig(Section):
    num_gpus: int = Field(0, ge=0)
    """Learner GPUs (one rank each); 0 = CPU ranks with DeepSpeed's CPU accelerator."""
    cpu_ranks: int = Field(1, ge=1)
    """Learner ranks when num_gpus = 0."""
    cpus_per_rank: float = Field(1.0, gt=0)
    """Ray CPUs per learner rank."""
    zero_stage: Literal[0, 1, 2, 3] = 1
    """DeepSpeed ZeRO stage."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto = bf16 on GPU, fp32 on CPU."""
    micro_batch_tokens: int = Field(8192, gt=0)
    """Token budget of one micro-batch (padded length x sequences)."""
    max_micro_batch_size: int = Field(64, gt=0)
    """Sequences per micro-batch at most."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per learner step (the batch is split into this many mini-batches)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clip; a non-finite norm skips the step (counted)."""
    loss_type: Literal["ppo", "gspo", "gspo_token", "cispo"] = "ppo"
    """Policy loss; ppo = Guided-GRPO's `default` (asymmetric + dual clip)."""
    loss_avg_mode: Literal["token", "seq", "seq_sum_token_mean"] = "token"
    """Aggregation: global token mean, mean of per-sequence means, or Dr.GRPO's sum / max tokens."""
    norm_length: int | None = Field(None, gt=0)
    """Dr.GRPO (loss_avg_mode=seq_sum_token_mean): the constant each sequence's token sum is divided
    by, the same every step (the paper's MAX_TOKENS). None = the configured response budget:
    data.max_response_length, times rollout.guide.max_turns when the guide trains every turn (full_turn)."""
    clip_eps_low: float = Field(0.2, ge=0)
    """PPO epsilon below 1."""
    clip_eps_high: float = Field(0.3, ge=0)
    """PPO epsilon above 1 (asymmetric like Guided-GRPO/DAPO)."""
    clip_ratio_dual: float = Field(3.0, gt=1)
    """Dual-clip constant c on negative advantages."""
    cispo_eps_low: float | None = None
    """CISPO lower bound on the IS weight (None = unbounded below, as the paper)."""
    cispo_eps_high: float = Field(4.0, gt=0)
    """CISPO: IS weight clamped to at most 1 + eps_high."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    """Off-policy correction."""
    kl: KLConfig = Field(default_factory=KLConfig)
    """Reference-model KL."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    weights: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """Weight broadcast to rollout engines."""
    batch_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for a batch from the buffer before the run fails with a message."""
    prefetch: bool = True
    """Rank 0 asks the buffer for the next step's batch while the current step trains, so the
    learner waits only for what the rollouts have not produced yet (not for a round trip)."""


# ------------------------------------------------------------------------------------------- reward
class RewardConfig(Section):
    function: str = "guided_math"
    """Built-in name (`math`, `guided_math`, `dapo`, `r1v`) or `path/to/file.py:fn` (Guided-GRPO plug-in)."""
    type: Literal["batch", "sequential"] = "batch"
    """Plug-in calling convention: one call per batch of dicts, or one per sample."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments bound to the function."""
    timeout_s: float = Field(10.0, gt=0)
    """Bound on grading one sample."""


# ------------------------------------------------------------------------------------------ cluster
class ClusterConfig(Section):
    ray_address: str | None = None
    """Existing Ray cluster (`auto` or `ray://host:port`); None = start an embedded one."""
    num_cpus: int | None = None
    """Embedded cluster CPUs; None = the machine's count."""
    num_gpus: int | None = None
    """Embedded cluster GPUs; None = detected."""
    namespace: str = "asyncrl"
    """Ray namespace of the job's named actors."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """Longest wait for any component to start before failing with its name."""
    port_range: str | None = None
    """`lo-hi` (e.g. `20000-20099`): listeners whose port is 0 pick from this range, so a firewall
    can allow one fixed range between the nodes; None = any free port."""
    network_interface: str | None = None
    """Interface the collectives use on every node (sets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME
    for every role, e.g. `eth0`); None = the standard variables from the environment, else the
    libraries' own choice (by hostname, often wrong on multi-homed hosts)."""
    resources: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Extra Ray resources per role (`buffer`, `coordinator`, `learner` (per rank), `rollout` (per
    actor), `verifier` (per replica)), e.g. `{rollout: {node_b: 0.01}}` to pin a role to nodes
    started with `--resources '{"node_b": 1}'`."""
    model_dir: str | None = None
    """Directory every node can read where a hub id in `model.path` / `verifier.model_path` is
    downloaded once by the driver; None = `~/.cache/asyncrl/models` (single host or shared home)."""
    min_shm_gb: float = Field(1.0, ge=0)
    """Smallest /dev/shm the launcher and doctor accept on a node hosting an engine or a learner
    rank (Kubernetes pods default to 64 MB: mount an emptyDir of medium Memory there)."""
    max_identical_failures: int = Field(3, ge=1)
    """A rollout actor that fails this many times in a row with the same error stops the job
    (naming the actor, its host and the address it could not reach) instead of restarting forever."""
    max_restarts: int = Field(3, ge=-1)
    """Times Ray restarts a dead buffer host or coordinator in the running job (each resumes its
    state from disk: buffer.durable log, coordinator state); -1 = without limit."""


# ------------------------------------------------------------------------------------------ trainer
class TrainerConfig(Section):
    project_name: str = "asyncrl"
    """Project (W&B project, run-dir parent)."""
    experiment_name: str = "quickstart"
    """Run name; the run directory is `run_dir/experiment_name`."""
    run_dir: str = "runs"
    """Parent of run directories."""
    max_steps: int = Field(20, gt=0)
    """Learner steps (policy versions) to train."""
    eval_every: int = -1
    """Evaluate on `data.val_files` every N steps; -1 = never."""
    eval_before_after: bool = True
    """Evaluate on `data.test_files` before and after training (summary.json)."""
    eval_limit: int | None = None
    """Evaluate on at most this many rows."""
    save_every: int = 25
    """Checkpoint every N steps (bounds the steps a learner death costs); -1 = only at the end, on
    SIGTERM and on the error path."""
    save_limit: int = -1
    """Keep the newest K checkpoints; -1 = all."""
    recover_learner: bool = True
    """A dead learner rank is recovered in the running job: the learner group is rebuilt from the
    newest checkpoint (up to `cluster.max_restarts` times); false = stop (exit 3) for a resume."""
    resume: str = "never"
    """`auto` (newest complete checkpoint of this run), `never`, or a checkpoint path."""
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["console", "jsonl"]
    )
    """Metric sinks; every sink gets the same keys."""
    samples_per_eval: int = Field(4, ge=0)
    """Decoded trajectories written to samples/ per evaluation."""
    seed: int = 1
    """Global seed (torch, numpy, python)."""


CLUSTER_ROLES = ("buffer", "coordinator", "learner", "rollout", "verifier")


def _cluster_problems(c: ClusterConfig) -> list[str]:
    from asyncrl.addresses import parse_port_range

    problems = [f"cluster.resources.{role}: unknown role (one of {', '.join(CLUSTER_ROLES)})"
                for role in c.resources if role not in CLUSTER_ROLES]
    try:
        parse_port_range(c.port_range)
    except ValueError as exc:
        problems.append(str(exc))
    return problems


# --------------------------------------------------------------------------------------------- root
class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    _unmapped_keys: list[str] = PrivateAttr(default_factory=list)
    """Guided-GRPO keys that had no equivalent (set by from_guided_grpo)."""

    @model_validator(mode="after")
    def _validate_and_derive(self) -> Config:
        problems: list[str] = []
        d, r, g = self.data, self.rollout, self.rollout.guide
        # Derived values: computed here once, read everywhere else.
        if r.max_model_len is None:
            turns = g.max_turns if g.enable else 1
            r.max_model_len = d.max_prompt_length + turns * (d.max_response_length + g.sampling.max_tokens)
        if self.learner.norm_length is None:  # Dr.GRPO's constant: the policy-token budget of one sample
            full = g.enable and g.train_scope == "full_turn"
            self.learner.norm_length = d.max_response_length * (g.max_turns if full else 1)
        eager, memory = rollout_device_defaults(r.gpus_per_actor)
        if r.enforce_eager is None:
            r.enforce_eager = eager
        if r.gpu_memory_utilization is None:
            r.gpu_memory_utilization = memory
        if r.max_num_batched_tokens < d.max_prompt_length + d.max_response_length:
            problems.append(
                f"rollout.max_num_batched_tokens ({r.max_num_batched_tokens}) must be >= data.max_prompt_length"
                f" + data.max_response_length ({d.max_prompt_length + d.max_response_length})"
            )
        if r.max_model_len < d.max_prompt_length + d.max_response_length:
            problems.append(
                f"rollout.max_model_len ({r.max_model_len}) must be >= data.max_prompt_length + "
                f"data.max_response_length ({d.max_prompt_length + d.max_response_length})"
            )
        if self.algorithm.adv_estimator in ("grpo", "dr_grpo", "rloo", "grpo_passk",
                                            "reinforce_plus_plus_baseline") and r.n < 2:
            problems.append(f"algorithm.adv_estimator={self.algorithm.adv_estimator} needs rollout.n > 1 (got {r.n})")
        if g.train_scope == "full_turn" and g.history != "full":
            problems.append("rollout.guide.train_scope=full_turn requires rollout.guide.history=full")
        if self.verifier.backend == "http" and not self.verifier.http.base_url:
            problems.append("verifier.backend=http requires verifier.http.base_url")
        if self.verifier.backend == "vllm" and not self.verifier.model_path:
            problems.append("verifier.backend=vllm requires verifier.model_path")
        if self.buffer.dynamic_sampling.low >= self.buffer.dynamic_sampling.high:
            problems.append("buffer.dynamic_sampling.low must be < buffer.dynamic_sampling.high")
        if self.learner.clip_eps_low >= 1:
            problems.append("learner.clip_eps_low must be < 1")
        if self.learner.off_policy.low >= self.learner.off_policy.high:
            problems.append("learner.off_policy.low must be < learner.off_policy.high")
        if self.trainer.resume not in ("auto", "never") and not self.trainer.resume:
            problems.append("trainer.resume must be auto, never or a checkpoint path")
        if self.cluster.num_gpus is not None:
            need = self.learner.num_gpus + self.rollout.num_actors * self.rollout.gpus_per_actor
            need += self.verifier.num_replicas * self.verifier.gpus_per_replica
            if need > self.cluster.num_gpus:
                problems.append(f"roles need {need:g} GPUs but cluster.num_gpus is {self.cluster.num_gpus}")
        problems += _cluster_problems(self.cluster)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # Derived views used by several components.
    @property
    def on_gpu(self) -> bool:
        return self.learner.num_gpus > 0 or self.rollout.gpus_per_actor > 0

    @property
    def learner_world_size(self) -> int:
        return self.learner.num_gpus if self.learner.num_gpus > 0 else self.learner.cpu_ranks

    @property
    def engine_dtype(self) -> str:
        if self.rollout.dtype != "auto":
            return self.rollout.dtype
        return "bfloat16" if self.rollout.gpus_per_actor > 0 else "float32"

    @property
    def learner_precision(self) -> str:
        if self.learner.precision != "auto":
            return self.learner.precision
        return "bf16" if self.learner.num_gpus > 0 else "fp32"

    @property
    def run_path(self) -> Path:
        return Path(self.trainer.run_dir) / self.trainer.experiment_name

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=False)


# ------------------------------------------------------------------------------------ loading logic
def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["a.b=1", "c=[x, y]"]` -> nested dict; values are parsed as YAML scalars/lists."""
    tree: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key part")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {key}: cannot parse value {raw!r}: {exc}") from None
        _set_dotted(tree, key, value)
    return tree


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the key at `loc` (for suggestions)."""
    model: Any = Config
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _format_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        key = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden":
            owner = _model_at(loc)
            hint = ""
            if owner is not None:
                close = difflib.get_close_matches(str(loc[-1]), list(owner.model_fields), n=1, cutoff=0.5)
                prefix = ".".join(str(p) for p in loc[:-1])
                if close:
                    hint = f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
                else:
                    hint = f"; valid keys here: {', '.join(owner.model_fields)}"
            lines.append(f"unknown key '{key}'{hint}")
        elif err["type"] == "value_error" and not loc:
            lines.append(str(err["msg"]).removeprefix("Value error, "))
        else:
            given = err.get("input")
            given_s = repr(given) if not isinstance(given, dict) else "a mapping"
            lines.append(f"'{key}': {err['msg']} (given: {given_s[:80]})")
    return f"invalid config ({source}):\n  " + "\n  ".join(lines)


def build_config(tree: dict[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, source)) from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: list[str] | None = None,
    config_format: Literal["asyncrl", "guided_grpo"] = "asyncrl",
) -> Config:
    """Defaults < YAML file < dotted overrides. Raises ConfigError with a user-facing message."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        tree = _read_yaml(path)
        source = str(path)
        if config_format == "guided_grpo":
            tree, _ = convert_guided_grpo(tree)
    if overrides:
        tree = _deep_merge(tree, parse_overrides(overrides))
        source += " + overrides"
    return build_config(tree, source)


def check_files(cfg: Config) -> list[str]:
    """Names of files the config points at that do not exist (local-looking paths only: hub ids
    such as `Qwen/Qwen2.5-7B-Instruct` are resolved later by the component that loads them)."""

    def local(p: str) -> bool:
        head = p.split("@", 1)[0]
        return head.startswith((".", "/", "~")) or head.endswith((".json", ".jsonl", ".parquet")) or (
            Path(head.split("/", 1)[0]).exists() and "/" in head
        )

    missing = []
    named = {
        "data.train_files": cfg.data.train_files,
        "data.val_files": cfg.data.val_files,
        "data.test_files": cfg.data.test_files,
        "model.path": cfg.model.path,
        "model.tokenizer_path": cfg.model.tokenizer_path,
        "data.format_prompt": cfg.data.format_prompt if cfg.data.format_prompt and "." in cfg.data.format_prompt else None,
        "verifier.model_path": cfg.verifier.model_path if cfg.verifier.backend == "vllm" else None,
    }
    if ":" in cfg.reward.function or cfg.reward.function.endswith(".py"):
        named["reward.function"] = cfg.reward.function.rsplit(":", 1)[0]
    for key, value in named.items():
        if value and local(value):
            p = Path(os.path.expanduser(value.split("@", 1)[0]))
            if not p.exists():
                missing.append(f"{key}: no such file or directory: {p}")
    return missing


# --------------------------------------------------------------------------- Guided-GRPO compatibility
def convert_guided_grpo(tree: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Map a Guided-GRPO YAML tree onto asyncrl's (see asyncrl/config_guided_grpo.py)."""
    from asyncrl.config_guided_grpo import convert_guided_grpo as convert

    return convert(tree)


def from_guided_grpo(path_or_tree: str | os.PathLike[str] | dict[str, Any], overrides: list[str] | None = None,
                     strict: bool = False) -> Config:
    """Load a YAML written for Guided-GRPO. Keys with no equivalent are reported by name in a warning
    (an error when `strict`), never dropped silently."""
    import warnings

    tree = path_or_tree if isinstance(path_or_tree, dict) else _read_yaml(path_or_tree)
    converted, unmapped = convert_guided_grpo(tree)
    if unmapped:
        msg = "Guided-GRPO keys with no asyncrl equivalent (ignored): " + ", ".join(unmapped)
        if strict:
            raise ConfigError(msg)
        warnings.warn(msg, stacklevel=2)
    if overrides:
        converted = _deep_merge(converted, parse_overrides(overrides))
    cfg = build_config(converted, "guided_grpo")
    cfg._unmapped_keys = unmapped
    return cfg


def __getattr__(name: str) -> Any:  # GUIDED_GRPO_KEY_MAP lives with the converter
    if name == "GUIDED_GRPO_KEY_MAP":
        from asyncrl.config_guided_grpo import GUIDED_GRPO_KEY_MAP

        return GUIDED_GRPO_KEY_MAP
    raise AttributeError(name)
