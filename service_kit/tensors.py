"""torch.Tensor <-> ddtree.internal.v1.Tensor (raw little-endian bytes + shape + dtype; never pickle)."""

from __future__ import annotations

import math

import torch

from ddtree.internal.v1 import tensor_pb2
from service_kit.errors import InvalidArgument

_TO_PROTO = {
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.int64: tensor_pb2.DTYPE_INT64,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}


def to_proto(t: torch.Tensor) -> tensor_pb2.Tensor:
    if t.dtype not in _TO_PROTO:
        raise TypeError(f"dtype {t.dtype} has no wire encoding")
    flat = t.detach().contiguous().cpu().reshape(-1)
    return tensor_pb2.Tensor(data=flat.view(torch.uint8).numpy().tobytes(), shape=list(t.shape),
                             dtype=_TO_PROTO[t.dtype])


def from_proto(msg: tensor_pb2.Tensor, field: str) -> torch.Tensor:
    """Decodes and validates; every inconsistency raises InvalidArgument naming `field`."""
    dtype = _FROM_PROTO.get(msg.dtype)
    if dtype is None:
        raise InvalidArgument(f"{field}.dtype", f"unsupported dtype {msg.dtype}")
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{field}.shape", f"negative dimension in {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(msg.data) != expected:
        raise InvalidArgument(f"{field}.data", f"{len(msg.data)} bytes, shape {shape} of {dtype} needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(shape)
