"""The dashboard's SQLite database in the run directory: the schema, the writer (the run) and opening it to read.

The run writes through one :class:`DashboardStore` (WAL mode, one commit per event, so a killed run keeps
everything recorded until then); servers open their own read connections (:func:`open_for_reading`), so a live run
can be viewed while it writes. Every ``step`` column holds the step as the terminal and metrics.jsonl number it
(step N trains on rollout N - 1; step 0 is the eval before training).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from miles_core.errors import MilesError

DB_NAME = "dashboard.sqlite"
SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS engines (
    cell_id TEXT PRIMARY KEY, state TEXT NOT NULL, weight_version INTEGER, info TEXT NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS routers (name TEXT PRIMARY KEY, info TEXT NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS phases (
    id INTEGER PRIMARY KEY, step INTEGER NOT NULL, phase TEXT NOT NULL, started REAL NOT NULL, ended REAL NOT NULL);
CREATE INDEX IF NOT EXISTS phases_step ON phases (step);
CREATE TABLE IF NOT EXISTS metrics (
    step INTEGER NOT NULL, name TEXT NOT NULL, value REAL, PRIMARY KEY (step, name));
CREATE TABLE IF NOT EXISTS samples (
    step INTEGER NOT NULL, sample_index INTEGER NOT NULL, occurrence INTEGER NOT NULL, reward REAL,
    prompt TEXT NOT NULL, response TEXT NOT NULL, data TEXT NOT NULL, PRIMARY KEY (step, sample_index, occurrence));
CREATE TABLE IF NOT EXISTS weight_updates (
    version INTEGER NOT NULL, protocol TEXT NOT NULL, num_bytes INTEGER NOT NULL, seconds REAL NOT NULL,
    gb_per_s REAL, num_engines INTEGER NOT NULL, checksum_ok INTEGER, started REAL, ended REAL NOT NULL);
"""


def db_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / DB_NAME


def finite(value: Any) -> float | None:
    """A number as a finite float, or ``None`` (JSON has no NaN or infinity; a metric may be either)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


class DashboardStore:
    """The writer: one per run, used from the run's threads (serialised by a lock)."""

    def __init__(self, run_dir: Path | str) -> None:
        self.path = db_path(run_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a commit survives a killed process
        self._db.executescript(SCHEMA)  # executescript commits by itself: outside a transaction
        with self._transaction() as db:
            db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- run --------------------------------------------------------------------------------------------------

    def run_started(self, *, run_dir: str, start_step: int, num_steps: int, config: Mapping[str, Any]) -> None:
        self._set_meta(
            status="running",
            run_dir=run_dir,
            started=time.time(),
            ended=None,
            error=None,
            pid=os.getpid(),
            start_step=start_step,
            num_steps=num_steps,
            config=config,
        )

    def run_ended(self, *, status: str, error: str | None) -> None:
        self._set_meta(status=status, ended=time.time(), error=error)

    def _set_meta(self, **values: Any) -> None:
        with self._transaction() as db:
            db.executemany(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)", [(key, json.dumps(value)) for key, value in values.items()]
            )

    # -- topology ---------------------------------------------------------------------------------------------

    def set_trainer(self, trainer: Mapping[str, Any]) -> None:
        self._set_meta(trainer=dict(trainer))

    def set_engines(self, engines: list[Mapping[str, Any]]) -> None:
        """The engines now running; an empty list marks every known engine ``stopped`` (they keep their last
        description, so a finished run still shows its topology)."""
        now = time.time()
        with self._transaction() as db:
            if not engines:
                db.execute("UPDATE engines SET state = 'stopped', updated = ?", (now,))
                return
            for engine in engines:
                db.execute(
                    "INSERT OR REPLACE INTO engines VALUES (?, ?, ?, ?, ?)",
                    (
                        str(engine.get("cell_id", "?")),
                        str(engine.get("state", "unknown")),
                        _int_or_none(engine.get("weight_version")),
                        _to_json(engine),
                        now,
                    ),
                )

    def set_router(self, router: Mapping[str, Any]) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO routers VALUES (?, ?, ?)",
                (str(router.get("name", "router")), _to_json(router), time.time()),
            )

    # -- events -----------------------------------------------------------------------------------------------

    def add_phase(self, *, step: int, phase: str, started: float, ended: float) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT INTO phases (step, phase, started, ended) VALUES (?, ?, ?, ?)",
                (int(step), str(phase), float(started), float(ended)),
            )

    def add_metrics(self, *, step: int, metrics: Mapping[str, Any]) -> None:
        rows = [(int(step), str(name), finite(value)) for name, value in metrics.items()]
        with self._transaction() as db:
            db.executemany("INSERT OR REPLACE INTO metrics VALUES (?, ?, ?)", rows)

    def add_samples(self, *, step: int, samples: Iterable[Any]) -> int:
        """Store a step's samples; each gets the next free ``occurrence`` of its ``sample_index`` in the step, so
        samples that share an index (a group, a resent request, a second call) never overwrite each other."""
        records = [sample_record(sample) for sample in samples]
        with self._transaction() as db:
            taken = dict(
                db.execute(
                    "SELECT sample_index, MAX(occurrence) + 1 FROM samples WHERE step = ? GROUP BY sample_index",
                    (int(step),),
                ).fetchall()
            )
            rows = []
            for record in records:
                occurrence = taken.get(record["sample_index"], 0)
                taken[record["sample_index"]] = occurrence + 1
                rows.append(
                    (
                        int(step),
                        record["sample_index"],
                        occurrence,
                        record["reward"],
                        record["prompt"],
                        record["response"],
                        _to_json(record["data"]),
                    )
                )
            db.executemany("INSERT INTO samples VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
        return len(records)

    def add_weight_update(self, *, report: Any, started: float | None) -> None:
        ended = time.time()
        with self._transaction() as db:
            db.execute(
                "INSERT INTO weight_updates VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    int(report.version),
                    str(report.protocol),
                    int(report.num_bytes),
                    float(report.seconds),
                    finite(report.gb_per_s),
                    int(report.num_engines),
                    report.checksum_ok,
                    started,
                    ended,
                ),
            )
            db.execute(
                "UPDATE engines SET weight_version = ?, updated = ? WHERE state = 'running'",
                (int(report.version), ended),
            )

    def drop_steps_from(self, from_step: int) -> None:
        """Delete every record of steps ``from_step`` and later (phases, metrics, samples, and the weight updates
        of those versions: version N is step N's), in one transaction: a resumed run records them again."""
        with self._transaction() as db:
            for table, column in (
                ("phases", "step"),
                ("metrics", "step"),
                ("samples", "step"),
                ("weight_updates", "version"),
            ):
                db.execute(f"DELETE FROM {table} WHERE {column} >= ?", (int(from_step),))

    # -- helpers ----------------------------------------------------------------------------------------------

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db, self._lock)


class _Transaction:
    """``BEGIN``/``COMMIT`` (``ROLLBACK`` on error) under the store's lock: one commit per event."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        self.db, self.lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.db

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.lock.release()


def sample_record(sample: Any) -> dict[str, Any]:
    """A sample (the executor's ``Sample``, a mapping, or any object with attributes) as a row: its index, reward,
    prompt text, response text, and every other field as JSON-ready data (nested dataclasses become mappings when
    the row is written, :func:`_to_json`)."""
    if dataclasses.is_dataclass(sample) and not isinstance(sample, type):
        data = _fields(sample)  # shallow: copying a step's token lists and logprobs again would cost milliseconds
    elif isinstance(sample, Mapping):
        data = dict(sample)
    else:
        data = dict(vars(sample))
    index = data.pop("sample_index", data.pop("index", None))
    prompt = data.pop("prompt", "")
    if dataclasses.is_dataclass(prompt) and not isinstance(prompt, type):
        prompt = _fields(prompt)
    if isinstance(prompt, Mapping):  # the executor's Prompt: text, label, metadata
        data["label"], data["prompt_metadata"] = prompt.get("label"), prompt.get("metadata")
        prompt = prompt.get("text", "")
    return {
        "sample_index": _int_or_none(index) or 0,
        "reward": finite(data.pop("reward", None)),
        "prompt": str(prompt),
        "response": str(data.pop("response", "")),
        "data": data,
    }


def _fields(instance: Any) -> dict[str, Any]:
    return {name: getattr(instance, name) for name in _field_names(type(instance))}


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(cls))


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _to_json(value: Any) -> str:
    """``value`` as strict JSON: dataclasses as mappings, other unknown objects as their ``str``, and NaN or
    infinity as ``null`` (a first, strict pass finds whether there are any: most rows hold none)."""
    try:
        return json.dumps(value, default=_jsonable, allow_nan=False)
    except (ValueError, TypeError):  # a NaN or an infinity somewhere, or a key that is not a string or a number
        return json.dumps(_replace_non_finite(value), default=str, allow_nan=False)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _fields(value)
    return str(value)


def _replace_non_finite(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = _fields(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _replace_non_finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_replace_non_finite(v) for v in value]
    return value


# -- reading ----------------------------------------------------------------------------------------------------


class DashboardDatabaseError(MilesError):
    """The run directory or its database cannot be opened: the message says what is wrong and what to do."""


def check_run_dir(run_dir: Path | str) -> Path:
    """The database of ``run_dir``, checked: the directory exists and holds a readable dashboard database."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise DashboardDatabaseError(
            f"run directory {str(run_dir)!r} does not exist (give the --output-dir of a run, e.g. runs/latest)"
        )
    if not run_dir.is_dir():
        raise DashboardDatabaseError(f"{str(run_dir)!r} is not a directory (give a run directory, e.g. runs/latest)")
    path = db_path(run_dir)
    if path.exists() and not path.is_file():
        raise DashboardDatabaseError(
            f"{str(path)!r} is not a regular file (a directory, FIFO or device): it is not a "
            "dashboard database; move it aside or open another run directory"
        )
    if not path.is_file():
        raise DashboardDatabaseError(
            f"{str(run_dir)!r} holds no dashboard database ({DB_NAME}): is it a run directory of `miles train`? "
            "(runs record one unless --dashboard-record false)"
        )
    with open_for_reading(path):
        pass
    return path


def _schema_problem(path: Path, version: Any) -> str:
    """What to do about a database of another schema version: a newer miles wrote it, or an older one."""
    shown = str(version)[:20] if version is not None else "none"
    newer = isinstance(version, str) and version.isascii() and version.isdigit() and int(version) > SCHEMA_VERSION
    what = (
        "a newer miles recorded it: upgrade miles-core to read it"
        if newer
        else "it is not a dashboard database of this miles: open another run directory, or move it aside"
    )
    return f"{str(path)!r} has dashboard schema version {shown}; this miles reads version {SCHEMA_VERSION}: {what}"


@contextlib.contextmanager
def open_for_reading(path: Path) -> Iterator[sqlite3.Connection]:
    """A read connection to a dashboard database, checked; a corrupt or foreign file is a
    :class:`DashboardDatabaseError` that names the file and says what to do."""
    db = None
    try:
        # Not mode=ro: a reader of a WAL database may have to create the -shm file of a stopped run. The path is
        # percent-encoded (as_uri): a run directory named 'a#1' or 'r?x' must not open (or create) the file 'a'.
        db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=rw", uri=True, timeout=5.0)
        db.row_factory = sqlite3.Row
        version = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if version is None or version[0] != str(SCHEMA_VERSION):
            raise DashboardDatabaseError(_schema_problem(path, version[0] if version else None))
    except sqlite3.DatabaseError as exc:
        if db is not None:
            db.close()
        raise DashboardDatabaseError(
            f"{str(path)!r} is not a readable dashboard database ({exc}): it may be corrupt or not a miles run's; "
            "move it aside or open another run directory"
        ) from None
    except BaseException:
        db.close()
        raise
    try:
        yield db
    finally:
        db.close()
