"""The per-role sections of the config tree: rollout (with the guided protocol), verifier service,
replay buffer, learner (with optimiser, KL, off-policy correction and weight sync).

A docstring under every field is its documentation (docs/config.md is generated from them).
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import Field, field_serializer, field_validator, model_validator

from asyncrl.config.sections import Section

__all__ = ["GuideSamplingConfig", "GuideConfig", "rollout_device_defaults", "learner_device_defaults", "rollout_cpu_nice", "engine_dtype", "RolloutConfig",
           "VerifierHTTPConfig", "VerifierClientConfig", "AutoscalingConfig", "VerifierConfig", "CurveConfig",
           "DynamicSamplingConfig", "DurableConfig", "BufferConfig", "OptimConfig", "OffPolicyConfig", "KLConfig",
           "WeightSyncConfig", "LearnerConfig"]

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


def learner_device_defaults(num_gpus: int) -> int:
    """`learner.micro_batch_tokens` when the config leaves it None."""
    return 8192 if num_gpus > 0 else 2048


def rollout_cpu_nice(gpus_per_actor: int, nice: int | None) -> int | None:
    """The niceness a rollout actor gives itself (its engine processes inherit it); None = leave
    it as Ray started it."""
    if nice is not None:
        return nice
    return None if gpus_per_actor > 0 else 19


def engine_dtype(dtype: str, gpus: float) -> str:
    """The dtype a vLLM engine (policy or verifier) is built with: the configured one, or for
    `auto` float32 on CPU (vLLM's CPU build runs it 3x faster than bf16) and vLLM's own `auto` on
    GPU (the checkpoint's dtype, float32 checkpoints served in half precision)."""
    if dtype != "auto":
        return dtype
    return "auto" if gpus > 0 else "float32"


class RolloutConfig(Section):
    num_actors: int = Field(2, ge=0)
    """Rollout actors (each owns one vLLM engine); scaled live with `asyncrl.ctl scale N`."""
    gpus_per_actor: int = Field(0, ge=0)
    """GPUs per rollout actor (= tensor parallel size on GPU); 0 = vLLM's CPU build."""
    cpus_per_actor: float = Field(1.0, gt=0)
    """Ray CPUs reserved per rollout actor."""
    cpu_nice: int | None = Field(None, ge=0, le=19)
    """Scheduling niceness (absolute) of a rollout actor and its engine processes; None = derived
    (`rollout_cpu_nice`): 19 for a CPU engine, unchanged with GPUs. On a CPU machine the engines
    and the learner share cores while the fleet is paced by the buffer's admission anyway (it idles
    ~55% of the quick start waiting for tickets): the learner, the job's critical path, goes first.
    Applied once the engine is built (the build is what the first step waits for).
    Ray starts its worker processes at niceness 15, so values below that change nothing."""
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
    limit_images: int = Field(0, ge=0)
    """>0: at most this many images per prompt (trimmed identically for rollout and learner)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype; auto = float32 on CPU (3x faster than bf16 there), the checkpoint's dtype on GPU
    (vLLM's `auto`); the engine reads `engine_dtype`."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """vLLM GPU memory fraction; None = derived: 0.9 with gpus_per_actor > 0 (the rollout actor
    owns its GPUs), else 0.6."""
    cpu_kvcache_gb: float = Field(1.0, gt=0)
    """vLLM CPU build: KV cache size in GiB, fractions allowed (vLLM's `kv_cache_memory_bytes`);
    vLLM zero-fills all of it when the engine starts."""
    enforce_eager: bool | None = None
    """Disable CUDA graphs; None = derived: False (CUDA graphs on: 2-3x faster decode; vLLM's
    in-place reload keeps their storage valid) with gpus_per_actor > 0, True on CPU."""
    enable_prefix_caching: bool = True
    """Reuse KV of shared prefixes (multi-turn); reset after every weight update."""
    weight_transfer: Literal["extension", "native"] = "extension"
    """How a weight round enters the engine. `extension`: asyncrl's worker extension runs the whole
    round (the tested default). `native`: vLLM's weight-transfer API (`init_weight_transfer_engine`,
    `start_weight_update` / `update_weights` / `finish_weight_update`) with asyncrl's engine
    registered in vLLM's factory (backend `asyncrl`): the same bounded gloo/NCCL group, checks and
    safe loads. Stays opt-in until it has run on a GPU."""
    engine_in_process: bool | None = None
    """vLLM CPU build: the model worker runs inside the engine-core process (no worker process and
    no busy-polling queue between them); None = True on CPU. Ignored on GPU (`engine_env`)."""
    engine_fork: bool | None = None
    """vLLM CPU build: fork the engine-core process from the rollout actor instead of spawning it (a
    spawned one imports torch and vLLM again, on the first step's critical path); None = True
    on CPU with the model worker in-process. Never on GPU, never for engines built outside a rollout
    actor (`asyncrl.engine_setup.engine_core_forked`)."""
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
    val_override_config: dict[str, Any] = Field(default_factory=lambda: {"temperature": 0.0, "n": 1})
    """Sampling overrides for evaluation (greedy by default)."""
    guide: GuideConfig = Field(default_factory=GuideConfig)
    """Guided multi-turn protocol (Guided-GRPO's `worker.rollout.verifier.*`)."""

    @property
    def engine_dtype(self) -> str:
        """The dtype the policy engine is built with (`engine_dtype(dtype, gpus_per_actor)`)."""
        return engine_dtype(self.dtype, self.gpus_per_actor)


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
    ingress: bool = True
    """Run the HTTP ingress (Serve's proxy) for clients outside the job; false = Serve without
    proxies (`host`/`port` unused): the rollout actors' Serve handles do not need it, and a job
    without outside clients saves the proxy's process and its start-up CPU."""
    api_key: str = ""
    """If set, the ingress requires `Authorization: Bearer <key>`; `env:NAME` reads the environment."""
    http: VerifierHTTPConfig = Field(default_factory=VerifierHTTPConfig)
    """http back-end settings."""
    client: VerifierClientConfig = Field(default_factory=VerifierClientConfig)
    """Client used by rollout actors: deadlines, retries, concurrency."""
    error_reruns: int = Field(2, ge=0)
    """Times the conversations a verifier failure ended are run again (fresh seeds, same group slots)
    before their group is re-issued untrained (`rollout.guide.on_error: stop`); a verifier failure is
    never trained as the policy's failure. 0 = re-issue the group at once. Each re-run costs the
    policy's and the verifier's calls for those conversations again."""
    outage_wait_s: float = Field(300.0, ge=0)
    """How long a verifier outage (every verifier call in a few seconds failed; said on the console)
    may last before the job stops with `VerifierOutage` (exit 3, after a checkpoint; resume once the
    verifier answers). Meanwhile nothing is trained and groups are re-issued, and the learner's batch
    deadline waits for it. 0 = wait as long as it takes."""

    @property
    def engine_dtype(self) -> str:
        """The dtype of the vllm back-end's engine (`engine_dtype(dtype, gpus_per_replica)`)."""
        return engine_dtype(self.dtype, self.gpus_per_replica)


# ------------------------------------------------------------------------------------------- buffer
REDACTED = "<redacted>"


def _job_secret(value: str) -> str:
    """An empty or redacted secret becomes a fresh one (each job draws its own at parse time)."""
    return secrets.token_hex(32) if value in ("", REDACTED) else value


def _redact(value: str, info: Any) -> str:
    """Secrets travel to the job's processes in the config (actor construction) but are never
    written: `Config.to_json` (config.resolved.json, --print-config) dumps with `redact_secrets`."""
    return REDACTED if (info.context or {}).get("redact_secrets") and value else value


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
    sync_thread: bool = False
    """`fsync: always`: fsync on a thread of its own while the socket loop keeps receiving, checking
    and appending pushes; each acknowledgement still leaves only after the fsync that covers its
    record (group commit: the pushes that arrive during one fsync share the next). false: the loop
    fsyncs in line and serves nothing meanwhile. Off by default: on a loaded 2-core machine the
    thread handoffs cost more than the overlap gained; `bench buffer --durable-only` measures both
    (`sync_thread_ratio`) on the buffer host's kind of machine."""
    compact_min_mb: float = Field(64.0, gt=0)
    """The log is rewritten with only the live groups once it exceeds max(this, 2 x buffered MiB)."""
    restored_lease_s: float = Field(300.0, gt=0)
    """After a restart, tickets leased before the death stay leased at most this long."""


class BufferConfig(Section):
    max_staleness: int = Field(1, ge=0)
    """Learner versions a group may lag behind (v - min_version); higher = more throughput, more
    off-policy noise. 0 = synchronous on-policy."""
    staleness: Literal["versions", "drift"] = "versions"
    """Admission pacing: `versions` admits up to `max_staleness` versions ahead; `drift` moves the
    admitted lag within [0, max_staleness] by the learner's measured drift (`train/seq_mismatch_kl`,
    per step): down one while over `drift_budget`, up one while under half of it. `max_staleness` stays
    the hard bound on delivery either way; logged: `buffer/admission_staleness`."""
    drift_budget: float = Field(0.02, gt=0)
    """staleness=drift: the budget of KL(mu || pi_prox) per trained sequence, the mean of
    `train/seq_mismatch_kl` (on the quick start: 0.004-0.012 at lag 1, 0.03-0.09 at lag 4)."""
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
    auth: bool = True
    """Authenticate every request with an HMAC-SHA256 keyed by the job's secret (`secret`), also on
    loopback: a process outside the job is answered `unauthenticated` (docs/security.md)."""
    secret: str = Field("", validate_default=True)
    """The job's buffer secret; empty = a fresh random one per job (the usual case). Handed to the
    buffer and its clients with the config; never written to disk (redacted in config.resolved.json)."""
    max_wait_s: float = Field(3600.0, gt=0)
    """Ceiling of any wait a request may ask for (ticket and batch `timeout_s`); larger, negative or
    non-finite values are refused (`buffer/refused/timeout`). Keep it above learner.batch_timeout_s."""
    max_parked_per_peer: int = Field(16, gt=0)
    """Ticket requests one connection may have waiting in the buffer at once (one per actor id);
    beyond, it is answered `busy`. Each connection also has at most one waiting batch request."""

    _secret = field_validator("secret")(classmethod(lambda cls, v: _job_secret(v)))
    _secret_out = field_serializer("secret", when_used="json")(lambda self, v, info: _redact(v, info))


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
    mode: Literal["none", "bypass", "tis", "mis", "rs", "seq_tis", "seq_mis", "seq_rs", "decoupled", "m2po"] = "tis"
    """Correction between behaviour (engine) and proximal (learner at step start) policies, weight w
    of r = pi_prox/mu: tis min(r, cap); mis (masked IS) r * 1[low <= r <= high]; rs (rejection only)
    1[low <= r <= high]; seq_* the same on the sequence ratio (`seq_ratio`); decoupled r * 1[r <= cap];
    m2po r * M, M masking the largest (log r)^2 until their mean is <= `m2po_tau` (M2PO)."""
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
    m2po_tau: float = Field(0.04, gt=0)
    """m2po: budget of the mean (log pi_prox/mu)^2 over a micro-batch's trained tokens (the M2PO
    paper's default 0.04); logged: `train/m2po_masked_frac`."""
    seq_kl_budget: float | None = Field(None, gt=0)
    """Drift masking (any weighting mode but none/bypass): a sequence whose k3 estimate of
    KL(mu || pi_prox), summed over its trained tokens, exceeds this gets weight 0 on every token
    (null = off); logged: `train/drift_masked_frac`. On the quick start a conversation drifts
    0.004-0.012 at lag 1, 0.03-0.09 at lag 4."""
    lag_decay: float = Field(1.0, gt=0, le=1)
    """Per-group down-weighting by lag: a group's advantages are multiplied by lag_decay^lag, lag =
    versions between the group's oldest token and the trained version (1.0 = off); logged:
    `train/lag_weight_mean`."""
    lr_scale: Literal["none", "ess", "lag"] = "none"
    """Scale each optimizer step's learning rate: `ess` by the normalised effective sample size
    (mean w)^2 / mean(w^2) of the step's sequence importance weights w = prod_t pi_prox/mu (VCPO); `lag` by 1 / (1 + mean lag
    per token) (the step size shrinking like 1/staleness); logged: `train/lr_scale`."""
    lr_scale_min: float = Field(0.1, gt=0, le=1)
    """Floor of the learning-rate scale (one degenerate batch must not stall training)."""

    @property
    def needs_proximal(self) -> bool:
        """Whether the step recomputes pi_prox (the learner's log-probs at the start of the step):
        every mode but `bypass`, which anchors the ratio at the behaviour log-probs instead."""
        return self.mode != "bypass"

    @property
    def weighs(self) -> bool:
        """Whether tokens are weighted by pi_prox/mu (needing both log-probs): not `none`/`bypass`."""
        return self.mode not in ("none", "bypass")

    @model_validator(mode="after")
    def _composable(self) -> OffPolicyConfig:
        """Refuse by name the combinations that would silently do nothing."""
        problems = []
        if self.lr_scale == "ess" and not self.weighs:
            problems.append(f"learner.off_policy.lr_scale=ess needs correction weights, but off_policy.mode={self.mode} "
                            "weights every token by 1 (ESS is always 1): use tis, decoupled, mis, m2po...")
        if self.seq_kl_budget is not None and not self.weighs:
            problems.append(f"learner.off_policy.seq_kl_budget needs pi_prox and the behaviour log-probs, which "
                            f"off_policy.mode={self.mode} does not weigh: use tis, decoupled, mis, m2po...")
        if problems:
            raise ValueError("; ".join(problems))
        return self


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
    """Bucket cap on the gloo (CPU) path, which uses min(bucket_mb, this): on a 2-core CPU machine
    4-16 MB buckets beat one flat gloo broadcast 1.5-2.4x, 32 MB and up lose (copy + gloo large-message cost)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective back-end; auto = nccl on GPU, gloo on CPU."""
    timeout_s: float = Field(60.0, gt=0)
    """Watchdog bound on every weight collective; a member past it is dropped and re-fed from the
    object store."""
    host: str = "auto"
    """Bind (and advertised) address of the weight group's rendezvous TCPStore on learner rank 0:
    `auto` = loopback on an embedded cluster, rank 0's node address on a joined cluster; a wildcard
    binds every interface (asyncrl.addresses)."""
    port: int = Field(0, ge=0, le=65535)
    """Rendezvous port; 0 = a free one (from `cluster.port_range` when set)."""
    secret: str = Field("", validate_default=True)
    """The job's rendezvous secret: a (re)join request must carry its HMAC or it is ignored. Empty =
    a fresh random one per job; handed over with the config, never written to disk."""

    _secret = field_validator("secret")(classmethod(lambda cls, v: _job_secret(v)))
    _secret_out = field_serializer("secret", when_used="json")(lambda self, v, info: _redact(v, info))
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
    micro_batch_tokens: int | None = Field(None, gt=0)
    """Token budget of one micro-batch (padded length x sequences); None = derived
    (`learner_device_defaults`): 8192 on GPU, 2048 on CPU (less padding and activations that stay
    in cache make a CPU step faster; the loss is the same since micro-batches are summed exactly)."""
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
    max_nonfinite_steps: int = Field(3, ge=0)
    """Learner steps in a row with no finite gradient (every optimizer step skipped) or a non-finite
    loss before the job stops as diverged, naming the last good checkpoint; 0 = never stop."""
    prefetch: bool = True
    """Rank 0 asks the buffer for the next step's batch while the current step trains, so the
    learner waits only for what the rollouts have not produced yet (not for a round trip)."""
