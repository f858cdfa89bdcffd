"""``metrics.jsonl`` when a run resumes: the rows of the steps that run again go, everything else stays byte for
byte, the file is replaced atomically, and a file that is not one is a clear error."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from miles_core.errors import MilesError
from miles_core.reporting import drop_rows_from


def row(step: int, **values: float) -> bytes:
    return (json.dumps({"step": step, "time": 0.5 * step, **values}) + "\n").encode()


EARLIER = [
    row(0, **{"eval/reward_mean": 0.0}),
    row(1, **{"train/loss": 0.25}),
    b"a line that is no row, kept\n",
    row(2, **{"train/loss": -0.125}),
]
ABANDONED = [row(3, **{"train/loss": 1.5}), row(4, **{"train/loss": 2.5})]


@pytest.mark.parametrize(("from_step", "kept"), [(3, EARLIER), (0, [EARLIER[2]])])
def test_the_rows_of_the_steps_that_run_again_go_and_every_other_line_stays(
    tmp_path: Path, from_step: int, kept: list[bytes]
) -> None:
    """From step 3 (resumed from checkpoint 2), and from 0 (no checkpoint: the eval before training runs again)."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(EARLIER + ABANDONED))
    assert drop_rows_from(path, from_step=from_step) == len(EARLIER) + len(ABANDONED) - len(kept)
    assert path.read_bytes() == b"".join(kept)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left


def test_a_killed_run_s_unfinished_last_line_goes_and_a_whole_row_gets_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(EARLIER) + row(3)[:20])  # killed while writing step 3's row
    assert drop_rows_from(path, from_step=3) == 0  # no whole row dropped, but the file is repaired
    assert path.read_bytes() == b"".join(EARLIER)
    path.write_bytes(b"".join(EARLIER) + row(3).rstrip(b"\n"))  # killed before the newline
    assert drop_rows_from(path, from_step=4) == 0
    assert path.read_bytes() == b"".join([*EARLIER, row(3)])  # the next row starts a line of its own


def test_a_linked_metrics_file_is_rewritten_where_the_link_points(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.jsonl"
    target.write_bytes(b"".join(EARLIER + ABANDONED))
    (tmp_path / "metrics.jsonl").symlink_to(target)
    assert drop_rows_from(tmp_path / "metrics.jsonl", from_step=3) == 2
    assert (tmp_path / "metrics.jsonl").is_symlink() and target.read_bytes() == b"".join(EARLIER)


def test_nothing_to_drop_leaves_the_file_untouched_and_a_missing_file_missing(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(EARLIER))
    before = os.stat(path)
    assert drop_rows_from(path, from_step=3) == 0
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert drop_rows_from(tmp_path / "none.jsonl", from_step=0) == 0
    assert not (tmp_path / "none.jsonl").exists()


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_rewrite_that_fails_midway_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """The new file replaces the old one only once it is whole and synced: failing while it is written (a full
    disk) or renamed leaves the old file, every row in it, and an error naming it."""
    path = tmp_path / "metrics.jsonl"
    content = b"".join(EARLIER + ABANDONED)
    path.write_bytes(content)

    def fail(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(MilesError, match=f"cannot be dropped from {str(path)!r}: No space left on device"):
        drop_rows_from(path, from_step=3)
    monkeypatch.undo()
    assert path.read_bytes() == content
    assert drop_rows_from(path, from_step=3) == 2  # the next resume succeeds over the rewrite left behind
    assert path.read_bytes() == b"".join(EARLIER)


@pytest.mark.parametrize("kind", ["directory", "fifo", "loop"])
def test_a_metrics_file_that_is_not_a_regular_file_is_an_error_not_a_hang(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "metrics.jsonl"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(tmp_path / "other.jsonl", path)
        os.symlink(path, tmp_path / "other.jsonl")
    outcome: list[BaseException] = []
    reader = threading.Thread(target=lambda: _capture(outcome, path), daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert not reader.is_alive(), "drop_rows_from blocked on a FIFO"
    assert isinstance(outcome[0], MilesError)
    assert "it is not a regular file (a directory, FIFO or device); move it aside" in str(outcome[0])


def _capture(outcome: list[BaseException], path: Path) -> None:
    try:
        drop_rows_from(path, from_step=1)
    except BaseException as exc:
        outcome.append(exc)
