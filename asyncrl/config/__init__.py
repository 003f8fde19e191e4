"""The one typed configuration tree of asyncrl (pydantic v2), importable without the runtime.

Layout:
- `sections`: the job-wide sections (model, data, algorithm, reward, cluster, trainer), the
  `Section` base class and `ConfigError`;
- `roles`: the per-role sections (rollout with the guided protocol, verifier, buffer, learner);
- `schema`: the root `Config`, its cross-field rules and derived values;
- `tree`: nested-dict helpers (`set_dotted`, `deep_merge`, `read_yaml`);
- `loading`: defaults < YAML file < dotted overrides (`load_config`), and `load_guided_grpo`;
- `guided_grpo`: every Guided-GRPO key's fate and the converter (reached only through `load_guided_grpo`);
- `role_split`: the rule sharing a Guided-GRPO recipe's GPUs among asyncrl's roles.

Importing this package imports no torch, ray or vllm (a unit test checks it), so `--help` and
`--print-config` answer at once. Every name below can be imported from `asyncrl.config`.
"""

from __future__ import annotations

from asyncrl.config.guided_grpo import GUIDED_GRPO_KEY_MAP, KEY_FATES
from asyncrl.config.loading import (
    build_config,
    check_files,
    from_guided_grpo,
    load_config,
    load_guided_grpo,
    parse_overrides,
)
from asyncrl.config.roles import (
    AutoscalingConfig,
    BufferConfig,
    CurveConfig,
    DurableConfig,
    DynamicSamplingConfig,
    GuideConfig,
    GuideSamplingConfig,
    KLConfig,
    LearnerConfig,
    OffPolicyConfig,
    OptimConfig,
    RolloutConfig,
    VerifierClientConfig,
    VerifierConfig,
    VerifierHTTPConfig,
    WeightSyncConfig,
    engine_dtype,
    learner_device_defaults,
    rollout_cpu_nice,
    rollout_device_defaults,
)
from asyncrl.config.schema import Config
from asyncrl.config.sections import (
    CLUSTER_ROLES,
    AlgorithmConfig,
    ClusterConfig,
    ConfigError,
    DataConfig,
    LoRAConfig,
    ModelConfig,
    RewardConfig,
    Section,
    TrainerConfig,
)
from asyncrl.config.tree import deep_merge, read_yaml, set_dotted

__all__ = [
    "CLUSTER_ROLES",
    "GUIDED_GRPO_KEY_MAP",
    "KEY_FATES",
    "AlgorithmConfig",
    "AutoscalingConfig",
    "BufferConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "CurveConfig",
    "DataConfig",
    "LoRAConfig",
    "DurableConfig",
    "DynamicSamplingConfig",
    "GuideConfig",
    "GuideSamplingConfig",
    "KLConfig",
    "LearnerConfig",
    "ModelConfig",
    "OffPolicyConfig",
    "OptimConfig",
    "RewardConfig",
    "RolloutConfig",
    "Section",
    "TrainerConfig",
    "VerifierClientConfig",
    "VerifierConfig",
    "VerifierHTTPConfig",
    "WeightSyncConfig",
    "build_config",
    "check_files",
    "deep_merge",
    "engine_dtype",
    "learner_device_defaults",
    "rollout_cpu_nice",
    "from_guided_grpo",
    "load_guided_grpo",
    "load_config",
    "parse_overrides",
    "read_yaml",
    "rollout_device_defaults",
    "set_dotted",
]
