"""Guided-GRPO compatibility: every key of the original's config (an EasyR1/verl fork) with its fate
in asyncrl, and the one converter that turns an original recipe (its YAML, plus command-line
overrides in its own namespace) into an asyncrl config tree of the same experiment.

Fates (`KEY_FATES`, documented per key in docs/config.md):
- `maps`: the value carries over to one asyncrl key, converted where the spelling differs;
- `derived`: asyncrl computes its own keys from this one and others (PPO mini-batches from the batch
  sizes, the role split from the GPU count, steps from epochs, the before/after evaluation data,
  the resume policy) and the converter records how, for the launch summary and `asyncrl.migrate`;
- `ignored`: no effect in an asynchronous system (FSDP, offload, colocation, log-prob micro-batches);
- `changed`: kept, but means something slightly different here; the message says how;
- `unsupported`: asyncrl lacks it; a warning says what to do;
- `error`: a value asyncrl cannot honour (e.g. `adv_estimator: gae`) stops with exit status 2.
Keys the original does not have are errors that suggest the closest original key, as the
original's own (OmegaConf structured) loader rejects them. The warned keys are reported once, in
one grouped message (`Conversion.message`). Absent keys take the ORIGINAL's defaults
(`ORIGINAL_DEFAULTS`), not asyncrl's: a recipe means what it meant there.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncrl.config.role_split import split_for_model
from asyncrl.config.sections import ConfigError
from asyncrl.config.tree import set_dotted

__all__ = ["GUIDED_GRPO_KEY_MAP", "KEY_FATES", "ORIGINAL_DEFAULTS", "Conversion", "Fate", "convert_guided_grpo",
           "flatten", "is_guided_grpo_tree", "is_original_key", "suggest_original_key"]

Kind = Literal["maps", "derived", "ignored", "changed", "unsupported", "error"]


@dataclass(frozen=True)
class Fate:
    kind: Kind
    target: str = ""
    """maps: the asyncrl key; otherwise the asyncrl keys involved or what to do, for the message."""


def _m(target: str) -> Fate:
    return Fate("maps", target)


# Simple renames (value conversions in `_convert_value`).
GUIDED_GRPO_KEY_MAP: dict[str, str] = {
    "data.train_files": "data.train_files", "data.val_files": "data.val_files",
    "data.prompt_key": "data.prompt_key", "data.answer_key": "data.answer_key", "data.image_key": "data.image_key",
    "data.video_key": "data.video_key", "data.image_dir": "data.image_dir",
    "data.max_prompt_length": "data.max_prompt_length", "data.max_response_length": "data.max_response_length",
    "data.rollout_batch_size": "data.rollout_batch_size", "data.format_prompt": "data.format_prompt",
    "data.system_prompt": "data.system_prompt", "data.override_chat_template": "data.override_chat_template",
    "data.shuffle": "data.shuffle", "data.seed": "data.seed", "data.min_pixels": "data.min_pixels",
    "data.max_pixels": "data.max_pixels", "data.filter_overlong_prompts": "data.filter_overlong_prompts",
    "algorithm.gamma": "algorithm.gamma", "algorithm.adv_estimator": "algorithm.adv_estimator",
    "algorithm.kl_coef": "learner.kl.coef", "algorithm.kl_type": "learner.kl.type",
    "algorithm.kl_horizon": "learner.kl.horizon", "algorithm.kl_target": "learner.kl.target",
    "algorithm.online_filtering": "buffer.dynamic_sampling.enable", "algorithm.filter_key": "buffer.dynamic_sampling.key",
    "algorithm.filter_low": "buffer.dynamic_sampling.low", "algorithm.filter_high": "buffer.dynamic_sampling.high",
    "worker.actor.micro_batch_size_per_device_for_update": "learner.max_micro_batch_size",
    "worker.actor.max_grad_norm": "learner.max_grad_norm", "worker.actor.clip_ratio_dual": "learner.clip_ratio_dual",
    "worker.actor.loss_avg_mode": "learner.loss_avg_mode", "worker.actor.loss_type": "learner.loss_type",
    "worker.actor.ppo_epochs": "learner.ppo_epochs",
    "worker.actor.model.model_path": "model.path", "worker.actor.model.tokenizer_path": "model.tokenizer_path",
    "worker.actor.model.override_config": "model.override_config",
    "worker.actor.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "worker.actor.model.trust_remote_code": "model.trust_remote_code",
    "worker.actor.model.freeze_vision_tower": "model.freeze_vision_tower",
    "worker.actor.optim.lr": "learner.optim.lr", "worker.actor.optim.betas": "learner.optim.betas",
    "worker.actor.optim.weight_decay": "learner.optim.weight_decay",
    "worker.actor.optim.lr_warmup_ratio": "learner.optim.warmup_ratio",
    "worker.actor.optim.min_lr_ratio": "learner.optim.min_lr_ratio",
    "worker.actor.optim.lr_scheduler_type": "learner.optim.lr_scheduler",
    "worker.reward.reward_type": "reward.type", "worker.reward.reward_function": "reward.function",
    "worker.reward.reward_function_kwargs": "reward.kwargs",
    "worker.rollout.n": "rollout.n", "worker.rollout.temperature": "rollout.temperature",
    "worker.rollout.top_p": "rollout.top_p", "worker.rollout.top_k": "rollout.top_k", "worker.rollout.seed": "rollout.seed",
    "worker.rollout.limit_images": "rollout.limit_images", "worker.rollout.dtype": "rollout.dtype",
    "worker.rollout.enforce_eager": "rollout.enforce_eager", "worker.rollout.max_model_len": "rollout.max_model_len",
    "worker.rollout.max_num_batched_tokens": "rollout.max_num_batched_tokens",
    "worker.rollout.verifier.model_path": "verifier.model_path",
    "worker.rollout.verifier.tokenizer_path": "verifier.tokenizer_path",
    "worker.rollout.verifier.base_url": "verifier.http.base_url", "worker.rollout.verifier.model": "verifier.http.model",
    "worker.rollout.verifier.api_key": "verifier.http.api_key",
    "worker.rollout.verifier.http_timeout": "verifier.http.timeout_s",
    "worker.rollout.verifier.http_concurrency": "verifier.http.concurrency",
    "worker.rollout.verifier.enable_hallucination_score": "rollout.guide.enable_hallucination_score",
    "worker.rollout.verifier.temperature": "rollout.guide.sampling.temperature",
    "worker.rollout.verifier.top_p": "rollout.guide.sampling.top_p",
    "worker.rollout.verifier.top_k": "rollout.guide.sampling.top_k",
    "worker.rollout.verifier.max_tokens": "rollout.guide.sampling.max_tokens",
    "worker.rollout.verifier.max_turns": "rollout.guide.max_turns",
    "worker.rollout.verifier.stop_token": "rollout.guide.stop_token",
    "worker.rollout.verifier.prompt_template": "rollout.guide.prompt_template",
    "worker.rollout.verifier.train_scope": "rollout.guide.train_scope",
    "trainer.project_name": "trainer.project_name", "trainer.experiment_name": "trainer.experiment_name",
    "trainer.val_freq": "trainer.eval_every", "trainer.save_freq": "trainer.save_every",
    "trainer.save_limit": "trainer.save_limit", "trainer.val_generations_to_log": "trainer.samples_per_eval",
}

_NO_EFFECT = "no effect in an asynchronous system"
KEY_FATES: dict[str, Fate] = {key: _m(target) for key, target in GUIDED_GRPO_KEY_MAP.items()} | {
    # derived: asyncrl computes its keys from these (the converter's `_derive_*` functions)
    "trainer.total_epochs": Fate("derived", "trainer.total_epochs -> trainer.max_steps at launch, once the rows are loaded"),
    "trainer.max_steps": Fate("derived", "trainer.max_steps (wins over total_epochs, as in the original)"),
    "trainer.nnodes": Fate("derived", "role split: learner.num_gpus, rollout.num_actors, verifier.num_replicas"),
    "trainer.n_gpus_per_node": Fate("derived", "role split: learner.num_gpus, rollout.num_actors, verifier.num_replicas"),
    "worker.rollout.tensor_parallel_size": Fate("derived", "rollout.gpus_per_actor (role split)"),
    "worker.actor.fsdp.enable_full_shard": Fate("derived", "learner.zero_stage: FULL_SHARD -> 3, SHARD_GRAD_OP -> 2"),
    "worker.actor.global_batch_size": Fate("derived", "learner.mini_batches = rollout_batch_size / global_batch_size"),
    "worker.actor.optim.lr_warmup_steps": Fate("derived", "learner.optim.warmup_steps = steps x mini_batches x ppo_epochs"),
    "worker.actor.clip_ratio_low": Fate("derived", "learner.clip_eps_low (learner.cispo_eps_low with loss_type cispo)"),
    "worker.actor.clip_ratio_high": Fate("derived", "learner.clip_eps_high (learner.cispo_eps_high with loss_type cispo)"),
    "algorithm.disable_kl": Fate("derived", "learner.kl.enable (negated)"),
    "algorithm.use_kl_loss": Fate("derived", "learner.kl.mode: true -> loss, false -> reward"),
    "algorithm.kl_penalty": Fate("derived", "learner.kl.estimator: kl -> k1, abs, mse -> k2, low_var_kl -> k3"),
    "worker.rollout.verifier.enable": Fate("derived", "rollout.guide.enable"),
    "worker.rollout.verifier.use_http": Fate("derived", "verifier.backend: true -> http, false -> vllm"),
    "worker.rollout.verifier.http_max_retries": Fate("derived", "verifier.http.max_retries = attempts - 1 (the "
                                                     "original counts the first attempt)"),
    "worker.rollout.verifier.http_retry_interval": Fate("derived", "verifier.client.backoff_s (first backoff; "
                                                        "asyncrl doubles it per retry, with jitter)"),
    "worker.rollout.val_override_config": Fate("derived", "rollout.val_override_config (temperature, top_p, top_k; "
                                               "n > 1 warned: one sample per evaluation row here)"),
    "trainer.val_before_train": Fate("derived", "trainer.eval_before_after, data.test_files = data.val_files"),
    "trainer.find_last_checkpoint": Fate("derived", "trainer.resume: true -> auto, false -> never"),
    "trainer.save_checkpoint_path": Fate("derived", "trainer.run_dir (the run lands in <path>/<experiment_name>; "
                                         "null -> checkpoints/<project_name>, the original's default place)"),
    "trainer.logger": Fate("derived", "trainer.logger: file -> jsonl; console, tensorboard, wandb kept; "
                           "mlflow, swanlab warned"),
    # ignored: meaningful only in the original's colocated, synchronous FSDP design
    "worker.hybrid_engine": Fate("ignored", "asyncrl never colocates; false is an error in the original too"),
    "worker.actor.strategy": Fate("ignored", "the learner is DeepSpeed (learner.zero_stage)"),
    "worker.actor.micro_batch_size_per_device_for_experience": Fate(
        "ignored", "log-prob passes are micro-batched by tokens (learner.micro_batch_tokens)"),
    "worker.actor.padding_free": Fate("ignored", "the learner packs by tokens (learner.micro_batch_tokens)"),
    "worker.actor.dynamic_batching": Fate("ignored", "the learner packs by tokens (learner.micro_batch_tokens)"),
    "worker.actor.ulysses_size": Fate("ignored", "no sequence parallelism; long sequences use ZeRO-3"),
    "worker.actor.use_torch_compile": Fate("ignored", "not used by the DeepSpeed learner"),
    "worker.actor.optim.strategy": Fate("ignored", "DeepSpeed AdamW keeps fp32 moments (adamw_bf16's bf16 moments "
                                        "are not reproduced)"),
    "worker.actor.fsdp.*": Fate("ignored", "FSDP settings: the learner is DeepSpeed ZeRO"),
    "worker.actor.offload.*": Fate("ignored", "offloading between colocated phases: each role owns its GPUs"),
    "worker.ref.*": Fate("ignored", "the reference model lives in the learner (learner.kl)"),
    "worker.critic.*": Fate("ignored", "no critic (adv_estimator gae is an error)"),
    "worker.rollout.name": Fate("ignored", "the engine is always vLLM"),
    "worker.rollout.gpu_memory_utilization": Fate(
        "ignored", "the original shares each GPU with FSDP; a rollout actor owns its GPUs here (derived 0.9; "
        "rollout.gpu_memory_utilization sets it)"),
    "worker.rollout.enable_chunked_prefill": Fate("ignored", "vLLM's own default"),
    "worker.rollout.enable_sleep_mode": Fate("ignored", "engines never sleep: they do not share GPUs with the learner"),
    "worker.rollout.disable_log_stats": Fate("ignored", "engine statistics go to the rollout logs"),
    "worker.rollout.disable_tqdm": Fate("ignored", "no engine progress bars"),
    "worker.rollout.verifier.trust_remote_code": Fate("ignored", "the verifier engine loads standard checkpoints"),
    "worker.reward.num_cpus": Fate("ignored", "rewards are computed in the rollout actors"),
    "worker.reward.skip_special_tokens": Fate("ignored", "responses are always decoded without special tokens"),
    "data.val_batch_size": Fate("ignored", "evaluation rows stream through the rollout engines, no eval batch"),
    "data.filter_overlong_prompts_workers": Fate("ignored", "the filter runs once in the driver"),
    "algorithm.lam": Fate("ignored", "GAE's lambda; no critic here"),
    "trainer.critic_warmup": Fate("ignored", "no critic here"),
    "trainer.ray_timeline": Fate("ignored", "use Ray's dashboard"),
    "trainer.val_generations_save_freq": Fate("ignored", "samples are written at every evaluation (samples/)"),
    "trainer.val_generations_print_num": Fate("ignored", "samples are written at every evaluation (samples/)"),
    "trainer.val_generations_print_max_chars": Fate("ignored", "samples are written at every evaluation (samples/)"),
    "trainer.save_model_only": Fate("ignored", "asyncrl checkpoints always hold the optimizer (resumable)"),
    # changed meaning
    "data.mini_rollout_batch_size": Fate(
        "changed", "the original's generation chunk: asyncrl generates group by group and, with online filtering, "
        "keeps issuing prompts until data.rollout_batch_size groups pass; steps from epochs count whole rollout "
        "batches (rows // rollout_batch_size per epoch)"),
    "trainer.max_try_make_batch": Fate(
        "changed", "filling a batch is bounded by time here: learner.batch_timeout_s (the run stops with a message)"),
    # unsupported
    "worker.rollout.ignore_eos": Fate("unsupported", "every policy turn ends at its end-of-turn token; remove the key"),
    "data.video_fps": Fate("unsupported", "videos are carried along, never decoded into frames; remove the key"),
    "worker.rollout.prompt_truncation": Fate(
        "unsupported", "a sampled prompt is never cut: data.max_prompt_length is enforced before each policy turn "
        "by dropping history (rollout.guide.history); remove the key"),
    "trainer.save_keep_steps": Fate("unsupported", "checkpoints are pruned by trainer.save_limit only; copy the ones "
                                    "to keep out of the run directory"),
    # errors (by value)
    "trainer.val_only": Fate("error", "true: asyncrl.launch always trains; evaluate a checkpoint with "
                             "`python -m asyncrl.eval --model PATH` instead"),
    "trainer.load_checkpoint_path": Fate("error", "an original (FSDP) checkpoint cannot be resumed here; point "
                                         "worker.actor.model.model_path at its exported HF weights, or resume an "
                                         "asyncrl run with trainer.resume=PATH"),
}
"""Every key of the original's config (docs: GUIDED_GRPO section of docs/config.md), `*` = a subtree."""

_DICT_VALUED = ("worker.actor.model.override_config", "worker.reward.reward_function_kwargs",
                "worker.rollout.val_override_config")

ORIGINAL_DEFAULTS: dict[str, Any] = {
    "data.train_files": "", "data.prompt_key": "prompt", "data.max_prompt_length": 512, "data.max_response_length": 512,
    "data.rollout_batch_size": 512, "data.val_files": "", "data.shuffle": True, "data.seed": 1,
    "data.filter_overlong_prompts": True,
    "algorithm.adv_estimator": "grpo", "algorithm.disable_kl": False, "algorithm.use_kl_loss": False,
    "algorithm.kl_penalty": "kl", "algorithm.kl_coef": 1e-3,
    "worker.actor.global_batch_size": 256, "worker.actor.micro_batch_size_per_device_for_update": 4,
    "worker.actor.clip_ratio_low": 0.2, "worker.actor.clip_ratio_high": 0.3, "worker.actor.clip_ratio_dual": 3.0,
    "worker.actor.loss_type": "default", "worker.actor.ppo_epochs": 1,
    "worker.actor.model.enable_gradient_checkpointing": True, "worker.actor.model.trust_remote_code": True,
    "worker.actor.optim.lr": 1e-6, "worker.actor.optim.weight_decay": 1e-2,
    "worker.actor.fsdp.enable_full_shard": True,
    "worker.reward.reward_type": "batch",
    "worker.rollout.n": 1, "worker.rollout.temperature": 1.0, "worker.rollout.top_p": 1.0,
    "worker.rollout.tensor_parallel_size": 2, "worker.rollout.val_override_config": {},
    "worker.rollout.verifier.enable": False, "worker.rollout.verifier.use_http": False,
    "worker.rollout.verifier.max_turns": 20, "worker.rollout.verifier.http_timeout": 300.0,
    "worker.rollout.verifier.http_max_retries": 3, "worker.rollout.verifier.http_retry_interval": 30.0,
    "worker.rollout.verifier.http_concurrency": 4,
    "trainer.total_epochs": 15, "trainer.max_steps": None, "trainer.project_name": "easy_r1",
    "trainer.experiment_name": "demo", "trainer.logger": ["console", "wandb"], "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8, "trainer.val_freq": -1, "trainer.val_before_train": True,
    "trainer.val_generations_to_log": 0, "trainer.save_freq": -1, "trainer.save_limit": -1,
    "trainer.save_checkpoint_path": None, "trainer.find_last_checkpoint": True,
}
"""The original's dataclass defaults where they differ from asyncrl's or feed a derivation."""

_VISION_DEFAULTS = {"data.min_pixels": 262144, "data.max_pixels": 4194304}
"""Image-size bounds every shipped recipe carries, text ones included, at the values both systems
default to: left unset, so a text recipe does not count as one that sets vision keys."""
_KL_PENALTY = {"kl": "k1", "abs": "abs", "mse": "k2", "low_var_kl": "k3"}
_LOGGERS = {"console": "console", "file": "jsonl", "tensorboard": "tensorboard", "wandb": "wandb", "jsonl": "jsonl"}
"""The original's sink names (and asyncrl's `jsonl`, so `trainer.logger=[jsonl]` after a recipe works)."""
_ESTIMATORS = ("grpo", "grpo_passk", "reinforce_plus_plus", "remax", "rloo")


def _entry(key: str) -> str | None:
    """The KEY_FATES entry that covers dotted `key`: itself, its dict-valued parent, or a `prefix.*`."""
    if key in KEY_FATES:
        return key
    for dict_key in _DICT_VALUED:
        if key.startswith(dict_key + "."):
            return dict_key
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) + ".*" in KEY_FATES:
            return ".".join(parts[:i]) + ".*"
    return None


def _fate(key: str) -> Fate | None:
    entry = _entry(key)
    return KEY_FATES[entry] if entry else None


def is_original_key(key: str) -> bool:
    """Whether `key` (dotted) is in the original's namespace (`worker.ref.fsdp.x` included)."""
    return _fate(key) is not None


def suggest_original_key(key: str) -> str | None:
    names = [k.replace(".*", "") for k in KEY_FATES]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    return close[0] if close else None


def is_guided_grpo_tree(tree: dict[str, Any]) -> bool:
    """A YAML in the original's shape: a `worker:` section, and only its four top-level sections."""
    return "worker" in tree and set(tree) <= {"data", "algorithm", "worker", "trainer"}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> dotted keys; the original's dict-valued keys stay whole."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and value and full not in _DICT_VALUED:
            flat.update(flatten(value, full + "."))
        else:
            flat[full] = value
    return flat


@dataclass
class Conversion:
    """An original recipe converted: the asyncrl tree, and what the user must be told."""

    tree: dict[str, Any] = field(default_factory=dict)
    derived: dict[str, str] = field(default_factory=dict)
    """asyncrl key -> how its value was derived (printed at launch, a comment in `asyncrl.migrate`)."""
    notes: dict[str, dict[str, str]] = field(default_factory=lambda: {"ignored": {}, "changed": {}, "unsupported": {}})
    """Warned keys of the user's recipe, by group -> {key: why / what to do}."""
    recipe_gpus: int = 0
    tp_rule: list[str] = field(default_factory=list)
    """The rollout TP rule's arithmetic, printed under the role split table."""

    def set(self, key: str, value: Any, why: str | None = None) -> None:
        set_dotted(self.tree, key, value)
        if why:
            self.derived[key] = why

    def warn(self, group: str, key: str, text: str) -> None:
        self.notes[group][key] = text

    @property
    def warned_keys(self) -> list[str]:
        return [k for group in self.notes.values() for k in group]

    def message(self) -> str:
        """One grouped message for every warned key, or "" when there is none."""
        titles = {"ignored": f"ignored ({_NO_EFFECT})", "changed": "changed meaning (here is how)",
                  "unsupported": "not supported (what to do)"}
        parts = []
        for group, keys in self.notes.items():
            if keys:
                parts.append(f"{titles[group]}:\n" + "\n".join(f"    {k}: {why}" for k, why in keys.items()))
        return "Guided-GRPO keys that asyncrl does not take as they are:\n  " + "\n  ".join(parts) if parts else ""


def convert_guided_grpo(tree: dict[str, Any], fixed: frozenset[str] = frozenset()) -> Conversion:
    """Map an original recipe tree (YAML merged with its overrides) onto asyncrl's. `fixed` holds the
    asyncrl keys the user sets explicitly (they win; the role split is not required for them).
    Raises ConfigError (one line per problem) for unknown keys and values asyncrl cannot honour."""
    user = flatten(tree)
    problems = [_unknown(key) for key in user if _fate(key) is None]
    if problems:
        raise ConfigError("invalid Guided-GRPO recipe:\n  " + "\n  ".join(problems))
    o = ORIGINAL_DEFAULTS | user
    conv = Conversion()
    for key, value in user.items():
        entry = _entry(key)
        assert entry is not None
        fate = KEY_FATES[entry]
        if fate.kind in ("ignored", "changed", "unsupported") and value is not None and _matters(entry, o):
            conv.warn(fate.kind, entry, fate.target)
    for key, target in GUIDED_GRPO_KEY_MAP.items():
        if o.get(key) is not None and _VISION_DEFAULTS.get(key, object()) != o[key]:
            conv.set(target, _convert_value(key, o[key]))
        elif key in ("data.train_files", "data.val_files"):
            conv.set(target, "")  # the original's TODO placeholders: no data, never asyncrl's quick start
    for derive in (_derive_errors, _derive_kl, _derive_clip, _derive_batches, _derive_steps, _derive_eval,
                   _derive_checkpoints, _derive_logger, _derive_verifier, _derive_val_sampling):
        derive(o, user, conv)
    _derive_roles(o, conv, fixed)
    return conv


def _matters(entry: str, o: dict[str, Any]) -> bool:
    """Whether a warned key changes anything in this recipe (a bound on filling batches only does
    with online filtering)."""
    if entry == "trainer.max_try_make_batch":
        return bool(o.get("algorithm.online_filtering"))
    return True


def _unknown(key: str) -> str:
    close = suggest_original_key(key)
    return f"unknown Guided-GRPO key '{key}'" + (f"; did you mean '{close}'?" if close else "")


def _convert_value(key: str, value: Any) -> Any:
    if key == "worker.actor.loss_type" and value == "default":
        return "ppo"
    if key == "worker.rollout.dtype":
        return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(value, value)
    if key == "worker.reward.reward_function" and ":" not in str(value):
        return f"{value}:main"  # the original's default function name
    if key == "worker.actor.optim.betas":
        return list(value)
    return value


def _derive_errors(o: dict[str, Any], user: dict[str, Any], conv: Conversion) -> None:
    problems = []
    if o["algorithm.adv_estimator"] not in _ESTIMATORS:
        problems.append(f"algorithm.adv_estimator={o['algorithm.adv_estimator']!r}: asyncrl has no critic; use one "
                        f"of {', '.join(_ESTIMATORS)}")
    for key, allowed in (("worker.actor.loss_type", ("default", "gspo", "gspo_token", "cispo")),
                         ("worker.actor.loss_avg_mode", ("token", "seq"))):
        if key in o and o[key] not in allowed:
            problems.append(f"{key}={o[key]!r}: the original has {', '.join(allowed)}")
    if o.get("trainer.val_only"):
        problems.append(f"trainer.val_only={o['trainer.val_only']}: {KEY_FATES['trainer.val_only'].target.split(': ', 1)[1]}")
    if o.get("trainer.load_checkpoint_path"):
        problems.append(f"trainer.load_checkpoint_path={o['trainer.load_checkpoint_path']}: "
                        + KEY_FATES["trainer.load_checkpoint_path"].target)
    if o.get("worker.hybrid_engine") is False:
        problems.append("worker.hybrid_engine=false: the original does not implement it either; remove the key")
    if problems:
        raise ConfigError("invalid Guided-GRPO recipe:\n  " + "\n  ".join(problems))


def _derive_kl(o: dict[str, Any], user: dict[str, Any], conv: Conversion) -> None:
    penalty = o["algorithm.kl_penalty"]
    if penalty not in _KL_PENALTY:
        raise ConfigError(f"algorithm.kl_penalty={penalty!r} has no asyncrl estimator (one of {', '.join(_KL_PENALTY)}; "
                          "`full` is mis-specified in the original)")
    on = not o["algorithm.disable_kl"]
    conv.set("learner.kl.enable", on, None if "algorithm.disable_kl" in user else
             "the original's default algorithm.disable_kl=false: a reference-model KL")
    conv.set("learner.kl.mode", "loss" if o["algorithm.use_kl_loss"] else "reward")
    conv.set("learner.kl.estimator", _KL_PENALTY[penalty])


def _derive_clip(o: dict[str, Any], user: dict[str, Any], conv: Conversion) -> None:
    low, high = o["worker.actor.clip_ratio_low"], o["worker.actor.clip_ratio_high"]
    if o["worker.actor.loss_type"] != "cispo":
        conv.set("learner.clip_eps_low", low)
        conv.set("learner.clip_eps_high", high)
        return
    conv.set("learner.cispo_eps_high", high, f"worker.actor.clip_ratio_high={high} under loss_type=cispo")
    if low == 0:
        conv.set("learner.cispo_eps_low", None, "clip_ratio_low=0 under cispo: the original then raises every IS "
                 "weight below 1 to 1; unbounded below here, as the CISPO paper")
    else:
        conv.set("learner.cispo_eps_low", low, f"worker.actor.clip_ratio_low={low} under loss_type=cispo")


def _derive_batches(o: dict[str, Any], user: dict[str, Any], conv: Conversion) -> None:
    rollout, global_ = o["data.rollout_batch_size"], o["worker.actor.global_batch_size"]
    if not isinstance(global_, int) or global_ <= 0 or rollout % global_:
        raise ConfigError(f"data.rollout_batch_size={rollout} is not a multiple of worker.actor.global_batch_size="
                          f"{global_} (prompts per PPO mini-batch; the original requires it too): make "
                          "global_batch_size a divisor of rollout_batch_size")
    minis = rollout // global_
    conv.set("learner.mini_batches", minis, f"data.rollout_batch_size {rollout} / worker.actor.global_batch_size "
             f"{global_}: {minis} PPO update(s) per step")
    warmup = o.get("worker.actor.optim.lr_warmup_steps")
    if warmup is not None:
        per_step = minis * o["worker.actor.ppo_epochs"]
        conv.set("learner.optim.warmup_steps", warmup * per_step,
                 f"worker.actor.optim.lr_warmup_steps {warmup} training steps x {per_step} optimizer steps each "
                 "(the schedule steps per optimizer step here)")


def _derive_steps(o: dict[str, Any], user: dict[str, Any], conv: Conversion) -> None:
    steps, epochs = o["trainer.max_steps"], o["trainer.total_epochs"]
    if steps is not None:
        conv.set("trainer.max_steps", steps, f"trainer.max_steps={steps}" + (
            f"; trainer.total_epochs={epochs} ignored: max_steps wins, as in the original"
            if "trainer.total_epochs" in user else ""))
        return
    conv.set("trainer.max_steps", None, "null: derived at launch from trainer.total_epochs once the rows are loaded")
    conv.set("trainer.total_epochs", epochs, f"{epochs} epochs x (training rows // data.rollout_batch_size) steps"
             + ("" if "trainer.total_epochs" in user else " (the original's default)"))


def _derive_eval(o: dict[str, Any], user: dict[str, Any], conv: Conversion) -> None:
    before, val = bool(o["trainer.val_before_train"]), o.get("data.val_files") or ""
    conv.set("trainer.eval_before_after", before and bool(val))
    if before and val:
        conv.set("data.test_files", val, "= data.val_files: the original validates before training (and at the "
                 "end) on its val files; it has no test files")
    else:
        conv.set("data.test_files", "", "no before/after evaluation (trainer.val_before_train is off or "
                 "data.val_files empty)")


def _derive_checkpoints(o: dict[str, Any], user: dict[str, Any], conv: Conversion) -> None:
    conv.set("trainer.resume", "auto" if o["trainer.find_last_checkpoint"] else "never",
             "trainer.find_last_checkpoint: resume from this run's newest checkpoint" if o["trainer.find_last_checkpoint"]
             else None)
    path = o["trainer.save_checkpoint_path"]
    if path is None:
        conv.set("trainer.run_dir", f"checkpoints/{o['trainer.project_name']}",
                 "the original's default checkpoint place, checkpoints/<project_name>/<experiment_name>")
    else:
        conv.set("trainer.run_dir", str(path), "trainer.save_checkpoint_path: the run lands in "
                 "<save_checkpoint_path>/<experiment_name>")
        conv.warn("changed", "trainer.save_checkpoint_path", "the run directory is <path>/<experiment_name> "
                  "(the original writes into <path> itself)")


def _derive_logger(o: dict[str, Any], user: dict[str, Any], conv: Conversion) -> None:
    names = o["trainer.logger"]
    names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in _LOGGERS]
    if unknown:
        conv.warn("unsupported", "trainer.logger", f"{', '.join(unknown)} not available (dropped); the sinks are "
                  "console, file (jsonl), tensorboard, wandb")
    conv.set("trainer.logger", list(dict.fromkeys(_LOGGERS[n] for n in names if n in _LOGGERS)))


def _derive_verifier(o: dict[str, Any], user: dict[str, Any], conv: Conversion) -> None:
    enable = bool(o["worker.rollout.verifier.enable"])
    conv.set("rollout.guide.enable", enable)
    if not enable:
        return
    conv.set("verifier.backend", "http" if o["worker.rollout.verifier.use_http"] else "vllm")
    if not o["worker.rollout.verifier.use_http"]:
        # The original builds its local verifier engine with the policy engine's context length.
        context = o.get("worker.rollout.max_model_len") or o["data.max_prompt_length"] + o["data.max_response_length"]
        conv.set("verifier.max_model_len", int(context), "the original's local verifier engine has the policy "
                 "engine's context (worker.rollout.max_model_len, else prompt + response length)")
        conv.warn("changed", "worker.rollout.verifier.model_path", "the original's local verifier engine is built "
                  "with load_format=dummy and never loads these weights (a random verifier); asyncrl serves the "
                  "checkpoint's real weights")
    attempts = o["worker.rollout.verifier.http_max_retries"]
    conv.set("verifier.http.max_retries", max(0, int(attempts) - 1),
             f"worker.rollout.verifier.http_max_retries={attempts} attempts in all = {max(0, int(attempts) - 1)} "
             "retries after the first")
    conv.set("verifier.client.backoff_s", float(o["worker.rollout.verifier.http_retry_interval"]))


def _derive_val_sampling(o: dict[str, Any], user: dict[str, Any], conv: Conversion) -> None:
    val = dict(o["worker.rollout.val_override_config"] or {})
    n = val.pop("n", 1)
    if n != 1:
        conv.warn("changed", "worker.rollout.val_override_config.n",
                  f"{n}: evaluation draws one sample per row here (its accuracy estimates the same mean, "
                  "with more variance)")
    sampling = {k: val.pop(k) for k in ("temperature", "top_p", "top_k") if k in val}
    for k in val:
        conv.warn("unsupported", f"worker.rollout.val_override_config.{k}", "only temperature, top_p, top_k and n "
                  "apply to evaluation here; remove it")
    # The original samples evaluation with the training settings unless overridden.
    full = {"temperature": o["worker.rollout.temperature"], "top_p": o["worker.rollout.top_p"], **sampling, "n": 1}
    conv.set("rollout.val_override_config", full, "worker.rollout.val_override_config over the training sampling "
             "(the original's evaluation); one sample per row")


def _derive_roles(o: dict[str, Any], conv: Conversion, fixed: frozenset[str]) -> None:
    nnodes, per_node = int(o["trainer.nnodes"]), int(o["trainer.n_gpus_per_node"])
    conv.recipe_gpus = nnodes * per_node
    tp = int(o.get("worker.rollout.tensor_parallel_size") or 1)
    zero = 3 if o["worker.actor.fsdp.enable_full_shard"] else 2
    conv.set("learner.zero_stage", zero, f"worker.actor.fsdp.enable_full_shard={bool(zero == 3)}: "
             + ("FULL_SHARD = ZeRO-3" if zero == 3 else "SHARD_GRAD_OP = ZeRO-2"))
    if conv.recipe_gpus <= 0:
        return
    local_verifier = bool(o["worker.rollout.verifier.enable"]) and not o["worker.rollout.verifier.use_http"]
    role_keys = {"learner.num_gpus", "rollout.num_actors", "rollout.gpus_per_actor"}
    if role_keys <= fixed:
        return  # the user sets the roles with asyncrl's keys
    context = int(o.get("worker.rollout.max_model_len") or o["data.max_prompt_length"] + o["data.max_response_length"])
    split, conv.tp_rule, changed = split_for_model(nnodes, per_node, tp, local_verifier,
                                                   str(o.get("worker.actor.model.model_path") or ""),
                                                   o.get("worker.rollout.dtype"), context)
    if changed:
        conv.warn("changed", "worker.rollout.tensor_parallel_size", changed)
    rule = f"role split of {nnodes} x {per_node} GPUs (docs/guided_grpo.md#role-split)"
    for key, value in split.asyncrl_keys.items():
        conv.set(key, value, rule)
    conv.set("cluster.startup_timeout_s", 1800.0, "a GPU recipe's cold start (hub downloads, CUDA graphs) may take "
             "long; as asyncrl's GPU configs")
    # Keep an engine fed as the original's batched generation does: 256 sequences at once.
    conv.set("rollout.max_num_seqs", 256, "vLLM's GPU default: an engine batches up to 256 sequences")
    groups = max(2, math.ceil(256 / max(1, int(o["worker.rollout.n"]))))
    conv.set("rollout.groups_in_flight", groups, f"256 sequences / worker.rollout.n {o['worker.rollout.n']}: "
             "groups each actor keeps in flight")
