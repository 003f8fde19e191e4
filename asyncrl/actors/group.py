"""From a prompt to a scored, wire-ready `Group` (and the same path for evaluation).

This module binds the engine-agnostic guided protocol (asyncrl.actors.guided) to the three real
parts a rollout actor owns: the policy engine (`generate`), the verifier client (`verify`) and the
reward function. The evaluation command and the rollout actor share it, so evaluation measures
exactly what training produces.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.actors.guided import (
    GuideOptions,
    PolicyChat,
    build_training_sample,
    make_group,
    run_group,
    sample_metadata,
)
from asyncrl.config import Config
from asyncrl.protocol import Group, Sample


@dataclass
class VLContext:
    """What a rollout actor of a vision-language policy (Qwen-VL) holds besides the text pieces:
    the HF processor, the placeholder ban (`vision.vision_logit_bias`, the same bias the
    learner applies before its softmax) and the image placeholder id. None for text policies."""

    processor: Any
    logit_bias: dict[int, float]
    image_token_id: int


class PromptTooLong(Exception):
    """A VL prompt whose processor-expanded ids exceed `data.max_prompt_length`: the caller drops
    it (completes it at the coordinator and counts it), since re-issuing it would fail forever."""


def prepare_vl_prompt(cfg: Config, prompt: dict[str, Any], vl: VLContext) -> Any:
    """`vision.build_vl_prompt` for one stream item (once per group: images aligned, loaded,
    resized, PNG-round-tripped and processed ONCE; every turn of every conversation reuses them).
    Raises PromptTooLong when the expanded prompt does not fit `data.max_prompt_length`."""
    from asyncrl.vision import build_vl_prompt

    vp = build_vl_prompt(prompt, vl.processor, cfg.data, cfg.rollout.limit_images, image_token_id=vl.image_token_id)
    if len(vp.prompt_ids) > cfg.data.max_prompt_length:
        raise PromptTooLong(f"prompt {prompt.get('uid')}: {len(vp.prompt_ids)} ids (images expanded) > "
                            f"data.max_prompt_length={cfg.data.max_prompt_length}")
    return vp


def make_generate(cfg: Config, engine: Any, *, overrides: dict[str, Any] | None = None, vp: Any = None,
                  logit_bias: dict[int, float] | None = None):
    """`generate(prompt_ids, seed)` for the guided driver, with the rollout's sampling settings.
    With a `vp` (vision.VLPrompt) every turn sends vLLM the collapsed ids + the prompt's PIL images
    (the same objects every turn) and bans the placeholders with `logit_bias`."""
    r = cfg.rollout
    sampling = {"max_tokens": cfg.data.max_response_length, "temperature": r.temperature, "top_p": r.top_p,
                "top_k": r.top_k}
    sampling.update({k: v for k, v in (overrides or {}).items() if k in sampling})

    async def generate(prompt_ids: list[int], seed: int | None):
        if vp is not None:
            ids, mm = vp.engine_inputs(prompt_ids)
            g = await engine.generate(ids, seed=seed, multi_modal_data=mm, logit_bias=logit_bias, **sampling)
        else:
            g = await engine.generate(prompt_ids, seed=seed, **sampling)
        # One version per turn: the oldest that sampled any of its tokens (an in-flight update can
        # land mid-turn; the older version is the conservative one for the staleness bound).
        version = min(g.versions) if g.versions else engine.version
        return g.token_ids, g.logprobs, version, g.finish_reason

    return generate


def make_verify(cfg: Config, verifier: Any):
    """`verify(messages)` through the service client with the guide's sampling settings."""
    s = cfg.rollout.guide.sampling

    async def verify(messages: list[dict[str, str]]):
        return await verifier.chat(messages, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                   top_k=s.top_k if s.top_k > 0 else None, request_id=uuid.uuid4().hex)

    return verify


def guide_options(cfg: Config, training: bool) -> GuideOptions:
    return GuideOptions.from_config(cfg.rollout.guide, max_prompt_length=cfg.data.max_prompt_length, training=training,
                                    **({} if cfg.rollout.guide.enable else {"max_turns": 1}))


async def run_guided_group(cfg: Config, prompt: dict[str, Any], engine: Any, verifier: Any, *, chat: PolicyChat,
                           training: bool = True, n: int | None = None,
                           sampling_overrides: dict[str, Any] | None = None, vp: Any = None,
                           vl: VLContext | None = None) -> list[Any]:
    """The `n` conversations of one prompt, run concurrently; raises GroupDropped under drop_group.
    VL policies pass `vp` (`prepare_vl_prompt`) and `vl`: conversations are built from the
    verifier's view with the processor-expanded prompt ids (history=full)."""
    if vp is not None:
        convs = make_group(vp.verifier_messages, chat=chat, options=guide_options(cfg, training),
                           n=n or cfg.rollout.n, ground_truth=prompt.get("ground_truth"), base_seed=cfg.rollout.seed,
                           prompt_index=int(prompt.get("index", 0)), prompt_uid=str(prompt.get("uid", "")),
                           prompt_ids=vp.prompt_ids)
    else:
        convs = make_group(prompt["messages"], chat=chat, options=guide_options(cfg, training), n=n or cfg.rollout.n,
                           ground_truth=prompt.get("ground_truth"), base_seed=cfg.rollout.seed,
                           prompt_index=int(prompt.get("index", 0)), prompt_uid=str(prompt.get("uid", "")))
    if not cfg.rollout.guide.enable:  # single-turn GRPO: no verifier in the loop
        async def verify(messages):  # noqa: ARG001 - stop after the only turn
            return {"ok": True, "text": cfg.rollout.guide.stop_token, "version": "none"}
    else:
        verify = make_verify(cfg, verifier)
    if vp is not None:
        generate = make_generate(cfg, engine, overrides=sampling_overrides, vp=vp,
                                 logit_bias=vl.logit_bias if vl is not None else None)
    else:
        generate = make_generate(cfg, engine, overrides=sampling_overrides)
    return await run_group(convs, generate, verify)


def reward_inputs(convs: list[Any], ground_truth: str | None) -> list[dict[str, Any]]:
    """Guided-GRPO's reward-function input dicts (docs/guided_grpo.md#rewards): final policy turn,
    its length, the answer and the verifier's hallucination score, plus `num_turns` (asyncrl;
    plug-ins may ignore it)."""
    items = []
    for c in convs:
        last = c.turns[-1]
        items.append({"response": c.final_text, "response_length": len(last.token_ids),
                      "ground_truth": ground_truth or "", "verifier_hallucination_score": c.hallucination_score,
                      "num_turns": c.num_turns})
    return items


def build_sample(conv: Any, reward_parts: dict[str, float], *, scope: str) -> Sample:
    """The wire `Sample` of one finished conversation: its training arrays under `scope`
    (`build_training_sample`; full_turn may fall back, recorded as `scope_fallback`), the reward
    (`reward_parts["overall"]`, every part kept) and `sample_metadata` with the transcript."""
    ts = build_training_sample(conv, scope)
    meta = sample_metadata(conv, include_text=True)
    meta["scope_fallback"] = ts.fallback
    return Sample(
        uid=conv.uid or uuid.uuid4().hex, prompt_uid=str(conv.prompt_uid or ""),
        prompt_ids=ts.prompt_ids, response_ids=ts.response_ids, response_mask=ts.response_mask,
        behaviour_logprobs=ts.behaviour_logprobs, token_versions=ts.token_versions,
        reward=float(reward_parts["overall"]), reward_parts={k: float(v) for k, v in reward_parts.items()},
        num_turns=conv.num_turns, finish_reason=str(conv.finish_reason),
        verifier_version=str(meta.get("verifier_version") or ""), metadata=_jsonable(meta))


async def build_group(cfg: Config, prompt: dict[str, Any], convs: list[Any], reward_fn: Any, tokenizer: Any, *,
                      actor_id: str, verifier: Any = None, vp: Any = None) -> Group:
    """Score the conversations (off the event loop) and pack them as a `Group`. With a `vp`
    (VL) the group's metadata also carries the prompt's final images once (`images`: PNG bytes +
    sha256, `vision.PreparedImages.to_wire`), which the learner decodes (`group_row_images`)."""
    from asyncrl.rewards import score

    items = reward_inputs(convs, prompt.get("ground_truth"))
    guarded = getattr(reward_fn, "score_async", None)  # asyncrl.rewards.guard.RewardGuard: deadline, named errors
    scores = await (guarded(items) if guarded is not None else score(reward_fn, items))
    scope = cfg.rollout.guide.train_scope
    samples = [build_sample(conv, parts, scope=scope) for conv, parts in zip(convs, scores)]
    metadata: dict[str, Any] = {"prompt_index": int(prompt.get("index", -1))}
    steps = (prompt.get("row") or {}).get("num_steps")
    if isinstance(steps, int) and not isinstance(steps, bool):  # the buffer counts groups by it (asyncrl.replay.mix)
        metadata["num_steps"] = steps
    if vp is not None:
        metadata["images"] = vp.images.to_wire()
    group = Group.from_samples(samples, created_at=time.time(), actor_id=actor_id, metadata=metadata)
    return group


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


async def evaluate_rows(cfg: Config, rows: list[dict[str, Any]], engine: Any, verifier: Any, *, chat: PolicyChat,
                        mode: str = "both", max_concurrency: int = 32, vl: VLContext | None = None) -> dict[str, Any]:
    """Greedy evaluation (rollout.val_override_config) of `rows` (PromptItem-like dicts with
    `messages` and `ground_truth`): guided (verifier in the loop, no reference unless
    verifier_sees_reference=always) and/or solver-only (one turn, no verifier). Returns `{mode: summary}`
    in the layout of the rule back-end's (`eval_summary`), so one merger serves every back-end."""
    from asyncrl.rewards import grade_final_answer

    overrides = dict(cfg.rollout.val_override_config)
    sem = asyncio.Semaphore(max_concurrency)
    out: dict[str, Any] = {}

    async def one(row: dict[str, Any], guided: bool) -> dict[str, Any]:
        async with sem:
            c = cfg if guided else cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={
                "guide": cfg.rollout.guide.model_copy(update={"enable": False})})})
            vp = None
            if vl is not None:
                try:
                    vp = prepare_vl_prompt(c, row, vl)
                except PromptTooLong:
                    # counted as wrong (as a truncated prompt would be), with empty token counts
                    return {"correct": False, "turns": 0, "format": False, "finish_reason": "prompt_too_long",
                            "meta": {"tokens": {"policy": 0, "user": 0}, "verifier_hallucination_score": 0.0}}
            convs = await run_guided_group(c, row, engine, verifier, chat=chat, training=False, n=1,
                                           sampling_overrides=overrides, vp=vp, vl=vl)
            conv = convs[0]
            correct = grade_final_answer(conv.final_text, row.get("ground_truth"))
            meta = sample_metadata(conv, include_text=True)
            return {"correct": correct, "turns": conv.num_turns, "meta": meta, "finish_reason": str(conv.finish_reason),
                    "format": bool(conv.turns[-1].has_final_answer)}

    modes = ["guided", "solver"] if mode == "both" else [mode]
    for m in modes:
        if m == "guided" and not cfg.rollout.guide.enable:
            continue
        t0 = time.time()
        results = await asyncio.gather(*(one(r, m == "guided") for r in rows))
        out[m] = eval_summary(m, results)
        out[m]["wall_s"] = time.time() - t0
    return out


def eval_summary(mode: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's numbers in the layout of `asyncrl.eval.summarize` (mergeable by `n`)."""
    from asyncrl.actors.guided.evaluation import accuracy_se

    n = len(results)
    mean = (lambda xs: sum(xs) / max(n, 1))  # noqa: E731
    accuracy = mean([float(r["correct"]) for r in results])
    reasons: dict[str, int] = {}
    for r in results:
        reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
    return {"mode": mode, "n": n, "accuracy": accuracy, "accuracy_se": accuracy_se(accuracy, n),
            "mean_turns": mean([r["turns"] for r in results]),
            "mean_policy_tokens": mean([r["meta"]["tokens"]["policy"] for r in results]),
            "mean_verifier_tokens": mean([r["meta"]["tokens"]["user"] for r in results]),
            "format_rate": mean([float(r["format"]) for r in results]),
            "hallucination_score": mean([r["meta"]["verifier_hallucination_score"] for r in results]),
            "finish_reasons": reasons}
