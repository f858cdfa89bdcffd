"""The tensors of an RDT object, pickled by reference rather than by value.

Ray (2.60) pickles every tensor of an RDT object as ``(deserialize, (index,))``, where ``deserialize`` is a closure
defined inside ``SerializationContext.serialize_rdt_objects``. cloudpickle pickles such a function by value into
every object, and to do so scans ``sys.modules`` for the submodules its globals use: about 3 ms of the trainer's CPU
per ``ray.put``, measured with cProfile in the rdt benchmark's trainer (some 2000 modules), more than half of what
a put costs. The same two functions defined at module level pickle by reference, in a few bytes.

:func:`pickle_tensors_by_reference` installs them in this process, in the place of Ray's own (which they mirror:
an index into the object's out-of-band tensors while Ray serializes an RDT object, a plain pickle otherwise). The
receiving process unpickles with :func:`tensor_from_rdt_object`, so it must be able to import this package: the
staging receivers are its own actors.
"""

from __future__ import annotations

import pickle
from typing import Any

import ray
import ray.cloudpickle


def tensor_to_rdt_object(tensor: Any) -> int | bytes:
    """Inside an RDT object: the tensor's index among the object's out-of-band tensors; elsewhere, its pickle."""
    context = ray._private.worker.global_worker.get_serialization_context()
    if getattr(context._thread_local, "use_external_transport", False):
        context._thread_local.rdt_tensors.append(tensor)
        return len(context._thread_local.rdt_tensors) - 1
    return pickle.dumps(tensor)


def tensor_from_rdt_object(value: int | bytes) -> Any:
    """The inverse of :func:`tensor_to_rdt_object`, in the receiving process."""
    context = ray._private.worker.global_worker.get_serialization_context()
    if isinstance(value, int):
        return context._thread_local.rdt_tensors[value]
    return pickle.loads(value)


def _reduce_tensor(tensor: Any) -> tuple:
    return tensor_from_rdt_object, (tensor_to_rdt_object(tensor),)


def pickle_tensors_by_reference(data_type: type) -> bool:
    """Make this process pickle ``data_type`` (``torch.Tensor`` for NIXL) in RDT objects by reference; True once
    done. Call it before each transfer: Ray registers its own reducer again in every new serialization context
    (a new job), and the reducer table is global. False, with Ray's reducer left alone, where Ray's internals are
    not the ones this was written against."""
    context = ray._private.worker.global_worker.get_serialization_context()
    registered = getattr(context, "_rdt_custom_serializer_registered", None)
    thread_local = getattr(context, "_thread_local", None)
    if not isinstance(registered, dict) or thread_local is None:
        return False
    registered[data_type] = True  # Ray's serialize_rdt_objects then leaves the reducer below in place
    ray.cloudpickle.CloudPickler.dispatch[data_type] = _reduce_tensor
    return True
