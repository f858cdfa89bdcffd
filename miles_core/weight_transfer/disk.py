"""``disk``: the weights are written as one safetensors file per version; engines load it with
``/update_weights_from_disk`` (which SGLang servers implement too)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from safetensors.torch import save_file

from miles_core.weight_transfer.http_engines import HttpEngineProtocol
from miles_core.weight_transfer.protocol import TransferReport, WeightBucket, check_setting, is_whole_number


class DiskProtocol(HttpEngineProtocol):
    name = "disk"

    def __init__(self, *, work_dir: str | None = None, keep_versions: int = 2) -> None:
        check_setting(
            "disk",
            "work_dir",
            work_dir,
            valid=work_dir is None or isinstance(work_dir, str),
            allowed="a directory path (a string) or null",
        )
        check_setting(
            "disk",
            "keep_versions",
            keep_versions,
            valid=is_whole_number(keep_versions) and keep_versions >= 1,
            allowed="a whole number of at least 1 (the versions kept on disk)",
        )
        super().__init__(work_dir=work_dir, keep_versions=keep_versions)
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="miles-disk-"))
        self.keep_versions = keep_versions

    async def transfer(self, buckets: Iterable[WeightBucket], *, version: int) -> TransferReport:
        started = time.perf_counter()
        tensors = {name: tensor.detach().contiguous().cpu() for bucket in buckets for name, tensor in bucket}
        directory = self.work_dir / f"v{version}"
        partial = self.work_dir / f".v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file(tensors, str(partial / "model.safetensors"))
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)
        await self.on_each_engine(lambda c: c.update_weights_from_disk(str(directory), weight_version=str(version)))
        for old in sorted(self.work_dir.glob("v*"), key=lambda p: int(p.name[1:]))[: -self.keep_versions]:
            shutil.rmtree(old, ignore_errors=True)
        return self.report(
            version=version, num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()), started=started
        )
