"""One verifier's table over the replayed turns (docs/rescore.md#the-table).

Definitions (each a ratio with its count, so a reader sees how much it rests on):
- agreement with the run: turns where both the run's verifier and this one gave a `[SCORE]` and the
  two are equal, over turns where both gave one;
- agreement with the ground truth: the same against the task's checker (`get_step_checker`);
- `[SCORE]` parse rate: answered guidance replies (not STOP) carrying a parsable score, over
  answered guidance replies (a STOP reply need not score);
- STOP decisions: replies read as STOP (`parse_verifier_reply`, the rollout's own rule), and how
  often they match the run's STOP decision;
- tokens: completion tokens the verifier reported (the rule back-end counts words);
- latency: per request, retries included (p50, p95, ms);
- failed: requests with no reply after the client's retries, with the first error.
"""

from __future__ import annotations

from typing import Any

__all__ = ["verifier_table", "render_markdown"]


def _ratio(num: int, den: int) -> dict[str, Any]:
    return {"rate": round(num / den, 4) if den else None, "n": den}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


def verifier_table(name: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """`records`: one per turn, {ok, error, label, stop, run_label, run_stop, truth_label, tokens,
    latency_ms} (what __main__ appends to replies.jsonl)."""
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    both = [r for r in ok if r["label"] is not None and r["run_label"] is not None]
    truth = [r for r in ok if r["label"] is not None and r.get("truth_label") is not None]
    guidance = [r for r in ok if not r["stop"]]
    return {
        "verifier": name, "turns": len(records), "answered": len(ok), "failed": len(failed),
        "first_error": failed[0]["error"] if failed else None,
        "agreement_with_run": _ratio(sum(r["label"] == r["run_label"] for r in both), len(both)),
        "agreement_with_truth": _ratio(sum(r["label"] == r["truth_label"] for r in truth), len(truth)),
        "score_parse_rate": _ratio(sum(r["label"] is not None for r in guidance), len(guidance)),
        "stop": {"count": sum(r["stop"] for r in ok), **_ratio(sum(r["stop"] for r in ok), len(ok))},
        "stop_matches_run": _ratio(sum(r["stop"] == r["run_stop"] for r in ok), len(ok)),
        "tokens": {"total": sum(r["tokens"] for r in ok),
                   "mean": round(sum(r["tokens"] for r in ok) / len(ok), 2) if ok else None},
        "latency_ms": {"p50": _pct([r["latency_ms"] for r in ok], 0.5), "p95": _pct([r["latency_ms"] for r in ok], 0.95)},
        "reference_missing": sum(bool(r.get("reference_missing")) for r in records),
    }


def _cell(x: dict[str, Any]) -> str:
    return "n/a (0)" if x["rate"] is None else f"{x['rate']:.3f} ({x['n']})"


def render_markdown(t: dict[str, Any]) -> str:
    rows = [
        ("turns replayed", f"{t['turns']} (answered {t['answered']}, failed {t['failed']})"),
        ("step-label agreement with the run's verifier", _cell(t["agreement_with_run"])),
        ("step-label agreement with the ground truth", _cell(t["agreement_with_truth"])),
        ("[SCORE] parse rate (guidance replies)", _cell(t["score_parse_rate"])),
        ("STOP decisions", f"{t['stop']['count']} ({_cell(t['stop'])} of answered)"),
        ("STOP decision equals the run's", _cell(t["stop_matches_run"])),
        ("completion tokens (total / mean)", f"{t['tokens']['total']} / {t['tokens']['mean']}"),
        ("latency ms (p50 / p95)", f"{t['latency_ms']['p50']} / {t['latency_ms']['p95']}"),
    ]
    if t["failed"]:
        rows.append(("first error", str(t["first_error"])[:200].replace("|", "/")))
    if t["reference_missing"]:
        rows.append(("turns sent without their reference (training rows unreadable)", str(t["reference_missing"])))
    lines = [f"# Re-scored with {t['verifier']}", "", "| measure | value (n) |", "|---|---|"]
    return "\n".join(lines + [f"| {a} | {b} |" for a, b in rows]) + "\n"
