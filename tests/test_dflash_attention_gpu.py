"""kernels/dflash_attention against its fp32 torch reference: Kimi's drafter heads (64 q / 8 kv x 128) and the
tiny drafter's (6 / 2 x 64), odd page counts and shuffled page tables, masked window starts and padding pages,
sliding-window (causal) masks, and NaN in every pool slot no query sees."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from drafter_service.model import block_mask  # noqa: E402
from kernels.dflash_attention import dflash_attention, dflash_attention_ref  # noqa: E402

# bf16 inputs, fp32 softmax; the kernel rounds P to bf16 before P·V (as flash attention does): outputs (weighted
# means of N(0, 1) values, |out| < ~1) agree with the fp32 reference to 2e-2.
ATOL = RTOL = 2e-2


def _case(B, pages, nh, nkv, hd, Bk=8, page_size=64, window=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total_pages = B * pages + 3
    k_pool = torch.full((total_pages * page_size, nkv, hd), float("nan"), device="cuda", dtype=torch.bfloat16)
    v_pool = k_pool.clone()
    page_table = torch.randperm(total_pages, device="cuda", generator=g)[: B * pages].view(B, pages)
    Lc = pages * page_size
    lengths = [max(1, Lc - 5 * b - 17) for b in range(B)]  # the last page partly written
    starts = [min(37 * b, lengths[b] - 1) for b in range(B)]  # the window starts mid-page
    pos = torch.arange(Lc, device="cuda")
    valid = torch.stack([(pos >= s) & (pos < n) for s, n in zip(starts, lengths)])  # [B, Lc]
    slots = (page_table[:, :, None] * page_size + torch.arange(page_size, device="cuda")).flatten(1)
    for b in range(B):  # only visible slots hold numbers: every other slot stays NaN
        seen = slots[b][valid[b]]
        k_pool[seen] = torch.randn(len(seen), nkv, hd, device="cuda", generator=g).bfloat16()
        v_pool[seen] = torch.randn(len(seen), nkv, hd, device="cuda", generator=g).bfloat16()
    q = torch.randn(B, Bk, nh, hd, device="cuda", generator=g).bfloat16()
    k_blk = torch.randn(B, Bk, nkv, hd, device="cuda", generator=g).bfloat16()
    v_blk = torch.randn(B, Bk, nkv, hd, device="cuda", generator=g).bfloat16()
    block_pos = torch.tensor(lengths, device="cuda")[:, None] + torch.arange(Bk, device="cuda")
    ctx_pos = pos.expand(B, -1)
    mask = block_mask(block_pos, ctx_pos, valid, window)
    return q, k_pool, v_pool, page_table, page_size, k_blk, v_blk, mask, hd**-0.5


@pytest.mark.parametrize("heads", [(64, 8, 128), (6, 2, 64)], ids=["kimi", "tiny"])
@pytest.mark.parametrize("B, pages", [(1, 1), (1, 3), (3, 17), (1, 65), (2, 2)])
def test_matches_reference(heads, B, pages):
    args = _case(B, pages, *heads, seed=B * 100 + pages)
    got, want = dflash_attention(*args), dflash_attention_ref(*args)
    assert args[-2].stride(1) == 0  # block_mask's expanded view, read in place
    assert torch.isfinite(got).all(), "NaN from a slot no query sees"
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window", [1, 5, 100])
def test_sliding_window_masks(window):
    """A sliding layer's mask: causal and within `window` positions (by absolute position), per token."""
    args = _case(2, 3, 64, 8, 128, window=window, seed=window)
    torch.testing.assert_close(dflash_attention(*args).float(), dflash_attention_ref(*args).float(),
                               atol=ATOL, rtol=RTOL)


def test_query_seeing_no_key_gets_zero():
    q, k_pool, v_pool, page_table, page_size, k_blk, v_blk, mask, scale = _case(2, 2, 6, 2, 64)
    mask = mask.clone()
    mask[1, 3] = False  # token 3 of sequence 1 sees nothing
    got = dflash_attention(q, k_pool, v_pool, page_table, page_size, k_blk, v_blk, mask, scale)
    assert torch.equal(got[1, 3], torch.zeros_like(got[1, 3]))
    want = dflash_attention_ref(q, k_pool, v_pool, page_table, page_size, k_blk, v_blk, mask, scale)
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("heads", [(64, 8, 128), (6, 2, 64)], ids=["kimi", "tiny"])
def test_values_of_the_block_read_from_a_column_block(heads):
    """v_blk as the served drafter passes it: the v columns of its fused k|v projection output (tokens 2·nkv·hd
    apart), read in place: bit for bit the contiguous call."""
    args = list(_case(2, 3, *heads, seed=9))
    v_blk = args[6]
    B, Bk, nkv, hd = v_blk.shape
    fused = torch.cat([torch.randn(B, Bk, nkv * hd, device="cuda").bfloat16(), v_blk.flatten(-2)], dim=-1)
    strided = fused[..., nkv * hd:].unflatten(-1, (nkv, hd))
    assert not strided.is_contiguous() and torch.equal(strided, v_blk)
    want = dflash_attention(*args)
    args[6] = strided
    assert torch.equal(dflash_attention(*args), want)
