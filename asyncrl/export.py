"""`python -m asyncrl.export RUN_DIR [--merge]`: a run's trained policy as a standalone model.

From the newest complete checkpoint of RUN_DIR (`runs/<experiment>`, or `--checkpoint` naming
one): with `--merge`, an HF checkpoint of the base model with the LoRA adapter merged in (what
transformers and vLLM load with no PEFT); without it, the adapter alone in PEFT format (load with
`peft.PeftModel.from_pretrained(base, DIR)` or serve with vLLM's `--lora-modules`). A run without
`model.lora` has no adapter: its checkpoint's `hf/` export is already the full model, and
`--merge` copies it. The merge is PEFT's own (`merge_and_unload`) on the base model named in the
run's resolved config, in that config's precision; the tokenizer is written beside the weights.
Exit 2 for a run directory, checkpoint or base model that is not there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from asyncrl.learner.checkpoint import ADAPTER_DIR, latest_checkpoint

__all__ = ["export", "main"]


class ExportError(RuntimeError):
    """A missing run directory, checkpoint or base model (exit 2)."""


def _checkpoint(run_dir: Path, checkpoint: str | None) -> Path:
    if checkpoint:
        path = Path(checkpoint) if Path(checkpoint).is_absolute() else run_dir / "checkpoints" / checkpoint
        if not path.is_dir():
            raise ExportError(f"--checkpoint {checkpoint}: no checkpoint directory {path}")
        return path
    path = latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        raise ExportError(f"{run_dir}: no complete checkpoint under {run_dir / 'checkpoints'} (is it a run directory?)")
    return path


def _run_config(run_dir: Path) -> dict:
    resolved = run_dir / "config.resolved.json"
    if not resolved.is_file():
        raise ExportError(f"{run_dir}: no config.resolved.json (is it a run directory, runs/<experiment>?)")
    return json.loads(resolved.read_text())


def export(run_dir: str | Path, out: str | Path | None = None, *, merge: bool = False,
           checkpoint: str | None = None) -> Path:
    """Write the run's policy to `out` (default RUN_DIR/export/{merged,adapter}); returns it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    ckpt = _checkpoint(run_dir, checkpoint)
    out = Path(out) if out else run_dir / "export" / ("merged" if merge else "adapter")
    adapter = ckpt / ADAPTER_DIR
    if not adapter.is_dir():  # a full fine-tuning run: hf/ is the model
        if not merge:
            raise ExportError(f"{ckpt} has no {ADAPTER_DIR}/ (the run did not train a LoRA adapter): "
                              "use --merge to export its full model")
        _replace(ckpt / "hf", out)
        return out
    if not merge:
        _replace(adapter, out)
        return out
    model_cfg = _run_config(run_dir)["model"]
    _merge(adapter, model_cfg, out)
    return out


def _replace(src: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)


def _merge(adapter: Path, model_cfg: dict, out: Path) -> None:
    """Base model + adapter merged by PEFT, saved as a plain HF checkpoint with the tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_path = model_cfg["path"]
    if not Path(base_path).exists() and Path(base_path).is_absolute():
        raise ExportError(f"the run's base model {base_path} is not there (model.path of config.resolved.json)")
    trust = bool(model_cfg.get("trust_remote_code"))
    base = AutoModelForCausalLM.from_pretrained(base_path, trust_remote_code=trust)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    tmp = out.with_name(f".tmp-{out.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    merged.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(model_cfg.get("tokenizer_path") or base_path, trust_remote_code=trust).save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run directory, runs/<experiment> (holds checkpoints/)")
    parser.add_argument("--merge", action="store_true", help="merge the adapter into the base model (HF checkpoint)")
    parser.add_argument("--checkpoint", help="a checkpoint (step_N or a path); default: the newest complete one")
    parser.add_argument("--out", help="output directory (default RUN_DIR/export/merged or RUN_DIR/export/adapter)")
    args = parser.parse_args(argv)
    try:
        out = export(args.run_dir, args.out, merge=args.merge, checkpoint=args.checkpoint)
    except ExportError as exc:
        print(f"asyncrl.export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {'merged model' if args.merge else 'adapter'} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
