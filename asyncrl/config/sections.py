"""The job-wide sections of the config tree: model, data, algorithm, reward, cluster, trainer; the
shared base class and the error type. Per-role sections live in `asyncrl.config.roles`; the root
`Config` and its cross-field rules in `asyncrl.config.schema`.

A docstring under every field is its documentation (docs/config.md is generated from them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ConfigError", "Section", "DataConfig", "AlgorithmConfig", "ModelConfig", "LoRAConfig", "VLLM_LORA_RANKS",
           "RewardConfig", "ClusterConfig", "CLUSTER_ROLES", "TrainerConfig", "cluster_problems"]


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
    test_files: str = ""
    """Held-out data for the before/after evaluation of a run (summary.json), same syntax. Empty (the
    default) = no before/after evaluation; name a test split, or `data.val_files`'s spec to evaluate
    on the validation rows."""
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
    max_prompt_length: int = Field(512, gt=0)
    """Tokens of the policy prompt at any turn (P): enforced before every policy turn (history is
    dropped or the conversation ends), never by cutting a sampled prompt."""
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
    """Drop training rows whose initial prompt (chat template + generation prompt, media items
    counted as their marker) exceeds `max_prompt_length` tokens, when the job loads its data
    (counted and logged)."""


# ---------------------------------------------------------------------------------------- algorithm
class AlgorithmConfig(Section):
    adv_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                           "grpo_passk", "remax"] = "grpo"
    """Advantage estimator. Group estimators need `rollout.n > 1`."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of REINFORCE++ token returns."""
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


# --------------------------------------------------------------------------------------------- lora
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""LoRA ranks vLLM 0.32 can serve (`vllm.config.lora.MaxLoRARanks`; `max_lora_rank` is set to the rank)."""
LORA_REFUSED_MODULE_WORDS = ("embed", "lm_head", "wte", "wpe", "output_layer")
"""Substrings of target module names that name embeddings or the output head: vLLM 0.32 loads no
LoRA weights for them (its adapter loader accepts only the model's LoRA-capable linear layers)."""


class LoRAConfig(Section):
    enable: bool = False
    """Train a LoRA adapter (PEFT) on the frozen policy: the optimizer holds only the adapter, the
    KL reference is the same model with the adapter disabled (no second replica), and each
    version travels to the engines as the adapter alone (megabytes, not the model)."""
    rank: int = 16
    """LoRA rank r; one of the ranks vLLM serves: 1, 8, 16, 32, 64, 128, 256, 320, 512."""
    alpha: float = Field(32.0, gt=0)
    """LoRA alpha; the update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (the engines never apply it; > 0 also turns
    off the learner's reuse of the training forward as pi_prox)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Linear layers (name suffixes, PEFT's `target_modules`) that get an adapter; never embeddings
    or the output head, which vLLM cannot serve with LoRA."""
    modules_to_save: list[str] = Field(default_factory=list)
    """Must stay empty: fully trained copies of modules are not an adapter vLLM can load per
    request (PEFT's `modules_to_save`); kept as a key only to refuse it by name."""
    use_dora: bool = False
    """Must stay false: vLLM 0.32 has no DoRA kernels (PEFT's `use_dora`)."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Must stay `none`: vLLM 0.32 serves no trained biases in an adapter (PEFT's `bias`)."""
    sync: Literal["auto", "adapter", "merged"] = "auto"
    """How a version reaches the engines: `adapter` (the adapter alone, loaded as a new LoRA per
    version), `merged` (base + adapter merged into full weights, the full-weight sync), or `auto`:
    adapter when vLLM can serve the architecture with LoRA, else merged with one warning."""

    @model_validator(mode="after")
    def _servable(self) -> LoRAConfig:
        """Refuse what vLLM cannot serve as a LoRA adapter, each with its reason and key."""
        problems = []
        if self.rank not in VLLM_LORA_RANKS:
            problems.append(f"model.lora.rank={self.rank} is not a rank vLLM serves (max_lora_rank must be one "
                            f"of {', '.join(map(str, VLLM_LORA_RANKS))})")
        bad = [m for m in self.target_modules if any(w in m.lower() for w in LORA_REFUSED_MODULE_WORDS)]
        if bad:
            problems.append(f"model.lora.target_modules: {', '.join(bad)} are embeddings or the output head; vLLM "
                            "0.32 loads LoRA weights only for the model's linear layers (attention/MLP projections)")
        if not self.target_modules:
            problems.append("model.lora.target_modules is empty: name the linear layers that get an adapter")
        if self.modules_to_save:
            problems.append("model.lora.modules_to_save must be empty: fully trained module copies are not a LoRA "
                            "adapter vLLM can apply per request (train them with model.lora.enable=false)")
        if self.use_dora:
            problems.append("model.lora.use_dora=true: vLLM 0.32 cannot serve DoRA adapters (no DoRA kernels)")
        if self.bias != "none":
            problems.append(f"model.lora.bias={self.bias}: vLLM 0.32 serves no trained biases in a LoRA adapter; "
                            "use bias=none")
        if problems:
            raise ValueError("; ".join(problems))
        return self


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
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    """Train a LoRA adapter instead of the full model, and sync only the adapter."""


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
    call_timeout_s: float = Field(120.0, gt=0)
    """Deadline of one reward call (a group's batch, plug-ins included); a call past it fails the
    group, is named as hung, and its thread is left behind (asyncrl.rewards.guard)."""
    max_consecutive_failures: int = Field(8, ge=0)
    """Reward calls of one rollout actor that may fail in a row (raised or hung) before the job stops
    with the reward function's own error; 0 = never stop (each failed group is re-issued)."""


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
    small_machine: bool | None = None
    """Tuning for a machine whose few cores every process of the job shares (the CPU quick starts):
    the embedded Ray head without its idle daemons, vLLM's engine core forked instead of spawned,
    heavy imports without the cyclic GC, the rollout engines niced below the learner
    (`asyncrl.small_machine`). None = derived: on when no role uses a GPU."""
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
    max_steps: int | None = Field(20, gt=0)
    """Learner steps (policy versions) to train. null = derived at launch from `total_epochs` once
    the training rows are loaded (epochs x rows // data.rollout_batch_size, printed)."""
    total_epochs: int | None = Field(None, gt=0)
    """Epochs over the training rows (Guided-GRPO's `trainer.total_epochs`); read only when
    `max_steps` is null (the original's rule: max_steps wins when both are set)."""
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
    min_free_disk_mb: float = Field(64.0, ge=0)
    """Free space the run directory's disk must keep: below it admission pauses (a console line)
    until twice as much is free again; 0 = not watched."""
    disk_full_wait_s: float = Field(300.0, gt=0)
    """How long admission may stay paused for a full disk before the job ends (DiskFull, exit 3)."""
    emergency_dir: str | None = None
    """Where the emergency checkpoint goes when the run's disk is full (`<dir>/asyncrl-emergency/<run>`);
    None = $TMPDIR."""
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


def cluster_problems(c: ClusterConfig) -> list[str]:
    """What is wrong with the cluster section (unknown roles, a malformed port range), one line each."""
    from asyncrl.addresses import parse_port_range

    problems = [f"cluster.resources.{role}: unknown role (one of {', '.join(CLUSTER_ROLES)})"
                for role in c.resources if role not in CLUSTER_ROLES]
    try:
        parse_port_range(c.port_range)
    except ValueError as exc:
        problems.append(str(exc))
    return problems
