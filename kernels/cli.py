"""`ddtree kernels check` (compile every kernel with NVRTC, no GPU needed; print registers, static
shared memory, stack and spills) and `ddtree bench kernels` (kernels/bench.py)."""

from __future__ import annotations

import importlib
import sys

MODULES = ("moe_w4a16", "moe_gate", "mla_tree_attention", "mla_rope", "ddtree_build", "tree_accept", "kv_commit",
           "rms_norm", "skinny_linear", "skinny_gemm", "w8a16_gemm", "silu_mul", "dflash_attention", "all_reduce")


def check(archs: list[str]) -> int:
    from kernels._compile import compile_cubin, cuda_source, nvrtc_version, resources, target_arch

    print(f"NVRTC {'.'.join(map(str, nvrtc_version()))}")
    print(f"{'kernel':<44} {'arch':<7} {'regs':>5} {'smem':>6} {'stack':>6} {'spill st/ld':>12}")
    spilled = []
    for name in MODULES:
        mod = importlib.import_module(f"kernels.{name}")
        for arch in map(target_arch, archs):
            report = resources(compile_cubin(cuda_source(mod.CODE), arch, mod.NAMES))
            for expr in mod.NAMES:
                r = report.get(expr)
                if r is None or "regs" not in r:  # a ptxas -v log without this kernel (seen once, NVRTC 13.0)
                    print(f"{name + ':' + expr:<44} {arch:<7} {'n/a':>5}")
                    continue
                print(f"{name + ':' + expr:<44} {arch:<7} {r['regs']:>5} {r['smem']:>6} {r['stack']:>6} "
                      f"{r['spill_st']:>6}/{r['spill_ld']:<5}")
                if r["spill_st"] or r["spill_ld"]:
                    spilled.append(f"{name}:{expr} on {arch}")
    if spilled:
        print("spills (local-memory traffic): " + ", ".join(spilled))
    return 0


def _check_cmd(args) -> int:
    return check(args.arch or ["sm_90", "sm_120"])


def _bench_cmd(args) -> int:
    from kernels import bench

    return bench.main(args.preset, args.out, getattr(args, "only", None), getattr(args, "set", None))


def add_parser(sub) -> None:
    """Register `kernels` on the `ddtree` subcommand parser."""
    p = sub.add_parser("kernels", help="CUDA kernel tools")
    ksub = p.add_subparsers(dest="kernels_command", required=True)
    c = ksub.add_parser("check", help="compile every kernel with NVRTC and print resource usage")
    c.add_argument("--arch", action="append", help="sm_90, sm_120, ... (repeatable; default both)")
    c.set_defaults(func=_check_cmd)


def _setting(text: str) -> str:
    """argparse type of --set: the form and the module checked at parse time (the flag itself when applied)."""
    import argparse

    from kernels import overrides

    try:
        overrides.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_set_argument(p) -> None:
    """`--set MODULE.FLAG=VALUE` (kernels/overrides.py), repeatable: a kernel variant of a bench run."""
    p.add_argument("--set", action="append", type=_setting, metavar="MODULE.FLAG=VALUE",
                   help="set a kernel module's tuning flag for this run, e.g. moe_w4a16.FEW_DOWN_T=8 (repeatable)")


def add_bench_parser(bsub) -> None:
    """`ddtree bench kernels` (the `bench` parser itself lives in service_kit/tools.py)."""
    bk = bsub.add_parser("kernels", help="time every kernel against its torch reference on the GPU")
    bk.add_argument("--preset", default="k26", choices=["k26"])
    bk.add_argument("--out", help="also write the table as JSON lines here")
    bk.add_argument("--only", help="bench only the group whose name contains this: moe, mla, small, linear, int8, "
                                   "ddtree, dflash")
    add_set_argument(bk)
    bk.set_defaults(func=_bench_cmd)


if __name__ == "__main__":  # python -m kernels.cli check ... without the ddtree entry point
    import argparse

    parser = argparse.ArgumentParser(prog="kernels")
    commands = parser.add_subparsers(dest="command", required=True)
    add_parser(commands)
    add_bench_parser(commands.add_parser("bench").add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args()
    sys.exit(int(args.func(args) or 0))
