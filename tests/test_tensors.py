"""Wire tensors: exact round trip, and every inconsistency rejected with the field named."""

import pytest
import torch

from ddtree.internal.v1 import tensor_pb2
from service_kit.errors import InvalidArgument
from service_kit.tensors import from_proto, to_proto


@pytest.mark.parametrize("writable", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(0, 5), (1,), (3, 7), (2, 3, 4)])
def test_round_trip_is_bit_exact(dtype, shape, writable):
    t = (torch.randn(shape) * 100).to(dtype)
    back = from_proto(to_proto(t), "x", writable=writable)
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(back.view(-1).view(torch.uint8) if back.numel() else back, t.view(-1).view(torch.uint8) if t.numel() else t)


def test_bytes_are_little_endian_row_major():
    msg = to_proto(torch.tensor([[1, 2], [3, 258]], dtype=torch.int32))
    assert msg.data == bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 2, 1, 0, 0])
    assert list(msg.shape) == [2, 2] and msg.dtype == tensor_pb2.DTYPE_INT32


@pytest.mark.parametrize("msg, field", [
    (tensor_pb2.Tensor(data=b"\0" * 7, shape=[2], dtype=tensor_pb2.DTYPE_FLOAT32), "feat.data"),
    (tensor_pb2.Tensor(data=b"", shape=[-1, 0], dtype=tensor_pb2.DTYPE_FLOAT32), "feat.shape"),
    (tensor_pb2.Tensor(data=b"\0" * 4, shape=[1], dtype=tensor_pb2.DTYPE_UNSPECIFIED), "feat.dtype"),
])
def test_inconsistent_tensors_are_rejected(msg, field):
    with pytest.raises(InvalidArgument) as e:
        from_proto(msg, "feat")
    assert e.value.field == field


def test_to_proto_fills_a_field_in_place():
    """The verifier builds each Propose item's features in the request (no whole-message copies)."""
    from ddtree.internal.v1 import drafter_pb2 as dpb

    t = torch.randn(3, 5).bfloat16()
    req = dpb.ProposeRequest()
    item = req.items.add()
    assert to_proto(t, out=item.features) is item.features
    back = dpb.ProposeRequest.FromString(req.SerializeToString())
    assert torch.equal(from_proto(back.items[0].features, "f"), t)
