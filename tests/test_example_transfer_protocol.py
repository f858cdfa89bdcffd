"""The example third-party protocol, loaded through its entry point the way the core loads it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_core.builtin.core_plugin import check_weight_transfer_protocol
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.weight_transfer import WeightTransferProtocol


@pytest.fixture(scope="module")
def protocol_class() -> type:
    protocol = check_weight_transfer_protocol(MilesPluginManager.load().registries, "sharded-disk")
    assert issubclass(protocol, WeightTransferProtocol)
    return protocol


def make_buckets(step: int) -> list[list[tuple[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(step)
    return [
        [
            ("model.embed_tokens.weight", torch.randn(8, 4, generator=generator)),
            ("model.norm.weight", torch.randn(4, generator=generator).to(torch.bfloat16)),
        ],
        [("lm_head.weight", torch.randn(8, 4, generator=generator))],
    ]


def test_writes_one_shard_per_bucket_with_an_index(tmp_path: Path, protocol_class: type) -> None:
    protocol = protocol_class(directory=str(tmp_path), keep_versions=2)
    buckets = make_buckets(1)
    asyncio.run(protocol.connect([]))
    report = asyncio.run(protocol.transfer(buckets, version=1))
    expected_bytes = sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)
    assert (report.protocol, report.version, report.num_bytes, report.num_engines) == (
        "sharded-disk",
        1,
        expected_bytes,
        0,
    )
    index = json.loads((tmp_path / "v1" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors",
    }
    loaded = {}
    for shard in sorted((tmp_path / "v1").glob("*.safetensors")):
        loaded.update(load_file(str(shard)))
    for name, tensor in (pair for bucket in buckets for pair in bucket):
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype


def test_keeps_only_the_newest_versions(tmp_path: Path, protocol_class: type) -> None:
    protocol = protocol_class(directory=str(tmp_path), keep_versions=2)
    for version in (1, 2, 3):
        asyncio.run(protocol.transfer(make_buckets(version), version=version))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2", "v3"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"keep_versions": 0}, "sharded-disk setting keep_versions = 0: expected a whole number of at least 1"),
        (
            {"keep_versions": True},
            "keep_versions = True: expected a whole number of at least 1 and of at most 64 (a boolean is not",
        ),
        ({"timeout_s": -5}, "sharded-disk setting timeout_s = -5: expected a number above 0"),
        ({"directory": 7}, "sharded-disk setting directory = 7: expected a string or null"),
        ({"keep_version": 2}, "has no setting 'keep_version' (did you mean 'keep_versions'?)"),
    ],
)
def test_rejects_bad_settings(protocol_class: type, settings: dict, message: str) -> None:
    """Its declared settings model refuses them (a boolean was taken as 1 and a negative timeout passed before)."""
    with pytest.raises(ConfigError) as refused:
        protocol_class(**settings)
    assert message in str(refused.value)
    assert "do not fit the protocol 'sharded-disk' (miles_example_transfer.protocol:" in str(refused.value)


def test_reads_its_settings_as_typed_attributes(tmp_path: Path, protocol_class: type) -> None:
    protocol = protocol_class(directory=str(tmp_path), keep_versions=3, timeout_s=5)
    assert (protocol.settings.keep_versions, protocol.settings.timeout_s) == (3, 5.0)
    assert isinstance(protocol.settings.timeout_s, float) and protocol.directory == tmp_path
