"""`python -m asyncrl.bench method --config configs/quickstart_learned_verifier.yaml`: Guided-GRPO in miniature, unconfounded.

Arms, each trained from the same initial policy (`model.path`) with the same number of trained
samples (`--steps` x `data.rollout_batch_size` x `rollout.n`), by real training runs of the whole
system (`asyncrl.job.runtime.run`, as `convergence`):
- `none`: no training (the initial policy);
- `grpo`: single-turn GRPO (`rollout.guide.enable=false`, no verifier in the loop);
- `guided-rule`: Guided-GRPO with the arith rule oracle (always right);
- `guided-sft`: Guided-GRPO with the Stage-2 verifier (`--sft-verifier`, vllm back-end);
- `guided-untuned`: Guided-GRPO with the same architecture before Stage 2 prompted as verifier
  (`--untuned-verifier`, default the initial policy itself: the paper's "self-verification" arm).
Every trained policy is then scored in every evaluation cell (greedy, `--test-rows` test rows,
`asyncrl.eval.evaluate_with_llm` on vLLM's CPU build, the original's validation protocol: the
verifier is not shown the reference): `solver` (the policy alone: continue prompt only), `rule`
(+ the rule oracle), `sft` (+ the SFT verifier), `untuned` (+ the un-tuned verifier). So the two
cells the paper lacks (a Guided-GRPO policy alone, a GRPO policy with the verifier) are filled,
and training effect (rows) and inference-time help (columns) read apart. The learned verifiers
answer the evaluation cells through transformers' greedy `generate` (one batch per turn); in
training they are served by Ray Serve's vllm back-end.

Per arm and seed: accuracy ± binomial SE per cell, turns and policy / verifier tokens per problem
per cell, training curves (reward, response length, entropy, turns per step), wall time. The
summary: per arm x cell the mean over seeds ± the standard error across seeds.
Not run: the verifier seeing its own earlier replies (the protocol renders only the policy's turns
for the verifier, `verifier_io.render_verifier_messages`; there is no flag for it).

`--reuse` takes a trained arm from its run directory when that holds a finished run of the same
length, and an evaluation from `<run dir>/method_eval.json` when it has the same rows and cells
(an interrupted grid continues); `--reuse-only` runs nothing new.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.bench.common import int_list, print_table, save_figure, str_list
from asyncrl.config import Config

ARMS = ["none", "grpo", "guided-rule", "guided-sft", "guided-untuned"]
CELLS = ["solver", "rule", "sft", "untuned"]
CURVE_KEYS = {"reward": "rollout/reward_mean", "response_len": "rollout/response_len_mean",
              "entropy": "train/entropy", "turns": "rollout/turns_mean"}
LEARNED_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart_learned_verifier.yaml"


def add_args(parser: Any) -> None:
    parser.add_argument("--arms", type=str_list, metavar=",".join(ARMS), help="arms to train (default all)")
    parser.add_argument("--cells", type=str_list, metavar=",".join(CELLS), help="evaluation cells (default all)")
    parser.add_argument("--seeds", type=int_list, metavar="1,2", help="seeds (data, rollout, trainer); default 1,2")
    parser.add_argument("--steps", type=int, default=20, help="learner steps per trained arm (default 20)")
    parser.add_argument("--test-rows", type=int, default=100, help="the first N test rows per cell (default 100)")
    parser.add_argument("--sft-verifier", default="assets/tiny-verifier", help="Stage-2 verifier checkpoint")
    parser.add_argument("--untuned-verifier", default=None,
                        help="the un-tuned verifier (default model.path: the initial policy prompted as verifier)")
    reuse = parser.add_mutually_exclusive_group()
    reuse.add_argument("--reuse", dest="reuse", action="store_const", const="finished",
                       help="take finished arms and evaluations from their run directories")
    reuse.add_argument("--reuse-only", dest="reuse", action="store_const", const="only",
                       help="run nothing: report the finished arms and evaluations")


def verifier_section(kind: str, path: str | None) -> dict[str, Any]:
    """The `verifier` config of a guided arm."""
    if kind == "rule":
        return {"backend": "rule", "task": "arith", "version": "arith-rule-v1", "ingress": False, "port": 0}
    return {"backend": "vllm", "model_path": str(Path(path).resolve()), "version": f"arith-{kind}",
            "dtype": "float32", "max_model_len": 1024, "cpus_per_replica": 0.25, "ingress": False, "port": 0}


def arm_config(cfg: Config, arm: str, seed: int, p: dict[str, Any]) -> Config:
    """The training config of one trained arm and seed."""
    from asyncrl.config.roles import VerifierConfig

    c = cfg.model_copy(deep=True)
    c.data.seed = c.rollout.seed = c.trainer.seed = seed
    c.trainer.max_steps = p["steps"]
    c.trainer.eval_every = -1
    c.trainer.eval_before_after = False  # every policy is scored below, in every cell
    c.trainer.save_every = -1
    c.trainer.logger = ["jsonl"]
    c.trainer.resume = "never"
    c.trainer.run_dir = str(Path(p["output"]).resolve() / "method-runs")
    c.trainer.experiment_name = f"method-{arm}-seed{seed}"
    c.rollout.guide.prompt_template = p["template"]
    if arm == "grpo":
        c.rollout.guide = c.rollout.guide.model_copy(update={"enable": False})
    else:
        kind = {"guided-rule": "rule", "guided-sft": "sft", "guided-untuned": "untuned"}[arm]
        c.verifier = VerifierConfig.model_validate(verifier_section(kind, p["verifiers"].get(kind)))
    return c


def _finished(run_dir: Path, steps: int) -> bool:
    from asyncrl.bench.convergence import _finished as finished

    return finished(run_dir, steps)


def train_arm(cfg: Config, arm: str, seed: int, p: dict[str, Any]) -> dict[str, Any]:
    """One real training run (or a reused one); its exported policy, curves and wall time."""
    from asyncrl.export import export
    from asyncrl.job.runtime import run

    c = arm_config(cfg, arm, seed, p)
    run_dir = c.run_path
    t0 = time.time()
    if p["reuse"] and _finished(run_dir, p["steps"]):
        print(f"[method] reusing the finished run in {run_dir}", flush=True)
        wall = json.loads((run_dir / "method_train.json").read_text())["wall_s"] if (run_dir / "method_train.json").exists() else None
    elif p["reuse"] == "only":
        raise RuntimeError(f"not run (--reuse-only: no finished run in {run_dir})")
    else:
        for stale in ("metrics.jsonl", "summary.json", "method_eval.json"):
            (run_dir / stale).unlink(missing_ok=True)
        rc = run(c)
        if rc != 0:
            raise RuntimeError(f"run {c.trainer.experiment_name} exited with {rc}")
        wall = time.time() - t0
        (run_dir / "method_train.json").write_text(json.dumps({"wall_s": wall}))
    policy = export(run_dir, run_dir / "export" / "policy", merge=True)
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    rows = [r for r in rows if "step" in r and "resumed_from" not in r]
    curves = {name: [[r["step"], r.get(key)] for r in rows if r.get(key) is not None] for name, key in CURVE_KEYS.items()}
    return {"policy": str(policy), "run_dir": str(run_dir), "train_wall_s": wall, "curves": curves,
            "trained_samples": p["steps"] * c.data.rollout_batch_size * c.rollout.n}


def evaluate_policy(policy: str, where: Path, p: dict[str, Any]) -> dict[str, Any]:
    """Every evaluation cell for one policy, in a child process (its vLLM engine goes with it);
    reused from `where/method_eval.json` under --reuse when it has the same rows and cells."""
    out = where / "method_eval.json"
    if p["reuse"] and out.exists():
        got = json.loads(out.read_text())
        if got.get("test_rows") == p["test_rows"] and set(p["cells"]) <= set(got.get("cells", {})):
            print(f"[method] reusing the evaluation in {out}", flush=True)
            return got
    if p["reuse"] == "only":
        raise RuntimeError(f"not evaluated (--reuse-only: no {out})")
    where.mkdir(parents=True, exist_ok=True)
    spec = {"policy": policy, "out": str(out), "test_files": p["test_files"], "test_rows": p["test_rows"],
            "cells": p["cells"], "verifiers": p["verifiers"], "max_turns": p["max_turns"],
            "max_tokens": p["max_tokens"], "max_prompt_length": p["max_prompt_length"],
            "verifier_max_tokens": p["verifier_max_tokens"], "template": p["template"]}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    rc = subprocess.call([sys.executable, "-m", "asyncrl.bench.method", "--evaluate", json.dumps(spec)], env=env)
    if rc != 0:
        raise RuntimeError(f"evaluation of {policy} exited with {rc}")
    return json.loads(out.read_text())


def _evaluate_main(spec: dict[str, Any]) -> None:
    """The child process of `evaluate_policy`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.data import load_rows
    from asyncrl.eval import build_llm, evaluate_with_llm
    from asyncrl.verifier_training.sft import generate_replies

    rows = load_rows(spec["test_files"])[: spec["test_rows"]]
    tok = AutoTokenizer.from_pretrained(spec["policy"])
    llm = build_llm(spec["policy"], max_model_len=spec["max_prompt_length"] + spec["max_tokens"] + 64)
    result: dict[str, Any] = {"policy": spec["policy"], "test_rows": len(rows), "cells": {}}
    template = spec["template"]
    for cell in spec["cells"]:
        t0 = time.time()
        kw: dict[str, Any] = {"max_turns": spec["max_turns"], "max_tokens": spec["max_tokens"],
                              "max_prompt_length": spec["max_prompt_length"]}
        if cell == "solver":
            r = evaluate_with_llm(llm, tok, rows, "solver", **kw)
        elif cell == "rule":
            r = evaluate_with_llm(llm, tok, rows, "guided", **kw)
        else:
            path = spec["verifiers"][cell]
            vtok = AutoTokenizer.from_pretrained(path)
            vmodel = AutoModelForCausalLM.from_pretrained(path)

            def verify_batch(requests: list[list[dict]], vmodel: Any = vmodel, vtok: Any = vtok) -> list[str]:
                # the compact template the verifiers were trained on replaces the default system prompt
                msgs = [[{"role": "system", "content": template.strip()}, *m[1:]] for m in requests]
                return generate_replies(vmodel, vtok, msgs, spec["verifier_max_tokens"], batch_size=32)

            r = evaluate_with_llm(llm, tok, rows, "guided", verify_batch=verify_batch, **kw)
        r["wall_s"] = round(time.time() - t0, 1)
        result["cells"][cell] = r
        print(f"[method] {Path(spec['policy']).parts[-3] if len(Path(spec['policy']).parts) > 3 else spec['policy']} "
              f"{cell}: accuracy {r['accuracy']:.3f} ± {r['accuracy_se']:.3f}, turns {r['mean_turns']:.2f}", flush=True)
    Path(spec["out"]).write_text(json.dumps(result, indent=1))


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def _se(xs: list[float]) -> float | None:
    return round(statistics.stdev(xs) / len(xs) ** 0.5, 4) if len(xs) > 1 else None


CELL_KEYS = ("accuracy", "mean_turns", "mean_policy_tokens", "mean_verifier_tokens", "hallucination_score",
             "format_rate")


def summarize(results: list[dict[str, Any]], p: dict[str, Any]) -> dict[str, Any]:
    """Per arm x cell: mean over seeds ± SE across seeds of each number; per arm: wall time."""
    table: dict[str, dict[str, Any]] = {}
    for arm in p["arms"]:
        done = [r for r in results if r["arm"] == arm and "error" not in r]
        row: dict[str, Any] = {"seeds": [r["seed"] for r in done],
                               "train_wall_s": _mean([r["train_wall_s"] for r in done if r.get("train_wall_s")])}
        for cell in p["cells"]:
            got = [r["cells"][cell] for r in done if cell in r.get("cells", {})]
            row[cell] = {k: _mean([g[k] for g in got]) for k in CELL_KEYS}
            row[cell]["accuracy_se_seeds"] = _se([g["accuracy"] for g in got])
            row[cell]["accuracy_se_binomial"] = _mean([g["accuracy_se"] for g in got])
        table[arm] = row
    return table


def print_grid(summary: dict[str, Any], cells: list[str]) -> None:
    print("\n== method: accuracy (mean over seeds ± SE across seeds) ==")
    print(f"{'arm':16}" + "".join(f"{c:>18}" for c in cells) + f"{'train wall s':>14}")
    def fmt(row: dict[str, Any], c: str) -> str:
        a, se = row[c]["accuracy"], row[c]["accuracy_se_seeds"]
        return "-" if a is None else f"{a:.3f}" + (f" ± {se:.3f}" if se is not None else "")

    for arm, row in summary.items():
        wall = row.get("train_wall_s")
        print(f"{arm:16}" + "".join(f"{fmt(row, c):>18}" for c in cells) + f"{(f'{wall:.0f}' if wall else '-'):>14}")


def plan(cfg: Config, args: Any) -> dict[str, Any]:
    arms = args.arms or ARMS
    cells = args.cells or CELLS
    for name in arms:
        if name not in ARMS:
            raise SystemExit(f"error: unknown arm {name!r}; arms: {', '.join(ARMS)}")
    for name in cells:
        if name not in CELLS:
            raise SystemExit(f"error: unknown cell {name!r}; cells: {', '.join(CELLS)}")
    template = cfg.rollout.guide.prompt_template
    if template is None:  # the default renders ~2,000 tokens: more than the tiny verifiers' context
        from asyncrl.config import load_config

        template = load_config(LEARNED_CONFIG).rollout.guide.prompt_template
        print(f"[method] rollout.guide.prompt_template: the compact arith template of {LEARNED_CONFIG.name}")
    verifiers = {"sft": args.sft_verifier, "untuned": args.untuned_verifier or cfg.model.path}
    for kind, path in verifiers.items():
        needed = f"guided-{kind}" in arms or kind in cells
        if needed and not (Path(path) / "config.json").is_file():
            raise SystemExit(f"error: the {kind} verifier {path} is not a model directory "
                             "(scripts/make_tiny_verifier.py builds the SFT one)")
    return {"arms": arms, "cells": cells, "seeds": args.seeds or [1, 2], "steps": args.steps,
            "test_rows": args.test_rows, "reuse": args.reuse, "output": args.output, "template": template,
            "verifiers": {k: str(Path(v).resolve()) for k, v in verifiers.items()},
            "test_files": cfg.data.test_files, "max_turns": cfg.rollout.guide.max_turns,
            "max_tokens": cfg.data.max_response_length, "max_prompt_length": cfg.data.max_prompt_length,
            "verifier_max_tokens": cfg.rollout.guide.sampling.max_tokens}


def run(cfg: Config, args: Any) -> dict[str, Any]:
    p = plan(cfg, args)
    out = Path(args.output)
    trained = [a for a in p["arms"] if a != "none"]
    print_table("method plan", [
        ("arms", str(p["arms"])), ("cells", str(p["cells"])), ("seeds", str(p["seeds"])),
        ("steps per trained arm", p["steps"]),
        ("trained samples per arm", p["steps"] * cfg.data.rollout_batch_size * cfg.rollout.n),
        ("training runs", len(trained) * len(p["seeds"])), ("test rows per cell", p["test_rows"]),
        ("sft verifier", p["verifiers"]["sft"]), ("untuned verifier", p["verifiers"]["untuned"])])
    results: list[dict[str, Any]] = []
    t0 = time.time()
    if "none" in p["arms"]:  # greedy evaluation of the initial policy: one per grid (every seed is the same)
        try:
            ev = evaluate_policy(str(Path(cfg.model.path).resolve()), out / "method-runs" / "method-none", p)
            for seed in p["seeds"]:
                results.append({"arm": "none", "seed": seed, "train_wall_s": 0.0, "cells": ev["cells"], "curves": {}})
        except Exception as exc:  # noqa: BLE001 - one failed piece must not lose the others
            results.append({"arm": "none", "seed": 0, "error": f"{type(exc).__name__}: {exc}"})
    for seed in p["seeds"]:
        for arm in trained:
            print(f"\n[method] {arm} seed {seed} ({(time.time() - t0) / 60:.1f} min elapsed)", flush=True)
            try:
                tr = train_arm(cfg, arm, seed, p)
                ev = evaluate_policy(tr["policy"], Path(tr["run_dir"]), p)
                results.append({"arm": arm, "seed": seed, **tr, "cells": ev["cells"]})
            except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
                print(f"[method] {arm} seed {seed} failed: {exc}", flush=True)
                results.append({"arm": arm, "seed": seed, "error": f"{type(exc).__name__}: {exc}"})
            (out / "method-partial.json").parent.mkdir(parents=True, exist_ok=True)
            (out / "method-partial.json").write_text(json.dumps({"plan": p, "runs": results}, indent=1, default=str))
    summary = summarize(results, p)
    print_grid(summary, p["cells"])
    result = {"plan": {k: v for k, v in p.items() if k != "reuse"}, "summary": summary,
              "runs": [{k: v for k, v in r.items() if k != "cells"} | {"cells": {
                  c: {k: v for k, v in cell.items() if k != "conversations"} for c, cell in r.get("cells", {}).items()}}
                       for r in results], "total_wall_s": time.time() - t0}
    try:
        result["plot"] = str(plot(result, out))
    except Exception as exc:  # noqa: BLE001 - the JSON is the result
        print(f"plot not written: {exc}")
    return result


def plot(result: dict[str, Any], out: Path) -> Path:
    """Accuracy per arm x cell (± SE across seeds), and the training reward / response length /
    entropy curves per arm (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, cells = result["summary"], result["plan"]["cells"]
    arms = list(summary)
    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    width = 0.8 / max(1, len(cells))
    for j, cell in enumerate(cells):
        acc = [summary[a][cell]["accuracy"] or 0 for a in arms]
        err = [summary[a][cell]["accuracy_se_seeds"] or summary[a][cell]["accuracy_se_binomial"] or 0 for a in arms]
        ax[0].bar([i + j * width for i in range(len(arms))], acc, width, yerr=err, capsize=2, label=f"eval: {cell}")
    ax[0].set_xticks([i + 0.4 - width / 2 for i in range(len(arms))], arms, rotation=30, fontsize=7)
    ax[0].set(ylabel="test accuracy (greedy)", title="trained arm x evaluation cell")
    ax[0].legend(fontsize=7)
    for k, (name, label) in enumerate((("reward", "training reward"), ("response_len", "response length (tokens)"),
                                        ("entropy", "entropy"))):
        for arm in arms:
            runs = [r for r in result["runs"] if r["arm"] == arm and r.get("curves", {}).get(name)]
            if not runs:
                continue
            steps = sorted({s for r in runs for s, _ in r["curves"][name]})
            ys = [statistics.fmean([v for r in runs for s2, v in r["curves"][name] if s2 == s]) for s in steps]
            ax[k + 1].plot(steps, ys, label=arm)
        ax[k + 1].set(xlabel="learner step", title=label)
        ax[k + 1].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out, "method")


if __name__ == "__main__":  # the evaluation child process (`evaluate_policy`)
    parser = argparse.ArgumentParser()
    parser.add_argument("--evaluate", required=True)
    _evaluate_main(json.loads(parser.parse_args().evaluate))
