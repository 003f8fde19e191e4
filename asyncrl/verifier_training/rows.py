"""Verifier SFT rows from finished guided conversations, the quality filters, and the resumable writer.

One row per verifier call of a policy turn: the verifier's input exactly as it was sent
(`PolicyTurn.verifier_request`, the `[system, user]` chat messages), the teacher's raw reply, and
two step labels for that policy turn (1 = hallucinated, 0 = clean):
- `step_label`: the teacher's own `[SCORE] hallucination_detect=0|1` (score 0 -> 1 here; a STOP
  reply carries no score and accepts a correct final answer -> 0);
- `checker_label`: the task's ground-truth checker where one exists (`CHECKERS`; arith: the rule
  verifier's step check, `asyncrl.tasks.arith_verifier.verify_turns`), None elsewhere. With the
  arith rule oracle as teacher the two always agree by construction; with a model teacher the
  `agree_with_checker` filter is what removes its mistakes.

Filters, each a `synth.filters.*` key and each counted in the summary (`dropped_<name>`):
`require_parse` (the reply is STOP or guidance carrying a `[SCORE]`, asyncrl's reply grammar
`parse_verifier_reply`), `agree_with_checker`, `max_prompt_tokens` / `max_reply_tokens` (with the
verifier's chat template and tokenizer), `dedup` (same input and reply), and at the end `balance`
(clean rows kept at most `balance` x the hallucinated ones, dropped by a seeded draw). Teacher
errors (a verifier call that failed: down, timeout, non-chat reply) are rows that never were:
counted as `teacher_errors` with the teacher named and the first messages kept.

`SynthWriter` guarantees no duplicate row after a kill: every row has a positional id
(`<prompt uid>/<sample>/<turn>`); rows are appended chunk by chunk (one write + fsync) before the
chunk is marked done in `progress.json` (atomic rename), and on resume the ids already in
`rows.jsonl` are skipped (a chunk cut by the kill is redone, its rows written once).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# re-exported: the records the rows are made of
from asyncrl.actors.guided.conversation import conversation_record

__all__ = ["SynthFilters", "SynthConfig", "conversation_record", "records_to_rows", "SynthWriter", "CHECKERS",
           "reply_parses"]


class SynthFilters(BaseModel):
    """Quality filters of Stage 1 (`synth.filters.*`)."""

    model_config = ConfigDict(extra="forbid")
    require_parse: bool = True
    """Keep only replies in the grammar: STOP, or guidance with a `[SCORE] hallucination_detect=0|1` line."""
    agree_with_checker: bool = True
    """Keep only rows whose teacher label equals the ground-truth checker's (tasks with a checker)."""
    max_prompt_tokens: int = Field(900, gt=0)
    """Longest verifier input kept (tokens, chat template applied, verifier tokenizer)."""
    max_reply_tokens: int = Field(96, gt=0)
    """Longest teacher reply kept (tokens)."""
    dedup: bool = True
    """Drop a row whose input and reply equal an earlier row's."""
    balance: float | None = Field(1.5, gt=0)
    """Clean rows kept at most `balance` x hallucinated rows (None = keep all)."""


class SynthConfig(BaseModel):
    """The `synth:` section of a Stage-1 config (the rest of the file is an ordinary asyncrl config:
    the policy, the rollout fleet, and the teacher as `verifier.*`)."""

    model_config = ConfigDict(extra="forbid")
    prompts: str | None = None
    """Data spec of the prompts (default `data.train_files`)."""
    samples_per_prompt: int = Field(4, gt=0)
    """Conversations per prompt (the group size used for synthesis)."""
    chunk_prompts: int = Field(8, gt=0)
    """Prompts per actor call; the unit of progress and of resume."""
    heldout_fraction: float = Field(0.1, ge=0, lt=1)
    """Share of prompts (by uid hash) whose rows go to the held-out split."""
    seed: int = 0
    """Seed of the balance draw."""
    tokenizer: str | None = None
    """Tokenizer (with chat template) that counts lengths; default the policy's."""
    filters: SynthFilters = Field(default_factory=SynthFilters)


def _arith_label(problem: str, policy_turns: list[str]) -> int:
    from asyncrl.tasks.arith_verifier import verify_turns

    return 1 if verify_turns(problem, policy_turns).score == 0 else 0


CHECKERS: dict[str, Callable[[str, list[str]], int]] = {"arith": _arith_label, "arith_vl": _arith_label}
"""Ground-truth step checkers by task: (problem, policy turns so far) -> 1 if the latest turn is
hallucinated."""


def reply_parses(text: str | None, stop_token: str = "###STOP###") -> tuple[bool, int | None]:
    """(in the grammar, step label): STOP -> (True, 0); guidance with a score s -> (True, 1 - s);
    anything else (no score, empty, abnormal) -> (False, None)."""
    from asyncrl.actors.guided import parse_verifier_reply

    reply = parse_verifier_reply(text, stop_token)
    if reply.kind == "stop":
        return (reply.stop_cause == "stop_token"), (0 if reply.stop_cause == "stop_token" else None)
    if reply.hallucination is None:
        return False, None
    return True, 1 - reply.hallucination


def _correct(text: str, answer: Any) -> bool:
    from asyncrl.tasks.arith_verifier import boxed_value, has_final_answer

    return has_final_answer(text) and (boxed_value(text) or "").strip() == str(answer).strip()


def records_to_rows(records: Iterable[dict[str, Any]], *, task: str, teacher: str,
                    stop_token: str = "###STOP###") -> tuple[list[dict[str, Any]], Counter, list[str]]:
    """Unfiltered rows of finished conversations, a Counter (`conversations`, `turns`,
    `teacher_errors`, `unverified_turns`) and the teacher's error messages."""
    checker = CHECKERS.get(task)
    counts: Counter = Counter()
    errors: list[str] = []
    rows: list[dict[str, Any]] = []
    for rec in records:
        counts["conversations"] += 1
        turns = rec["turns"]
        for k, t in enumerate(turns):
            counts["turns"] += 1
            if t.get("error"):
                counts["teacher_errors"] += 1
                errors.append(str(t["error"]))
                continue
            if t.get("request") is None or t.get("reply") is None:
                counts["unverified_turns"] += 1  # the last turn of a conversation cut by max_turns/length
                continue
            parses, label = reply_parses(t["reply"], stop_token)
            history = [x["policy"] for x in turns[: k + 1]]
            nxt = turns[k + 1]["policy"] if k + 1 < len(turns) else None
            context = list(rec.get("initial_messages") or [])  # what the policy saw, through turn k
            for j, x in enumerate(turns[: k + 1]):
                context.append({"role": "assistant", "content": x["policy"]})
                if j < k:
                    context.append({"role": "user", "content": x.get("user") or ""})
            rows.append({
                "id": f"{rec['prompt_uid']}/{rec['sample']}/{k}", "prompt_uid": rec["prompt_uid"],
                "turn": k, "messages": t["request"], "reply": t["reply"], "parses": parses, "step_label": label,
                "checker_label": checker(rec["problem"], history) if checker else None,
                "teacher": teacher, "teacher_version": t.get("version"),
                "problem": rec["problem"], "answer": rec["ground_truth"],
                "policy_messages": context,
                "turn_correct": _correct(t["policy"], rec["ground_truth"]),
                "next_turn_correct": None if nxt is None else _correct(nxt, rec["ground_truth"]),
            })
    return rows, counts, errors


def content_key(row: dict[str, Any]) -> str:
    blob = json.dumps([row["messages"], row["reply"]], sort_keys=True, ensure_ascii=False)
    return hashlib.sha1(blob.encode()).hexdigest()


class SynthWriter:
    """Filters rows and appends them to `<out>/rows.jsonl`, chunk by chunk, resumable (module doc)."""

    def __init__(self, out: Path, cfg: SynthConfig, count_tokens: Callable[[list[dict[str, str]], str], tuple[int, int]]):
        self.out, self.cfg, self.count_tokens = out, cfg, count_tokens
        out.mkdir(parents=True, exist_ok=True)
        self.rows_path, self.progress_path = out / "rows.jsonl", out / "progress.json"
        self.progress: dict[str, Any] = {"done": {}, "errors": []}
        if self.progress_path.exists():
            self.progress = json.loads(self.progress_path.read_text())
        self.ids: set[str] = set()
        self.keys: set[str] = set()
        if self.rows_path.exists():
            self._truncate_partial_line()
            for line in self.rows_path.read_text().splitlines():
                row = json.loads(line)
                self.ids.add(row["id"])
                self.keys.add(content_key(row))

    def _truncate_partial_line(self) -> None:
        data = self.rows_path.read_bytes()
        if data and not data.endswith(b"\n"):  # the kill cut a row in half: drop that half
            self.rows_path.write_bytes(data[: data.rfind(b"\n") + 1])

    def chunk_done(self, chunk: int) -> bool:
        return str(chunk) in self.progress["done"]

    def add_chunk(self, chunk: int, rows: list[dict[str, Any]], counts: Counter, errors: list[str]) -> Counter:
        """Filter `rows`, append the kept ones, mark `chunk` done; the chunk's counts."""
        f = self.cfg.filters
        counts = Counter(counts)
        kept = []
        for row in rows:
            if row["id"] in self.ids:
                counts["skipped_already_written"] += 1
                continue
            if f.require_parse and not row["parses"]:
                counts["dropped_require_parse"] += 1
                continue
            if (f.agree_with_checker and row["checker_label"] is not None
                    and row["step_label"] is not None and row["step_label"] != row["checker_label"]):
                counts["dropped_agree_with_checker"] += 1
                continue
            n_prompt, n_reply = self.count_tokens(row["messages"], row["reply"])
            row["prompt_tokens"], row["reply_tokens"] = n_prompt, n_reply
            if n_prompt > f.max_prompt_tokens:
                counts["dropped_max_prompt_tokens"] += 1
                continue
            if n_reply > f.max_reply_tokens:
                counts["dropped_max_reply_tokens"] += 1
                continue
            key = content_key(row)
            if f.dedup and key in self.keys:
                counts["dropped_dedup"] += 1
                continue
            self.ids.add(row["id"])
            self.keys.add(key)
            kept.append(row)
        counts["written"] += len(kept)
        if kept:
            with self.rows_path.open("a") as fh:
                fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
                fh.flush()
                os.fsync(fh.fileno())
        self.progress["done"][str(chunk)] = dict(counts)
        self.progress["errors"] = (self.progress["errors"] + errors)[:20]
        tmp = self.progress_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.progress))
        os.replace(tmp, self.progress_path)
        return counts

    def totals(self) -> Counter:
        total: Counter = Counter()
        for c in self.progress["done"].values():
            total.update(c)
        return total

    def finalize(self, card: dict[str, Any]) -> dict[str, Any]:
        """Balance, split by prompt into train/heldout jsonl, write the summary and the dataset card."""
        rows = [json.loads(ln) for ln in self.rows_path.read_text().splitlines()] if self.rows_path.exists() else []
        totals = self.totals()
        bad = [r for r in rows if r["step_label"] == 1]
        good = [r for r in rows if r["step_label"] != 1]
        if self.cfg.filters.balance is not None and bad:
            cap = int(self.cfg.filters.balance * len(bad))
            if len(good) > cap:
                rng = random.Random(self.cfg.seed)
                keep = set(rng.sample(range(len(good)), cap))
                totals["dropped_balance"] = len(good) - cap
                good = [r for i, r in enumerate(good) if i in keep]
        final = sorted(bad + good, key=lambda r: r["id"])

        # held-out prompts: the first ceil(fraction x prompts) by uid hash (at least one when there are two)
        uids = sorted({r["prompt_uid"] for r in final}, key=lambda u: hashlib.sha1(u.encode()).hexdigest())
        n_held = math.ceil(self.cfg.heldout_fraction * len(uids)) if len(uids) > 1 else 0
        held = set(uids[:n_held])
        splits = {"train": [r for r in final if r["prompt_uid"] not in held],
                  "heldout": [r for r in final if r["prompt_uid"] in held]}
        for name, part in splits.items():
            (self.out / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part))
        summary = {**{k: int(v) for k, v in sorted(totals.items())},
                   "kept": len(final), "hallucinated": len(bad), "clean": len(good),
                   "train": len(splits["train"]), "heldout": len(splits["heldout"]),
                   "teacher_error_examples": self.progress["errors"][:5]}
        (self.out / "summary.json").write_text(json.dumps({**card, "counts": summary}, indent=1))
        write_card(self.out, card, summary, self.cfg, [name for name, part in splits.items() if part])
        return summary


def write_card(out: Path, card: dict[str, Any], counts: dict[str, Any], cfg: SynthConfig, splits: list[str]) -> None:
    """A Hugging Face dataset card (README.md with `configs:` front matter naming the non-empty
    splits, so `datasets.load_dataset(out)` finds them)."""
    files = [ln for name in splits for ln in (f"  - split: {name}", f"    path: {name}.jsonl")]
    lines = ["---", "configs:", "- config_name: default", "  data_files:", *files,
             "task_categories:", "- text-generation", "---", "",
             "# Verifier SFT data (asyncrl Stage 1)", "",
             "Each row: `messages` (the verifier's input exactly as it was sent), `reply` (the teacher's reply, the "
             "SFT target), `step_label` (teacher's `[SCORE]`: 1 = the policy turn is hallucinated), "
             "`checker_label` (the task's ground-truth checker, null where none), `next_turn_correct`.", "",
             f"- source policy: `{card.get('policy')}`", f"- teacher: `{card.get('teacher')}`",
             f"- task: `{card.get('task')}`; prompts: `{card.get('prompts')}` ({card.get('prompt_count')} prompts x "
             f"{cfg.samples_per_prompt} conversations)",
             f"- verifier template: {card.get('template_tokens')} tokens (system prompt, verifier tokenizer)",
             f"- filters: `{json.dumps(cfg.filters.model_dump())}`", "", "## Counts", "", "| count | value |",
             "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in counts.items() if not isinstance(v, list)]
    (out / "README.md").write_text("\n".join(lines) + "\n")
