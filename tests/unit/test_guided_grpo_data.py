"""Proves that a Guided-GRPO user's data and reward files work here unchanged: the dataset layouts
the original's recipes name load from local copies with the same columns (math12k-style
`problem`/`answer` in json, jsonl and parquet; geometry3k-style parquet whose `images` column is a
list of `{bytes, path}` structs; a multi-image set trimmed by `limit_images`; dapo17k-style rows,
which its recipe reads with config.yaml's `problem`/`answer` keys); the original's format prompts
render as there; its reward files (math.py, r1v.py, dapo.py, copied unchanged under
tests/fixtures/guided_grpo) load through the plug-in loader and score hand-derived cases as the
original does; and steps are derived from epochs once the rows are loaded."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from asyncrl.config import load_guided_grpo
from asyncrl.data import build_messages, derive_max_steps, load_rows, load_training_rows
from asyncrl.rewards.plugins import load_reward_function
from asyncrl.vision import prepare_images

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "tests" / "fixtures" / "guided_grpo"
TINY = str(ROOT / "assets" / "tiny-policy")


@pytest.fixture(autouse=True)
def in_the_original_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipes' relative paths (./examples/...) resolve from the original's checkout, as there."""
    monkeypatch.chdir(RECIPES)


def recipe(tmp_train: Path, *overrides: str):
    """examples/config.yaml with local data and the tiny policy substituted (as a user would)."""
    cfg, _ = load_guided_grpo(RECIPES / "examples/config.yaml", [
        f"data.train_files={tmp_train}", f"worker.actor.model.model_path={TINY}", *overrides])
    return cfg


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def png(color: tuple[int, int, int], size: tuple[int, int] = (8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


# ---------------------------------------------------------------------------------- steps from epochs
def test_steps_from_epochs_count_rows_after_the_overlong_filter(tmp_path: Path) -> None:
    rows = [{"problem": f"Compute {i} + 1.", "answer": str(i + 1)} for i in range(20)]
    rows.append({"problem": "word " * 400, "answer": "0"})  # ~2000 tokens, far beyond max_prompt_length 128
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = recipe(train, "data.format_prompt=null", "data.max_prompt_length=128", "data.max_response_length=32",
                 "data.rollout_batch_size=4",
                 "worker.actor.global_batch_size=2", "trainer.total_epochs=3", "worker.rollout.n=2")
    assert cfg.trainer.max_steps is None and cfg.learner.mini_batches == 2  # 4 / 2
    # 21 rows - 1 overlong = 20 rows; 20 // 4 = 5 steps per epoch; 3 epochs x 5 = 15 steps
    assert derive_max_steps(cfg) == ("trainer.max_steps = 3 epochs x 5 steps = 15 steps "
                                     "(20 training rows // data.rollout_batch_size 4)")
    assert cfg.trainer.max_steps == 15
    kept = load_training_rows(cfg)  # the job's own load takes the rows already loaded, once
    assert len(kept) == 20 and all(len(r["problem"]) < 100 for r in kept)


def test_max_steps_wins_over_epochs_as_in_the_original(tmp_path: Path) -> None:
    cfg = recipe(write_jsonl(tmp_path / "t.jsonl", [{"problem": "q", "answer": "a"}]), "trainer.max_steps=7")
    assert cfg.trainer.max_steps == 7 and cfg.trainer.total_epochs is None


def test_epochs_over_fewer_rows_than_a_batch_is_an_error(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "t.jsonl", [{"problem": "q", "answer": "a"}] * 3)
    cfg = recipe(train, "data.filter_overlong_prompts=false", "worker.rollout.n=2")
    with pytest.raises(ValueError, match=r"has 3 training rows, fewer than one batch of data.rollout_batch_size=512"):
        derive_max_steps(cfg)


def test_unreachable_hub_dataset_names_it_and_the_local_form() -> None:
    with pytest.raises(ValueError) as err:
        load_rows("hiyouga/geometry3k@test")
    msg = str(err.value)
    assert "dataset hiyouga/geometry3k (split test)" in msg and "data.train_files=/path/to/geometry3k@test" in msg


# ------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet"])
def test_math12k_layout(tmp_path: Path, fmt: str) -> None:
    rows = [{"problem": "What is $1+1$?", "answer": "2"}, {"problem": "Solve $x^2=4$, $x>0$.", "answer": "2"}]
    path = tmp_path / f"train.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "jsonl":
        write_jsonl(path, rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = recipe(path)
    loaded = load_rows(f"{path}@train", cfg.data)
    assert loaded == rows
    # math.jinja (examples/format_prompt), rendered as the original: file stripped, `content | trim`
    text = build_messages(loaded[0], cfg.data)[-1]["content"]
    template = (RECIPES / "examples/format_prompt/math.jinja").read_text().strip()
    assert text == template.replace("{{ content | trim }}", "What is $1+1$?")
    assert text.startswith("What is $1+1$?\n\nYou MUST follow these response rules:")


def test_geometry3k_parquet_images_as_bytes_path_structs(tmp_path: Path) -> None:
    image_type = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.table({
        "images": pa.array([[{"bytes": png((255, 0, 0)), "path": None}]], type=image_type),
        "problem": ["<image>Find $x$ in the triangle."], "answer": ["3"]})
    path = tmp_path / "geometry3k" / "train-00000-of-00001.parquet"
    path.parent.mkdir()
    pq.write_table(table, path)
    cfg = recipe(path.parent, "data.format_prompt=null", "data.min_pixels=1")
    rows = load_rows(f"{path.parent}@train", cfg.data)  # a directory, split by file name
    assert rows[0]["images"][0]["path"] is None and rows[0]["images"][0]["bytes"][:4] == b"\x89PNG"
    messages = build_messages(rows[0], cfg.data)
    assert messages[-1]["content"] == [{"type": "image"}, {"type": "text", "text": "Find $x$ in the triangle."}]
    _, prepared = prepare_images(messages, rows[0]["images"], cfg.data)
    assert len(prepared) == 1 and prepared.images[0].getpixel((0, 0)) == (255, 0, 0)


def test_multi_image_rows_trimmed_by_limit_images(tmp_path: Path) -> None:
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    row = {"images": [{"bytes": png(c), "path": None} for c in colors],
           "problem": "<image><image><image>Which picture is green?", "answer": "B"}
    path = tmp_path / "multi.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    cfg = recipe(path, "data.format_prompt=null", "data.min_pixels=1", "worker.rollout.limit_images=2")
    assert cfg.rollout.limit_images == 2
    loaded = load_rows(str(path), cfg.data)
    messages = build_messages(loaded[0], cfg.data)
    assert [it["type"] for it in messages[-1]["content"]] == ["image", "image", "image", "text"]
    # limit_images 2: the first two images and the first two placeholders are kept
    msgs, prepared = prepare_images(messages, loaded[0]["images"], cfg.data, cfg.rollout.limit_images)
    assert [it["type"] for it in msgs[-1]["content"]] == ["image", "image", "text"]
    assert [im.getpixel((0, 0)) for im in prepared.images] == colors[:2]


def test_dapo17k_layout_with_the_dapo_format_prompt(tmp_path: Path) -> None:
    """The dapo17k recipe keeps config.yaml's keys (problem/answer) and the dapo.jinja prompt, whose
    `\\n\\n` are literal backslash-n characters in the file (and so in the prompt)."""
    path = write_jsonl(tmp_path / "dapo.jsonl", [{"problem": "  Find 2+2.  ", "answer": "4"}])
    cfg = recipe(path, "data.format_prompt=./examples/format_prompt/dapo.jinja")
    row = load_rows(str(path), cfg.data)[0]
    text = build_messages(row, cfg.data)[-1]["content"]
    assert text == ("Solve the following math problem step by step. The last line of your response should be of "
                    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\\n\\n"
                    "Find 2+2.\\n\\nRemember to put your answer on its own line after \"Answer:\".")


# ------------------------------------------------------------------------------------- reward files
def reward_fn(spec_override: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The reward function of a converted recipe, loaded as the job loads it."""
    cfg = recipe(write_jsonl(tmp_path / "t.jsonl", [{"problem": "q", "answer": "a"}]), *spec_override)
    return load_reward_function(cfg.reward.function, cfg.reward.type, cfg.reward.kwargs)


def test_math_reward_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    score = reward_fn([], monkeypatch, tmp_path)  # config.yaml's own: math.py:compute_score, batch
    cases = [
        # (response, ground truth) -> (format, accuracy); overall = 0.9 accuracy + 0.1 format
        ("<think>4*8=32, 32-6=26</think><answer>\\boxed{26}</answer>", "26", 1.0, 1.0),
        ("< answer > \\boxed{26} </ answer >", "26", 1.0, 1.0),  # spaces around < > / removed first
        ("The answer is \\boxed{26}.", "26", 0.0, 1.0),  # no <answer> block: format 0, accuracy from the box
        ("<answer>\\boxed{2}\\boxed{6}</answer>", "26", 0.0, 0.0),  # two boxes; the last one (6) is graded
        ("<answer>\\boxed{25}</answer>", "26", 1.0, 0.0),
    ]
    out = score([{"response": r, "response_length": 10, "ground_truth": gt} for r, gt, _, _ in cases])
    for (_, _, fmt, acc), s in zip(cases, out, strict=True):
        assert (s["format"], s["accuracy"]) == (fmt, acc)
        assert s["overall"] == pytest.approx(0.9 * acc + 0.1 * fmt)
    half = reward_fn(["worker.reward.reward_function_kwargs={format_weight: 0.5}"], monkeypatch, tmp_path)
    # format 1, accuracy 0, format_weight 0.5: overall = 0.5 x 0 + 0.5 x 1 = 0.5
    assert half([{"response": "<answer>\\boxed{1}</answer>", "response_length": 5, "ground_truth": "2"}])[0][
        "overall"] == 0.5


def test_r1v_reward_file_sequential(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    score = reward_fn(["worker.reward.reward_type=sequential",
                       "worker.reward.reward_function=./examples/reward_function/r1v.py:compute_score"],
                      monkeypatch, tmp_path)
    out = score([
        {"response": "<think>two</think> <answer>2</answer>", "response_length": 9, "ground_truth": "2"},
        {"response": "<answer>2</answer>", "response_length": 5, "ground_truth": "2"},
        {"response": "<think>x</think><answer>3</answer>", "response_length": 5, "ground_truth": "2"},
    ])
    # format_weight 0.5: (1, 1) -> 1.0; no <think> block (0, 1) -> 0.5; wrong answer (1, 0) -> 0.5
    assert [(s["format"], s["accuracy"], s["overall"]) for s in out] == [(1, 1, 1.0), (0, 1, 0.5), (1, 0, 0.5)]


def test_dapo_reward_file_with_its_recipe_kwargs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    score = reward_fn(["worker.reward.reward_function=./examples/reward_function/dapo.py:compute_score",
                       "worker.reward.reward_function_kwargs={max_response_length: 200, overlong_buffer_length: 50, "
                       "overlong_penalty_factor: 1.0}"], monkeypatch, tmp_path)
    out = score([
        {"response": "2+2 is four.\nAnswer: 4", "response_length": 100, "ground_truth": "4"},
        {"response": "Answer: 4", "response_length": 175, "ground_truth": "4"},
        {"response": "Answer: 5", "response_length": 250, "ground_truth": "4"},
    ])
    # expected length L_exp = 200 - 50 = 150. L=100 <= 150: no penalty -> 1 + 0 = 1.0.
    # L=175: (150 - 175) / 50 = -0.5 -> 1 - 0.5 = 0.5. L=250 > 200: -1, and a wrong answer -1 -> -2.0.
    assert [s["overall"] for s in out] == [1.0, 0.5, -2.0]
    assert [s["overlong"] for s in out] == [0.0, -0.5, -1.0]
    assert [s["accuracy_normalized"] for s in out] == [1.0, 1.0, 0.0]
