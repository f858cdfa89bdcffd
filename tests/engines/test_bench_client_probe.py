"""The bench client's probe: an SGLang environment whose client cannot start on this CPU is a skip that says why
(a signal's name), not a failure of the test that would run it, and one that starts is no reason at all."""

from __future__ import annotations

import sys
from pathlib import Path

from miles_core.testkit.sglang_bench import bench_client_unavailable_reason


def fake_python(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


def test_a_client_that_dies_of_an_illegal_instruction_is_named_with_the_signal(tmp_path: Path) -> None:
    reason = bench_client_unavailable_reason(fake_python(tmp_path, "kill -ILL $$"))
    assert reason is not None and "SIGILL" in reason and "AVX-512" in reason, reason


def test_a_client_that_fails_to_import_is_named_with_its_error(tmp_path: Path) -> None:
    reason = bench_client_unavailable_reason(fake_python(tmp_path, "echo 'No module named sglang' >&2; exit 1"))
    assert reason is not None and "No module named sglang" in reason, reason


def test_an_environment_that_imports_the_client_is_no_reason(tmp_path: Path) -> None:
    stub = tmp_path / "stub" / "sglang"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "bench_serving.py").write_text("")
    python = fake_python(tmp_path, f'PYTHONPATH={stub.parent} exec {sys.executable} "$@"')
    assert bench_client_unavailable_reason(python) is None
