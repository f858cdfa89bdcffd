"""Build every distribution of the repository into a wheelhouse, and check that the wheels hold all of the code.

    python tools/wheelhouse.py build WHEELHOUSE     # python -m build: an sdist of each, and a wheel built from it
    python tools/wheelhouse.py check WHEELHOUSE     # every wheel holds every file of its packages, and its metadata
    python tools/wheelhouse.py modules              # the modules of every distribution, one a line (from the tree)
    python -I tools/wheelhouse.py imports < LIST    # import each module named on stdin; run in the wheels' venv
    python tools/wheelhouse.py collect-time PYTHON...  # `pytest --co` here with each interpreter: time, torch?

``check`` compares each wheel's file list with the files git tracks under the distribution's package (code and
data alike) and reads the wheel's metadata; ``imports`` imports every module in an environment that has the wheels
installed (run with ``python -I`` from outside the checkout, so nothing of the source tree is on ``sys.path``) and
fails naming each module that is missing or does not import. Either fails on a file left out of a wheel. The
standard library only: ``imports`` runs in a bare environment.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib
import statistics
import subprocess
import sys
import time
import tomllib
import traceback
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REQUIRED_METADATA = ("Name", "Version", "Summary", "License-Expression", "Requires-Python", "Project-URL", "Classifier")


def distribution_roots(repo: Path = REPO) -> list[Path]:
    """The folders with a pyproject.toml: the core, the first-party plugins, the example plugins."""
    return [
        repo,
        *sorted(p.parent for p in repo.glob("miles_plugins_*/pyproject.toml")),
        *sorted(p.parent for p in repo.glob("plugins/*/pyproject.toml")),
    ]


def project_of(root: Path) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]


def package_of(root: Path) -> str:
    return project_of(root)["name"].replace("-", "_")


def source_files(root: Path) -> list[str]:
    """The files of the distribution's package as they would lie in a wheel (``pkg/sub/mod.py``): those git tracks
    (a clean clone has no others), else every file but byte code."""
    package = root / package_of(root)
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", str(package)], cwd=root, capture_output=True, check=True, text=True
        ).stdout.split("\0")
        paths = [root / name for name in listed if name]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in package.rglob("*") if p.is_file()]
    return sorted(p.relative_to(root).as_posix() for p in paths if "__pycache__" not in p.parts and p.suffix != ".pyc")


def wheel_path(wheelhouse: Path, root: Path) -> Path:
    project = project_of(root)
    version = project.get("version") or _dynamic_version(root)
    return wheelhouse / f"{package_of(root)}-{version}-py3-none-any.whl"


def _dynamic_version(root: Path) -> str:
    """``version = {attr = "pkg.__version__"}``: the literal assigned in that module (as setuptools reads it)."""
    attr = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    module, _, name = attr.rpartition(".")
    path = root / Path(*module.split(".")) / "__init__.py"
    for line in path.read_text().splitlines():
        if line.startswith(f"{name} = "):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise SystemExit(f"{path}: no {name} = ... line")


def problems_with(wheel: Path, root: Path) -> list[str]:
    """What the wheel of the distribution at ``root`` lacks: files of its package, metadata fields, entry points."""
    if not wheel.is_file():
        return [f"{wheel.name}: not built (expected in {wheel.parent})"]
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        metadata = email.parser.Parser().parsestr(archive.read(f"{dist_info}/METADATA").decode())
        listed = f"{dist_info}/entry_points.txt"
        entry_points = archive.read(listed).decode() if listed in names else ""
    found = [f"{wheel.name} lacks {path}" for path in source_files(root) if path not in names]
    found += [f"{wheel.name}: METADATA has no {field}" for field in REQUIRED_METADATA if not metadata.get_all(field)]
    if not any(n.startswith(f"{dist_info}/licenses/") for n in names):
        found.append(f"{wheel.name}: no license file")
    for group, eps in project_of(root).get("entry-points", {}).items():
        for name, value in eps.items():
            if f"{name} = {value}" not in entry_points or f"[{group}]" not in entry_points:
                found.append(f"{wheel.name}: entry point {group}: {name} = {value} is missing")
    return found


def modules_of(root: Path) -> list[str]:
    return sorted(
        ".".join(Path(path).with_suffix("").parts).removesuffix(".__init__")
        for path in source_files(root)
        if path.endswith(".py")
    )


def build(wheelhouse: Path) -> int:
    wheelhouse.mkdir(parents=True, exist_ok=True)
    for root in distribution_roots():
        # An sdist, then the wheel built from it: a file the sdist leaves out is missing from the wheel too.
        command = [sys.executable, "-m", "build", "--outdir", str(wheelhouse), str(root)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            print(f"building {root}: {' '.join(command)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
            return 1
        print(f"built {wheel_path(wheelhouse, root).name}")
    return 0


def check(wheelhouse: Path) -> int:
    found = [problem for root in distribution_roots() for problem in problems_with(wheel_path(wheelhouse, root), root)]
    for problem in found:
        print(problem)
    if not found:
        print(f"{len(distribution_roots())} wheels hold every file of their packages, their metadata and entry points")
    return 1 if found else 0


def imports(modules: list[str], *, outside: Path | None) -> int:
    """Import each module; each that fails is printed with its error. With ``outside``, a module loaded from under
    that folder (the source tree) is a failure too."""
    failed = 0
    for name in modules:
        try:
            module = importlib.import_module(name)
        except BaseException as exc:  # every failure is reported, a module's SystemExit included
            failed += 1
            print(f"{name}: {type(exc).__name__}: {exc}")
            if not isinstance(exc, ImportError):
                traceback.print_exc(limit=-3)
            continue
        where = Path(getattr(module, "__file__", "") or "").resolve()
        if outside is not None and where.is_relative_to(outside.resolve()):
            failed += 1
            print(f"{name}: imported from the source tree ({where}), not from an installed wheel")
    print(f"imported {len(modules) - failed} of {len(modules)} modules")
    return 1 if failed else 0


# `pytest --co` in the current folder; then whether torch (or transformers) was imported on the way.
COLLECT_PROBE = """
import sys, pytest
pytest.main(["--co", "-q"])
print("HEAVY:" + ",".join(m for m in ("torch", "transformers") if m in sys.modules))
"""


def collect_time(interpreters: list[str], *, repeats: int = 5) -> int:
    """The median wall time of ``pytest --co`` (in the current folder) with each interpreter; fails when one of them
    imports torch or transformers on the way (a pytest plugin that installing a package registered)."""
    heavy_found = False
    for python in interpreters:
        seconds, heavy = [], ""
        for _ in range(repeats):
            began = time.perf_counter()
            result = subprocess.run([python, "-c", COLLECT_PROBE], capture_output=True, text=True, check=False)
            seconds.append(time.perf_counter() - began)
            heavy = result.stdout.rpartition("HEAVY:")[2].strip()
        heavy_found = heavy_found or bool(heavy)
        print(
            f"pytest --co with {python}: median {statistics.median(seconds):.3f} s of {repeats} "
            f"(min {min(seconds):.3f}, max {max(seconds):.3f}); imported {heavy or 'neither torch nor transformers'}"
        )
    return 1 if heavy_found else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("build", "check"):
        commands.add_parser(name).add_argument("wheelhouse", type=Path)
    commands.add_parser("modules")
    commands.add_parser("collect-time").add_argument("interpreters", nargs="+")
    importing = commands.add_parser("imports")
    importing.add_argument("--outside", type=Path, help="fail for a module loaded from under this folder")
    importing.add_argument("--path", type=Path, action="append", default=[], help="a folder to put first on sys.path")
    args = parser.parse_args(argv)
    if args.command == "build":
        return build(args.wheelhouse)
    if args.command == "check":
        return check(args.wheelhouse)
    if args.command == "modules":
        print("\n".join(module for root in distribution_roots() for module in modules_of(root)))
        return 0
    if args.command == "collect-time":
        return collect_time(args.interpreters)
    sys.path[:0] = [str(path) for path in args.path]  # a `pip install --target` folder, as the tests make
    return imports([line.strip() for line in sys.stdin if line.strip()], outside=args.outside)


if __name__ == "__main__":
    sys.exit(main())
