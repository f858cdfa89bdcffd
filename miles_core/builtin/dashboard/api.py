"""The dashboard's JSON API: every view's data, read from a run's dashboard database.

Routes (all ``GET``; steps are numbered as in the terminal and metrics.jsonl: step N trains on rollout N - 1, and
step 0 holds the eval before training; the ``step`` of the hooks):

* ``/api/run``: status (``empty``, ``running``, ``finished``, ``failed``, or ``interrupted`` for a run whose
  process is gone), start and end, the steps recorded, the config.
* ``/api/topology``: the engine cells (state, weight version, workers), routers, trainer ranks.
* ``/api/metrics``: every metric as a series ``[[step, value], ...]``.
* ``/api/phases``: the timeline: every phase of every step, with wall-clock start and end.
* ``/api/weight_updates``: every weight transfer: version, protocol, bytes, seconds, GB/s.
* ``/api/steps``: the steps recorded, with their sample count and mean reward.
* ``/api/steps/STEP``: one step's metrics, phases and sample count.
* ``/api/steps/STEP/samples?offset=O&limit=L``: the step's samples, keyed ``(sample_index, occurrence)``.
* ``/api/steps/STEP/samples/INDEX/OCCURRENCE``: one sample, every field.

A step with no samples answers an empty list; an unknown step is a 404 and a malformed parameter a 400, both as
``{"error": MESSAGE}``.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from miles_core.builtin.dashboard.store import open_for_reading

MAX_PAGE = 1000
"""The most samples one request returns."""


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


Query = Mapping[str, list[str]]


class DashboardApi:
    """Answers API paths from the database at ``db_path``, one read connection per request."""

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path
        self.routes: list[tuple[re.Pattern[str], Callable[..., Any]]] = [
            (re.compile(r"/api/run"), self.run),
            (re.compile(r"/api/topology"), self.topology),
            (re.compile(r"/api/metrics"), self.metrics),
            (re.compile(r"/api/phases"), self.phases),
            (re.compile(r"/api/weight_updates"), self.weight_updates),
            (re.compile(r"/api/steps"), self.steps),
            (re.compile(r"/api/steps/(?P<step>[^/]+)"), self.step),
            (re.compile(r"/api/steps/(?P<step>[^/]+)/samples"), self.samples),
            (re.compile(r"/api/steps/(?P<step>[^/]+)/samples/(?P<index>[^/]+)/(?P<occurrence>[^/]+)"), self.sample),
        ]

    def answer(self, path: str, query: Query) -> tuple[int, dict[str, Any]]:
        """``(status, JSON body)`` for ``path``; errors are bodies too (``{"error": ...}``)."""
        for pattern, view in self.routes:
            match = pattern.fullmatch(path.rstrip("/") or "/")
            if match:
                try:
                    with open_for_reading(self.db_path) as db:
                        return 200, view(db, query, **match.groupdict())
                except ApiError as exc:
                    return exc.status, {"error": str(exc)}
        return 404, {"error": f"no API route {path!r}; routes: {', '.join(p.pattern for p, _ in self.routes)}"}

    # -- views ----------------------------------------------------------------------------------------------

    def run(self, db: sqlite3.Connection, query: Query) -> dict[str, Any]:
        meta = _meta(db)
        steps = _known_steps(db)
        status = meta.get("status", "empty")
        if status == "running" and not _alive(meta.get("pid")):
            status = "interrupted"
        return {
            "status": status,
            "run_dir": meta.get("run_dir"),
            "started": meta.get("started"),
            "ended": meta.get("ended"),
            "error": meta.get("error"),
            "num_steps": meta.get("num_steps"),
            "start_step": meta.get("start_step"),
            "steps_recorded": len(steps),
            "last_step": steps[-1] if steps else None,
            "config": meta.get("config"),
        }

    def topology(self, db: sqlite3.Connection, query: Query) -> dict[str, Any]:
        engines = [
            {
                **json.loads(row["info"]),
                "cell_id": row["cell_id"],
                "state": row["state"],
                "weight_version": row["weight_version"],
                "updated": row["updated"],
            }
            for row in db.execute("SELECT * FROM engines ORDER BY cell_id")
        ]
        routers = [json.loads(row["info"]) for row in db.execute("SELECT info FROM routers ORDER BY name")]
        return {"engines": engines, "routers": routers, "trainer": _meta(db).get("trainer")}

    def metrics(self, db: sqlite3.Connection, query: Query) -> dict[str, Any]:
        series: dict[str, list[list[float | None]]] = {}
        for row in db.execute("SELECT step, name, value FROM metrics ORDER BY name, step"):
            series.setdefault(row["name"], []).append([row["step"], row["value"]])
        return {"series": series}

    def phases(self, db: sqlite3.Connection, query: Query) -> dict[str, Any]:
        rows = db.execute("SELECT step, phase, started, ended FROM phases ORDER BY started, id").fetchall()
        return {"phases": [{**dict(row), "seconds": row["ended"] - row["started"]} for row in rows]}

    def weight_updates(self, db: sqlite3.Connection, query: Query) -> dict[str, Any]:
        rows = db.execute("SELECT * FROM weight_updates ORDER BY ended").fetchall()
        return {"weight_updates": [{**dict(row), "checksum_ok": _bool_or_none(row["checksum_ok"])} for row in rows]}

    def steps(self, db: sqlite3.Connection, query: Query) -> dict[str, Any]:
        counts = {
            row[0]: (row[1], row[2])
            for row in db.execute("SELECT step, COUNT(*), AVG(reward) FROM samples GROUP BY step")
        }
        return {
            "steps": [
                {
                    "step": step,
                    "num_samples": counts.get(step, (0, None))[0],
                    "reward_mean": counts.get(step, (0, None))[1],
                }
                for step in _known_steps(db)
            ]
        }

    def step(self, db: sqlite3.Connection, query: Query, *, step: str) -> dict[str, Any]:
        number = _known_step(db, step)
        metrics = {
            row["name"]: row["value"] for row in db.execute("SELECT name, value FROM metrics WHERE step = ?", (number,))
        }
        phases = [
            dict(row)
            for row in db.execute("SELECT phase, started, ended FROM phases WHERE step = ? ORDER BY started", (number,))
        ]
        (num_samples,) = db.execute("SELECT COUNT(*) FROM samples WHERE step = ?", (number,)).fetchone()
        return {"step": number, "metrics": metrics, "phases": phases, "num_samples": num_samples}

    def samples(self, db: sqlite3.Connection, query: Query, *, step: str) -> dict[str, Any]:
        number = _known_step(db, step)
        offset = _int_param(query, "offset", default=0, low=0)
        limit = _int_param(query, "limit", default=100, low=1, high=MAX_PAGE)
        (total,) = db.execute("SELECT COUNT(*) FROM samples WHERE step = ?", (number,)).fetchone()
        rows = db.execute(
            "SELECT step, sample_index, occurrence, reward, prompt, response FROM samples "
            "WHERE step = ? ORDER BY sample_index, occurrence LIMIT ? OFFSET ?",
            (number, limit, offset),
        ).fetchall()
        return {
            "step": number,
            "total": total,
            "offset": offset,
            "limit": limit,
            "samples": [dict(row) for row in rows],
        }

    def sample(self, db: sqlite3.Connection, query: Query, *, step: str, index: str, occurrence: str) -> dict:
        number = _known_step(db, step)
        key = (_int_path(index, "sample index"), _int_path(occurrence, "occurrence"))
        row = db.execute(
            "SELECT * FROM samples WHERE step = ? AND sample_index = ? AND occurrence = ?", (number, *key)
        ).fetchone()
        if row is None:
            raise ApiError(404, f"step {number} has no sample ({key[0]}, {key[1]}) (sample_index, occurrence)")
        return {**{k: row[k] for k in row.keys() if k != "data"}, "data": json.loads(row["data"])}  # noqa: SIM118


def _meta(db: sqlite3.Connection) -> dict[str, Any]:
    return {
        row["key"]: json.loads(row["value"])
        for row in db.execute("SELECT key, value FROM meta")
        if row["key"] != "schema_version"
    }


def _known_steps(db: sqlite3.Connection) -> list[int]:
    rows = db.execute(
        "SELECT step FROM phases UNION SELECT step FROM metrics UNION SELECT step FROM samples ORDER BY step"
    )
    return [row[0] for row in rows]


def _known_step(db: sqlite3.Connection, text: str) -> int:
    number = _int_path(text, "step")
    steps = _known_steps(db)
    if number not in steps:
        recorded = f"{steps[0]}..{steps[-1]}" if steps else "none yet"
        raise ApiError(404, f"step {number} is not recorded (steps recorded: {recorded})")
    return number


def _int_path(text: str, what: str) -> int:
    if not re.fullmatch(r"[0-9]{1,9}", text):  # ASCII digits: int() and \d take other scripts' digits too
        raise ApiError(400, f"{what} must be a non-negative integer, got {text[:40]!r}")
    return int(text)


def _int_param(query: Query, name: str, *, default: int, low: int, high: int | None = None) -> int:
    values = query.get(name)
    if not values:
        return default
    text = values[-1]
    if not re.fullmatch(r"-?[0-9]{1,9}", text) or int(text) < low or (high is not None and int(text) > high):
        allowed = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        raise ApiError(400, f"query parameter {name} must be {allowed}, got {text[:40]!r}")
    return int(text)


def _alive(pid: Any) -> bool:
    """Whether the process ``pid`` (the run's, on this machine) still exists."""
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _bool_or_none(value: Any) -> bool | None:
    return None if value is None else bool(value)
