"""The scheduler batches a tensor model's requests by their shape past the batch dim (servicer's key)."""

from __future__ import annotations

from infermesh.v1 import common_pb2
from services.scheduler.servicer import _tensor_shape


def _tensor(name: str, *shape: int) -> common_pb2.Tensor:
    return common_pb2.Tensor(name=name, datatype="FP32", shape=shape)


def test_requests_differing_only_in_rows_or_input_order_share_a_key():
    key_a, rows_a = _tensor_shape([_tensor("x", 1, 3, 32, 32), _tensor("mask", 1, 7)])
    key_b, rows_b = _tensor_shape([_tensor("mask", 4, 7), _tensor("x", 4, 3, 32, 32)])
    assert key_a == key_b and (rows_a, rows_b) == (1, 4)


def test_another_dim_past_the_batch_makes_another_key():
    assert _tensor_shape([_tensor("ids", 1, 12)])[0] != _tensor_shape([_tensor("ids", 1, 13)])[0]
    assert _tensor_shape([_tensor("ids", 2)]) == ((("ids", ()),), 2)
