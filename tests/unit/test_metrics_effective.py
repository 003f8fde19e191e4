"""The effective history of a metrics.jsonl that went through a rollback: the rows after the
newest `resumed_from` marker replace the earlier rows of the same steps."""

from __future__ import annotations

from asyncrl.metrics import effective_rows


def test_rows_after_the_marker_replace_the_rolled_back_steps() -> None:
    rows = [{"step": s, "run": "first"} for s in (1, 2, 3, 4)]
    rows.append({"step": 2, "resumed_from": "checkpoints/step_2", "rolled_back_steps": 2})
    rows += [{"step": s, "run": "second"} for s in (3, 4, 5)]
    eff = effective_rows(rows)
    assert [(r["step"], r["run"]) for r in eff] == [(1, "first"), (2, "first"), (3, "second"), (4, "second"),
                                                   (5, "second")]
    assert effective_rows(rows[:4]) == rows[:4]  # no marker: unchanged
