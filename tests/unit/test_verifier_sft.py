"""Stage 2's pieces without training: the reply-only labels (every prompt token -100, every reply
token and the end-of-turn token trained), step-label precision/recall/F1 by hand, bad SFT input
exiting 2 naming the file and row, and the compact verifier template: one text in the synthesis and
the learned-verifier configs, and what it costs per turn against Guided-GRPO's default."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "assets" / "tiny-policy"


def test_encode_row_trains_only_the_reply_and_its_end_of_turn_token() -> None:
    from transformers import AutoTokenizer

    from asyncrl.verifier_training.sft import encode_row

    tok = AutoTokenizer.from_pretrained(POLICY)
    row = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U 1 + 2"}],
           "reply": "Correct.\n[SCORE] hallucination_detect=1"}
    enc = encode_row(tok, row, 1024)
    prompt = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)["input_ids"]
    reply = tok.encode(row["reply"], add_special_tokens=False)
    assert enc["input_ids"] == prompt + reply + [tok.eos_token_id]
    assert enc["labels"] == [-100] * len(prompt) + reply + [tok.eos_token_id]
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"  # what the chat template ends a turn with
    assert encode_row(tok, row, len(prompt) + len(reply)) is None  # one token too long: skipped, not cut


def test_step_label_scores_by_hand() -> None:
    from asyncrl.verifier_training.sft import step_label_scores

    # predicted [1, 1, 0, None, 1] vs truth [1, 0, 1, 1, 1]: tp = 2 (idx 0, 4), fp = 1 (idx 1), fn = 2 (idx 2, 3)
    # precision 2/3 = 0.6667, recall 2/4 = 0.5, F1 = 2 * 0.6667 * 0.5 / 1.1667 = 0.5714
    got = step_label_scores([1, 1, 0, None, 1], [1, 0, 1, 1, 1])
    assert (got["precision"], got["recall"], got["f1"], got["positives"]) == (0.6667, 0.5, 0.5714, 4)


def _sft(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.sft", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_missing_dataset_exits_2_naming_it(tmp_path: Path) -> None:
    r = _sft("--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "nowhere" in r.stderr


def test_a_row_without_the_reply_field_exits_2_naming_file_and_row(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "x"}], "reply": "###STOP###"}
    (tmp_path / "train.jsonl").write_text(json.dumps(good) + "\n" + json.dumps({"messages": good["messages"]}) + "\n")
    (tmp_path / "heldout.jsonl").write_text("")
    r = _sft("--data", str(tmp_path), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "train.jsonl row 1" in r.stderr and "'reply'" in r.stderr, r.stderr


def _template(path: str) -> str:
    import yaml

    return yaml.safe_load((ROOT / path).read_text())["rollout"]["guide"]["prompt_template"]


def test_compact_template_is_the_one_the_verifier_is_trained_and_served_with_and_fits() -> None:
    from transformers import AutoTokenizer

    from asyncrl.actors.guided import render_verifier_messages

    compact = _template("configs/verifier/synth_arith.yaml")
    assert compact == _template("configs/quickstart_learned_verifier.yaml")
    tok = AutoTokenizer.from_pretrained(POLICY)
    turns = ["4 * 8 = 32. Right?", "32 - 6 = 26. Right?", "<answer>\\boxed{26}</answer>", "Done."]

    def tokens(template: str | None, n: int) -> int:
        msgs = render_verifier_messages("Compute 4 * 8 - 6.", "26", turns[:n], template)
        return len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])

    # measured: default 2,126 tokens for one turn (system prompt alone 1,962), compact 359
    assert tokens(None, 1) > 1024 > tokens(compact, 4) + 96  # + the longest kept reply
    assert tokens(compact, 1) < 400
