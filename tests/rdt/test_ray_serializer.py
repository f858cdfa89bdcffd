"""The tensors of RDT objects pickle by reference to this package's functions, not as a closure pickled by value."""

from __future__ import annotations

import pytest
import ray
import ray.cloudpickle
import torch
from miles_plugins_rdt.ray_serializer import pickle_tensors_by_reference, tensor_from_rdt_object

pytestmark = pytest.mark.slow


def serialized_rdt_value(tensors: list[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    context = ray._private.worker.global_worker.get_serialization_context()
    serialized, out_of_band = context.serialize_rdt_objects(tensors, "NIXL")
    return serialized.to_bytes(), out_of_band


def test_rdt_tensors_pickle_by_reference_and_come_back(ray_cluster) -> None:
    tensors = [torch.arange(4.0), torch.ones(2, 3)]
    context = ray._private.worker.global_worker.get_serialization_context()
    context._rdt_custom_serializer_registered.pop(torch.Tensor, None)  # Ray registers its own reducer again
    by_value, _ = serialized_rdt_value(tensors)  # Ray's own reducer: its closure travels in every object
    assert pickle_tensors_by_reference(torch.Tensor)
    by_reference, out_of_band = serialized_rdt_value(tensors)
    assert [t.data_ptr() for t in out_of_band] == [t.data_ptr() for t in tensors]  # the tensors go out of band
    assert b"tensor_from_rdt_object" in by_reference and len(by_reference) < len(by_value) // 2, (
        len(by_reference),
        len(by_value),
    )
    context._thread_local.rdt_tensors = out_of_band  # as Ray sets it while it deserializes an RDT object
    try:
        assert tensor_from_rdt_object(1) is out_of_band[1]
    finally:
        context._thread_local.rdt_tensors = []
    plain = torch.randn(3)  # outside an RDT object a tensor is a plain pickle
    assert torch.equal(ray.cloudpickle.loads(ray.cloudpickle.dumps(plain)), plain)
