"""GPU: kernels/moe_gate against a float64 brute force of the same routing (and moe_gate_ref)."""

import pytest
import torch

from kernels.moe_gate import fits, moe_gate, moe_gate_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCALE = 2.827  # Kimi's routed_scaling_factor


@pytest.fixture(autouse=True)
def _sync_every_launch(monkeypatch):
    monkeypatch.setenv("DDTREE_KERNEL_SYNC", "1")  # a device fault fails the launching test


def router(T: int, E: int, H: int, dtype: torch.dtype, seed: int, gate_dtype: torch.dtype = torch.bfloat16):
    """bf16 gate: the checkpoint's router (logits on skinny_gemm); fp32: gate_logits."""
    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(T, H, generator=g, device="cuda").to(dtype)
    gate = (torch.randn(E, H, generator=g, device="cuda") * H**-0.5).to(gate_dtype)
    bias = torch.randn(E, generator=g, device="cuda") * 0.1
    return x, gate, bias


def brute_force(x, gate, bias, k: int, renormalize: bool):
    """float64: every expert's biased score, sorted; the chosen scores' weights."""
    s = torch.sigmoid(x.double() @ gate.double().T)
    order = (s + bias.double()).sort(-1, descending=True)
    ids = order.indices[:, :k]
    w = s.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * SCALE, order.values


@pytest.mark.parametrize("dtype, gate_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.float32)])
@pytest.mark.parametrize("T, E, H, k", [(1, 384, 7168, 8), (3, 384, 7168, 8), (17, 384, 7168, 8), (63, 384, 7168, 8),
                                        (100, 384, 7168, 8), (17, 16, 384, 4), (5, 72, 1028, 3), (33, 512, 8192, 32)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_gate_matches_brute_force(T, E, H, k, dtype, gate_dtype, renormalize):
    x, gate, bias = router(T, E, H, dtype, seed=T * 1000 + E + k, gate_dtype=gate_dtype)
    if gate_dtype == torch.bfloat16 and H % 8:  # skinny_gemm needs K % 8 == 0: the torch path routes these
        assert not fits(x, gate, k)
        return
    assert fits(x, gate, k)
    ids, weights = moe_gate(x, gate, bias, k, SCALE, renormalize)
    want_ids, want_w, sorted_choice = brute_force(x, gate, bias, k, renormalize)
    # Rows whose k-th and (k+1)-th biased scores lie within fp32 rounding of each other may pick either.
    clear = (sorted_choice[:, k - 1] - sorted_choice[:, k]) > 1e-5
    assert clear.float().mean() >= 0.9
    assert torch.equal(ids[clear], want_ids[clear])  # the same experts, best first
    torch.testing.assert_close(weights[clear].double(), want_w[clear], rtol=1e-5, atol=1e-6)
    ref_ids, ref_w = moe_gate_ref(x, gate, bias, k, SCALE, renormalize)
    assert torch.equal(ref_ids[clear], ids[clear])
    torch.testing.assert_close(weights[clear], ref_w[clear], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32])
def test_moe_gate_row_does_not_depend_on_its_batch(gate_dtype):
    """A row routed alone gets bit for bit the ids and weights it gets inside a batch of 100 (a tree row and
    the AR row of the same token pick the same experts with the same weights; bf16 gate: four row blocks)."""
    x, gate, bias = router(100, 384, 7168, torch.bfloat16, seed=7, gate_dtype=gate_dtype)
    ids, weights = moe_gate(x, gate, bias, 8, SCALE)
    for r in (0, 5, 16, 32, 33, 99):
        one_ids, one_w = moe_gate(x[r: r + 1].contiguous(), gate, bias, 8, SCALE)
        assert torch.equal(one_ids[0], ids[r]) and torch.equal(one_w[0], weights[r])


def test_moe_gate_ties_pick_the_lower_expert():
    """Equal biased scores: the lower expert id first (a zero router makes every score 0.5)."""
    x = torch.randn(4, 256, device="cuda").bfloat16()
    bias = torch.zeros(64, device="cuda")
    bias[[9, 40]] = 1.0
    for gate in (torch.zeros(64, 256, device="cuda"), torch.zeros(64, 256, device="cuda").bfloat16()):
        ids, weights = moe_gate(x, gate, bias, 6, 1.0)
        assert ids.tolist() == [[9, 40, 0, 1, 2, 3]] * 4
        torch.testing.assert_close(weights, torch.full((4, 6), 1 / 6, device="cuda"))


def test_moe_gate_never_picks_nan_or_minus_inf():
    """-inf biases are never chosen while finite scores are left (brute force on the other experts), and a row whose
    scores are all NaN (a poisoned activation) still gets in-range ids without disturbing the rest of its batch."""
    x, gate, bias = router(5, 384, 7168, torch.bfloat16, seed=3)
    bias[::3] = float("-inf")
    x[2] = float("nan")
    ids, weights = moe_gate(x, gate, bias, 8, SCALE)
    assert int(ids.min()) >= 0 and int(ids.max()) < 384
    fine = [0, 1, 3, 4]
    want_ids, want_w, order = brute_force(x[fine], gate, bias, 8, True)
    assert ((order[:, 7] - order[:, 8]) > 1e-5).all()  # no near-tie at the 8th choice in these rows
    assert torch.equal(ids[fine], want_ids)
    torch.testing.assert_close(weights[fine].double(), want_w, rtol=1e-5, atol=1e-6)
    for r in fine:
        one_ids, one_w = moe_gate(x[r: r + 1].contiguous(), gate, bias, 8, SCALE)
        assert torch.equal(one_ids[0], ids[r]) and torch.equal(one_w[0], weights[r])


def test_moe_gate_empty_batch():
    x, gate, bias = router(0, 384, 7168, torch.bfloat16, seed=1)
    ids, weights = moe_gate(x, gate, bias, 8, SCALE)
    assert ids.shape == (0, 8) and weights.shape == (0, 8)


def brute_force_select(scores: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool):
    """Python over each row: the finite (or +inf) biased scores by value, equal values by lower expert id; choice i
    past the last such score is expert i. Weights: the chosen unbiased scores summed in choice order (fp32)."""
    ids, weights = [], []
    for s_row in scores.cpu():
        keyed = [(float(v), e) for e, v in enumerate((s_row + bias.cpu()).tolist()) if v == v and v != float("-inf")]
        chosen = [e for _, e in sorted(keyed, key=lambda t: (-t[0], t[1]))[:k]]
        chosen += list(range(len(chosen), k))
        v = s_row[chosen]
        total = torch.zeros((), dtype=torch.float32)
        for x in v:
            total = total + x
        ids.append(chosen)
        weights.append((v / (total + 1e-20) if renormalize else v) * SCALE)
    return torch.tensor(ids), torch.stack(weights)


@pytest.mark.parametrize("k", [1, 3, 8, 9, 32])
@pytest.mark.parametrize("E", [384, 512, 72, 8])
@pytest.mark.parametrize("renormalize", [True, False])
def test_gate_select_adversarial_scores(k, E, renormalize):
    """Ties (coarse values, +0 against -0), NaN, -inf and +inf biased scores, and rows with fewer usable experts than k:
    gate_select against a Python brute force, ids exactly, weights to fp32 rounding."""
    from kernels.moe_gate import gate_select

    if k > E:
        return
    g = torch.Generator("cuda").manual_seed(E * 100 + k)
    T = 9
    scores = (torch.randint(0, 6, (T, E), generator=g, device="cuda") / 8).float()  # many equal values
    bias = torch.zeros(E, device="cuda")
    scores[1] = torch.rand(E, generator=g, device="cuda")  # no ties
    scores[2, ::2] = float("nan")
    scores[3] = float("nan")  # nothing usable: choice i is expert i
    bias[E // 2] = float("-inf")
    scores[4, 1::3] = float("inf")
    scores[5] = 0.0
    scores[5, ::2] = -0.0  # -0 and +0 are equal: lower id first
    scores[6, : E - min(E, k // 2 + 1)] = float("nan")  # fewer usable than k when k > 1
    scores[7] = -scores[7]  # negative values
    ids, weights = gate_select(scores, bias, k, SCALE, renormalize)
    want_ids, want_w = brute_force_select(scores, bias, k, renormalize)
    assert torch.equal(ids.cpu(), want_ids)
    usable = ~torch.isnan(weights.cpu()) & ~torch.isnan(want_w)
    assert torch.equal(usable, ~torch.isnan(want_w))
    torch.testing.assert_close(weights.cpu()[usable], want_w[usable], rtol=1e-6, atol=0)


@pytest.mark.parametrize("T, live", [(1, 0), (1, 1), (4, 3), (17, 9), (64, 1), (64, 63), (64, 64), (33, 200)])
def test_moe_gate_skips_pad_rows(T, live):
    """Rows from live_rows[0] on (a graph's pad rows) get ids -1 and weights 0; the others exactly what they get
    without live_rows. The count is read on the device: one live_rows buffer, rewritten between calls."""
    x, gate, bias = router(T, 384, 7168, torch.bfloat16, seed=T + live)
    all_ids, all_w = moe_gate(x, gate, bias, 8, SCALE)
    live_rows = torch.tensor([T], device="cuda")
    moe_gate(x, gate, bias, 8, SCALE, live_rows=live_rows)  # an earlier value, overwritten in place
    live_rows.fill_(live)
    ids, weights = moe_gate(x, gate, bias, 8, SCALE, live_rows=live_rows)
    n = min(live, T)
    assert torch.equal(ids[:n], all_ids[:n]) and torch.equal(weights[:n], all_w[:n])
    assert (ids[n:] == -1).all() and (weights[n:] == 0).all()
    ref_ids, ref_w = moe_gate_ref(x, gate, bias, 8, SCALE, live_rows=live_rows)
    assert (ref_ids[n:] == -1).all() and (ref_w[n:] == 0).all()
    torch.testing.assert_close(ref_w[:n], weights[:n], rtol=1e-5, atol=1e-6)
