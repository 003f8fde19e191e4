"""The Guided-GRPO prompt data ships byte-identical and loads as the original uses it.

Proves: every data file of the asyncrl.data package matches the bytes copied from Guided-GRPO (SHA-256
pins; the released verifier was trained with these prompts), the loaders return the stripped
runtime values, the built-in format-prompt names resolve, and the files are declared package data.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from asyncrl.data import prompts

PINS = {
    "verifier_prompt.txt": "12d0b52305487e3eb60d27eb158e5aa6de0a535387d7b0e99c2355d8225dbc09",
    "student_system_prompt.txt": "959feca4366a734c9db3b302cbfc471cc27842f986e7724f2f58e2eb6bcf3dfb",
    "format_prompt/math.jinja": "0c2daa0a378b6cf631bb2adc1f9af90e5f1be43bdff084b1ef287c0ee520e961",
    "format_prompt/r1v.jinja": "f1b62cb8332bdbec38efc8689aff6e9ce65174c0db8967937307880f95f58fca",
    "format_prompt/dapo.jinja": "a1ab12f854882f5e1415646379895da88164460282cefc476336d8a4ba2dea9f",
}


@pytest.mark.parametrize("name,digest", sorted(PINS.items()))
def test_data_files_pinned(name, digest):
    assert hashlib.sha256(prompts.read_data_file(name).encode("utf-8")).hexdigest() == digest


def test_runtime_values():
    t = prompts.default_verifier_template()
    assert t == prompts.read_data_file("verifier_prompt.txt").strip()
    assert "\\boxed{...}" in t and "\\\\boxed" not in t  # single backslash at runtime
    assert "###STOP###" in t and t.count("\n") == 34
    assert prompts.resolve_verifier_template(None) == t
    assert prompts.resolve_verifier_template("  x \n") == "x"
    s = prompts.student_system_prompt()
    assert s.startswith("You are the student solving the math problem") and s.endswith("concise and precise.")
    math = prompts.format_prompt_template("math")
    assert math.startswith("{{ content | trim }}\n\nYou MUST follow") and "3–6" in math
    assert prompts.format_prompt_template("guided_math") == math
    assert "\\n\\n{{ content | trim }}\\n\\n" in prompts.format_prompt_template("dapo")  # literal backslash-n
    with pytest.raises(KeyError, match="unknown built-in format prompt"):
        prompts.format_prompt_template("nope")


def test_declared_as_package_data():
    """Every pinned file matches a package-data pattern of `asyncrl.data`, so a wheel ships it."""
    from fnmatch import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["asyncrl.data"]
    for name in [*PINS, "NOTICE.md"]:
        assert (root / "asyncrl" / "data" / name).is_file()
        assert any(fnmatch(name, p) and name.count("/") == p.count("/") for p in patterns), name
