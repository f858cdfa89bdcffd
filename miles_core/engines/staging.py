"""Where weight-staging files live, and the check that a path from a request names one of them.

Weight updates on one machine travel through files (``/update_weights_from_tensor`` with ``safetensors_path``, or
``/update_weights_from_staging``, whose layout :mod:`miles_core.weight_transfer.staging_layout` describes): the sender
writes them and the engine reads, maps or removes them. A path in a request must never reach anything else, so
senders create these files in one *staging directory* and the engine accepts only regular files directly inside it
(after resolving symlinks). The directory is private to the user (mode 0700, owned by them, never a symlink):
``$MILES_WEIGHT_STAGING_DIR`` where set, else ``/dev/shm/miles-staging-<uid>`` (the system's temporary directory
where there is no ``/dev/shm``). Senders and engines of a run find the same directory without being told, as they
run as the same user on the same machine.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from miles_core.errors import MilesError

STAGING_DIR_ENV = "MILES_WEIGHT_STAGING_DIR"
"""The environment variable that names the weight-staging directory (both ends of a staging transfer read it)."""


class StagingPathError(MilesError):
    """A path in a request that is not a staging file of this engine; nothing was read, written or removed."""


def weight_staging_dir() -> Path:
    """The user's weight-staging directory, created (mode 0700) when missing; an unsafe one is an error."""
    configured = os.environ.get(STAGING_DIR_ENV)
    if configured:
        directory = Path(configured)
    else:
        root = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
        directory = root / f"miles-staging-{os.getuid()}"
    return ensure_private_dir(directory)


def remove_orphan_files(directory: Path, prefix: str) -> list[Path]:
    """Remove this user's files ``<prefix><pid>-...`` in ``directory`` whose process ``pid`` is gone: staging and
    send buffers of a process that died without removing them (SIGKILL, the OOM killer), each as large as a bucket of
    weights in shared memory. Call it before making new ones; returns what it removed."""
    removed = []
    for path in directory.glob(f"{prefix}*"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        try:
            if path.lstat().st_uid == os.getuid():
                path.unlink()
                removed.append(path)
        except OSError:  # removed meanwhile, or not ours to remove
            continue
    return removed


def ensure_private_dir(directory: Path) -> Path:
    """``directory`` created with mode 0700 if missing; it must be a real directory (not a symlink) that only this
    user owns and can write, or it is refused (someone else could put or swap files in it)."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(directory)
    except OSError as exc:
        raise MilesError(
            f"weight-staging directory {str(directory)!r}: {exc.strerror}; set {STAGING_DIR_ENV} to a "
            "directory of yours"
        ) from None
    problem = None
    if not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory (a symlink?)"
    elif info.st_uid != os.getuid():
        problem = f"belongs to uid {info.st_uid}, not to this user ({os.getuid()})"
    elif info.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):o}: others may use it (it must be 700)"
    if problem is not None:
        raise MilesError(
            f"weight-staging directory {str(directory)!r} {problem}; remove it, or set "
            f"{STAGING_DIR_ENV} to a private directory of yours"
        )
    return directory


def confined_staging_file(path: object, directory: Path, *, field: str) -> Path:
    """``path`` (from request ``field``) resolved, if it names a regular file directly inside ``directory``;
    anything else (another directory, ``..``, a symlink leading out, a device, a missing file) is refused."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise StagingPathError(f"{field} must be the path of a staging file, got {path!r}")
    resolved = Path(os.path.realpath(path))
    if resolved.parent != Path(os.path.realpath(directory)):
        raise StagingPathError(
            f"{field} {path!r} is not in this engine's weight-staging directory "
            f"{str(directory)!r}: senders create staging files there"
        )
    try:
        info = os.lstat(resolved)
    except OSError as exc:
        raise StagingPathError(f"{field} {path!r}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise StagingPathError(f"{field} {path!r} is not a regular file")
    return resolved
