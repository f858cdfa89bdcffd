"""The node check's parts, in one process: witnesses of shared directories, what a node reports, the error text.
Across real hosts: ``tests/cluster/test_bad_input_across_hosts.py``."""

from __future__ import annotations

from pathlib import Path

from miles_core.workers.node_check import PROBE_PREFIX, make_witnesses, miles_packages, node_problems, probe_node
from miles_core.workers.provider import SharedPath


def test_a_probe_is_written_only_into_the_runs_own_directories(tmp_path: Path) -> None:
    run_dir, model_dir, missing = tmp_path / "run", tmp_path / "model", tmp_path / "absent"
    run_dir.mkdir()
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    witnesses = make_witnesses(
        [
            SharedPath(str(run_dir), "the run directory", "--output-dir", owned=True),
            SharedPath(str(model_dir), "the model directory", "--model"),
            SharedPath(str(missing), "a directory not made yet", "--x", owned=True),
        ]
    )
    assert [(Path(w.file).parent, w.probe) for w in witnesses] == [(run_dir, True), (model_dir, False)]
    assert Path(witnesses[0].file).name.startswith(PROBE_PREFIX)
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json"]  # the user's directory is not written to


def test_a_node_reports_what_it_does_not_see_and_what_it_cannot_import(tmp_path: Path) -> None:
    shared = SharedPath(str(tmp_path), "the run directory", "run.output_dir (--output-dir)", owned=True)
    (witness,) = make_witnesses([shared])
    assert probe_node([(witness.file, witness.digest)], ["miles_core"]) == {"unseen": [], "missing": []}
    Path(witness.file).write_bytes(b"another file system's bytes")
    found = probe_node([(witness.file, witness.digest)], ["miles_no_such_package"])
    assert found["unseen"] == [f"{witness.file}: other bytes than the driver wrote (another file system)"]
    assert found["missing"][0].startswith("miles_no_such_package (ModuleNotFoundError")
    text = node_problems("10.0.0.3 (id 12345678)", [witness], found)
    assert text.startswith("node 10.0.0.3 (id 12345678) cannot host this run's workers:")
    assert f"it does not see the run directory {tmp_path} as the driver does" in text
    assert "set run.output_dir (--output-dir) to such a directory" in text
    assert "install the same Miles and plugins on every node" in text
    assert node_problems("n", [witness], {"unseen": [], "missing": []}) is None


def test_the_packages_looked_for_are_the_installed_miles_packages_imported_here() -> None:
    packages = miles_packages()
    assert "miles_core" in packages and all(name.startswith("miles_") for name in packages)


def test_the_node_address_and_the_interface_collectives_use(monkeypatch) -> None:
    from miles_core.workers import node

    monkeypatch.delenv(node.NODE_ADDRESS_ENV, raising=False)
    assert node.node_address() == "127.0.0.1" and node.is_this_node("localhost") and not node.is_this_node(None)
    monkeypatch.setenv(node.NODE_ADDRESS_ENV, "10.0.0.2")
    assert node.node_address() == "10.0.0.2" and node.is_this_node("10.0.0.2") and not node.is_this_node("10.0.0.3")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's choice is kept
    assert node.collective_interface_env("127.0.0.1") == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "ib0"}
    assert node.collective_interface_env("203.0.113.9") == {}  # an address no interface has: left to gloo and NCCL
