"""``GlooSender``: the trainer-side actor of a gloo transfer.

Gloo is two-sided and Ray's collective groups hold actors only, so a gloo transfer needs an actor on the sending
side. The trainer copies each chunk into the sender's shared-memory send bucket (one memory copy on the trainer's
node, laid out like the engines' staging buckets) and the sender returns views of it as an RDT object over gloo.
NIXL is one-sided and needs no such actor: the trainer puts its tensors as an RDT object itself.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import ray
import torch

from miles_core import StagingLayout, map_staging_file, remove_orphan_files

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
SEND_PREFIX = "miles-rdt-send-"


def new_send_bucket(capacity: int) -> tuple[Path, torch.Tensor]:
    """A shared-memory file of ``capacity`` bytes, mapped as a uint8 tensor."""
    remove_orphan_files(SHM_DIR, SEND_PREFIX)  # a dead trainer's buffers (killed before it closed its protocol)
    path = SHM_DIR / f"{SEND_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    with open(path, "wb") as send_file:
        send_file.truncate(capacity)
    return path, map_staging_file(path, capacity)


@ray.remote(num_cpus=0, max_restarts=0, enable_tensor_transport=True)
class GlooSender:
    """Maps the trainer's send bucket and sends views of it to the receivers of its collective group."""

    def __init__(self, *, path: str, capacity: int) -> None:
        self.bucket = map_staging_file(path, capacity)

    @ray.method(tensor_transport="gloo")
    def chunk(self, layout: StagingLayout) -> list[torch.Tensor]:
        """The tensors of a chunk that the trainer laid into the send bucket as ``layout``, as views of it."""
        return list(layout.views(self.bucket).values())
