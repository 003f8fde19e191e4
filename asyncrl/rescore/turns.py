"""The verifier requests a finished run made, rebuilt from its stored conversations.

A run keeps conversations in two places (asyncrl.job.loop, asyncrl.eval): `samples/train_*.json`
(a few trained trajectories per evaluation: chat `messages`, the verifier's raw `verifier_texts`
and `hallucination_scores`) and `samples/eval_*.json` (`conversations.guided`: problem, answer and
per-turn policy text, verifier reply, score, STOP). Turn k of a conversation becomes one request
with the policy turns 1..k, rendered exactly as the rollout renders it
(`render_verifier_messages`). The reference answer is shown as the run showed it
(`rollout.guide.verifier_sees_reference`: training turns only by default, never evaluation); for
training turns it is found by the problem's text among the rows of `data.train_files`, and is `N/A`
when those rows cannot be read (counted in the table). Solver-only transcripts have no verifier
turns and are skipped.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl.verifier_protocol import flatten_content, parse_verifier_reply

__all__ = ["ReplayTurn", "load_turns", "NoConversations"]


class NoConversations(ValueError):
    """The run directory holds no stored conversation to replay."""


@dataclass(frozen=True)
class ReplayTurn:
    key: str
    """`<file>:<conversation>:<turn>`, unique within the run (the resume key)."""
    problem: Any
    reference: str | None
    policy_turns: list[str]
    run_reply: str
    run_label: int | None
    """The run verifier's `[SCORE]` for this turn (None: it gave none)."""
    run_stop: bool
    truth_label: int | None = None
    """The task checker's label (None: no checker, or nothing to label)."""
    reference_missing: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _reference_index(cfg: dict[str, Any], run_dir: Path) -> dict[str, str] | None:
    """Problem text -> answer over the training rows, or None when they cannot be read."""
    from asyncrl.config import load_config
    from asyncrl.data.messages import build_messages
    from asyncrl.data.sources import load_rows

    data = cfg.get("data") or {}
    spec = data.get("train_files")
    if not spec:
        return None
    conf = load_config(None, [f"data.{k}={json.dumps(v)}" for k, v in data.items()
                              if k in ("prompt_key", "answer_key", "system_prompt", "format_prompt")])
    for base in (Path.cwd(), run_dir, *run_dir.parents):
        try:
            rows = load_rows(str(base / spec) if not Path(spec).is_absolute() else spec, conf.data)
        except Exception:  # noqa: BLE001 - not here (a hub id offline, a relative path elsewhere): next base
            continue
        index = {}
        for row in rows:
            user = next(m for m in build_messages(row, conf.data) if m.get("role") == "user")
            index[flatten_content(user["content"])] = str(row.get(conf.data.answer_key))
        return index
    return None


def load_turns(run_dir: str | Path) -> tuple[list[ReplayTurn], dict[str, Any]]:
    """Every replayable verifier turn of the run, and its resolved config. Raises FileNotFoundError
    (not a run directory) or NoConversations."""
    from asyncrl.tasks import get_step_checker

    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.resolved.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.resolved.json)")
    cfg = json.loads(cfg_path.read_text())
    guide = (cfg.get("rollout") or {}).get("guide") or {}
    sees = guide.get("verifier_sees_reference", "train_only")
    stop_token = guide.get("stop_token", "###STOP###")
    checker = get_step_checker(str((cfg.get("verifier") or {}).get("task", "")))
    files = sorted((run_dir / "samples").glob("*.json"))
    refs = _reference_index(cfg, run_dir) if sees != "never" and any(f.name.startswith("train_") for f in files) \
        else None
    out: list[ReplayTurn] = []

    def add(key: str, problem: Any, reference: str | None, missing: bool, policy: list[str], replies: list[str],
            labels: list[int | None], stops: list[bool]) -> None:
        for k, reply in enumerate(replies):
            truth = checker(flatten_content(problem), policy[:k + 1]) if checker else None
            out.append(ReplayTurn(f"{key}:{k}", problem, reference, policy[:k + 1], reply, labels[k], stops[k],
                                  truth, missing))

    for f in files:
        data = json.loads(f.read_text())
        if f.name.startswith("train_") and isinstance(data, list):
            for i, rec in enumerate(data):
                messages, replies = rec.get("messages") or [], rec.get("verifier_texts") or []
                users = [m for m in messages if m.get("role") == "user"]
                policy = [flatten_content(m["content"]) for m in messages if m.get("role") == "assistant"]
                if not users or not replies:
                    continue
                problem = users[0]["content"]
                ref = refs.get(flatten_content(problem)) if refs is not None else None
                parsed = [parse_verifier_reply(r, stop_token) for r in replies]
                labels = list(rec.get("hallucination_scores") or [p.hallucination for p in parsed])
                add(f"{f.stem}:{rec.get('prompt_uid', i)}#{i}", problem, ref if sees != "never" else None,
                    sees != "never" and ref is None, policy[:len(replies)], replies, labels[:len(replies)],
                    [p.kind == "stop" for p in parsed])
        elif f.name.startswith("eval_") and isinstance(data, dict):
            for conv in (data.get("conversations") or {}).get("guided", []):
                turns = [t for t in conv.get("turns", []) if t.get("verifier") is not None]
                if not turns:
                    continue
                ref = str(conv.get("answer")) if sees == "always" else None
                add(f"{f.stem}:{conv.get('id')}", conv["problem"], ref, False, [t["policy"] for t in turns],
                    [t["verifier"] for t in turns], [t.get("score") for t in turns],
                    [bool(t.get("stop")) for t in turns])
    if not out:
        raise NoConversations(f"{run_dir} has no stored conversations to replay (samples/train_*.json with "
                              "verifier_texts, or samples/eval_*.json with guided conversations)")
    return out, cfg
