"""What a node needs before workers start on it, checked once per node: it sees the shared directories as the driver
does, and it has the Miles packages the driver loaded.

The driver writes a probe file of random bytes into each shared directory (or, where it cannot write, takes the
digest of a file already there) and a task on the node reads it back; the node also imports each ``miles_*``
package the driver imported. Either failing is a :class:`NodeCheckError` that names the node and says what to do,
before any worker starts there: not a missing file at the first weight update.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

from miles_core.workers.errors import WorkerStartError
from miles_core.workers.provider import SharedPath

PROBE_PREFIX = ".miles-node-check-"
WITNESS_BYTES = 1 << 20  # the most bytes of a file a witness digests


class NodeCheckError(WorkerStartError):
    """A node that cannot host the run's workers: a shared directory it does not see, a package it lacks."""


@dataclasses.dataclass(frozen=True)
class Witness:
    """A file in a shared directory and the digest its first bytes must have on every node."""

    shared: SharedPath
    file: str
    digest: str
    probe: bool  # written by the driver for the check (removed when the provider shuts down)


def make_witnesses(shared_paths: Sequence[SharedPath]) -> list[Witness]:
    """One witness per shared directory: a probe file written into a directory of the run's own, the first file of
    any other (a user's model directory is never written to) or of one this process cannot write. A directory that
    does not exist here is left to whoever reads it."""
    witnesses = []
    for shared in shared_paths:
        directory = Path(shared.path)
        if not directory.is_dir():
            continue
        witness = _written_probe(shared, directory) if shared.owned else None
        witness = witness or _existing_file(shared, directory)
        if witness is not None:
            witnesses.append(witness)
    return witnesses


def _written_probe(shared: SharedPath, directory: Path) -> Witness | None:
    probe = directory / f"{PROBE_PREFIX}{secrets.token_hex(8)}"
    try:
        probe.write_bytes(secrets.token_bytes(32))
    except OSError:
        return None  # a directory this process cannot write: witnessed by a file already there
    return Witness(shared, str(probe), file_digest(str(probe)), probe=True)


def _existing_file(shared: SharedPath, directory: Path) -> Witness | None:
    files = sorted(path for path in directory.iterdir() if path.is_file())
    return Witness(shared, str(files[0]), file_digest(str(files[0])), probe=False) if files else None


def file_digest(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read(WITNESS_BYTES)).hexdigest()


def miles_packages() -> list[str]:
    """The top-level ``miles_*`` packages of installed distributions that this process imported (the core, the
    plugins it loaded; a ``--plugin`` file is the driver's own, not looked for on the nodes)."""
    installed = importlib.metadata.packages_distributions()
    imported = {name.split(".", 1)[0] for name in sys.modules if name.startswith("miles_")}
    return sorted(package for package in imported if package in installed)


def probe_node(witnesses: list[tuple[str, str]], packages: list[str]) -> dict[str, list[str]]:
    """Run on the node: which witness files (``(file, digest)``) it does not see as the driver does, and which
    packages it cannot import, each with the reason."""
    unseen, missing = [], []
    for file, digest in witnesses:
        try:
            seen = file_digest(file)
        except OSError as exc:
            unseen.append(f"{file}: {exc.strerror or exc}")
            continue
        if seen != digest:
            unseen.append(f"{file}: other bytes than the driver wrote (another file system)")
    for package in packages:
        try:
            importlib.import_module(package)
        except Exception as exc:  # any failure to import is what this reports
            missing.append(f"{package} ({type(exc).__name__}: {exc})")
    return {"unseen": unseen, "missing": missing}


def node_problems(node: str, witnesses: Sequence[Witness], found: dict[str, list[str]]) -> str | None:
    """The error text for a node's probe result ``found`` (``None`` when the node is fit)."""
    lines = []
    by_file = {witness.file: witness for witness in witnesses}
    for problem in found["unseen"]:
        witness = by_file[problem.split(": ", 1)[0]]
        lines.append(
            f"it does not see {witness.shared.what} {witness.shared.path} as the driver does ({problem}): put it "
            f"on storage every node mounts at the same path, or set {witness.shared.setting} to such a directory"
        )
    for problem in found["missing"]:
        package = problem.split(" ", 1)[0]
        lines.append(
            f"it cannot import {problem}: install the same Miles and plugins on every node "
            f"(this driver has {package} {_version_of(package)})"
        )
    if not lines:
        return None
    return f"node {node} cannot host this run's workers:\n" + "\n".join(f"  - {line}" for line in lines)


def _version_of(package: str) -> str:
    for distribution in importlib.metadata.packages_distributions().get(package, []):
        try:
            return f"from {distribution} {importlib.metadata.version(distribution)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "(no distribution found)"
