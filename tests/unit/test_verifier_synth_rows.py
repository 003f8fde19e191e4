"""Stage 1's rows, filters and writer without an engine: real guided `Conversation`s (the tiny
policy's tokenizer) answered by the arith rule oracle give rows whose teacher labels equal the
ground-truth checker's; every filter counts what it drops; a write cut by a kill resumes without a
duplicate row; `datasets` loads the output; bad input (missing prompts, an unreachable teacher, unknown
synth keys) exits 2 naming the file, endpoint or key."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "assets" / "tiny-policy"


def _conversation(problem: str, answer: str, policy_turns: list[str]):
    from transformers import AutoTokenizer

    from asyncrl.actors.guided import Conversation, GuideOptions, PolicyChat
    from asyncrl.tasks.arith_verifier import ArithRuleVerifier

    tok = AutoTokenizer.from_pretrained(POLICY)
    conv = Conversation([{"role": "user", "content": problem}], chat=PolicyChat(tok),
                        options=GuideOptions(max_turns=4, max_prompt_length=512, training=True),
                        ground_truth=answer, uid="c", prompt_uid="p/0")
    teacher = ArithRuleVerifier()
    for text in policy_turns:
        conv.next_step()
        conv.on_generated(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id], None, 0)
        step = conv.next_step()
        if step is None:
            break
        conv.on_verified(teacher(step.messages))
    return conv


def _records():
    from asyncrl.verifier_training.rows import conversation_record

    convs = [
        # 4 * 8 = 32 right, then 32 - 6 = 25 wrong, then fixed and answered
        _conversation("Compute 4 * 8 - 6.", "26", ["4 * 8 = 32.", "32 - 6 = 25.", "32 - 6 = 26. <answer>\\boxed{26}</answer>"]),
        # order error (+ before *), then right
        _conversation("Compute 2 + 3 * 4.", "14", ["2 + 3 = 5.", "3 * 4 = 12. 2 + 12 = 14. <answer>\\boxed{14}</answer>"]),
    ]
    return [dict(conversation_record(c, 0), prompt_uid=f"p/{i}") for i, c in enumerate(convs)]


def test_rows_carry_the_exact_request_and_labels_that_agree_with_the_checker() -> None:
    from asyncrl.verifier_training.rows import records_to_rows

    rows, counts, errors = records_to_rows(_records(), task="arith", teacher="rule:arith")
    assert counts["conversations"] == 2 and counts["turns"] == 5 and not errors
    assert len(rows) == 5
    # turn labels by hand: [clean, hallucinated (25), clean+STOP], [hallucinated (order), clean+STOP]
    assert [r["step_label"] for r in rows] == [0, 1, 0, 1, 0]
    assert all(r["step_label"] == r["checker_label"] and r["parses"] for r in rows)
    first = rows[0]["messages"]
    assert first[0]["role"] == "system" and first[1]["content"].startswith("### Problem Statement\nCompute 4 * 8 - 6.")
    assert first[1]["content"].count("Assistant: ") == 1 and rows[1]["messages"][1]["content"].count("Assistant: ") == 2
    assert rows[2]["reply"] == "###STOP###" and rows[2]["turn_correct"]
    assert rows[1]["next_turn_correct"] is True  # after the correction the policy answered right
    # the policy's context of turn 1 = problem, turn 0, the guidance it got, turn 1
    assert [m["role"] for m in rows[1]["policy_messages"]] == ["user", "assistant", "user", "assistant"]


def _writer(tmp: Path, **filters):
    from asyncrl.verifier_training.rows import SynthConfig, SynthWriter

    cfg = SynthConfig.model_validate({"heldout_fraction": 0.5, "filters": filters})
    return SynthWriter(tmp, cfg, lambda messages, reply: (len(json.dumps(messages)) // 4, len(reply) // 4))


def test_filters_count_each_drop_and_a_killed_write_resumes_without_duplicates(tmp_path: Path) -> None:
    from asyncrl.verifier_training.rows import records_to_rows

    rows, counts, errors = records_to_rows(_records(), task="arith", teacher="rule:arith")
    garbage = dict(rows[0], id="p/9/9/0", reply="looks fine to me", parses=False, step_label=None)
    wrong = dict(rows[1], id="p/9/9/1", step_label=0)  # a teacher that missed the error
    copy = dict(rows[0], id="p/9/9/2")  # same input and reply as rows[0]
    w = _writer(tmp_path, balance=None)
    got = w.add_chunk(0, rows + [garbage, wrong, copy], counts, errors)
    assert (got["dropped_require_parse"], got["dropped_agree_with_checker"], got["dropped_dedup"]) == (1, 1, 1)
    assert got["written"] == 5
    # a kill in the middle of the next chunk's write: half a line, chunk 1 not marked done
    extra = dict(rows[0], id="q/1/0/0", messages=[{"role": "user", "content": "other"}])
    with (tmp_path / "rows.jsonl").open("a") as fh:
        fh.write(json.dumps(extra) + "\n" + json.dumps(dict(extra, id="q/1/0/1"))[:40])
    w2 = _writer(tmp_path, balance=None)
    assert not w2.chunk_done(1) and w2.chunk_done(0)
    again = w2.add_chunk(1, [extra, dict(extra, id="q/1/0/1", reply="x [SCORE] hallucination_detect=1")], Counter(), [])
    assert again["skipped_already_written"] == 1 and again["written"] == 1
    ids = [json.loads(ln)["id"] for ln in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 7
    summary = w2.finalize({"policy": "p", "teacher": "rule:arith", "task": "arith"})
    assert summary["train"] + summary["heldout"] == 7
    import datasets

    ds = datasets.load_dataset(str(tmp_path), cache_dir=str(tmp_path / "hf-cache"))
    assert set(ds) == {"train", "heldout"} and len(ds["train"]) + len(ds["heldout"]) == 7
    assert "reply" in ds["train"].column_names and "messages" in ds["train"].column_names


def test_balance_caps_clean_rows(tmp_path: Path) -> None:
    from asyncrl.verifier_training.rows import records_to_rows

    rows, counts, errors = records_to_rows(_records(), task="arith", teacher="rule:arith")
    w = _writer(tmp_path, balance=1.0)
    w.add_chunk(0, rows, counts, errors)
    s = w.finalize({})
    # 2 hallucinated, 3 clean -> clean capped at 1.0 x 2
    assert (s["hallucinated"], s["clean"], s["dropped_balance"]) == (2, 2, 1)


def test_teacher_errors_are_counted_not_dropped_silently() -> None:
    from asyncrl.verifier_training.rows import records_to_rows

    rec = _records()[0]
    rec["turns"][1] = dict(rec["turns"][1], error="upstream http://127.0.0.1:9/v1 failed after 3 attempts", reply="")
    rows, counts, errors = records_to_rows([rec], task="arith", teacher="http:http://127.0.0.1:9/v1")
    assert counts["teacher_errors"] == 1 and "127.0.0.1:9" in errors[0] and len(rows) == 2


def _synth(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.synth", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_missing_prompts_exit_2_naming_the_file(tmp_path: Path) -> None:
    r = _synth("--config", "configs/verifier/synth_arith.yaml", "--out", str(tmp_path / "o"),
               "synth.prompts=" + str(tmp_path / "nope.jsonl"))
    assert r.returncode == 2 and "nope.jsonl" in r.stderr


def test_an_unreachable_teacher_exits_2_naming_its_endpoint(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    r = _synth("--config", "configs/verifier/synth_arith.yaml", "--out", str(tmp_path / "o"), "--limit", "2",
               "verifier.backend=http", f"verifier.http.base_url={url}")
    assert r.returncode == 2 and url in r.stderr and "connection refused" in r.stderr, r.stderr


@pytest.mark.parametrize("key", ["synth.filters.nope=1", "synth.samples_per_prompt=0"])
def test_bad_synth_keys_exit_2(tmp_path: Path, key: str) -> None:
    r = _synth("--config", "configs/verifier/synth_arith.yaml", "--out", str(tmp_path / "o"), key)
    assert r.returncode == 2 and ("nope" in r.stderr or "samples_per_prompt" in r.stderr)
