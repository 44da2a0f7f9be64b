"""Session 47's A/B of moe_few_down variants (session 46's script, extended): moe_w4a16 with `add`, moe_few_down's
variants against moe_gemm's down + combine. Correctness against the fp32 reference, then us per call (a graph of
back-to-back calls over rotating routings). T = 1 spread over 1-8 local experts; T tokens on each of 8 experts;
T = 2..32 uniform draws over 384 experts, the slowest of 7 ranks' share. Without the s47 patch applied it times
main's kernel (few 4x4, 2x8); with it, the patch's variants (CONFIGS).
PYTHONPATH=. python docs/kernel-notes/s47_ab_few.py [breakdown]"""
import sys

import torch

from kernels import moe_w4a16 as moe
from kernels.bench import copy_bandwidth, gpu_time, kernel_breakdown, random_experts, spread_routing
from verifier_service.bench_verify import to_slowest_rank

H, I, E, K, N, WORLD = 7168, 2048, 55, 8, 384, 7
VARIANTS = {"main": dict(FEW_DOWN=False)}
PATCHED = hasattr(moe, "FEW_DOWN_N8")  # docs/kernel-notes/s47-few-pipe.patch applied
# name: (CPW, warps, PIPE, N8)
CONFIGS = ({"few 4x4": (4, 4, False, False), "pipe 2x4": (2, 4, True, False), "pipe 4x4": (4, 4, True, False),
            "pipe 2x8": (2, 8, True, False), "n8 4x4": (4, 4, False, True), "n8 pipe 2x4": (2, 4, True, True)}
           if PATCHED else {"few 4x4": (4, 4, False, False), "few 2x8": (2, 8, False, False)})
for name, (dcpw, dw, pipe, n8) in CONFIGS.items():
    VARIANTS[name] = dict(FEW_DOWN=True, FEW_DOWN_T=32, FEW_DOWN_CPW=dcpw, FEW_DOWN_WARPS=dw,
                          **(dict(FEW_DOWN_PIPE=pipe, FEW_DOWN_N8=n8) if PATCHED else {}))
DEFAULTS = {n: getattr(moe, n) for n in ("FEW_DOWN", "FEW_DOWN_T", "FEW_DOWN_CPW", "FEW_DOWN_WARPS", "FEW_DOWN_PIPE",
                                         "FEW_DOWN_N8") if hasattr(moe, n)}


def use(v):
    for n, val in {**DEFAULTS, **VARIANTS[v]}.items():
        setattr(moe, n, val)


def cases():
    for active in (1, 2, 3, 4, 8):
        ids, w = spread_routing(1, K, active, E)
        yield f"T=1 {active} exp", [(ids if r == 0 else torch.where(ids < E, (ids + r * active) % E, ids), w)
                                    for r in range(6)]
    for T in (2, 4, 8):  # T tokens on each of 8 experts
        ids, w = spread_routing(T, K, 8, E)
        yield f"T={T} 8 exp x {T}", [((ids + r * 8) % E, w) for r in range(6)]
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in (2, 4, 8, 16, 32):
        draws = []
        for _ in range(6):
            ids = to_slowest_rank(torch.rand(T, N, generator=g, device="cuda").topk(K).indices, N, WORLD)
            draws.append((ids.contiguous(), torch.rand(T, K, generator=g, device="cuda")))
        nexp = sum(d[0][d[0] < E].unique().numel() for d in draws) / 6
        yield f"T={T} slowest ({nexp:.1f} exp)", draws


def main():
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()} copy {bw / 1e9:.0f} GB/s")
    ex = random_experts(E, H, I)
    worst = 0.0
    for name, draws in cases():
        T = draws[0][0].shape[0]
        x = torch.randn(T, H, device="cuda").bfloat16()
        add = torch.randn(T, H, device="cuda").bfloat16()
        ids, w = draws[0]
        ref = moe.moe_w4a16_ref(x, ids, w, ex, add=add).double()
        row = []
        for v in VARIANTS:
            use(v)
            o = moe.moe_w4a16(x, ids, w, ex, add=add).double()
            e = ((o - ref).norm() / ref.norm()).item()
            if v != "main":
                worst = max(worst, e)
            t = gpu_time([lambda i=i, ww=ww: moe.moe_w4a16(x, i, ww, ex, add=add) for i, ww in draws])
            row.append(f"{v} {t * 1e6:6.1f} ({e:.0e})")
        print(f"{name:>24}: " + " | ".join(row), flush=True)
        if len(sys.argv) > 1:
            for v in [v for v in ("main", "few 4x4", "pipe 2x4", "n8 pipe 2x4") if v in VARIANTS]:
                use(v)
                print(f"    {v}:", kernel_breakdown(lambda: moe.moe_w4a16(x, ids, w, ex, add=add)))
    use("main")
    print(f"worst few rel err {worst:.2e}", "BAD" if worst > 1e-2 else "ok")


if __name__ == "__main__":
    main()
