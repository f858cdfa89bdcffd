"""A user's prompt data: JSONL, JSON, Parquet and Arrow files read with ``datasets`` into a lazy prompt source.

``--prompts`` (and ``--rollout-eval-prompts``) name one file, several (comma-separated; a list in the config file) or a
directory (all its files of one supported format). Every file is opened as a memory-mapped Arrow table
(``datasets``), and :class:`PromptSource` converts a row into a :class:`~miles_core.rollout.prompts.Prompt` only
when it is accessed: the driver's memory does not grow with the file.

Columns map to a prompt through :class:`PromptKeys` (``--rollout-prompt-key``, ``--rollout-label-key``,
``--rollout-metadata-keys``, ``--rollout-tools-key``). With the default keys a file holds only the columns
``prompt``, ``label``, ``metadata`` and ``tools`` (a misspelt ``lable`` is refused, not read as no label); once a key
is given, other columns are ignored and each key given must exist. What the Arrow schema and ``pyarrow.compute`` can
check is checked when the file is opened (cheap on millions of rows); the rest when a row is converted. Every error
is a one-line :class:`~miles_core.errors.ConfigError` naming the file, the row and the key.

A JSONL file is first scanned line by line with the strict JSON rules of every file a user names
(:mod:`miles_core.user_files`: no NaN, no duplicate key, one object per line), so a bad line is named by its
number; its columns are then read as JSON values (``datasets.Json``), so labels and metadata keep their values
whatever their types.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from miles_core.errors import ConfigError
from miles_core.rollout.chat_prompts import ChatRenderer
from miles_core.rollout.prompts import MAX_LINE_BYTES, Prompt
from miles_core.user_files import check_regular_file, parse_json_text

FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
"""The supported file suffixes and their formats."""
NAMES = {"jsonl": "JSONL", "json": "JSON", "parquet": "Parquet", "arrow": "Arrow"}
MAX_DATA_BYTES = 1 << 40
"""A prompt file is memory-mapped, not read whole: the bound only refuses what cannot be a prompt file."""
METADATA = "metadata"


@dataclasses.dataclass(frozen=True)
class PromptKeys:
    """Which columns give a prompt's text (or messages), label, metadata and tools. ``given``: the keys named on
    purpose (then each must exist and other columns are ignored); none given: the default, strict layout."""

    prompt: str = "prompt"
    label: str = "label"
    metadata: tuple[str, ...] = ()
    tools: str = "tools"
    given: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, rollout: Any) -> PromptKeys:
        """The keys of ``rollout`` (:class:`~miles_core.config.sections.RolloutSection`)."""
        named = {
            "prompt": rollout.prompt_key,
            "label": rollout.label_key,
            "tools": rollout.tools_key,
        }
        given = {value for value in named.values() if value is not None} | set(rollout.metadata_keys)
        return cls(
            prompt=rollout.prompt_key or "prompt",
            label=rollout.label_key or "label",
            metadata=tuple(rollout.metadata_keys),
            tools=rollout.tools_key or "tools",
            given=frozenset(given | ({rollout.prompt_key or "prompt"} if given else set())),
        )

    @property
    def strict(self) -> bool:
        """Whether unknown columns are refused: the default keys, none named."""
        return not self.given

    def known(self) -> set[str]:
        return {self.prompt, self.label, METADATA, self.tools, *self.metadata}

    def required(self) -> set[str]:
        return {self.prompt} | set(self.given)


class PromptSource(Sequence[Prompt]):
    """The prompts of one or more files, converted row by row when accessed (a lazy ``Sequence[Prompt]``).
    ``conversions`` counts the rows converted so far."""

    def __init__(self, files: list[PromptFile], *, keys: PromptKeys, renderer: ChatRenderer) -> None:
        self.files = files
        self.keys = keys
        self.renderer = renderer
        self.conversions = 0
        self._starts = [0]
        for file in files:
            self._starts.append(self._starts[-1] + len(file.dataset))

    def __len__(self) -> int:
        return self._starts[-1]

    @overload
    def __getitem__(self, index: int) -> Prompt: ...
    @overload
    def __getitem__(self, index: slice) -> list[Prompt]: ...
    def __getitem__(self, index: int | slice) -> Prompt | list[Prompt]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"prompt {index} of {len(self)}")
        number = bisect.bisect_right(self._starts, index) - 1
        file, row = self.files[number], index - self._starts[number]
        self.conversions += 1
        return row_prompt(file.row(row), keys=self.keys, renderer=self.renderer, where=file.where(row))

    def __iter__(self) -> Iterator[Prompt]:
        return (self[i] for i in range(len(self)))

    @property
    def has_messages(self) -> bool:
        return any(file.has_messages for file in self.files)


@dataclasses.dataclass
class PromptFile:
    """One opened file: its memory-mapped rows, and whether its prompts are chat messages."""

    path: Path
    dataset: datasets.Dataset
    lines: list[int] | None = None  # JSONL: the line number of each row (its non-blank lines), its values JSON text
    has_messages: bool = False

    def row(self, row: int) -> dict[str, Any]:
        values = self.dataset[row]
        if self.lines is not None:
            return {name: json.loads(value) for name, value in values.items() if value is not None}
        return values

    def where(self, row: int) -> str:
        if self.lines is not None:
            return f"{self.path}:{self.lines[row]}"
        return f"{self.path} row {row}"


def open_prompt_source(
    spec: str | Sequence[str],
    *,
    keys: PromptKeys | None = None,
    renderer: ChatRenderer,
    flag: str = "--prompts",
    cache_dir: str | None = None,
) -> PromptSource:
    """The prompts of the files ``spec`` names (see the module docstring), checked as far as the schema allows.
    ``cache_dir``: where ``datasets`` keeps the Arrow copy of a JSON or Parquet file (default: its own cache,
    ``HF_DATASETS_CACHE``)."""
    keys = keys or PromptKeys()
    _quiet_datasets()
    files = [open_prompt_file(path, keys=keys, cache_dir=cache_dir) for path in prompt_files(spec, flag=flag)]
    source = PromptSource(files, keys=keys, renderer=renderer)
    if not len(source):
        names = ", ".join(str(file.path) for file in files)
        raise ConfigError(f"{flag} {names} holds no prompts; give at least one row with a {keys.prompt!r}")
    if renderer.apply is False:
        chat = next((file for file in files if file.has_messages), None)
        if chat is not None:
            raise ConfigError(
                f"{chat.where(0)}: key {keys.prompt!r} holds chat messages and --rollout-apply-chat-template is "
                "false; give the prompts as strings or let the template render them"
            )
    renderer.check(has_messages=source.has_messages, what=f"{flag} {files[0].path}")
    pa.default_memory_pool().release_unused()  # the checks' temporary arrays: give their memory back
    return source


def prompt_files(spec: str | Sequence[str], *, flag: str) -> list[Path]:
    """The files of ``spec``: comma-separated names (or a list), each a file of a supported format or a directory
    of them."""
    names = [name.strip() for name in spec.split(",")] if isinstance(spec, str) else [str(name) for name in spec]
    names = [name for name in names if name]
    if not names:
        raise ConfigError(f"{flag} names no file; give a JSONL, JSON, Parquet or Arrow file, or a directory")
    paths: list[Path] = []
    for name in names:
        path = Path(name)
        paths.extend(_directory_files(path, flag=flag) if path.is_dir() else [_checked_file(path, flag=flag)])
    return paths


def _directory_files(directory: Path, *, flag: str) -> list[Path]:
    files = sorted(p for p in directory.iterdir() if p.suffix in FORMATS and not p.name.startswith("."))
    formats = sorted({FORMATS[p.suffix] for p in files})
    if not files:
        raise ConfigError(f"{flag} directory {str(directory)!r} holds no {', '.join(FORMATS)} file")
    if len(formats) > 1:
        raise ConfigError(
            f"{flag} directory {str(directory)!r} mixes the formats {', '.join(formats)}; keep one format per "
            "directory, or name the files"
        )
    return [_checked_file(path, flag=flag) for path in files]


def _checked_file(path: Path, *, flag: str) -> Path:
    fmt = FORMATS.get(path.suffix)
    expected = f"a {NAMES[fmt]} file" if fmt else "a JSONL, JSON, Parquet or Arrow file"
    check_regular_file(path, what=f"prompt file {str(path)!r}", expected=expected, limit=MAX_DATA_BYTES)
    if fmt is None:
        raise ConfigError(
            f"{flag} file {str(path)!r} is not of a supported format: give a file ending in {', '.join(FORMATS)}, "
            "or a directory of them"
        )
    return path


def open_prompt_file(path: Path, *, keys: PromptKeys, cache_dir: str | None) -> PromptFile:
    """One file, opened as a memory-mapped Arrow table and checked as far as its schema allows."""
    fmt = FORMATS[path.suffix]
    if fmt == "jsonl":
        scan = scan_jsonl(path, keys=keys)
        dataset = _read(path, fmt, lambda: _jsonl_dataset(path, columns=scan.columns, cache_dir=cache_dir))
        return PromptFile(path, dataset, lines=scan.lines, has_messages=scan.has_messages)
    if fmt == "arrow":
        dataset = _read(path, fmt, lambda: _arrow(path, cache_dir=cache_dir))
    elif fmt == "parquet":
        dataset = _read(path, fmt, lambda: datasets.Dataset.from_parquet(str(path), cache_dir=cache_dir))
    else:
        dataset = _read(path, fmt, lambda: datasets.Dataset.from_json(str(path), cache_dir=cache_dir))
    file = PromptFile(path, dataset)
    file.has_messages = check_table(file, keys=keys)
    return file


def _jsonl_dataset(path: Path, *, columns: list[str], cache_dir: str | None) -> datasets.Dataset:
    """A checked JSONL file as an Arrow table of JSON texts, one column per key: each value keeps its JSON type
    (pyarrow's JSON reader would unify a column's types, or refuse labels of several types)."""
    info = path.stat()
    return datasets.Dataset.from_generator(
        _jsonl_rows,
        # no list among the arguments: datasets would split the generator into one shard per item
        gen_kwargs={"path": str(path), "columns": json.dumps(columns), "stamp": f"{info.st_size}/{info.st_mtime_ns}"},
        features=datasets.Features({name: datasets.Value("string") for name in columns}),
        cache_dir=cache_dir,
    )


def _jsonl_rows(path: str, columns: str, stamp: str) -> Iterator[dict[str, str | None]]:
    """The rows of a JSONL file that :func:`scan_jsonl` checked, each value as JSON text. ``stamp`` (size and
    modification time) is part of the arguments so that ``datasets``' cache holds a new copy for a changed file."""
    del stamp
    names = json.loads(columns)
    with open(path, encoding="utf-8-sig") as file:
        for line in file:
            if line.strip():
                record = json.loads(line)
                yield {name: json.dumps(record[name]) if name in record else None for name in names}


def _arrow(path: Path, *, cache_dir: str | None) -> datasets.Dataset:
    """An Arrow stream file (as ``datasets`` saves) memory-mapped in place; an Arrow IPC (Feather) file through
    the ``arrow`` builder, which copies it into the cache."""
    try:
        return datasets.Dataset.from_file(str(path))
    except pa.ArrowInvalid:
        return datasets.load_dataset("arrow", data_files=str(path), split="train", cache_dir=cache_dir)


def _read(path: Path, fmt: str, load: Any) -> datasets.Dataset:
    try:
        return load()
    except Exception as exc:  # datasets wraps pyarrow's errors; the cause says what is wrong
        cause = exc.__cause__ or exc
        reason = " ".join(str(cause).split())[:300]
        raise ConfigError(
            f"prompt file {str(path)!r} cannot be read as {NAMES[fmt]}: {type(cause).__name__}: {reason}"
        ) from None


# -- checks ---------------------------------------------------------------------------------------------------------


def check_table(file: PromptFile, *, keys: PromptKeys) -> bool:
    """Check ``file``'s columns with its schema and ``pyarrow.compute``; whether its prompts are chat messages."""
    table = file.dataset.data.table
    names = table.column_names
    if keys.prompt not in names:  # first: the likeliest cause is a data set whose prompt column has another name
        raise ConfigError(
            f"{file.where(0)}: no key {keys.prompt!r} (the columns are {', '.join(names)}); name the prompt column "
            "with --rollout-prompt-key"
        )
    missing = sorted(keys.required() - set(names))
    if missing:
        raise ConfigError(f"{file.where(0)}: no key {missing[0]!r} (the columns are {', '.join(names)})")
    if keys.strict:
        unknown = [name for name in names if name not in keys.known()]
        if unknown:
            row = _first(pc.is_valid(table.column(unknown[0])))
            raise ConfigError(
                f"{file.where(row or 0)}: unknown key {unknown[0]!r}; a prompt has the keys "
                f"{keys.prompt}, {keys.label}, {METADATA}, {keys.tools} (or name the columns with --rollout-prompt-key "
                "and the other key flags)"
            )
    _check_prompt_column(file, table.column(keys.prompt), key=keys.prompt)
    if METADATA in names:
        _check_object_column(file, table.column(METADATA), key=METADATA)
    return pa.types.is_list(table.schema.field(keys.prompt).type) or pa.types.is_large_list(
        table.schema.field(keys.prompt).type
    )


def _check_prompt_column(file: PromptFile, column: pa.ChunkedArray, *, key: str) -> None:
    kind = column.type
    missing = _first(pc.is_null(column))
    if missing is not None:
        raise ConfigError(f"{file.where(missing)}: key {key!r} is missing (null); every row needs a prompt")
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        empty = _first(pc.equal(pc.utf8_length(column), 0))
        if empty is not None:
            raise ConfigError(f"{file.where(empty)}: key {key!r} is empty; give it some text")
        return
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        raise ConfigError(
            f"{file.where(0)}: key {key!r} is of type {kind}; a prompt is a string or a list of chat messages"
        )
    empty = _first(pc.equal(pc.list_value_length(column), 0))
    if empty is not None:
        raise ConfigError(f"{file.where(empty)}: key {key!r} is an empty list of messages")
    message = kind.value_type
    if not pa.types.is_struct(message):
        raise ConfigError(f"{file.where(0)}: key {key!r} is a list of {message}; a message is an object")
    for field in ("role", "content"):
        if message.get_field_index(field) < 0:
            raise ConfigError(f"{file.where(0)}: key {key!r} holds a message without {field!r}")
        values = pc.struct_field(pc.list_flatten(column), field)
        bad = _first(pc.is_null(values))
        if bad is not None:
            row = pc.list_parent_indices(column).to_numpy()[bad]
            raise ConfigError(f"{file.where(int(row))}: key {key!r} holds a message without {field!r}")


def _check_object_column(file: PromptFile, column: pa.ChunkedArray, *, key: str) -> None:
    if not (pa.types.is_struct(column.type) or pa.types.is_null(column.type)):
        raise ConfigError(f"{file.where(0)}: {key!r} must be an object, got {column.type}")


def _first(mask: pa.ChunkedArray | pa.Array) -> int | None:
    """The index of the first true value of ``mask``, or ``None``."""
    offset = 0
    for chunk in mask.chunks if isinstance(mask, pa.ChunkedArray) else [mask]:
        found = pc.index(chunk, True).as_py()
        if found >= 0:
            return offset + found
        offset += len(chunk)
    return None


@dataclasses.dataclass
class JsonlScan:
    lines: list[int]  # the line number of each row
    columns: list[str]  # the keys the file's objects hold
    has_messages: bool  # whether a prompt is a list of chat messages


def scan_jsonl(path: Path, *, keys: PromptKeys) -> JsonlScan:
    """Check a JSONL file line by line (streamed: strict JSON objects, the keys of :class:`PromptKeys`); a bad line
    is a :class:`ConfigError` naming it."""
    scan = JsonlScan(lines=[], columns=[], has_messages=False)
    columns: dict[str, None] = {}
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            what = f"{path}:{number}"
            if len(raw) > MAX_LINE_BYTES:
                raise ConfigError(f"{what}: a line of {len(raw)} bytes, more than the {MAX_LINE_BYTES} allowed")
            text = _decode_line(raw, path=path, number=number)
            if not text.strip():
                continue
            record = parse_json_text(text, what=what)
            if not isinstance(record, dict):
                raise ConfigError(f"{what}: expected an object with a {keys.prompt!r}, got {_excerpt(text.strip())}")
            check_record(record, keys=keys, where=what)
            columns.update(dict.fromkeys(record))
            scan.has_messages = scan.has_messages or isinstance(record[keys.prompt], list)
            scan.lines.append(number)
    if not scan.lines:
        raise ConfigError(
            f'prompt file {str(path)!r} holds no prompts; write one {{"{keys.prompt}": ...}} object per line'
        )
    scan.columns = list(columns)
    return scan


def _decode_line(raw: bytes, *, path: Path, number: int) -> str:
    if b"\x00" in raw or (number == 1 and raw.startswith((b"\xff\xfe", b"\xfe\xff"))):
        raise ConfigError(f"prompt file {str(path)!r} is binary or UTF-16/UTF-32, not UTF-8 text; save it as UTF-8")
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"prompt file {str(path)!r} is not UTF-8 text (byte {raw[exc.start]:#04x} at line {number}); "
            "save it as UTF-8"
        ) from None


# -- rows -----------------------------------------------------------------------------------------------------------


def check_record(record: dict[str, Any], *, keys: PromptKeys, where: str) -> None:
    """Check one row's values (see the module docstring); a :class:`ConfigError` names ``where`` and the key."""
    for key in sorted(keys.required()):  # first: the likeliest cause is a key of another name
        if key not in record:
            hint = "; name the prompt key with --rollout-prompt-key" if key == keys.prompt else ""
            raise ConfigError(f"{where}: no key {key!r}{hint}")
    if keys.strict:
        unknown = next((key for key in record if key not in keys.known()), None)
        if unknown is not None:
            raise ConfigError(
                f"{where}: unknown key {_excerpt(unknown)}; a line has the keys {keys.prompt}, {keys.label}, "
                f"{METADATA}, {keys.tools}"
            )
    value = record[keys.prompt]
    if isinstance(value, str):
        if not value:
            raise ConfigError(f"{where}: key {keys.prompt!r} is empty; give it some text")
    elif isinstance(value, list):
        _check_messages(value, key=keys.prompt, where=where)
    else:
        raise ConfigError(
            f"{where}: key {keys.prompt!r} is {_type(value)}; a prompt is a string or a list of chat messages"
        )
    metadata = record.get(METADATA)
    if metadata is not None and not isinstance(metadata, dict):
        raise ConfigError(f"{where}: key {METADATA!r} must be an object, got {_type(metadata)}")
    tools = record.get(keys.tools)
    if tools is not None and not isinstance(tools, list):
        raise ConfigError(f"{where}: key {keys.tools!r} must be a list of tool definitions, got {_type(tools)}")


def _check_messages(messages: list[Any], *, key: str, where: str) -> None:
    if not messages:
        raise ConfigError(f"{where}: key {key!r} is an empty list of messages")
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConfigError(f"{where}: key {key!r} message {number} is {_type(message)}, not an object")
        for field in ("role", "content"):
            if message.get(field) is None:
                raise ConfigError(f"{where}: key {key!r} message {number} has no {field!r}")


def row_prompt(row: dict[str, Any], *, keys: PromptKeys, renderer: ChatRenderer, where: str) -> Prompt:
    """The :class:`Prompt` of one row (checked with :func:`check_record`; a chat prompt rendered)."""
    record = {key: value for key, value in row.items() if value is not None or key in keys.required()}
    check_record(record, keys=keys, where=where)
    metadata = dict(record.get(METADATA) or {})
    metadata.update({key: record.get(key) for key in keys.metadata})
    value = record[keys.prompt]
    if isinstance(value, list):  # Arrow structs hold every field of any message: drop those a message lacks
        value = [{name: part for name, part in message.items() if part is not None} for message in value]
    tools = record.get(keys.tools)
    return renderer.prompt(value, label=record.get(keys.label), metadata=metadata, tools=tools, origin=where)


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _excerpt(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _quiet_datasets() -> None:
    """No progress bars or info logs from ``datasets`` on the run's output."""
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
