"""Where prompts come from: dataset specs, row loading and checking, the overlong-prompt filter.

Follows Guided-GRPO (docs/guided_grpo.md#data-format):
- `data.train_files` is `path[@split]`: a local .json/.jsonl/.parquet file, a local directory
  (loader from the files' extension), or a hub id (split default `train`); `prompt_key`/`answer_key`
  columns; other columns carried along untouched. Parquet files and hub ids load with HF `datasets`;
  local JSON and JSON-lines files are read with the standard library (importing `datasets` brings
  pandas and pyarrow, a large share of a launch's start-up on a small machine). As with `datasets`, every row gets
  every column (None where a row lacks it); unlike it, values stay as the file wrote them (pyarrow
  unifies a column's type: 3 becomes 3.0 in a column that also holds 3.5, and a column mixing
  numbers and text fails to load).
- `data.filter_overlong_prompts` drops training rows whose initial prompt exceeds
  `max_prompt_length` tokens: `load_training_rows`, the loader the job uses, applies it.

Departs (on purpose): rows missing a required column (or holding null there) fail at load time
with a ValueError naming the file, the row (0-based within that file) and the column, not deep
inside a collate function mid-run.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import DataConfig
from asyncrl.data.messages import build_messages

if TYPE_CHECKING:
    from asyncrl.config import Config

__all__ = ["parse_data_spec", "load_rows", "filter_overlong_prompts", "load_training_rows", "derive_max_steps",
           "steps_per_epoch", "has_preloaded_rows"]

log = logging.getLogger(__name__)

_EXT_LOADER = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def parse_data_spec(spec: str) -> tuple[str, str]:
    """`path[@split]` -> (path, split); split defaults to `train`."""
    path, sep, split = spec.rpartition("@")
    if not sep or not path or "/" in split:
        return spec, "train"
    return path, split


def _local_files(path: Path, split: str) -> list[Path]:
    if path.is_file():
        return [path]  # a single file is its own (train) split; `@split` is ignored
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _EXT_LOADER)
    if not files:
        raise ValueError(f"data directory {path}: no .json/.jsonl/.parquet files")
    named = [p for p in files if split in re.split(r"[^A-Za-z0-9]+", p.relative_to(path).as_posix())]
    if named:
        return named
    if split == "train":
        return files
    raise ValueError(f"data directory {path}: no file for split {split!r} among {[p.name for p in files]}")


def _read_json_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a local .json/.jsonl file: one object per line (JSON lines, either suffix), or, for
    .json, one array of objects or one object of equal-length column lists. ValueError naming the file
    and line (or item) at fault."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip()[:1] in ("[", "{"):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # JSON lines under a .json name: read line by line below
        if isinstance(whole, list):
            for i, row in enumerate(whole):
                if not isinstance(row, dict):
                    raise ValueError(f"data file {path}: item {i} of the top-level array is a JSON "
                                     f"{type(row).__name__}, not an object (a row)")
            return whole
        if (isinstance(whole, dict) and whole and all(isinstance(v, list) for v in whole.values())
                and len({len(v) for v in whole.values()}) == 1):  # columns: {"problem": [...], "answer": [...]}
            return [dict(zip(whole, values, strict=True)) for values in zip(*whole.values(), strict=True)]
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"data file {path}, line {number}: not valid JSON ({exc.msg}, column {exc.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"data file {path}, line {number}: a JSON {type(row).__name__}, not an object (a row)")
        rows.append(row)
    return rows


def _every_column(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every row with every column of the rows, in first-seen order, None where a row lacks one (as
    `datasets` gives them); and the column names."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    if all(len(row) == len(columns) for row in rows):
        return rows, columns
    return [{c: row.get(c) for c in columns} for row in rows], columns


def load_rows(spec: str, cfg: DataConfig | None = None, *, require_answer: bool = True) -> list[dict[str, Any]]:
    """Load `path[@split]` (local file/dir or hub id) and return its rows as a list of dicts
    (sliceable, picklable to Ray actors), after checking that every row has the prompt column
    (text) and, if `require_answer`, the answer column (not null). Raises ValueError naming the
    file, the 0-based row within it and the column."""
    cfg = cfg or DataConfig()
    path_s, split = parse_data_spec(spec)
    path = Path(os.path.expanduser(path_s))
    if path.exists():
        files = _local_files(path, split)
        loaders = {_EXT_LOADER[p.suffix] for p in files}
        if len(loaders) > 1:
            raise ValueError(f"data {spec}: mixed file types {sorted({p.suffix for p in files})}")
        loader = loaders.pop()
        rows, sources = [], []
        for f in files:
            if loader == "json":
                part = _read_json_rows(f)
            else:
                import datasets

                try:
                    part = datasets.load_dataset(loader, data_files=[str(f)], split="train").to_list()
                except Exception as exc:
                    raise ValueError(f"data file {f}: cannot be read as {f.suffix}: {exc}") from exc
            rows += part
            sources.append((str(f), len(part)))
    else:
        if path_s.startswith((".", "/", "~")) or path_s.endswith(tuple(_EXT_LOADER)):
            raise ValueError(f"data {spec}: no such file or directory {path}")
        import datasets

        try:
            ds = datasets.load_dataset(path_s, split=split)
        except Exception as exc:
            offline = " (HF_HUB_OFFLINE is set: hub datasets cannot be fetched)" if os.environ.get("HF_HUB_OFFLINE") else ""
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise ValueError(
                f"dataset {path_s} (split {split}) is not a local path and could not be loaded from the hub{offline}: "
                f"{first}. Copy it where the hub is reachable (its parquet files, or `datasets.load_dataset("
                f"'{path_s}', split='{split}').to_parquet('{path_s.rsplit('/', 1)[-1]}/{split}.parquet')`) and point "
                f"at the local copy: data.train_files=/path/to/{path_s.rsplit('/', 1)[-1]}@{split} (data.val_files "
                "likewise)") from None
        rows, sources = ds.to_list(), [(path_s, len(ds))]
    rows, columns = _every_column(rows)
    _check_rows(rows, columns, cfg, sources, require_answer)
    return rows


def _check_rows(rows: list[dict[str, Any]], columns: list[str], cfg: DataConfig, sources: list[tuple[str, int]],
                require_answer: bool) -> None:
    required = [cfg.prompt_key] + ([cfg.answer_key] if require_answer else [])

    def where(i: int) -> str:
        for name, n in sources:
            if i < n:
                return f"data file {name}, row {i}"
            i -= n
        return f"row {i}"

    for col in required:
        if col not in columns:
            raise ValueError(f"{where(0).split(', row')[0]}: no column {col!r} (columns: {columns}); "
                             f"set data.{'prompt_key' if col == cfg.prompt_key else 'answer_key'}")
        for i, row in enumerate(rows):
            value = row[col]
            if value is None:
                raise ValueError(f"{where(i)}: missing column {col!r}")
            if col == cfg.prompt_key and not isinstance(value, str):
                raise ValueError(f"{where(i)}: column {col!r} is {type(value).__name__}, expected text")


def _as_text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        c = m["content"]
        if isinstance(c, list):  # media items counted as their marker only (the VL path expands them)
            c = "".join(p.get("text", "") if p.get("type") == "text" else f"<{p.get('type')}>" for p in c)
        out.append({"role": m["role"], "content": c})
    return out


def filter_overlong_prompts(rows: Any, tokenizer: Any, cfg: DataConfig | None = None,
                            batch_size: int = 512) -> tuple[Any, list[int]]:
    """Drop rows whose initial prompt (chat template + generation prompt) has more than
    `cfg.max_prompt_length` tokens. Returns (kept rows: a `datasets.Dataset` stays one, a list
    stays a list; dropped row indices). Image/video items count as their marker only: the
    processor's image pads are not expanded here (that needs the images)."""
    cfg = cfg or DataConfig()
    kwargs = {"chat_template": cfg.override_chat_template} if cfg.override_chat_template else {}
    if not kwargs and not getattr(tokenizer, "chat_template", None):
        raise ValueError("filter_overlong_prompts: the tokenizer has no chat template "
                         "(set data.override_chat_template)")
    keep, dropped = [], []
    for start in range(0, len(rows), batch_size):
        idx = list(range(start, min(start + batch_size, len(rows))))
        texts = [tokenizer.apply_chat_template(_as_text_messages(build_messages(rows[i], cfg)), tokenize=False,
                                               add_generation_prompt=True, **kwargs) for i in idx]
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        for i, n in zip(idx, lengths, strict=True):
            (keep if n <= cfg.max_prompt_length else dropped).append(i)
    if dropped:
        log.info("filter_overlong_prompts: dropped %d of %d rows longer than %d tokens",
                 len(dropped), len(rows), cfg.max_prompt_length)
    kept = rows.select(keep) if hasattr(rows, "select") else [rows[i] for i in keep]
    return kept, dropped



def filter_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The policy's tokenizer for the overlong filter. A local checkpoint with a `tokenizer.json` (and
    no remote code) loads as transformers' generic `TokenizersBackend` over that file: its saved
    pipeline and added tokens, and the chat template and special tokens of `tokenizer_config.json`.
    `AutoTokenizer` would pick a model-specific subclass (e.g. `Qwen2Tokenizer`) through machinery
    that imports torch (which the launcher otherwise never imports); the filter only counts tokens of
    the rendered prompt without special-token insertion, which the subclass computes from the same
    file (tests/unit/test_data.py checks texts and counts against AutoTokenizer on every shipped
    tokenizer). Anything else (a hub id, remote code, no tokenizer.json): `AutoTokenizer`."""
    local = Path(os.path.expanduser(path))
    config = local / "tokenizer_config.json"
    if not trust_remote_code and (local / "tokenizer.json").is_file() and config.is_file():
        try:
            remote = "auto_map" in json.loads(config.read_text())
        except (OSError, ValueError):  # unreadable: AutoTokenizer says what is wrong with it
            remote = True
        if not remote:
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(str(local))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


_preloaded: dict[str, list[dict[str, Any]]] = {}
"""Rows `derive_max_steps` or `preload_training_rows` loaded at launch, handed once to the job's own
`load_training_rows` (the driver then holds no second copy, and the rows are not read twice)."""


def _rows_key(cfg: Config) -> str:
    return cfg.data.model_dump_json() + "|" + (cfg.model.tokenizer_path or cfg.model.path)


def load_training_rows(cfg: Config) -> list[dict[str, Any]]:
    """The job's training rows: `data.train_files`, without the rows whose initial prompt is longer
    than `data.max_prompt_length` when `data.filter_overlong_prompts` (counted with the policy's
    tokenizer and chat template). Every row left can start a conversation within the budget."""
    preloaded = _preloaded.pop(_rows_key(cfg), None)
    if preloaded is not None:
        return preloaded
    rows = load_rows(cfg.data.train_files, cfg.data)
    if not cfg.data.filter_overlong_prompts:
        return rows
    tokenizer = filter_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code)
    kept, _ = filter_overlong_prompts(rows, tokenizer, cfg.data)
    return kept


def preload_training_rows(cfg: Config) -> None:
    """Load the job's training rows ahead of its data step (the launcher does it while the learner and the engines start)
    and keep them for that step's `load_training_rows`. Rows already kept are not read again. A
    file that cannot be loaded keeps nothing: the data step then loads it again and fails with
    the error naming the file and row."""
    key = _rows_key(cfg)
    if key in _preloaded:
        return
    try:
        rows = load_training_rows(cfg)
    except Exception:  # noqa: BLE001 - reported by the data step, in its place
        return
    _preloaded[key] = rows


def has_preloaded_rows(cfg: Config) -> bool:
    """Whether `preload_training_rows` kept this config's rows (after it returned: False means the
    data step will fail, naming the file and row)."""
    return _rows_key(cfg) in _preloaded


def steps_per_epoch(num_rows: int, rollout_batch_size: int) -> int:
    """Learner steps in one epoch: whole rollout batches of the rows (the original's training
    loader drops the last incomplete batch)."""
    return num_rows // rollout_batch_size


def derive_max_steps(cfg: Config) -> str:
    """Set `trainer.max_steps` from `trainer.total_epochs` once the training rows are loaded (after
    the overlong filter, as the original counts them), and say how, e.g. `15 epochs x 23 steps =
    345 steps`. The rows are kept for the job's own `load_training_rows`. ValueError when the
    rows make no whole batch (or cannot be loaded)."""
    epochs, batch = cfg.trainer.total_epochs, cfg.data.rollout_batch_size
    if epochs is None:
        raise ValueError("trainer.max_steps is null and trainer.total_epochs is not set")
    rows = load_training_rows(cfg)
    per_epoch = steps_per_epoch(len(rows), batch)
    if per_epoch == 0:
        raise ValueError(f"data.train_files ({cfg.data.train_files}) has {len(rows)} training rows, fewer than one "
                         f"batch of data.rollout_batch_size={batch}: no step in an epoch; lower the batch size or "
                         "set trainer.max_steps")
    _preloaded[_rows_key(cfg)] = rows
    cfg.trainer.max_steps = epochs * per_epoch
    return (f"trainer.max_steps = {epochs} epochs x {per_epoch} steps = {cfg.trainer.max_steps} steps "
            f"({len(rows)} training rows // data.rollout_batch_size {batch})")
