"""`python -m asyncrl.report RUN_DIR [--output FILE]`: one self-contained HTML page about a run.

Written automatically at the end of every run as `<run_dir>/report.html`; works on a running job's
directory too (it reads only files the job flushes as it goes). The page needs no network and no
server: plots are matplotlib PNGs embedded as base64, styles are inline, and a Content-Security-Policy
forbids every external load. Sections:
- the before/after evaluation table (test split, greedy) with binomial standard errors;
- metric curves from `metrics.jsonl` (reward, guided/solver accuracy, turns, tokens/s, idle ratios,
  staleness histogram, behaviour/learner mismatch KL), headed by the trained (sampled) reward's change
  beside the greedy accuracy's and why the two differ;
- generated vs trained groups by difficulty and length (the buffer's `buffer/mix/...` counts), so a
  drop or filter rule that favours easy or short prompts is visible;
- the conversation viewer: the same test problems before and after training side by side, every
  policy turn with the verifier's reply, `[SCORE]` and `###STOP###` marked, the final answer and
  whether it is right (from `samples/eval_before.json` / `eval_after.json`);
- a few trajectories the learner trained on at the last step, with reward parts, version lag and
  the verifier version that guided them (`samples/train_step_N.json`);
- the resolved config, folded.
Missing inputs (a run still starting, no evaluation configured) leave their section with a note.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

EVAL_ROWS = (("guided_accuracy", "guided accuracy"), ("solver_accuracy", "solver-only accuracy"),
             ("mean_turns", "turns per sample"), ("mean_policy_tokens", "policy tokens / sample"),
             ("mean_verifier_tokens", "verifier tokens / sample"), ("format_rate", "format rate"),
             ("hallucination_score", "verifier step score"))

PANELS = (  # (title, [(metric key, label)])
    ("Reward", [("rollout/reward_mean", "rollout reward"), ("train/reward_mean", "trained reward"),
                ("reward/accuracy", "trained accuracy"), ("eval/guided_accuracy", "greedy accuracy (val)")]),
    ("Accuracy (evaluations)", [("eval/guided_accuracy", "guided (val)"), ("eval/solver_accuracy", "solver-only (val)")]),
    ("Turns per sample", [("rollout/turns_mean", "rollout"), ("train/turns_mean", "trained")]),
    ("Tokens / s", [("perf/policy_tokens_per_s", "trained tokens/s"), ("rollout/tokens_per_s", "rollout tokens/s")]),
    ("Idle ratios", [("perf/learner_idle_ratio", "learner idle"), ("perf/rollout_idle_ratio", "rollout idle")]),
    ("Mismatch KL (behaviour vs learner)", [("train/mismatch_kl", "mismatch KL")]),
)


# ------------------------------------------------------------------------------------- inputs
def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The effective rows of metrics.jsonl (a resumed or recovered run's rolled-back steps are
    dropped at each `resumed_from` marker); a last line still being written (running job) is skipped.
    Rows of an older run also answer to the keys' current names (asyncrl.metrics.upgrade_row)."""
    from asyncrl.metrics import effective_rows, upgrade_row

    rows = []
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return [upgrade_row(r) for r in effective_rows(rows)]


def _eval_file(run_dir: Path, tag: str) -> dict[str, Any] | None:
    return _read_json(run_dir / "samples" / f"eval_{tag}.json")


def _last_train_samples(run_dir: Path) -> tuple[int | None, list[dict[str, Any]]]:
    files = sorted((run_dir / "samples").glob("train_step_*.json"),
                   key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not files:
        return None, []
    return int(re.sub(r"\D", "", files[-1].stem)), _read_json(files[-1]) or []


# ------------------------------------------------------------------------------------- plots
def _num(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value)):
        return float(value)
    return None


def moving_average(ys: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def plot_images(rows: list[dict[str, Any]], before: dict | None = None, after: dict | None = None) -> list[tuple[str, str]]:
    """(title, base64 PNG) per panel that has data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    for title, keys in PANELS:
        series = [(label, [(r["step"], _num(r.get(k))) for r in rows if _num(r.get(k)) is not None])
                  for k, label in keys]
        extra = []
        if title.startswith("Accuracy"):  # the test-split evaluations before and after as points
            steps = [r["step"] for r in rows] or [0]
            for tag, d, x in (("before", before, 0), ("after", after, max(steps))):
                for key, label in (("guided_accuracy", "guided (test)"), ("solver_accuracy", "solver-only (test)")):
                    if d and _num(d.get(key)) is not None:
                        extra.append((f"{label} {tag}", x, d[key], d.get(f"{key}_se")))
        if not any(pts for _, pts in series) and not extra:
            continue
        fig, ax = plt.subplots(figsize=(5.2, 3.0))
        for label, pts in series:
            if not pts:
                continue
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            if len(pts) < 40:
                ax.plot(xs, ys, marker=".", linewidth=1.2, label=label)
            else:  # per-step values are noisy: faint raw line + a moving average over ~1/20 of the run
                (line,) = ax.plot(xs, ys, linewidth=0.7, alpha=0.3)
                ax.plot(xs, moving_average(ys, max(3, len(ys) // 20)), linewidth=1.6, color=line.get_color(),
                        label=f"{label} (moving avg.)")
        for label, x, y, se in extra:
            ax.errorbar([x], [y], yerr=[se or 0.0], fmt="s" if "guided" in label else "D", capsize=3, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("learner step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        out.append((title, _png(fig)))
    from asyncrl.metrics import staleness_total

    hist = staleness_total(rows)
    if hist:
        fig, ax = plt.subplots(figsize=(5.2, 3.0))
        ax.bar(range(len(hist)), hist)
        ax.set_xticks(range(len(hist)))
        ax.set_title("Staleness of trained groups", fontsize=10)
        ax.set_xlabel("version lag (learner version - group's oldest token version)", fontsize=8)
        ax.set_ylabel("groups", fontsize=8)
        ax.tick_params(labelsize=7)
        fig.tight_layout()
        out.append(("Staleness histogram", _png(fig)))
    means = sync_phase_means(rows)
    if means:
        out.append(("Weight sync by phase", _png(sync_phase_figure(plt, means))))
    return out


SYNC_SIDES = (("send", "sender (learner)"), ("recv", "receiver (slowest actor)"), ("engine", "engine pause->resume"))
SYNC_WHOLE = {"round", "total"}  # the round itself, not a phase of it


def sync_phase_means(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean seconds per phase of the weight round over the steps that logged it, by side
    (`perf/weight_sync/{side}_{phase}_s`, asyncrl.job.step_metrics.weight_sync_phases); the engine's
    `round` is the receiver's whole round seen from outside, so it is left out of the engine's bar."""
    sums: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        for k, v in r.items():
            if not k.startswith("perf/weight_sync/") or _num(v) is None:
                continue
            side, _, phase = k[len("perf/weight_sync/"):-2].partition("_")
            sums.setdefault(side, {}).setdefault(phase, []).append(float(v))
    out = {}
    for side, phases in sums.items():
        skip = SYNC_WHOLE | ({"round"} if side == "engine" else set())
        out[side] = {p: sum(vs) / len(vs) for p, vs in phases.items() if p not in skip}
    return out


def sync_phase_figure(plt: Any, means: dict[str, dict[str, float]]) -> Any:
    """One horizontal stacked bar per side: where a weight round's seconds go."""
    sides = [(s, label) for s, label in SYNC_SIDES if s in means]
    fig, ax = plt.subplots(figsize=(7.5, 1.0 + 0.7 * len(sides)))
    colors = plt.get_cmap("tab20").colors
    seen: dict[str, Any] = {}
    for y, (side, _) in enumerate(sides):
        left = 0.0
        for phase, sec in means[side].items():
            if sec <= 0:
                continue
            color = seen.setdefault(phase, colors[len(seen) % len(colors)])
            ax.barh(y, sec, left=left, color=color, label=phase if phase not in ax.get_legend_handles_labels()[1] else None)
            left += sec
    ax.set_yticks(range(len(sides)))
    ax.set_yticklabels([label for _, label in sides], fontsize=7)
    ax.set_xlabel("seconds per weight round (mean over steps)", fontsize=8)
    ax.set_title("Weight sync by phase", fontsize=10)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35 - 0.05 * len(sides)))
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------- html pieces
def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def mark_verifier(text: str | None) -> str:
    """Escaped verifier reply with `[SCORE] ...` and `###STOP###` wrapped in <mark>."""
    if text is None:
        return '<span class="muted">(no verifier call)</span>'
    out = _e(text)
    out = re.sub(r"(\[SCORE\][^\n<]*)", r'<mark class="score">\1</mark>', out)
    out = out.replace("###STOP###", '<mark class="stop">###STOP###</mark>')
    return out


def _fmt(value: Any, digits: int = 3) -> str:
    v = _num(value)
    return "-" if v is None else f"{v:.{digits}f}"


def eval_table(before: dict | None, after: dict | None) -> str:
    if not before and not after:
        return '<p class="muted">No before/after evaluation (yet): it needs data.test_files and trainer.eval_before_after.</p>'
    b, a = before or {}, after or {}
    head = "<tr><th></th><th>before</th><th>after</th><th>change</th></tr>"
    body = []
    for key, label in EVAL_ROWS:
        vb, va = _num(b.get(key)), _num(a.get(key))
        if vb is None and va is None:
            continue
        cell = []
        for d, v in ((b, vb), (a, va)):
            se = _num(d.get(f"{key}_se"))
            cell.append(_fmt(v) + (f' <span class="se">± {se:.3f}</span>' if se is not None else ""))
        change = f"{va - vb:+.3f}" if vb is not None and va is not None else ""
        body.append(f"<tr><td>{_e(label)}</td><td>{cell[0]}</td><td>{cell[1]}</td><td>{change}</td></tr>")
    rows = b.get("rows") or a.get("rows")
    note = f"<p class='muted'>Test split, greedy, {rows} rows; ± is the binomial standard error.</p>" if rows else ""
    return f'<table class="eval">{head}{"".join(body)}</table>{note}'


def conversation_html(conv: dict[str, Any] | None, *, label: str) -> str:
    if conv is None:
        return f'<div class="conv empty"><div class="conv-head">{_e(label)}</div><p class="muted">not recorded</p></div>'
    ok = bool(conv.get("correct"))
    turns = []
    for i, t in enumerate(conv.get("turns", []), 1):
        turns.append(f'<div class="turn policy"><span class="who">policy · turn {i}</span><pre>{_e(t.get("policy"))}</pre></div>')
        if t.get("verifier") is not None or t.get("user") is not None:
            score = t.get("score")
            badge = "" if score is None else f' <span class="badge s{int(score)}">step score {int(score)}</span>'
            stop = ' <span class="badge stopb">STOP</span>' if t.get("stop") else ""
            turns.append(f'<div class="turn verifier"><span class="who">verifier{badge}{stop}</span>'
                         f'<pre>{mark_verifier(t.get("verifier"))}</pre></div>')
    verdict = ('<span class="right">✓ right</span>' if ok else '<span class="wrong">✗ wrong</span>')
    return (f'<div class="conv {"ok" if ok else "bad"}"><div class="conv-head">{_e(label)} · {conv.get("num_turns")} turn(s) · '
            f'{_e(conv.get("finish_reason"))}</div>{"".join(turns)}'
            f'<div class="final">final answer <b>{_e(conv.get("final_answer") or "(none)")}</b> · reference '
            f'{_e(conv.get("answer"))} · {verdict}</div></div>')


def conversation_viewer(before: dict | None, after: dict | None, mode: str = "guided") -> str:
    convs_b = {c["id"]: c for c in ((before or {}).get("conversations") or {}).get(mode, [])}
    convs_a = {c["id"]: c for c in ((after or {}).get("conversations") or {}).get(mode, [])}
    ids = sorted(set(convs_b) | set(convs_a))
    if not ids:
        return ('<p class="muted">No evaluation conversations recorded in samples/eval_before.json / eval_after.json '
                '(they are saved by the rule-verifier evaluation of runs made with this version).</p>')
    out = []
    for pid in ids:
        ref = convs_b.get(pid) or convs_a.get(pid) or {}
        out.append(f'<div class="problem" data-problem="{_e(pid)}"><h3>{_e(ref.get("problem"))} '
                   f'<span class="muted">({_e(pid)}, answer {_e(ref.get("answer"))})</span></h3><div class="pair">'
                   f'{conversation_html(convs_b.get(pid), label="before training")}'
                   f'{conversation_html(convs_a.get(pid), label="after training")}</div></div>')
    return "".join(out)


def trained_samples(step: int | None, samples: list[dict[str, Any]], limit: int = 4) -> str:
    if not samples:
        return '<p class="muted">No trained trajectories dumped yet (samples/train_step_N.json).</p>'
    out = [f"<p class='muted'>From the batch of learner step {step}.</p>"]
    for s in samples[:limit]:
        parts = ", ".join(f"{_e(k)} {_fmt(v, 2)}" for k, v in (s.get("reward_parts") or {}).items())
        msgs = s.get("messages") or []
        vtexts = list(s.get("verifier_texts") or [])
        turns, k = [], 0
        for m in msgs[1:]:
            if m.get("role") == "assistant":
                turns.append(f'<div class="turn policy"><span class="who">policy</span><pre>{_e(m.get("content"))}</pre></div>')
                vt = vtexts[k] if k < len(vtexts) else None
                k += 1
                if vt is not None:
                    turns.append(f'<div class="turn verifier"><span class="who">verifier</span><pre>{mark_verifier(vt)}</pre></div>')
        problem = msgs[0].get("content") if msgs else s.get("prompt_uid")
        lag = s.get("version_lag")
        out.append(f'<div class="conv sample"><div class="conv-head">{_e(problem)} · reward {_fmt(s.get("reward"), 2)} '
                   f'({parts}) · version lag {_e("-" if lag is None else lag)} · policy versions per turn '
                   f'{_e(s.get("turn_versions") or "-")} · verifier {_e(s.get("verifier_version"))} · '
                   f'{_e(s.get("finish_reason"))}</div>{"".join(turns)}</div>')
    return "".join(out)


def reward_vs_accuracy(rows: list[dict[str, Any]], config: dict[str, Any], before: dict | None,
                       after: dict | None) -> str:
    """The trained reward's change next to the greedy accuracy's, and why the two differ: a flat
    reward curve is otherwise read as "RL is not working" while the evaluated policy improves."""
    rewards = [(r["step"], float(r["train/reward_mean"])) for r in rows if _num(r.get("train/reward_mean")) is not None]
    if len(rewards) < 2:
        return ""
    w = max(1, len(rewards) // 6)  # first and last sixth of the steps (25 of the quick start's 150)
    first, last = rewards[:w], rewards[-w:]
    mean_first, mean_last = (sum(v for _, v in part) / len(part) for part in (first, last))
    temp = (config.get("rollout") or {}).get("temperature")
    parts = [f"Trained reward (samples at temperature {_e(temp)} on training prompts): {mean_first:.3f} over steps "
             f"{first[0][0]}-{first[-1][0]} → {mean_last:.3f} over steps {last[0][0]}-{last[-1][0]} "
             f"({mean_last - mean_first:+.3f})."]
    gb, ga = _num((before or {}).get("guided_accuracy")), _num((after or {}).get("guided_accuracy"))
    evals = [(r["step"], float(r["eval/guided_accuracy"])) for r in rows if _num(r.get("eval/guided_accuracy")) is not None]
    if gb is not None and ga is not None:
        parts.append(f"Greedy guided accuracy (test): {gb:.3f} before → {ga:.3f} after ({ga - gb:+.3f}).")
    elif len(evals) >= 2:
        parts.append(f"Greedy guided accuracy (val): {evals[0][1]:.3f} at step {evals[0][0]} → {evals[-1][1]:.3f} "
                     f"at step {evals[-1][0]} ({evals[-1][1] - evals[0][1]:+.3f}).")
    why = ("Why they can differ: the reward is the success rate of conversations sampled at the training "
           "temperature, greedy accuracy that of the most likely turn at every decision. On the quick start, the "
           "greedy policy learnt to fit a 4-step problem into its 4 turns (accuracy on them 0.00 → 0.42), which "
           "sampling at 0.5 already did about as often before training (0.30 → 0.31): the reward had that gain "
           "from the start (docs/index.md, “Training reward vs greedy accuracy”).")
    return f'<p class="reward-note">{" ".join(parts)}<br><span class="muted">{why}</span></p>'


def _mix_rows(last: dict[str, Any], dim: str) -> dict[str, dict[str, float]]:
    """bucket -> {kind: groups} from the buffer's `buffer/mix/<kind>/<dim>/<bucket>` counters."""
    out: dict[str, dict[str, float]] = {}
    for key, value in last.items():
        parts = key.split("/")
        if len(parts) == 5 and parts[:2] == ["buffer", "mix"] and parts[3] == dim and _num(value) is not None:
            out.setdefault(parts[4], {})[parts[2]] = float(value)
    return out


def _bucket_order(name: str) -> tuple[int, str]:
    digits = re.findall(r"\d+", name)
    return (int(digits[0]) if digits else 1 << 30, name)


def group_mix_table(rows: list[dict[str, Any]]) -> str:
    """Generated vs delivered (trained) vs dropped groups by difficulty and by length, from the
    last step's run counters: a drop or filter rule that favours easy or short prompts shows as a
    delivered share below the generated share in the hard or long rows."""
    last = next((r for r in reversed(rows) if any(k.startswith("buffer/mix/") for k in r)), None)
    if last is None:
        return '<p class="muted">No generated/trained group counts (buffer/mix/...) in metrics.jsonl.</p>'
    kinds = ("generated", "delivered", "dropped_stale", "dropped_filtered")
    head = ("<tr><th>bucket</th>" + "".join(f"<th>{k.replace('_', ' ')}</th>" for k in kinds)
            + "<th>share of generated</th><th>share of delivered</th><th>delivered / generated</th></tr>")
    out = []
    for dim, title in (("difficulty", "by difficulty"), ("length", "by policy tokens per sample")):
        mix = _mix_rows(last, dim)
        if not mix:
            continue
        totals = {k: sum(b.get(k, 0.0) for b in mix.values()) for k in kinds}
        body = []
        for bucket in sorted(mix, key=_bucket_order):
            b = mix[bucket]
            gen, dlv = b.get("generated", 0.0), b.get("delivered", 0.0)
            shares = [f"{100 * b.get(k, 0.0) / totals[k]:.1f}%" if totals[k] else "-" for k in ("generated", "delivered")]
            body.append(f"<tr><td>{_e(bucket)}</td>" + "".join(f"<td>{b.get(k, 0.0):.0f}</td>" for k in kinds)
                        + f"<td>{shares[0]}</td><td>{shares[1]}</td><td>{_fmt(dlv / gen if gen else None, 2)}</td></tr>")
        out.append(f"<h3>{_e(title)}</h3><table class='eval mix'>{head}{''.join(body)}</table>")
    means = [f"{k.replace('_', ' ')} {_fmt(last.get(f'buffer/mix/{k}/len_mean'), 1)}" for k in kinds
             if _num(last.get(f"buffer/mix/{k}/len_mean")) is not None]
    out.append(f"<p class='muted'>Policy tokens per sample: {_e(', '.join(means))}. Counts over the run up to step "
               f"{_e(last.get('step'))}; delivered groups are the ones the learner trained; generated minus delivered "
               "minus dropped were still in the buffer then.</p>")
    return "".join(out)


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;color:#1d232a;
background:#fafbfc;padding:0 16px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;border-bottom:1px solid #d8dee4;padding-bottom:4px;margin-top:28px}
h3{font-size:14px;margin:14px 0 6px}.muted{color:#6a737d;font-weight:normal}.se{color:#6a737d;font-size:12px}
table.eval{border-collapse:collapse;font-size:14px}table.eval td,table.eval th{border:1px solid #d8dee4;padding:4px 10px;
text-align:right}table.eval td:first-child{text-align:left}
.plots{display:flex;flex-wrap:wrap;gap:10px}.plots figure{margin:0;background:#fff;border:1px solid #e1e4e8;padding:4px}
.plots img{display:block;width:360px}
.pair{display:grid;grid-template-columns:1fr 1fr;gap:12px}
.conv{background:#fff;border:1px solid #d8dee4;border-radius:6px;padding:8px;margin-bottom:8px}
.conv.ok{border-left:4px solid #2da44e}.conv.bad{border-left:4px solid #cf222e}
.conv-head{font-size:12px;color:#57606a;margin-bottom:6px}
.turn{border-radius:6px;padding:4px 8px;margin:4px 0}.turn pre{margin:2px 0;white-space:pre-wrap;font-size:13px;
font-family:ui-monospace,SFMono-Regular,Menlo,monospace}
.turn.policy{background:#eef4ff}.turn.verifier{background:#fff6e5;margin-left:24px}
.who{font-size:11px;color:#57606a;text-transform:uppercase;letter-spacing:.03em}
mark.score{background:#d2f4d3;padding:0 2px}mark.stop{background:#ffd8d3;font-weight:bold;padding:0 2px}
.badge{font-size:10px;border-radius:8px;padding:0 6px;margin-left:4px;text-transform:none}.badge.s1{background:#d2f4d3}
.badge.s0{background:#ffd8d3}.badge.stopb{background:#e1e4e8}
.final{font-size:13px;margin-top:6px}.right{color:#1a7f37;font-weight:bold}.wrong{color:#cf222e;font-weight:bold}
details pre{background:#fff;border:1px solid #e1e4e8;padding:8px;font-size:12px;overflow:auto;max-height:600px}
"""

# Records load-time errors and image failures into the DOM (body[data-*]) so a headless browser test
# can read them from the serialised page; the page shows nothing from it.
HOOK = """
window.__errors=[];window.addEventListener('error',function(e){window.__errors.push(String(e.message||e.type));
document.body.setAttribute('data-js-errors',String(window.__errors.length));},true);
window.addEventListener('load',function(){var imgs=document.querySelectorAll('img.plot'),ok=0;
for(var i=0;i<imgs.length;i++){if(imgs[i].complete&&imgs[i].naturalWidth>0){ok++;}}
document.body.setAttribute('data-plots-loaded',String(ok));
document.body.setAttribute('data-js-errors',String(window.__errors.length));});
"""


def render(run_dir: str | Path) -> str:
    """The report page of `run_dir` as one HTML string."""
    run_dir = Path(run_dir)
    config = _read_json(run_dir / "config.resolved.json") or {}
    summary = _read_json(run_dir / "summary.json") or {}
    rows = read_metrics(run_dir)
    before = _eval_file(run_dir, "before") or summary.get("before")
    after = _eval_file(run_dir, "after") or summary.get("after")
    step, samples = _last_train_samples(run_dir)
    running = (run_dir / "job.json").exists()
    name = (config.get("trainer") or {}).get("experiment_name") or run_dir.name
    max_steps = (config.get("trainer") or {}).get("max_steps")
    last = rows[-1]["step"] if rows else 0
    state = (f"running: step {last}/{max_steps}" if running else
             f"finished: {summary.get('steps', last)} steps in {summary.get('wall_s', 0):.0f} s" if summary else
             f"stopped or starting: step {last}/{max_steps}")
    facts = []
    if summary:
        facts.append(f"trained tokens/s {summary.get('trained_tokens_per_s', 0):.0f}, weight sync "
                     f"{summary.get('weight_sync_s', 0):.1f} s in all, learner waited {summary.get('learner_wait_s', 0):.1f} s")
    plots = plot_images(rows, before, after)
    figs = "".join(f'<figure><img class="plot" alt="{_e(t)}" src="data:image/png;base64,{b}"></figure>' for t, b in plots)
    if not figs:
        figs = '<p class="muted">No learner step logged yet (metrics.jsonl is empty).</p>'
    cfg_text = _e(json.dumps(config, indent=2))
    solver = conversation_viewer(before, after, mode="solver")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>asyncrl report: {_e(name)}</title><style>{CSS}</style><script>{HOOK}</script></head>
<body>
<h1>asyncrl run report: {_e(name)}</h1>
<p class="muted">{_e(state)} · {_e(run_dir)} · generated {time.strftime('%Y-%m-%d %H:%M:%S')}</p>
<p>{_e('; '.join(facts))}</p>
<h2 id="evaluation">Before / after training</h2>
{eval_table(before, after)}
<h2 id="curves">Curves</h2>
{reward_vs_accuracy(rows, config, before, after)}
<div class="plots">{figs}</div>
<h2 id="group-mix">Generated vs trained groups</h2>
{group_mix_table(rows)}
<h2 id="conversations">Guided conversations, before and after training</h2>
<p class="muted">Same test problems, greedy. Verifier replies: <mark class="score">[SCORE]</mark> is its per-turn step
score, <mark class="stop">###STOP###</mark> accepts the answer; anything else is the guidance the policy sees next.</p>
<div id="viewer">{conversation_viewer(before, after)}</div>
<details><summary>Solver-only conversations (no verifier guidance)</summary>{solver}</details>
<h2 id="trained">Trained trajectories (last dumped step)</h2>
{trained_samples(step, samples)}
<h2 id="config">Configuration</h2>
<details><summary>Resolved config (config.resolved.json)</summary><pre>{cfg_text}</pre></details>
</body></html>
"""


def write_report(run_dir: str | Path, output: str | Path | None = None) -> Path:
    run_dir = Path(run_dir)
    path = Path(output) if output else run_dir / "report.html"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render(run_dir))
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run directory (runs/<experiment>), finished or still running")
    p.add_argument("--output", "-o", default=None, help="where to write the page (default RUN_DIR/report.html)")
    a = p.parse_args(argv)
    run_dir = Path(a.run_dir)
    if not (run_dir / "config.resolved.json").exists() and not (run_dir / "metrics.jsonl").exists():
        print(f"error: {run_dir} is not a run directory (no config.resolved.json or metrics.jsonl)", file=sys.stderr)
        return 2
    print(write_report(run_dir, a.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
