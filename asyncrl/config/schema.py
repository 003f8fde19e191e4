"""The root of asyncrl's typed configuration tree (pydantic v2) and its cross-field rules.

`Config` holds one section per concern (`asyncrl.config.sections`: model, data, algorithm, reward,
cluster, trainer; `asyncrl.config.roles`: rollout, verifier, buffer, learner). Every section
forbids unknown keys. The cross-field rules (Guided-GRPO's, docs/guided_grpo.md#config-keys, plus
asyncrl's own) run as one validator on the root after parsing, and the derived values are filled
in there too (`rollout.max_model_len`, `learner.norm_length`, the rollout's device defaults), so
nothing downstream re-derives them. Every field is read by some component: a unit test
(tests/unit/test_config_fields_read.py) fails on a field no code reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, PrivateAttr, model_validator

from asyncrl.config.roles import (
    BufferConfig,
    LearnerConfig,
    RolloutConfig,
    VerifierConfig,
    learner_device_defaults,
    rollout_device_defaults,
)
from asyncrl.config.sections import (
    AlgorithmConfig,
    ClusterConfig,
    DataConfig,
    ModelConfig,
    RewardConfig,
    Section,
    TrainerConfig,
    cluster_problems,
)

__all__ = ["Config"]


class Config(Section):
    """A whole job: defaults < YAML file < dotted overrides (`asyncrl.config.loading`)."""

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
    """Guided-GRPO keys that had no equivalent (set by `asyncrl.config.loading.from_guided_grpo`)."""

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
        if self.learner.micro_batch_tokens is None:
            self.learner.micro_batch_tokens = learner_device_defaults(self.learner.num_gpus)
        if self.cluster.small_machine is None:
            self.cluster.small_machine = not self.on_gpu and self.verifier.gpus_per_replica == 0
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
        if self.learner.batch_timeout_s > self.buffer.max_wait_s:
            problems.append(f"learner.batch_timeout_s={self.learner.batch_timeout_s} must be <= buffer.max_wait_s="
                            f"{self.buffer.max_wait_s} (the buffer refuses longer waits)")
        if self.learner.clip_eps_low >= 1:
            problems.append("learner.clip_eps_low must be < 1")
        if self.learner.off_policy.low >= self.learner.off_policy.high:
            problems.append("learner.off_policy.low must be < learner.off_policy.high")
        if self.trainer.max_steps is None and self.trainer.total_epochs is None:
            problems.append("trainer.max_steps is null: set it, or trainer.total_epochs to derive it from the rows")
        if self.trainer.resume not in ("auto", "never") and not self.trainer.resume:
            problems.append("trainer.resume must be auto, never or a checkpoint path")
        if self.cluster.num_gpus is not None:
            need = self.learner.num_gpus + self.rollout.num_actors * self.rollout.gpus_per_actor
            need += self.verifier.num_replicas * self.verifier.gpus_per_replica
            if need > self.cluster.num_gpus:
                problems.append(f"roles need {need:g} GPUs but cluster.num_gpus is {self.cluster.num_gpus}")
        problems += cluster_problems(self.cluster)
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
    def learner_precision(self) -> str:
        if self.learner.precision != "auto":
            return self.learner.precision
        return "bf16" if self.learner.num_gpus > 0 else "fp32"

    @property
    def run_path(self) -> Path:
        return Path(self.trainer.run_dir) / self.trainer.experiment_name

    def to_json(self) -> str:
        """The config as written to the run directory: the job's secrets are redacted."""
        return json.dumps(self.model_dump(mode="json", context={"redact_secrets": True}), indent=2, sort_keys=False)
