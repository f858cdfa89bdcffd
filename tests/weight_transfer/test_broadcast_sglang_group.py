"""The ``broadcast`` protocol's weight-update group meets SGLang's side of it. A stock SGLang server joins through
``init_custom_process_group``: a ``tcp://`` rendezvous with the trainer's store, the store prefixed with the group's
name, then torch's own ``_new_process_group_helper``, which names the keys and exchanges the group's sequence number
its own way. The engine side here is a separate process doing exactly those torch calls (SGLang itself cannot be
installed in this environment: it pins its own torch); the trainer side is Miles' ``new_weight_update_group``.
Before the group named its keys as torch does, the trainer waited for keys no SGLang rank writes and timed out."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch

from miles_core.engines.weights import broadcast, new_weight_update_group
from miles_core.workers.process import free_ports

ENGINE_SIDE = """
import sys, datetime, torch
from torch.distributed import distributed_c10d as c10d
address, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
timeout = datetime.timedelta(seconds=60)
store, rank, world_size = next(c10d.rendezvous(f"tcp://{address}:{port}", 1, 2, timeout=timeout))
store.set_timeout(timeout)
group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend("gloo"), c10d.PrefixStore(name, store),
                                          group_name=name, timeout=timeout)
c10d._world.pg_group_ranks[group] = {0: 0, 1: 1}
received = torch.zeros(6)
torch.distributed.broadcast(received, src=0, group=group)
print(received.tolist(), flush=True)
"""


def test_the_trainer_group_broadcasts_to_a_rank_made_as_sglang_makes_it() -> None:
    (port,) = free_ports(1, "127.0.0.1")
    argv = [sys.executable, "-c", ENGINE_SIDE, "127.0.0.1", str(port), "miles_weight_update"]
    engine = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    groups: list = []

    def trainer_side() -> None:
        groups.append(
            new_weight_update_group(
                master_address="127.0.0.1",
                master_port=port,
                rank=0,
                world_size=2,
                group_name="miles_weight_update",
                timeout_s=60,
            )
        )

    trainer = threading.Thread(target=trainer_side, daemon=True)
    try:
        trainer.start()
        trainer.join(timeout=120)
        if groups:
            broadcast(groups[0], torch.arange(6.0), root=0)
            out, err = engine.communicate(timeout=120)
    finally:
        engine.kill()
        engine.wait()
    if not groups:
        raise AssertionError(f"the trainer's group did not form with the engine's rank: {engine.stderr.read()[-2000:]}")
    assert engine.returncode == 0, err[-2000:]
    assert out.strip().splitlines()[-1] == str(torch.arange(6.0).tolist())
