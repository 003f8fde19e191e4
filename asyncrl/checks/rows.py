"""The one vocabulary of every check (preflight, doctor): a `Row` per finding."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Row:
    """One line of the preflight: a ✔ or a ✘ with what to change."""

    check: str
    ok: bool
    result: str
    fix: str = ""
    notice: bool = False  # a ✔ the launcher says aloud (something was derived differently)
