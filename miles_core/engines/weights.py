"""Loading HF-named tensors into a live model, all or nothing, and the wire formats that carry them.

Tensors travel as safetensors bytes (never pickle). A weight-update group for ``update_weights_from_distributed``
is a gloo (CPU) or NCCL (GPU) process group of its own, so it never touches a default process group. Its store
(unauthenticated) listens on the master address alone, and its gloo connections on the address that reaches it:
a group meets at its sender's node address (loopback on one machine, where nothing of it is reachable from
another).
"""

from __future__ import annotations

import bisect
import datetime
import socket
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load, load_file, save

from miles_core.distributed import local_address_towards, tcp_store
from miles_core.errors import MilesError
from miles_core.models.hf_checkpoint import checkpoint_named_tensors


class WeightLoadError(MilesError):
    """Weights that do not fit the model; nothing was loaded."""


class _Part:
    """Where a checkpoint tensor lies in a model tensor held in another layout: the elements ``flat[indices]``."""

    def __init__(self, tensor: torch.Tensor, indices: torch.Tensor) -> None:
        self.tensor, self.indices = tensor, indices
        self.shape = indices.shape
        self.dtype, self.device = tensor.dtype, tensor.device

    def copy_(self, value: torch.Tensor) -> None:
        self.tensor.view(-1).index_copy_(0, self.indices.flatten(), value.flatten())


_LAYOUTS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, tuple[str, torch.Tensor]]] = weakref.WeakKeyDictionary()


def checkpoint_layout(model: torch.nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """For a transformers model that holds some tensors in another layout than its checkpoint (a MoE's experts
    fused, DeepSeek-V4's tensors under other names): each checkpoint name that is not a tensor of the model, with
    the model tensor it lies in and the flat indices of its elements there. Found by running transformers' own
    conversion (what ``save_pretrained`` does) over tensors that hold their elements' positions; computed once per
    model (names and shapes never change)."""
    if model in _LAYOUTS:
        return _LAYOUTS[model]
    state = dict(unique_named_tensors(model.state_dict().items()))
    starts, sources, probes, total = [], [], [], 0
    for name, tensor in state.items():
        starts.append(total)
        sources.append(name)
        probes.append((name, torch.arange(total, total + tensor.numel()).view(tensor.shape)))
        total += tensor.numel()
    layout = {}
    if isinstance(model, transformers.PreTrainedModel):
        for name, probe in checkpoint_named_tensors(model, probes):
            if name in state or probe.numel() == 0:
                continue
            index = bisect.bisect_right(starts, int(probe.flatten()[0])) - 1
            layout[name] = (sources[index], probe - starts[index])
    _LAYOUTS[model] = layout
    return layout


def _target(state: Mapping[str, torch.Tensor], name: str, model: torch.nn.Module) -> torch.Tensor | _Part | None:
    """The model tensor (or the part of one) that the HF tensor ``name`` fills, ``None`` if none: a parameter or
    buffer of that name, or the elements of one that the checkpoint name stands for (see
    :func:`checkpoint_layout`), such as one expert's ``mlp.experts.{j}.gate_proj.weight`` in transformers 5's fused
    ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``."""
    if name in state:
        return state[name]
    placed = checkpoint_layout(model).get(name)
    if placed is None:
        return None
    source, indices = placed
    return _Part(state[source], indices)


def check_named_tensors(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every name must be a parameter or buffer of the model (or a per-expert part of a fused one), with the same
    shape; raise before any copy."""
    state = model.state_dict()
    problems = []
    for name, tensor in tensors.items():
        target = _target(state, name, model)
        if target is None:
            problems.append(f"{name}: not a weight of this model")
        elif tuple(tensor.shape) != tuple(target.shape):
            problems.append(f"{name}: shape {tuple(tensor.shape)}, model has {tuple(target.shape)}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise WeightLoadError(f"{len(problems)} tensors do not fit the model, none loaded: {shown}")


@torch.no_grad()
def load_named_tensors(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> int:
    """Copy ``tensors`` into the model's weights (checked first); returns the bytes loaded."""
    check_named_tensors(model, tensors)
    state = model.state_dict()
    for name, tensor in tensors.items():
        target = _target(state, name, model)  # a tensor, or the part of one it fills
        target.copy_(tensor.to(dtype=target.dtype, device=target.device))
    return sum(t.numel() * t.element_size() for t in tensors.values())


@torch.no_grad()
def swap_in_named_tensors(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> int:
    """Make the model's parameters *be* ``tensors`` (same dtype and shape; checked first), without copying; a
    parameter of another dtype or device gets a converted tensor of its own (never a copy into its current memory,
    which may be a staging buffer about to be refilled); other names (buffers) are copied. Returns the bytes loaded."""
    check_named_tensors(model, tensors)
    parameters = dict(model.named_parameters())
    copies = {}
    for name, tensor in tensors.items():
        parameter = parameters.get(name)
        if parameter is None:
            copies[name] = tensor
        elif parameter.dtype == tensor.dtype and parameter.device == tensor.device:
            parameter.data = tensor
        else:
            parameter.data = tensor.to(dtype=parameter.dtype, device=parameter.device, copy=True)
    if copies:
        load_named_tensors(model, copies)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read_checkpoint_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint directory."""
    path = Path(path)
    try:  # a name too long, a directory it may not read: the caller's mistake, not the engine's
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    except OSError as exc:
        raise WeightLoadError(f"cannot read the checkpoint directory {str(path)!r}: {exc.strerror}") from None
    if not files:
        raise WeightLoadError(f"{str(path)!r} is not a directory holding .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # OSError, or safetensors' own error types
            raise WeightLoadError(f"cannot read safetensors file {str(file)!r}: {exc}") from None
    return tensors


def read_safetensors_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of one safetensors file (copied out of the file, so it can be removed)."""
    try:
        return {name: tensor.clone() for name, tensor in load_file(str(path)).items()}
    except Exception as exc:  # OSError, or safetensors' own error types
        raise WeightLoadError(f"cannot read safetensors file {path}: {exc}") from None


def encode_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes for named tensors."""
    return save({name: t.detach().contiguous().cpu() for name, t in tensors.items()})


def decode_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """Named tensors from safetensors bytes; anything else is a :class:`WeightLoadError`."""
    try:
        return load(data)
    except Exception as exc:  # safetensors raises its own error types for malformed input
        raise WeightLoadError(f"payload is not safetensors data: {exc}") from None


def unique_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Drop tensors that share memory with one already seen (tied embeddings: ``lm_head.weight`` is
    ``model.embed_tokens.weight``), as HF checkpoints do."""
    seen: set[tuple[int, int]] = set()
    for name, tensor in named:
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        yield name, tensor


GROUP_BACKENDS = ("gloo", "nccl")


def resolve_group_backend(backend: str) -> str:
    """``"auto"`` as NCCL where this process has a CUDA device, else gloo; ``"nccl"`` checked to be usable here."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in GROUP_BACKENDS:
        raise MilesError(f"weight-update group backend {backend!r}: use auto, gloo or nccl")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise MilesError(
            "weight-update group backend 'nccl' needs a CUDA device and a torch built with NCCL, and "
            "this process has none: use 'gloo' (CPU tensors) or run it on a GPU machine"
        )
    return backend


def group_device(backend: str) -> torch.device:
    """Where a group's tensors must live: the current CUDA device for NCCL, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def new_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    listener: socket.socket | None = None,
) -> dist.ProcessGroup:
    """A process group of its own (rank 0 hosts the store) for broadcasting weights to engines: gloo over CPU
    tensors, or NCCL over CUDA tensors (every rank on a GPU of its own). It meets SGLang's side of the group (see
    :func:`group_store`), so engines may be Miles' local engine or stock SGLang servers. Rank 0 may pass the store's
    ``listener``, opened on the master address ahead (see :func:`~miles_core.distributed.tcp_store`)."""
    backend = resolve_group_backend(backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    # rank 0's store listens on the master address alone (torch's own socket would take every interface)
    store = tcp_store(
        master_address, master_port, world_size=world_size, is_master=rank == 0, timeout=timeout, listener=listener
    )
    prefixed = group_store(store, group_name=group_name, backend=backend)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # gloo's default device listens on the address of the machine's host name; this one, on the address that
        # reaches the master (127.0.0.1 for a master on 127.0.0.1).
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(master_address))]
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    # rank 0 publishes the group's first sequence number and the others wait for it (torch does this for every
    # group it makes: SGLang's ranks would wait for it forever otherwise)
    group._set_sequence_number_for_group()
    return group


def group_store(store: dist.Store, *, group_name: str, backend: str) -> dist.Store:
    """The keys of a weight-update group as SGLang's side names them: its ``init_custom_process_group`` prefixes
    the rendezvous store with the group's name, then torch's ``_new_process_group_helper`` with ``"<name>/"`` and
    the backend's device (``"cpu/"`` for gloo, ``"cuda/"`` for NCCL). Keys named any other way are never found by
    an SGLang rank (the group times out)."""
    device = "cuda" if backend == "nccl" else "cpu"
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, *, root: int = 0) -> None:
    """Broadcast ``tensor`` in place from ``root`` over ``group``."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([tensor], options).wait()


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` or ``"torch.float32"`` as a torch dtype; anything else is a :class:`WeightLoadError`."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightLoadError(f"unknown dtype {name!r}")
    return dtype
