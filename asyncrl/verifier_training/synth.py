"""Stage 1 of Guided-GRPO, data synthesis: `python -m asyncrl.synth --config X.yaml --out DIR [--limit N]`.

The policy talks to a *teacher* verifier over the training prompts, on the job's own parts: the
topology of a training job is built (`asyncrl.job.topology.build_topology`: the Serve verifier
deployment with `verifier.*` as the teacher, any back-end: `rule`, `vllm`, `http`; the rollout
fleet's vLLM engines), then, instead of training, each rollout actor runs training-mode guided
conversations (`RolloutWorker.synthesize`, the same `run_guided_group` a training step uses) and
sends back every verifier request with the teacher's reply. Rows, labels, filters and the resumable
writer: rows.py. The output directory holds `rows.jsonl` (every kept row, appended as chunks
finish), `train.jsonl` / `heldout.jsonl` (after balance, split by prompt), `summary.json` and a
dataset card `README.md`; `datasets.load_dataset(DIR)` loads it.

The config is an ordinary asyncrl config plus a `synth:` section (`SynthConfig`; dotted overrides
`synth.filters.balance=2`). Exit 2, before anything starts where it can be known: a missing prompt
file or a row without an answer (the file and row named), an unknown key, a `vllm` teacher whose
checkpoint does not load (its path named); and after the verifier's start-up probe: an unreachable
or failing teacher (its endpoint named). Run again with the same `--out` to resume.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.cli import fail
from asyncrl.verifier_training.rows import SynthConfig, SynthWriter, records_to_rows

__all__ = ["main", "load_synth_config", "teacher_name"]


def load_synth_config(path: str | None, overrides: list[str]) -> tuple[Any, SynthConfig]:
    """(Config, SynthConfig) from a YAML with a `synth:` section and dotted overrides (`synth.*`
    go to the synth section). ConfigError / ValidationError -> exit 2 by the caller."""
    from asyncrl.config.loading import build_config, parse_overrides
    from asyncrl.config.tree import deep_merge, read_yaml

    tree = read_yaml(path) if path else {}
    tree = deep_merge(tree, parse_overrides(overrides)) if overrides else tree
    synth_tree = tree.pop("synth", None) or {}
    scfg = SynthConfig.model_validate(synth_tree)
    return build_config(tree, str(path or "defaults")), scfg


def teacher_name(cfg: Any) -> str:
    """The teacher as a person names it: back-end and endpoint."""
    v = cfg.verifier
    if v.backend == "http":
        return f"http:{v.http.base_url} (model {v.http.model})"
    if v.backend == "vllm":
        return f"vllm:{v.model_path}"
    return f"rule:{v.task}"


def check_vllm_checkpoint(path: str | None) -> str | None:
    """Why vLLM could not load the checkpoint at `path` (config, architecture, weights, tokenizer
    with a chat template), or None. Cheap: no engine is built."""
    if not path or not Path(path).is_dir():
        return f"{path}: not a directory"
    cfg_file = Path(path) / "config.json"
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        return f"{cfg_file}: {exc}"
    archs = config.get("architectures") or []
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    if not archs or not any(a in supported for a in archs):
        return f"{cfg_file}: architectures {archs} are not served by vLLM"
    if not any(Path(path).glob("*.safetensors")) and not any(Path(path).glob("*.bin")):
        return f"{path}: no weights (*.safetensors)"
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure is the checkpoint's fault
        return f"{path}: tokenizer does not load: {exc}"
    if not getattr(tok, "chat_template", None):
        return f"{path}: tokenizer has no chat template"
    return None


def token_counter(path: str):
    """`count(messages, reply) -> (prompt tokens, reply tokens)` with `path`'s chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)

    def count(messages: list[dict[str, str]], reply: str) -> tuple[int, int]:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return len(ids), len(tok.encode(reply, add_special_tokens=False)) + 1  # + end of turn

    count.tokenizer = tok  # type: ignore[attr-defined]
    return count


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m asyncrl.synth", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", required=True, help="asyncrl YAML with a `synth:` section")
    p.add_argument("--out", required=True, help="output directory (resumed when it exists)")
    p.add_argument("--limit", type=int, default=0, help="the first N prompts only")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    return p


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    from asyncrl.config.sections import ConfigError

    args = build_parser().parse_intermixed_args(argv)
    try:
        cfg, scfg = load_synth_config(args.config, args.overrides)
    except (ConfigError, ValidationError) as exc:
        fail(str(exc).splitlines()[0] if isinstance(exc, ConfigError) else f"synth: {exc}")
    from asyncrl.data import load_rows, make_item

    spec = scfg.prompts or cfg.data.train_files
    try:
        rows = load_rows(spec, cfg.data)
    except (ValueError, FileNotFoundError, OSError) as exc:
        fail(f"prompts: {exc}")
    if args.limit:
        rows = rows[: args.limit]
    if not rows:
        fail(f"prompts: {spec} has no rows")
    if cfg.verifier.backend == "vllm" and (why := check_vllm_checkpoint(cfg.verifier.model_path)):
        fail(f"teacher verifier.model_path: {why}")
    from asyncrl.job.runtime import check_models

    if not check_models(cfg):  # the launcher's model checks: the teacher's endpoint or checkpoint, the policy
        print(f"error: teacher {teacher_name(cfg)} or the policy failed the checks above", file=sys.stderr)
        return 2
    out = Path(args.out)
    progress = out / "progress.json"
    if progress.exists():
        made = json.loads(progress.read_text()).get("chunk_prompts")
        if made not in (None, scfg.chunk_prompts):
            fail(f"{out} was written with synth.chunk_prompts={made}; resume with the same value or a new --out")
    tok_path = scfg.tokenizer or cfg.model.tokenizer_path or cfg.model.path
    writer = SynthWriter(out, scfg, token_counter(tok_path))
    writer.progress["chunk_prompts"] = scfg.chunk_prompts
    items = [make_item(rows, i, cfg.data, i, "synth").to_dict() for i in range(len(rows))]
    chunks = [items[i: i + scfg.chunk_prompts] for i in range(0, len(items), scfg.chunk_prompts)]
    todo = [(ci, ch) for ci, ch in enumerate(chunks) if not writer.chunk_done(ci)]
    teacher = teacher_name(cfg)
    print(f"synth: {len(rows)} prompts x {scfg.samples_per_prompt} conversations, teacher {teacher}; "
          f"{len(chunks) - len(todo)}/{len(chunks)} chunks already done in {out}", file=sys.stderr, flush=True)
    t0 = time.time()
    if todo:
        code = _run_on_fleet(cfg, scfg, todo, writer, teacher, out)
        if code:
            return code
    from asyncrl.verifier_protocol import render_verifier_messages

    system = render_verifier_messages("", None, [], cfg.rollout.guide.prompt_template)[0]["content"]
    card = {"policy": cfg.model.path, "teacher": teacher, "task": cfg.verifier.task, "prompts": spec,
            "prompt_count": len(rows), "template_tokens": len(writer.count_tokens.tokenizer.encode(system)),  # type: ignore[attr-defined]
            "samples_per_prompt": scfg.samples_per_prompt, "filters": scfg.filters.model_dump(),
            "wall_s": round(time.time() - t0, 1)}
    summary = writer.finalize(card)
    print(json.dumps(summary, indent=1))
    if summary.get("teacher_errors"):
        print(f"synth: {summary['teacher_errors']} teacher call(s) to {teacher} failed, e.g. "
              f"{summary['teacher_error_examples'][:1]}", file=sys.stderr)
    if summary["kept"] == 0:
        print(f"error: no row kept (teacher {teacher}); see {out / 'summary.json'}", file=sys.stderr)
        return 1
    return 0


def _run_on_fleet(cfg: Any, scfg: SynthConfig, todo: list[tuple[int, list[dict]]], writer: SynthWriter,
                  teacher: str, out: Path) -> int:
    """Build the job's topology, run the chunks on the rollout actors, tear it down."""
    import ray
    from tqdm import tqdm

    from asyncrl.job.runtime import preflight, prepare_run_dir, ray_init
    from asyncrl.logs import console, echo, quiet_console
    from asyncrl.startup import StartupError

    cfg.trainer.run_dir = str((out / "job").resolve())
    cfg.trainer.experiment_name = "synth"
    cfg.trainer.resume = "never"
    run_dir = prepare_run_dir(cfg)
    topo = None
    with quiet_console(run_dir):
        try:
            ray_init(cfg, f"asyncrl-synth-{os.getpid()}")
            preflight(cfg)
            from asyncrl.job.topology import build_topology

            topo = build_topology(cfg, run_dir, None)
            actors = list(topo.fleet.actors.values())
            queue = list(todo)
            sizes = {ci: len(ch) for ci, ch in todo}
            pending: dict[Any, int] = {}
            with tqdm(total=sum(len(ch) for _, ch in todo), unit="prompt", desc="synth", file=console()) as bar:
                while queue or pending:
                    while queue and len(pending) < 2 * len(actors):
                        ci, chunk = queue.pop(0)
                        actor = actors[ci % len(actors)]
                        pending[actor.synthesize.remote(chunk, scfg.samples_per_prompt)] = ci
                    done, _ = ray.wait(list(pending), num_returns=1)
                    ci = pending.pop(done[0])
                    records = ray.get(done[0])
                    rows, counts, errors = records_to_rows(records, task=cfg.verifier.task, teacher=teacher,
                                                           stop_token=cfg.rollout.guide.stop_token)
                    counts = writer.add_chunk(ci, rows, counts, errors)
                    bar.update(sizes[ci])
                    bar.set_postfix(rows=writer.totals()["written"], teacher_errors=writer.totals()["teacher_errors"])
        except StartupError as exc:
            line = str(exc).splitlines()[0]
            echo(f"error: {line}", err=True)
            return 2 if "verifier" in line else 1
        finally:
            if topo is not None:
                topo.shutdown()
            if ray.is_initialized():
                ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
