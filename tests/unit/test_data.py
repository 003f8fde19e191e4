"""Proves the data loading and message building of Guided-GRPO's data format
(docs/guided_grpo.md#data-format): json/jsonl/parquet
files and directories (`path@split`) load (parquet through HF datasets, JSON with the standard
library, the same rows as datasets gives for the repository's data files); a row missing a required column
fails with the file, row and column named; format prompts (built-in names and Jinja files,
stripped) and the `guided` system prompt render as in the original; `<image>` markers are
reconciled with the image count; hub ids fail clearly offline; the overlong filter drops rows
by their real chat-template token count, on the loader the job uses (`load_training_rows`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config import DataConfig
from asyncrl.data import (
    PromptStream,
    build_messages,
    filter_overlong_prompts,
    load_rows,
    load_training_rows,
    make_item,
    parse_data_spec,
    preload_training_rows,
)
from asyncrl.data.prompts import student_system_prompt

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"problem": f"q{i}", "answer": str(i), "extra": i} for i in range(6)]


def test_parse_spec() -> None:
    assert parse_data_spec("data/x.jsonl") == ("data/x.jsonl", "train")
    assert parse_data_spec("hiyouga/math12k@test") == ("hiyouga/math12k", "test")


def test_load_jsonl_json_parquet_and_dir(tmp_path: Path) -> None:
    import datasets

    a = write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "b.json").write_text(json.dumps(ROWS))
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "c.parquet"))
    for f in (a, tmp_path / "b.json", tmp_path / "c.parquet"):
        rows = load_rows(str(f))
        assert rows == ROWS  # other columns carried along, order kept
    d = tmp_path / "d"
    write_jsonl(d / "train-00000.jsonl", ROWS[:4])
    write_jsonl(d / "train-00001.jsonl", ROWS[4:])
    write_jsonl(d / "test.jsonl", ROWS[:1])
    assert load_rows(f"{d}@train") == ROWS
    assert load_rows(f"{d}@test") == ROWS[:1]
    with pytest.raises(ValueError, match="no file for split 'validation'"):
        load_rows(f"{d}@validation")


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "assets").rglob("*.jsonl")))
def test_json_rows_are_the_rows_datasets_gives(name: str) -> None:
    """The standard-library reader against the peer it replaces (HF datasets' json loader), on every
    JSON-lines file the repository ships (the quick starts' data, text and VL)."""
    import datasets

    path = ROOT / name
    assert load_rows(str(path), require_answer=False) == \
        datasets.load_dataset("json", data_files=[str(path)], split="train").to_list()


def test_json_shapes_columns_and_values_as_written(tmp_path: Path) -> None:
    rows = [{"problem": "a", "answer": 3}, {"problem": "b", "answer": 3.5, "extra": [1]}]
    expected = [{"problem": "a", "answer": 3, "extra": None}, {"problem": "b", "answer": 3.5, "extra": [1]}]
    # every row gets every column (None where absent, as datasets gives them), in first-seen order;
    # values as written: 3 stays 3 (pyarrow would make it 3.0 beside 3.5)
    write_jsonl(tmp_path / "lines.jsonl", rows)
    (tmp_path / "array.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "columns.json").write_text(json.dumps({"problem": ["a", "b"], "answer": [3, 3.5],
                                                       "extra": [None, [1]]}))
    write_jsonl(tmp_path / "lines.json", rows)  # JSON lines under a .json name
    for name in ("lines.jsonl", "array.json", "columns.json", "lines.json"):
        got = load_rows(str(tmp_path / name))
        assert got == expected and list(got[0]) == ["problem", "answer", "extra"], name
        assert type(got[0]["answer"]) is int, name


def test_malformed_json_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"problem": "a", "answer": "1"}\n\n{"problem": "b", "answer": \n')
    with pytest.raises(ValueError, match=rf"data file {f}, line 3: not valid JSON"):
        load_rows(str(f))
    f.write_text('{"problem": "a", "answer": "1"}\n["not", "a", "row"]\n')
    with pytest.raises(ValueError, match=rf"data file {f}, line 2: a JSON list, not an object"):
        load_rows(str(f))
    g = tmp_path / "bad.json"
    g.write_text(json.dumps([{"problem": "a", "answer": "1"}, 7]))
    with pytest.raises(ValueError, match=rf"data file {g}: item 1 of the top-level array is a JSON int"):
        load_rows(str(g))


def test_missing_column_in_a_row_names_file_row_and_column(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write_jsonl(d / "train-0.jsonl", ROWS[:3])
    bad = write_jsonl(d / "train-1.jsonl", [ROWS[3], {"problem": "no answer here"}, ROWS[4]])
    with pytest.raises(ValueError, match=rf"data file {bad}, row 1: missing column 'answer'"):
        load_rows(str(d))
    rows = load_rows(str(d), require_answer=False)  # e.g. unlabeled prompts
    assert len(rows) == 6


def test_missing_or_wrong_typed_prompt(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(ValueError, match=r"no column 'problem' \(columns: \['question', 'answer'\]\); set data.prompt_key"):
        load_rows(str(f))
    assert load_rows(str(f), DataConfig(prompt_key="question"))[0]["question"] == "q"
    g = write_jsonl(tmp_path / "y.jsonl", [{"problem": "q", "answer": "1"}, {"problem": None, "answer": "2"}])
    with pytest.raises(ValueError, match=rf"{g}, row 1: missing column 'problem'"):
        load_rows(str(g))


def test_missing_path_and_offline_hub_id() -> None:
    with pytest.raises(ValueError, match="no such file"):
        load_rows("./nope/train.jsonl")
    with pytest.raises(ValueError, match="hub"):
        load_rows("someone/not-a-local-dataset@train")


def test_messages_plain_with_builtin_template_and_guided_system() -> None:
    cfg = DataConfig(format_prompt="math", system_prompt="guided")
    msgs = build_messages({"problem": "  Compute 2+2.  ", "answer": "4"}, cfg)
    assert msgs[0] == {"role": "system", "content": student_system_prompt()}
    user = msgs[1]["content"]
    assert msgs[1]["role"] == "user" and isinstance(user, str)
    assert user.startswith("Compute 2+2.\n\nYou MUST follow these response rules:")  # content | trim
    assert user.endswith(r"MUST appear exactly once inside \boxed{…}.")
    assert build_messages({"problem": "Q", "answer": "1"}, DataConfig(system_prompt="Be brief.")) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}]


def test_template_file_is_stripped_and_bad_name_fails() -> None:
    cfg = DataConfig(format_prompt=str(FIX / "short_math.jinja"))
    assert build_messages({"problem": " 1+1 ", "answer": "2"}, cfg)[-1]["content"] == "1+1\nAnswer inside \\boxed{}."
    with pytest.raises(ValueError, match="neither a built-in"):
        build_messages({"problem": "x", "answer": "1"}, DataConfig(format_prompt="maths"))


@pytest.mark.parametrize(
    ("prompt", "k", "content"),
    [
        # no marker: one prepended, then split -> image item before the text
        ("Q?", 1, [{"type": "image"}, {"type": "text", "text": "\nQ?"}]),
        # more markers than images: only the first k kept
        ("A<image>B<image>C", 1, [{"type": "text", "text": "A"}, {"type": "image"}, {"type": "text", "text": "BC"}]),
        # fewer markers than images: missing ones prepended
        ("A<image>B", 2, [{"type": "image"}, {"type": "text", "text": "\nA"}, {"type": "image"},
                          {"type": "text", "text": "B"}]),
    ],
)
def test_image_markers(prompt: str, k: int, content: list[dict]) -> None:
    row = {"problem": prompt, "answer": "1", "images": [f"img{i}.png" for i in range(k)]}
    assert build_messages(row) == [{"role": "user", "content": content}]


def test_fixture_rows_items_carry_images_and_stringify_answers() -> None:
    rows = load_rows(str(FIX / "tiny.jsonl"))
    items = [make_item(rows, i, DataConfig(), i, "val") for i in range(len(rows))]
    # the row has the images column (empty): a content list, as the original builds it
    assert items[0].images is None
    assert items[0].messages == [{"role": "user", "content": [{"type": "text", "text": "What is 1+1?"}]}]
    assert items[1].images == ["a.png", "b.png"] and items[1].ground_truth == "3"
    assert [c["type"] for c in items[1].messages[0]["content"]] == ["text", "image", "text", "image", "text"]
    assert items[1].row["images"] == ["a.png", "b.png"] and items[1].uid == "val/1"
    d = items[1].to_dict()
    assert d["messages"] == items[1].messages and d["ground_truth"] == "3" and d["index"] == 1


def _tokenizer():
    """A real (tiny) fast tokenizer with a ChatML chat template: one token per word/symbol."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return fast


def test_filter_overlong_prompts_counts_template_tokens() -> None:
    tok = _tokenizer()
    # "<|im_start|> user \n w1 .. wn <|im_end|> \n <|im_start|> assistant \n": whitespace pre-tokenizer
    # drops newlines -> tokens = 1 + 1 + n + 1 + 1 + 1 = n + 5
    rows = [{"problem": " ".join(["w"] * n), "answer": "1"} for n in (3, 5, 6, 10)]
    kept, dropped = filter_overlong_prompts(rows, tok, DataConfig(max_prompt_length=10))
    assert [r["problem"].count("w") for r in kept] == [3, 5] and dropped == [2, 3]


def test_load_training_rows_applies_the_overlong_filter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from asyncrl.config import Config

    f = write_jsonl(tmp_path / "t.jsonl", [{"problem": " ".join(["w"] * (i % 8)), "answer": str(i)} for i in range(20)])
    loaded: list[str] = []

    def from_pretrained(path: str, **kwargs: object) -> object:
        loaded.append(path)
        return _tokenizer()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    cfg = Config.model_validate({"model": {"path": "policy-dir"}, "rollout": {"max_num_batched_tokens": 2048},
                                 "data": {"train_files": str(f), "max_prompt_length": 10}})
    rows = load_training_rows(cfg)  # n + 5 tokens per prompt (above): keeps rows with <= 5 words
    assert [r["answer"] for r in rows] == [str(i) for i in range(20) if i % 8 <= 5] and loaded == ["policy-dir"]
    off = cfg.model_copy(update={"data": cfg.data.model_copy(update={"filter_overlong_prompts": False})})
    assert len(load_training_rows(off)) == 20 and loaded == ["policy-dir"]  # no tokenizer needed


@pytest.mark.parametrize("model, named", [(m, None) for m in ("tiny-policy", "tiny-vl-policy", "tiny-vl-policy-2_5",
                                                                "tiny-vl-policy-3")] + [("tiny-policy", "Qwen2Tokenizer")])
def test_the_filters_tokenizer_counts_what_autotokenizer_counts(tmp_path: Path, model: str, named: str | None) -> None:
    """`filter_tokenizer` loads the generic TokenizersBackend over tokenizer.json (no torch);
    AutoTokenizer builds a model-specific subclass where it maps one (Qwen2Tokenizer for `qwen2`). On
    every shipped tokenizer, and on a copy whose tokenizer_config.json names `Qwen2Tokenizer` (what
    a real Qwen checkpoint names), the rendered prompts and their token counts must be the same."""
    import shutil

    from transformers import AutoTokenizer

    from asyncrl.data.sources import filter_tokenizer

    path = ROOT / "assets" / model
    if named:
        path = Path(shutil.copytree(path, tmp_path / model, ignore=shutil.ignore_patterns("*.safetensors")))
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": named}))
    ours, auto = filter_tokenizer(str(path)), AutoTokenizer.from_pretrained(str(path))
    assert type(ours).__name__ == "TokenizersBackend"  # AutoTokenizer: Qwen2Tokenizer for the text policy
    rows = load_rows(str(ROOT / "assets/arith/val.jsonl"))[:50]
    rows += [{"problem": "Ünïcödé, emoji 🙂 and\ttabs\n\n  spaces <|im_end|>", "answer": "1"}]
    texts = [[t.apply_chat_template(build_messages(r, DataConfig()), tokenize=False, add_generation_prompt=True)
              for r in rows] for t in (ours, auto)]
    assert texts[0] == texts[1]
    assert ours(texts[0], add_special_tokens=False)["input_ids"] == auto(texts[0], add_special_tokens=False)["input_ids"]


def test_the_filters_tokenizer_falls_back_to_autotokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Remote code, an `auto_map`, no tokenizer.json, or no local files: AutoTokenizer."""
    import shutil

    import transformers

    from asyncrl.data.sources import filter_tokenizer

    asked: list[tuple[str, bool]] = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, trust_remote_code=False: asked.append((path, trust_remote_code)) or "auto")
    path = Path(shutil.copytree(ROOT / "assets/tiny-policy", tmp_path / "p", ignore=shutil.ignore_patterns("*.safetensors")))
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert filter_tokenizer(str(path), trust_remote_code=True) == "auto"
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": ["x.X", None]}}))
    assert filter_tokenizer(str(path)) == "auto"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").unlink()
    assert filter_tokenizer(str(path)) == "auto"
    assert filter_tokenizer("someone/hub-model") == "auto"
    assert asked == [(str(path), True), (str(path), False), (str(path), False), ("someone/hub-model", False)]


def test_preloaded_rows_are_handed_once_and_a_bad_file_fails_in_the_data_step(tmp_path: Path) -> None:
    """The launcher loads the rows in the background (`preload_training_rows`); the data step takes
    them without reading the file again, and a file that cannot load fails there, by name."""
    from asyncrl.config import Config

    def cfg_for(path: Path) -> Config:
        return Config.model_validate({"model": {"path": "policy-dir"}, "rollout": {"max_num_batched_tokens": 2048},
                                      "data": {"train_files": str(path), "filter_overlong_prompts": False}})

    good = write_jsonl(tmp_path / "good.jsonl", ROWS)
    preload_training_rows(cfg_for(good))
    good.unlink()  # taken from the preload: the file is not read again
    assert [r["answer"] for r in load_training_rows(cfg_for(good))] == [str(i) for i in range(6)]
    with pytest.raises(ValueError, match="good.jsonl"):  # handed once: a second call reads the (gone) file
        load_training_rows(cfg_for(good))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "1 + 2", "answer": "3"}, {"problem": "2 + 2"}])
    preload_training_rows(cfg_for(bad))  # keeps nothing, raises nothing
    with pytest.raises(ValueError, match=r"bad.jsonl.*row 1"):
        load_training_rows(cfg_for(bad))


def test_quickstart_data_section_builds_streams() -> None:
    import os

    from asyncrl.config import load_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "quickstart.yaml").data
    cwd = os.getcwd()
    os.chdir(root)  # config paths are relative to the repository root
    try:
        for spec in (cfg.train_files, cfg.val_files, cfg.test_files):
            item = PromptStream(load_rows(spec, cfg), cfg.seed, cfg.shuffle, cfg).next()
            assert item.ground_truth and item.messages[-1]["role"] == "user"
    finally:
        os.chdir(cwd)
