"""torch.Tensor <-> ddtree.internal.v1.Tensor (raw little-endian bytes + shape + dtype; never pickle)."""

from __future__ import annotations

import math
import warnings

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


def to_proto(t: torch.Tensor, out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """`out`: fill this message (a field of the request being built) in place and return it. A message
    passed to a constructor or a repeated field is copied whole: 352 MB of feature rows (a 4096-row K2.6
    window) cost ~1 s per such copy on a 2-core host."""
    if t.dtype not in _TO_PROTO:
        raise TypeError(f"dtype {t.dtype} has no wire encoding")
    flat = t.detach().contiguous().cpu().reshape(-1)
    out = out if out is not None else tensor_pb2.Tensor()
    out.data = flat.view(torch.uint8).numpy().tobytes()
    out.shape[:] = list(t.shape)
    out.dtype = _TO_PROTO[t.dtype]
    return out


def from_proto(msg: tensor_pb2.Tensor, field: str, writable: bool = True) -> torch.Tensor:
    """Decodes and validates; every inconsistency raises InvalidArgument naming `field`. writable=False
    skips one copy: the tensor then shares the immutable bytes read out of the message, and its caller
    must only read it (the drafter's feature rows: 352 MB for a 4096-row K2.6 window)."""
    dtype = _FROM_PROTO.get(msg.dtype)
    if dtype is None:
        raise InvalidArgument(f"{field}.dtype", f"unsupported dtype {msg.dtype}")
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{field}.shape", f"negative dimension in {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    data = msg.data  # each read of a bytes field copies it out of the message: read it once
    if len(data) != expected:
        raise InvalidArgument(f"{field}.data", f"{len(data)} bytes, shape {shape} of {dtype} needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    if writable:  # bytes are immutable: a writable tensor needs its own copy
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
    with warnings.catch_warnings():  # torch warns that the buffer is read-only: the caller promised to only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype).reshape(shape)
