"""No listener of the product is bound to a hard-coded loopback or wildcard address: every one binds its node's
address (:func:`miles_core.workers.node.node_address`, loopback on one machine only because that is the node's
address there). A grep-level check over the product's code (docstrings aside): each string constant that names
loopback or every interface must be one of the places listed here, each with why it is not a worker's listener. The
cross-namespace check of what actually listens is ``tests/cluster/test_exposure_across_hosts.py``."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from tests.conftest import REPO

ADDRESSES = {"127.0.0.1", "0.0.0.0", "localhost", "::1", "[::1]", "::"}
PRODUCT = ["miles_core", "miles_plugins_megatron", "miles_plugins_sglang", "miles_plugins_rdt", "plugins"]
ALLOWED = {
    # the one definition of loopback, the address of a node that is one machine, and its names
    "miles_core/workers/node.py": 5,
    # names a Host header may carry, and the wildcard hosts refused or rewritten (no binding)
    "miles_core/http.py": 5,
    # the dashboard and the Prometheus endpoint: the user's own views of a run on the driver's machine, without
    # authentication, so loopback unless the user binds elsewhere on purpose (and the wildcard they may choose)
    "miles_core/builtin/dashboard/config.py": 1,
    "miles_core/builtin/dashboard/server.py": 2,
    "miles_core/builtin/dashboard/hosts.py": 1,
    "miles_core/cli/main.py": 1,
    "miles_core/builtin/metrics/config.py": 1,
    "miles_core/builtin/metrics/prometheus.py": 1,
    # a local Ray (no cluster address) is one machine: its node address is loopback, by design
    "miles_core/builtin/ray_provider.py": 1,
    # recognising a loopback Ray address the user gave (no binding)
    "miles_core/workers/ray_settings.py": 1,
    # recognising an engine URL on the driver's own node (no binding)
    "miles_plugins_rdt/miles_plugins_rdt/protocol.py": 3,
    # the test kit's fault-injecting proxy: a test tool in front of a server on this machine
    "miles_core/testkit/fault_proxy.py": 2,
}


def address_constants(path: Path) -> int:
    """How many string constants in ``path`` name loopback or every interface (docstrings left out)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and node.value.strip() in ADDRESSES
    )


def test_no_hard_coded_loopback_or_wildcard_address_outside_the_listed_places() -> None:
    found = Counter()
    for root in PRODUCT:
        for path in (REPO / root).rglob("*.py"):
            count = address_constants(path)
            if count:
                found[path.relative_to(REPO).as_posix()] = count
    assert dict(found) == ALLOWED


def test_the_check_sees_a_hard_coded_listener(tmp_path: Path) -> None:
    """The check finds a literal address in code, and not one in a docstring."""
    sample = tmp_path / "sample.py"
    sample.write_text('"""Binds 127.0.0.1 here."""\nHOST = "0.0.0.0"\nserve(host="127.0.0.1")\n')
    assert address_constants(sample) == 2
