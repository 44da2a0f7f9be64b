"""Copy accepted tree rows' latent KV from scratch slots to the session's next slots, all layers.

    kv_commit(kv, src_slots, dst_slots) -> None   (in place)

kv         [num_layers, num_pages, page_size, width] contiguous (PagedKVCache.kv; width * itemsize % 16 == 0)
src_slots  int64 [n]  scratch slots (page * page_size + offset), path order
dst_slots  int64 [n]  destination slots; must not alias any source (scratch pages never do)

For every layer l: kv[l].view(-1, width)[dst_slots[i]] = kv[l].view(-1, width)[src_slots[i]].
The device half of verifier_service/kv_cache.py PagedKVCache.commit; batch all sessions in one call.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels._compile import cuda_source, get_kernels, launch

CODE = r"""
// Grid (n, num_layers); one 16-byte piece per thread. Units: 16-byte pieces.
extern "C" __global__ void kv_commit(uint4* kv, const i64* src, const i64* dst, i64 layer_stride, int row) {
  const i64 base = blockIdx.y * layer_stride, s = base + src[blockIdx.x] * row, d = base + dst[blockIdx.x] * row;
  for (int c = threadIdx.x; c < row; c += blockDim.x) kv[d + c] = kv[s + c];
}
"""
NAMES = ("kv_commit",)


def kv_commit(kv: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    layers, pages, page_size, width = kv.shape
    row_bytes = width * kv.element_size()
    assert kv.is_cuda and kv.is_contiguous() and row_bytes % 16 == 0, (kv.shape, kv.dtype)
    assert src_slots.dtype == dst_slots.dtype == torch.int64 and src_slots.shape == dst_slots.shape
    assert src_slots.dim() == 1 and src_slots.is_contiguous() and dst_slots.is_contiguous()
    n, row = src_slots.shape[0], row_bytes // 16
    if n == 0 or layers == 0:
        return
    ker = get_kernels(cuda_source(CODE), NAMES)["kv_commit"]
    launch(ker, (n, layers), min(row, 128), kv, src_slots, dst_slots, np.int64(pages * page_size * row), row)


def kv_commit_ref(kv: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    flat = kv.view(kv.shape[0], -1, kv.shape[-1])  # [L, slots, width]
    flat[:, dst_slots] = flat[:, src_slots]
