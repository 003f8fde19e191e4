"""The TRL side of `python -m asyncrl.bench trl`: Hugging Face TRL's `GRPOTrainer` on asyncrl's task.

Run as its own process by the benchmark (so its launch-to-exit time counts its imports and model
load, as asyncrl's counts Ray's start-up):

    python -m asyncrl.bench.trl_side --config-json RESOLVED.json --out DIR

It reads the same resolved asyncrl config the asyncrl side trains with and maps every setting that
has a TRL counterpart (`trl_settings`; `asyncrl.bench.trl` prints the table and the differences):
the same policy, training rows and prompt messages (`asyncrl.data.build_messages`), the same reward
function (`asyncrl.rewards.build_reward_fn`, here accuracy), group size, prompts per step,
optimiser, KL term, clipping, loss normalisation, sampling temperature and response budget.
Writes `DIR/trl_result.json` (per-step end times, checkpoint times, the trainer's log history)
and HF checkpoints `DIR/checkpoint-N/` that `python -m asyncrl.eval` scores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

T_PROCESS = time.time()


def trl_settings(cfg: Any, out_dir: str) -> dict[str, Any]:
    """GRPOConfig keyword arguments equivalent to asyncrl's config `cfg` (see the module docstring)."""
    lc, r = cfg.learner, cfg.rollout
    return {
        "output_dir": out_dir,
        "max_steps": cfg.trainer.max_steps,
        "num_generations": r.n,
        # one optimiser step per generation round of B prompts x G samples, as asyncrl's learner step
        "per_device_train_batch_size": cfg.data.rollout_batch_size * r.n,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": lc.ppo_epochs,
        "learning_rate": lc.optim.lr,
        "lr_scheduler_type": lc.optim.lr_scheduler,
        "warmup_steps": int(lc.optim.warmup_steps or 0),
        "weight_decay": lc.optim.weight_decay,
        "adam_beta1": lc.optim.betas[0],
        "adam_beta2": lc.optim.betas[1],
        "adam_epsilon": lc.optim.eps,
        "max_grad_norm": lc.max_grad_norm,
        "beta": lc.kl.coef if lc.kl.enable else 0.0,
        "epsilon": lc.clip_eps_low,
        "epsilon_high": lc.clip_eps_high,
        # asyncrl's "token" mean over the whole batch = TRL's "dapo" (normalised by the batch's tokens)
        "loss_type": {"token": "dapo", "seq": "grpo", "seq_sum_token_mean": "dr_grpo"}[lc.loss_avg_mode],
        "scale_rewards": "group" if cfg.algorithm.norm_adv_by_std else "none",
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k if r.top_k > 0 else 0,
        "max_completion_length": cfg.data.max_response_length,
        "save_strategy": "steps",
        "save_steps": max(1, cfg.trainer.save_every),
        "save_only_model": True,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "bf16": False,
        "seed": cfg.trainer.seed,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.bench.trl_side", description=__doc__)
    p.add_argument("--config-json", required=True, help="an asyncrl config.resolved.json")
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = every core")
    args = p.parse_args(argv)
    from asyncrl.config import Config

    cfg = Config.model_validate_json(Path(args.config_json).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # TRL is one process: by default it gets every core, as a user running it here would (torch's
    # own default; the Makefile's OMP_NUM_THREADS=1, meant for asyncrl's many processes, would
    # otherwise hold it to one thread). --threads N pins it.
    threads = args.threads or (os.cpu_count() or 1)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.data import build_messages, load_rows
    from asyncrl.rewards import build_reward_fn

    if threads > 0:
        torch.set_num_threads(threads)
    rows = load_rows(cfg.data.train_files, cfg.data)
    data = Dataset.from_list([{"prompt": build_messages(row, cfg.data), "ground_truth": str(row[cfg.data.answer_key])}
                              for row in rows])
    score = build_reward_fn(cfg.reward)

    def reward(prompts: list[Any], completions: list[Any], ground_truth: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        items = [{"response": t, "response_length": len(t), "ground_truth": g, "num_turns": 1}
                 for t, g in zip(texts, ground_truth, strict=True)]
        return [float(s["overall"]) for s in score(items)]

    class Clock(TrainerCallback):
        """Wall time (since process start) at every step end and checkpoint."""

        def __init__(self) -> None:
            self.step_end: list[float] = []
            self.saves: dict[int, float] = {}
            self.t_first_step = None

        def on_step_begin(self, args, state, control, **kw):  # noqa: ARG002
            if self.t_first_step is None:
                self.t_first_step = time.time() - T_PROCESS

        def on_step_end(self, args, state, control, **kw):  # noqa: ARG002
            self.step_end.append(time.time() - T_PROCESS)

        def on_save(self, args, state, control, **kw):  # noqa: ARG002
            self.saves[int(state.global_step)] = time.time() - T_PROCESS

    settings = trl_settings(cfg, str(out))
    clock = Clock()
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**settings), train_dataset=data,
                          processing_class=tokenizer, callbacks=[clock])
    t_ready = time.time() - T_PROCESS
    trainer.train()
    result = {"settings": settings, "t_ready_s": t_ready, "t_first_step_s": clock.t_first_step,
              "step_end_s": clock.step_end, "saves": clock.saves, "log_history": trainer.state.log_history,
              "torch_threads": torch.get_num_threads(), "t_exit_s": time.time() - T_PROCESS}
    (out / "trl_result.json").write_text(json.dumps(result, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
