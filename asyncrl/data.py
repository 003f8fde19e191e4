"""The prompt stream: datasets, prompt templates, message building, a resumable sharded cursor.

Follows Guided-GRPO (GUIDED_GRPO.md 6.1, 7.1, 7.2):
- `data.train_files` is `path[@split]`: a local .json/.jsonl/.parquet file, a local directory
  (loader from the files' extension), or a hub id (split default `train`), loaded with HF
  `datasets`; `prompt_key`/`answer_key` columns; other columns carried along untouched.
- Messages: the question rendered through the Jinja2 `format_prompt` (file content stripped,
  variable `content`; built-in names read the byte-identical copies in asyncrl/data via
  `asyncrl.prompts`), `<image>` markers reconciled with the image count, optional system
  message, one user message (a content list when the row has images or videos).
- `filter_overlong_prompts` drops rows whose initial prompt exceeds `max_prompt_length` tokens.

Departs (on purpose):
- Rows missing a required column (or holding null there) fail at load time with a ValueError
  naming the file, the row (0-based within that file) and the column, not deep inside a
  collate function mid-run.
- Order: draw k of the infinite stream is row `perm_e[k mod N]` of epoch `e = k div N`, where
  `perm_e` is a numpy permutation seeded by `(seed, e)` (the original uses a torch
  RandomSampler; the order differs, but is equally deterministic and needs no replay to jump to
  any epoch). Epochs roll over forever; every epoch visits every row exactly once.
- The cursor is global: `state_dict()` / `load_state_dict()` resume a stream exactly (no prompt
  skipped or repeated). `shard(i, n)` splits the draws by `k mod n` between rollout actors;
  `merge_shard_states` folds the shards' states back into one global state, so a resume may use
  a different number of actors and still neither skips nor repeats a draw. `put_back(item)`
  returns a draw whose group was abandoned; it is served again first.
- Images and videos are carried through as they are stored (decoding, resizing and processor
  expansion belong to the vision-language path).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import re
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.config import DataConfig
from asyncrl.prompts import FORMAT_PROMPTS, format_prompt_template, student_system_prompt

__all__ = [
    "FORMAT_PROMPTS",
    "STUDENT_SYSTEM_PROMPT_NAME",
    "PromptItem",
    "PromptStream",
    "build_messages",
    "dump_state",
    "build_stream",
    "filter_overlong_prompts",
    "iter_items",
    "load_format_prompt",
    "load_rows",
    "merge_shard_states",
    "parse_data_spec",
]

log = logging.getLogger(__name__)

STUDENT_SYSTEM_PROMPT_NAME = "guided"
"""`data.system_prompt: guided` selects Guided-GRPO's student system prompt (asyncrl/data, 7.3)."""

_EXT_LOADER = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


# ------------------------------------------------------------------------------------------ loading
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


def load_rows(spec: str, cfg: DataConfig | None = None, *, require_answer: bool = True) -> list[dict[str, Any]]:
    """Load `path[@split]` (local file/dir or hub id) with HF `datasets` and return its rows as a
    list of dicts (sliceable, picklable to Ray actors), after checking that every row has the
    prompt column (text) and, if `require_answer`, the answer column (not null). Raises
    ValueError naming the file, the 0-based row within it and the column."""
    import datasets

    cfg = cfg or DataConfig()
    path_s, split = parse_data_spec(spec)
    path = Path(os.path.expanduser(path_s))
    if path.exists():
        files = _local_files(path, split)
        loaders = {_EXT_LOADER[p.suffix] for p in files}
        if len(loaders) > 1:
            raise ValueError(f"data {spec}: mixed file types {sorted({p.suffix for p in files})}")
        loader = loaders.pop()
        parts, sources = [], []
        for f in files:
            try:
                parts.append(datasets.load_dataset(loader, data_files=[str(f)], split="train"))
            except Exception as exc:
                raise ValueError(f"data file {f}: cannot be read as {f.suffix}: {exc}") from exc
            sources.append((str(f), len(parts[-1])))
        try:
            ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        except Exception as exc:
            cols = {s: p.column_names for (s, _), p in zip(sources, parts, strict=True)}
            raise ValueError(f"data {spec}: files have incompatible columns {cols}: {exc}") from exc
    else:
        if path_s.startswith((".", "/", "~")) or path_s.endswith(tuple(_EXT_LOADER)):
            raise ValueError(f"data {spec}: no such file or directory {path}")
        try:
            ds = datasets.load_dataset(path_s, split=split)
        except Exception as exc:
            offline = " (HF_HUB_OFFLINE is set: hub datasets cannot be fetched)" if os.environ.get("HF_HUB_OFFLINE") else ""
            raise ValueError(f"data {spec}: not a local path, and loading it from the hub failed{offline}: {exc}") from exc
        sources = [(path_s, len(ds))]
    _check_rows(ds, cfg, sources, require_answer)
    return ds.to_list()


def _check_rows(ds: Any, cfg: DataConfig, sources: list[tuple[str, int]], require_answer: bool) -> None:
    required = [cfg.prompt_key] + ([cfg.answer_key] if require_answer else [])

    def where(i: int) -> str:
        for name, n in sources:
            if i < n:
                return f"data file {name}, row {i}"
            i -= n
        return f"row {i}"

    for col in required:
        if col not in ds.column_names:
            raise ValueError(f"{where(0).split(', row')[0]}: no column {col!r} (columns: {ds.column_names}); "
                             f"set data.{'prompt_key' if col == cfg.prompt_key else 'answer_key'}")
        for i, value in enumerate(ds[col]):
            if value is None:
                raise ValueError(f"{where(i)}: missing column {col!r}")
            if col == cfg.prompt_key and not isinstance(value, str):
                raise ValueError(f"{where(i)}: column {col!r} is {type(value).__name__}, expected text")


# ----------------------------------------------------------------------------------------- messages
_TEMPLATE_CACHE: dict[str, Any] = {}


def load_format_prompt(name_or_path: str | None) -> Any:
    """A compiled Jinja2 template: a built-in name (`math`, `guided_math`, `r1v`, `dapo`) or a file
    (content stripped, as in Guided-GRPO). None -> None (the question as is)."""
    if name_or_path is None:
        return None
    if name_or_path not in _TEMPLATE_CACHE:
        import jinja2

        if name_or_path in FORMAT_PROMPTS:
            text = format_prompt_template(name_or_path).strip()
        elif Path(name_or_path).expanduser().is_file():
            text = Path(name_or_path).expanduser().read_text(encoding="utf-8").strip()
        else:
            raise ValueError(f"data.format_prompt {name_or_path!r}: neither a built-in "
                             f"({', '.join(FORMAT_PROMPTS)}) nor an existing file")
        _TEMPLATE_CACHE[name_or_path] = jinja2.Template(text)
    return _TEMPLATE_CACHE[name_or_path]


def _reconcile_markers(prompt: str, marker: str, k: int) -> str:
    """7.2 step 2: 0 markers -> prepend one; more than k -> keep the first k; fewer -> prepend."""
    count = prompt.count(marker)
    if count == 0:
        return marker + "\n" + prompt
    if count > k:
        pieces = prompt.split(marker)
        return marker.join(pieces[: k + 1]) + "".join(pieces[k + 1:])
    if count < k:
        return (marker + "\n") * (k - count) + prompt
    return prompt


def _content_list(prompt: str, marker: str, kind: str) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = []
    for i, piece in enumerate(prompt.split(marker)):
        if i > 0:
            content.append({"type": kind})
        if piece:
            content.append({"type": "text", "text": piece})
    return content


def build_messages(row: Mapping[str, Any], cfg: DataConfig | None = None) -> list[dict[str, Any]]:
    """OpenAI-style messages for one row (Guided-GRPO 7.2): [system] + one user message whose
    content is a string, or a list of text/image (or video) items when the row has the image
    (video) column."""
    cfg = cfg or DataConfig()
    prompt = row[cfg.prompt_key]
    template = load_format_prompt(cfg.format_prompt)
    if template is not None:
        prompt = template.render(content=prompt)
    messages: list[dict[str, Any]] = []
    if cfg.system_prompt:
        messages.append({"role": "system",
                         "content": student_system_prompt() if cfg.system_prompt == STUDENT_SYSTEM_PROMPT_NAME else cfg.system_prompt})
    # As the original: a row that HAS the image (video) column gets a content list, even when the
    # list is empty; markers are reconciled only when there are images.
    if cfg.image_key in row:
        images = row.get(cfg.image_key) or []
        k = len(images) if isinstance(images, (list, tuple)) else 1
        if k > 0:
            prompt = _reconcile_markers(prompt, "<image>", k)
        messages.append({"role": "user", "content": _content_list(prompt, "<image>", "image")})
    elif cfg.video_key in row:
        messages.append({"role": "user", "content": _content_list(prompt, "<video>", "video")})
    else:
        messages.append({"role": "user", "content": prompt})
    return copy.deepcopy(messages)


@dataclass
class PromptItem:
    """One draw of the stream. `index` is the global draw number k (unique for the stream's whole
    life, across epochs and shards); `uid` = f"{name}/{k}"; `row_index` the row in `rows`."""

    index: int
    uid: str
    messages: list[dict[str, Any]]
    ground_truth: str
    images: list[Any] | None
    row: dict[str, Any]
    epoch: int = 0
    row_index: int = 0
    videos: list[Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (what actors receive; `row` included, media carried as stored)."""
        return dataclasses.asdict(self)


def make_item(rows: Sequence[Mapping[str, Any]], row_index: int, cfg: DataConfig, index: int,
              name: str, epoch: int = 0) -> PromptItem:
    row = dict(rows[row_index])
    answer = row.get(cfg.answer_key)
    return PromptItem(index=index, uid=f"{name}/{index}", messages=build_messages(row, cfg),
                      ground_truth="" if answer is None else str(answer), images=row.get(cfg.image_key) or None,
                      row=row, epoch=epoch, row_index=row_index, videos=row.get(cfg.video_key) or None)


def iter_items(rows: Sequence[Mapping[str, Any]], cfg: DataConfig | None = None, name: str = "val",
               limit: int | None = None) -> Iterator[PromptItem]:
    """Every row once, in file order (evaluation)."""
    cfg = cfg or DataConfig()
    for i in range(len(rows) if limit is None else min(limit, len(rows))):
        yield make_item(rows, i, cfg, i, name)


# ------------------------------------------------------------------------------------------- stream
_STATE_FORMAT = 1


def _fingerprint(rows: Sequence[Mapping[str, Any]], cfg: DataConfig) -> str:
    """Cheap content check for resume: row count + prompts of up to 8 evenly spaced rows."""
    n = len(rows)
    picks = sorted({int(i) for i in np.linspace(0, n - 1, num=min(8, n))}) if n else []
    h = hashlib.sha1(str(n).encode())
    for i in picks:
        h.update(str(rows[i].get(cfg.prompt_key)).encode())
    return h.hexdigest()[:16]


class PromptStream:
    """An endless, deterministic, resumable stream of prompts over `rows`.

    Draw k (k = 0, 1, 2, ...) is row `perm_e[k mod N]`, epoch e = k div N; a shard (index i of
    n) takes exactly the draws with k mod n == i. Guarantees: the same (rows, seed, shuffle)
    give the same draws; after `load_state_dict(state_dict())` the stream continues with the
    very next draw; no draw is served twice and none is skipped, across shards, put-backs and
    `merge_shard_states` (only `put_back` re-serves a draw, on purpose). Not thread-safe: one
    owner per stream (shard).
    """

    def __init__(self, rows: Sequence[Mapping[str, Any]], seed: int = 1, shuffle: bool = True,
                 cfg: DataConfig | None = None, *, name: str = "train", index: int = 0, count: int = 1):
        if len(rows) == 0:
            raise ValueError(f"prompt stream {name!r}: no rows (all filtered out?)")
        if not 0 <= index < count:
            raise ValueError(f"shard index {index} not in [0, {count})")
        self.rows, self.seed, self.shuffle = rows, int(seed), bool(shuffle)
        self.cfg = cfg or DataConfig()
        self.name, self.index, self.count = name, index, count
        self.num_rows = len(rows)
        self.fingerprint = _fingerprint(rows, self.cfg)
        self._cursor = index  # next candidate draw; always == index (mod count)
        self._skip: set[int] = set()  # draws >= cursor already served elsewhere
        self._pending: deque[int] = deque()  # put-back draws, served first
        self._perms: dict[int, np.ndarray] = {}
        load_format_prompt(self.cfg.format_prompt)  # fail now on a bad template, not at the first draw

    # -- order
    def permutation(self, epoch: int) -> np.ndarray:
        """Row order of `epoch` (identity when not shuffling)."""
        if epoch not in self._perms:
            if len(self._perms) >= 4:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = (np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
                                  if self.shuffle else np.arange(self.num_rows))
        return self._perms[epoch]

    def item(self, k: int) -> PromptItem:
        """Draw k, without moving the cursor."""
        epoch, pos = divmod(int(k), self.num_rows)
        return make_item(self.rows, int(self.permutation(epoch)[pos]), self.cfg, int(k), self.name, epoch)

    item_at = item

    # -- drawing
    def next(self) -> PromptItem:
        if self._pending:
            return self.item(self._pending.popleft())
        k = self._cursor
        while k in self._skip:
            self._skip.discard(k)
            k += self.count
        self._cursor = k + self.count
        return self.item(k)

    __next__ = next

    def __iter__(self) -> Iterator[PromptItem]:
        return self

    def take(self, n: int) -> list[PromptItem]:
        return [self.next() for _ in range(n)]

    def put_back(self, item: PromptItem | int) -> None:
        """Return a served draw (e.g. its group was abandoned): it is served again, first."""
        k = item.index if isinstance(item, PromptItem) else int(item)
        if k % self.count != self.index:
            raise ValueError(f"draw {k} does not belong to shard {self.index}/{self.count}")
        self._pending.append(k)

    @property
    def epoch(self) -> int:
        """Epoch of the next regular draw."""
        return self._cursor // self.num_rows

    # -- sharding
    def shard(self, index: int, count: int) -> PromptStream:
        """Shard `index` of `count` of this (global) stream, continuing from its cursor: the shards
        together serve exactly the draws this stream would have served next."""
        if self.count != 1:
            raise ValueError("shard a global stream (merge shard states first)")
        s = PromptStream(self.rows, self.seed, self.shuffle, self.cfg, name=self.name, index=index, count=count)
        s._perms = self._perms
        s._cursor = self._cursor + (index - self._cursor) % count
        s._skip = {k for k in self._skip if k % count == index and k >= s._cursor}
        s._pending = deque(k for k in self._pending if k % count == index)
        return s

    # -- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """JSON-able state; with the same rows, `load_state_dict` resumes at the very next draw."""
        return {"format": _STATE_FORMAT, "name": self.name, "num_rows": self.num_rows, "seed": self.seed,
                "shuffle": self.shuffle, "fingerprint": self.fingerprint, "index": self.index,
                "count": self.count, "cursor": self._cursor,
                "skip": sorted(k for k in self._skip if k >= self._cursor), "pending": list(self._pending)}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore a state from `state_dict()` (or `merge_shard_states`). Raises ValueError when it
        was made for other data, seed, order or shard; `strict=False` only downgrades a changed
        content fingerprint (same row count) to a warning."""
        _check_compatible(state, self, strict)
        if (state["index"], state["count"]) != (self.index, self.count):
            raise ValueError(f"stream state is for shard {state['index']}/{state['count']}, this stream is "
                             f"{self.index}/{self.count}: merge_shard_states() then shard() to re-shard")
        self._cursor = int(state["cursor"])
        self._skip = {int(k) for k in state["skip"]}
        self._pending = deque(int(k) for k in state["pending"])


def _check_compatible(state: Mapping[str, Any], ref: Any, strict: bool) -> None:
    get = (lambda k: ref[k]) if isinstance(ref, Mapping) else (lambda k: getattr(ref, k))
    if state.get("format") != _STATE_FORMAT:
        raise ValueError(f"unknown stream state format {state.get('format')!r}")
    for key in ("name", "num_rows", "seed", "shuffle"):
        if state[key] != get(key):
            raise ValueError(f"stream state was made with {key}={state[key]!r}, this stream has {get(key)!r}")
    if state["fingerprint"] != get("fingerprint"):
        msg = "stream state was made for different data (content fingerprint differs)"
        if strict:
            raise ValueError(msg + "; pass strict=False to resume anyway")
        log.warning(msg)


def merge_shard_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Fold the states of all `n` shards of one stream into a global state (count 1): the draws
    none of them served yet, and only those, are still to come (put-backs first). Shard that
    state again with any number of shards to resume with a different actor count."""
    if not states:
        raise ValueError("no shard states to merge")
    count = states[0]["count"]
    by_index = {s["index"]: s for s in states}
    if len(states) != count or set(by_index) != set(range(count)):
        raise ValueError(f"need the states of all {count} shards, got indices {sorted(by_index)}")
    for s in states[1:]:
        _check_compatible(s, states[0], strict=True)
        if s["count"] != count:
            raise ValueError("shard states have different shard counts")
    cursors = {i: int(s["cursor"]) for i, s in by_index.items()}
    skips = {i: {int(k) for k in s["skip"]} for i, s in by_index.items()}

    def accounted(k: int) -> bool:  # served (or pending re-service) by its shard
        i = k % count
        return k < cursors[i] or k in skips[i]

    hi = max(max(cursors.values()), max((max(v) for v in skips.values() if v), default=0)) + count
    frontier = max(0, min(cursors.values()) - count)
    while accounted(frontier):
        frontier += 1
    merged = dict(states[0])
    merged.update(index=0, count=1, cursor=frontier,
                  skip=[k for k in range(frontier, hi) if accounted(k)],
                  pending=[int(k) for i in sorted(by_index) for k in by_index[i]["pending"]])
    return merged


# ------------------------------------------------------------------------------ overlong filtering
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
    stays a list; dropped row indices). Image/video pads are not expanded here (VL path)."""
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


# ----------------------------------------------------------------------------------------- builder
def build_stream(cfg: DataConfig, tokenizer: Any = None, split: str = "train",
                 index: int = 0, count: int = 1) -> PromptStream:
    """The stream of `cfg.<split>_files` (shuffled by `cfg.seed` for train only), filtered for
    overlong prompts when `cfg.filter_overlong_prompts` and a tokenizer is given, sharded."""
    spec = {"train": cfg.train_files, "val": cfg.val_files, "test": cfg.test_files}[split]
    if not spec:
        raise ValueError(f"data.{split}_files is empty")
    rows = load_rows(spec, cfg)
    if cfg.filter_overlong_prompts and tokenizer is not None:
        rows, _ = filter_overlong_prompts(rows, tokenizer, cfg)
    stream = PromptStream(rows, cfg.seed, cfg.shuffle and split == "train", cfg, name=split)
    return stream if count == 1 else stream.shard(index, count)


def dump_state(stream: PromptStream, path: str | os.PathLike[str]) -> None:
    """Write `stream.state_dict()` as JSON (atomic rename)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(stream.state_dict()))
    tmp.replace(path)
