"""The example third-party protocol, loaded through its entry point the way the core loads it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_core.builtin.core_plugin import check_weight_transfer_protocol
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


def test_rejects_bad_settings(protocol_class: type) -> None:
    with pytest.raises(ValueError, match="keep_versions must be at least 1, got 0"):
        protocol_class(keep_versions=0)
