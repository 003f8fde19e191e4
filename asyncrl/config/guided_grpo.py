"""Guided-GRPO compatibility: the key map from the original's YAML onto asyncrl's config tree, and
the converter (docs/guided_grpo.md#config-keys). Keys with no asyncrl equivalent (FSDP, critic,
hybrid engine, ...) are returned by name so the loader can report them; nothing is dropped
silently. Keys whose behaviour asyncrl removed on purpose (`REMOVED_KEYS`) are reported with what
to do instead. The only caller is `asyncrl.config.loading.from_guided_grpo`; the map is
documented for users in docs/config.md."""

from __future__ import annotations

from typing import Any

from asyncrl.config.sections import ConfigError
from asyncrl.config.tree import set_dotted

__all__ = ["GUIDED_GRPO_KEY_MAP", "REMOVED_KEYS", "convert_guided_grpo", "describe_unmapped"]

# Original key -> asyncrl key. None = no equivalent (reported by name).
GUIDED_GRPO_KEY_MAP: dict[str, str | None] = {
    "data.train_files": "data.train_files",
    "data.val_files": "data.val_files",
    "data.prompt_key": "data.prompt_key",
    "data.answer_key": "data.answer_key",
    "data.image_key": "data.image_key",
    "data.video_key": "data.video_key",
    "data.image_dir": "data.image_dir",
    "data.video_fps": None,
    "data.max_prompt_length": "data.max_prompt_length",
    "data.max_response_length": "data.max_response_length",
    "data.rollout_batch_size": "data.rollout_batch_size",
    "data.format_prompt": "data.format_prompt",
    "data.system_prompt": "data.system_prompt",
    "data.override_chat_template": "data.override_chat_template",
    "data.shuffle": "data.shuffle",
    "data.seed": "data.seed",
    "data.min_pixels": "data.min_pixels",
    "data.max_pixels": "data.max_pixels",
    "data.filter_overlong_prompts": "data.filter_overlong_prompts",
    "data.mini_rollout_batch_size": None,
    "data.val_batch_size": None,
    "data.filter_overlong_prompts_workers": None,
    "algorithm.gamma": "algorithm.gamma",
    "algorithm.lam": None,
    "algorithm.adv_estimator": "algorithm.adv_estimator",
    "algorithm.disable_kl": "learner.kl.enable",  # negated
    "algorithm.use_kl_loss": "learner.kl.mode",  # true -> loss, false -> reward
    "algorithm.kl_penalty": "learner.kl.estimator",  # kl->k1, abs, mse->k2, low_var_kl->k3
    "algorithm.kl_coef": "learner.kl.coef",
    "algorithm.kl_type": "learner.kl.type",
    "algorithm.kl_horizon": "learner.kl.horizon",
    "algorithm.kl_target": "learner.kl.target",
    "algorithm.online_filtering": "buffer.dynamic_sampling.enable",
    "algorithm.filter_key": "buffer.dynamic_sampling.key",
    "algorithm.filter_low": "buffer.dynamic_sampling.low",
    "algorithm.filter_high": "buffer.dynamic_sampling.high",
    "worker.actor.global_batch_size": None,  # asyncrl: learner.mini_batches splits the step batch
    "worker.actor.micro_batch_size_per_device_for_update": "learner.max_micro_batch_size",
    "worker.actor.micro_batch_size_per_device_for_experience": None,
    "worker.actor.max_grad_norm": "learner.max_grad_norm",
    "worker.actor.clip_ratio_low": "learner.clip_eps_low",
    "worker.actor.clip_ratio_high": "learner.clip_eps_high",
    "worker.actor.clip_ratio_dual": "learner.clip_ratio_dual",
    "worker.actor.loss_avg_mode": "learner.loss_avg_mode",
    "worker.actor.loss_type": "learner.loss_type",  # default -> ppo
    "worker.actor.ppo_epochs": "learner.ppo_epochs",
    "worker.actor.model.model_path": "model.path",
    "worker.actor.model.tokenizer_path": "model.tokenizer_path",
    "worker.actor.model.override_config": "model.override_config",
    "worker.actor.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "worker.actor.model.trust_remote_code": "model.trust_remote_code",
    "worker.actor.model.freeze_vision_tower": "model.freeze_vision_tower",
    "worker.actor.optim.lr": "learner.optim.lr",
    "worker.actor.optim.betas": "learner.optim.betas",
    "worker.actor.optim.weight_decay": "learner.optim.weight_decay",
    "worker.actor.optim.lr_warmup_ratio": "learner.optim.warmup_ratio",
    "worker.actor.optim.lr_warmup_steps": "learner.optim.warmup_steps",
    "worker.actor.optim.min_lr_ratio": "learner.optim.min_lr_ratio",
    "worker.actor.optim.lr_scheduler_type": "learner.optim.lr_scheduler",
    "worker.actor.optim.strategy": None,
    "worker.reward.reward_type": "reward.type",
    "worker.reward.reward_function": "reward.function",
    "worker.reward.reward_function_kwargs": "reward.kwargs",
    "worker.reward.skip_special_tokens": None,
    "worker.reward.num_cpus": None,
    "worker.rollout.n": "rollout.n",
    "worker.rollout.temperature": "rollout.temperature",
    "worker.rollout.top_p": "rollout.top_p",
    "worker.rollout.top_k": "rollout.top_k",
    "worker.rollout.seed": "rollout.seed",
    "worker.rollout.limit_images": "rollout.limit_images",
    "worker.rollout.dtype": "rollout.dtype",
    "worker.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "worker.rollout.ignore_eos": None,
    "worker.rollout.enforce_eager": "rollout.enforce_eager",
    "worker.rollout.tensor_parallel_size": "rollout.gpus_per_actor",
    "worker.rollout.max_model_len": "rollout.max_model_len",
    "worker.rollout.max_num_batched_tokens": "rollout.max_num_batched_tokens",
    "worker.rollout.val_override_config": "rollout.val_override_config",
    "worker.rollout.prompt_truncation": None,
    "worker.rollout.name": None,
    "worker.rollout.enable_chunked_prefill": None,
    "worker.rollout.enable_sleep_mode": None,
    "worker.rollout.disable_log_stats": None,
    "worker.rollout.disable_tqdm": None,
    "worker.rollout.verifier.enable": "rollout.guide.enable",
    "worker.rollout.verifier.model_path": "verifier.model_path",
    "worker.rollout.verifier.tokenizer_path": "verifier.tokenizer_path",
    "worker.rollout.verifier.trust_remote_code": None,
    "worker.rollout.verifier.use_http": "verifier.backend",  # true -> http, false -> vllm
    "worker.rollout.verifier.base_url": "verifier.http.base_url",
    "worker.rollout.verifier.model": "verifier.http.model",
    "worker.rollout.verifier.api_key": "verifier.http.api_key",
    "worker.rollout.verifier.http_timeout": "verifier.http.timeout_s",
    "worker.rollout.verifier.http_max_retries": "verifier.http.max_retries",
    "worker.rollout.verifier.http_retry_interval": "verifier.client.backoff_s",
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
    "trainer.max_steps": "trainer.max_steps",
    "trainer.project_name": "trainer.project_name",
    "trainer.experiment_name": "trainer.experiment_name",
    "trainer.logger": "trainer.logger",
    "trainer.val_freq": "trainer.eval_every",
    "trainer.save_freq": "trainer.save_every",
    "trainer.save_limit": "trainer.save_limit",
    "trainer.save_checkpoint_path": "trainer.run_dir",
    "trainer.load_checkpoint_path": "trainer.resume",
    "trainer.total_epochs": None,
    "trainer.nnodes": None,
    "trainer.n_gpus_per_node": None,
    "trainer.max_try_make_batch": None,
    "trainer.critic_warmup": None,
    "trainer.val_before_train": "trainer.eval_before_after",
    "trainer.val_only": None,
    "trainer.val_generations_to_log": "trainer.samples_per_eval",
    "trainer.find_last_checkpoint": None,
    "trainer.ray_timeline": None,
}

REMOVED_KEYS: dict[str, str] = {
    "data.video_fps": "asyncrl does not decode videos (a video column is carried along, never sampled "
                      "into frames); remove the key",
    "algorithm.lam": "GAE's lambda: asyncrl has no critic and no `gae` estimator; remove the key",
    "worker.rollout.ignore_eos": "asyncrl ends every policy turn at its end-of-turn token; remove the key",
    "worker.rollout.prompt_truncation": "asyncrl never cuts a sampled prompt: data.max_prompt_length is "
                                        "enforced before each policy turn by dropping history "
                                        "(rollout.guide.history), see docs/guided_grpo.md#bug-prompt-truncation; "
                                        "remove the key",
}
"""Original keys whose behaviour asyncrl does not reproduce, with what to do instead."""

_KL_PENALTY = {"kl": "k1", "abs": "abs", "mse": "k2", "low_var_kl": "k3", "k1": "k1", "k2": "k2", "k3": "k3"}
_LOGGERS = {"console": "console", "file": "jsonl", "tensorboard": "tensorboard", "wandb": "wandb"}


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and value and not full.endswith(
            ("override_config", "reward_function_kwargs", "val_override_config")
        ):
            flat.update(_flatten(value, full + "."))
        else:
            flat[full] = value
    return flat


def convert_guided_grpo(tree: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Map a Guided-GRPO YAML tree onto asyncrl's. Returns (asyncrl tree, keys with no equivalent)."""
    out: dict[str, Any] = {}
    unmapped: list[str] = []
    for key, value in _flatten(tree).items():
        if key.startswith(("worker.ref.", "worker.critic.", "worker.actor.fsdp.", "worker.actor.offload.")) or (
            key in ("worker.hybrid_engine", "worker.actor.strategy", "worker.actor.padding_free",
                    "worker.actor.dynamic_batching", "worker.actor.ulysses_size", "worker.actor.use_torch_compile")
        ):
            unmapped.append(key)
            continue
        if key not in GUIDED_GRPO_KEY_MAP:
            unmapped.append(key)
            continue
        target = GUIDED_GRPO_KEY_MAP[key]
        if target is None:
            unmapped.append(key)
            continue
        if value is None:
            continue  # Guided-GRPO's TODO(null) placeholders: keep asyncrl's default
        if key == "algorithm.disable_kl":
            value = not value
        elif key == "algorithm.use_kl_loss":
            value = "loss" if value else "reward"
        elif key == "algorithm.kl_penalty":
            if value not in _KL_PENALTY:
                raise ConfigError(f"algorithm.kl_penalty={value!r} has no asyncrl equivalent (kl, abs, mse, low_var_kl)")
            value = _KL_PENALTY[value]
        elif key == "worker.actor.loss_type" and value == "default":
            value = "ppo"
        elif key == "worker.rollout.verifier.use_http":
            value = "http" if value else "vllm"
        elif key == "worker.rollout.dtype":
            value = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(value, value)
        elif key == "worker.rollout.tensor_parallel_size":
            value = int(value)
        elif key == "trainer.logger":
            dropped = [v for v in value if v not in _LOGGERS]
            unmapped.extend(f"trainer.logger[{v}]" for v in dropped)
            value = [_LOGGERS[v] for v in value if v in _LOGGERS]
        elif key == "trainer.load_checkpoint_path":
            value = str(value)
        elif key == "worker.reward.reward_function" and ":" not in str(value):
            value = f"{value}:main"  # the original's default function name
        set_dotted(out, target, value)
    # Guided-GRPO enables the verifier with `enable`; without it the rollout is single-turn.
    out.setdefault("rollout", {}).setdefault("guide", {}).setdefault("enable", False)
    return out, unmapped




def describe_unmapped(keys: list[str]) -> str:
    """The user-facing message for the keys `convert_guided_grpo` could not map: every key by name,
    and for a removed behaviour what to do instead."""
    msg = "Guided-GRPO keys with no asyncrl equivalent (ignored): " + ", ".join(keys)
    removed = [f"{k}: {REMOVED_KEYS[k]}" for k in keys if k in REMOVED_KEYS]
    return msg + ("\n  " + "\n  ".join(removed) if removed else "")
