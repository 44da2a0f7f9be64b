"""CPU emulation of the N8 layout for moe_few_down: up to 8 item rows on the MMA's N side, the weights' scale
groups made K-contiguous by a quad transpose of each lane's loaded words. One 16-row tile chunk (128 inputs)."""
import numpy as np

rng = np.random.default_rng(1)
q = rng.integers(-8, 8, size=(16, 128))
s = rng.random((16, 4)).astype(np.float64)
X = rng.standard_normal((8, 128))
words = np.zeros((16, 16), dtype=np.int64)
for r in range(16):
    for j in range(16):
        v = 0
        for i in range(8):
            v |= int(q[r, 8 * j + i] + 8) << (4 * i)
        words[r, j] = v


def dq(w):  # dequant: bf16x2 pairs (nibble i, nibble i + 4), i = 0..3
    return [(((w >> (4 * i)) & 0xF) - 8, ((w >> (4 * i + 16)) & 0xF) - 8) for i in range(4)]


def perm_x(v8):  # pair_order
    return [(v8[0], v8[4]), (v8[1], v8[5]), (v8[2], v8[6]), (v8[3], v8[7])]


def shfl_xor(vals, m):
    return [vals[lane ^ m] for lane in range(32)]


def quad_transpose(v):
    """v[lane] = 4 values (M[t][j]); returns v' with v'[lane][j] = M[j][t] of the lane's quad, by the CUDA
    function's two shuffle stages."""
    v = [list(x) for x in v]
    for m in (2, 1):
        sel = [((lane & 3) >> 1) if m == 2 else (lane & 1) for lane in range(32)]
        if m == 2:
            s0 = [v[l][0] if sel[l] else v[l][2] for l in range(32)]
            s1 = [v[l][1] if sel[l] else v[l][3] for l in range(32)]
        else:
            s0 = [v[l][0] if sel[l] else v[l][1] for l in range(32)]
            s1 = [v[l][2] if sel[l] else v[l][3] for l in range(32)]
        r0, r1 = shfl_xor(s0, m), shfl_xor(s1, m)
        for l in range(32):
            if m == 2:
                if sel[l]:
                    v[l][0], v[l][1] = r0[l], r1[l]
                else:
                    v[l][2], v[l][3] = r0[l], r1[l]
            else:
                if sel[l]:
                    v[l][0], v[l][2] = r0[l], r1[l]
                else:
                    v[l][1], v[l][3] = r0[l], r1[l]
    return v


# the loads: lane (g, t) holds words 4t..4t+3 of rows g (lo) and g + 8 (hi); scales of rows g, g + 8, all 4 groups
lo = [[int(words[l >> 2, 4 * (l & 3) + j]) for j in range(4)] for l in range(32)]
hi = [[int(words[(l >> 2) + 8, 4 * (l & 3) + j]) for j in range(4)] for l in range(32)]
lo, hi = quad_transpose(lo), quad_transpose(hi)
for l in range(32):  # the transpose's promise: lane t holds word t of each group G
    g, t = l >> 2, l & 3
    assert lo[l] == [int(words[g, 4 * G + t]) for G in range(4)]
for nr in range(1, 9):
    acc = np.zeros((32, 4))
    for G in range(4):
        d = np.zeros((16, 8))
        for h in range(2):  # the group's two MMAs: pairs (0, 1) then (2, 3) of each lane's word
            A = np.zeros((16, 16)); B = np.zeros((16, 8))
            for l in range(32):
                g, t = l >> 2, l & 3
                a_lo, a_hi = dq(lo[l][G]), dq(hi[l][G])
                A[g, 2 * t:2 * t + 2] = a_lo[2 * h]; A[g + 8, 2 * t:2 * t + 2] = a_hi[2 * h]
                A[g, 2 * t + 8:2 * t + 10] = a_lo[2 * h + 1]; A[g + 8, 2 * t + 8:2 * t + 10] = a_hi[2 * h + 1]
                xb = perm_x(X[g, 32 * G + 8 * t:32 * G + 8 * t + 8]) if g < nr else [(0, 0)] * 4
                B[2 * t:2 * t + 2, g] = xb[2 * h]; B[2 * t + 8:2 * t + 10, g] = xb[2 * h + 1]
            d += A @ B
        for l in range(32):  # lane (g, t): D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]
            g, t = l >> 2, l & 3
            acc[l] += [s[g, G] * d[g, 2 * t], s[g, G] * d[g, 2 * t + 1], s[g + 8, G] * d[g + 8, 2 * t],
                       s[g + 8, G] * d[g + 8, 2 * t + 1]]
    out = np.zeros((8, 16))
    for l in range(32):
        g, t = l >> 2, l & 3
        for hh in range(2):
            if 2 * t + hh < nr:
                out[2 * t + hh, g] += acc[l, hh]; out[2 * t + hh, g + 8] += acc[l, 2 + hh]
    ref = X[:nr] @ (q * np.repeat(s, 32, axis=1)).T
    err = np.abs(out[:nr] - ref).max()
    print(nr, "max err", err, "ref scale", np.abs(ref).max())
    assert err < 1e-9
print("ok")
