"""NVRTC compile, on-disk cubin cache, and launch on torch's current stream (DESIGN §7).

A kernel module keeps its CUDA C++ source and the name expressions it launches, and calls
`get_kernels(source, names)` once per process (cached); `launch` puts a kernel on
`torch.cuda.current_stream()`, so it orders with torch's work and is captured by CUDA graphs.
`compile_cubin` needs no GPU: `ddtree kernels check` compiles every kernel for any arch with it.

Cache: $DDTREE_KERNEL_CACHE (default ~/.cache/ddtree/kernels), one `<sha256>.cubin` + `.json`
(mangled names, ptxas report) per (source, arch, options, name expressions, NVRTC version).
Set DDTREE_KERNEL_SYNC=1 to synchronize and surface device faults after every launch (tests).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CACHE_DIR = Path(os.environ.get("DDTREE_KERNEL_CACHE", "~/.cache/ddtree/kernels")).expanduser()
# -lineinfo costs nothing at run time and lets compute-sanitizer / ncu name source lines.
OPTIONS = dict(std="c++17", ptxas_options="-v", lineinfo=True)


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    symbols: dict[str, str]  # name expression -> mangled name
    log: str  # NVRTC + ptxas -v output


@functools.cache
def cuda_source(code: str | tuple[str, ...]) -> str:
    """common.cuh followed by the kernel's code (a .cu file name next to this module, a tuple of them
    compiled as one unit, or inline source): the exact text that is compiled and hashed."""
    here = Path(__file__).parent
    parts = code if isinstance(code, tuple) else (code,)
    bodies = [(here / c).read_text() if c.endswith(".cu") else c for c in parts]
    return "\n".join([(here / "common.cuh").read_text(), *bodies])


def target_arch(arch: str) -> str:
    """The arch a device's cubin is built for: Hopper's arch-specific target sm_90a, whose wgmma
    (warpgroup MMA) mla_attn_wgmma uses; a sm_90a cubin runs on compute capability 9.0 only, which is
    the device it is built for. Other archs as they are (their kernels use no arch-specific features)."""
    return "sm_90a" if arch == "sm_90" else arch


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(err)
    return major, minor


def compile_cubin(source: str, arch: str, names: tuple[str, ...]) -> Compiled:
    """CUDA C++ -> cubin for `arch` ("sm_90", "sm_120", ...), through the disk cache."""
    key = hashlib.sha256(repr((source, arch, sorted(OPTIONS.items()), names, nvrtc_version())).encode())
    path = CACHE_DIR / key.hexdigest()
    if path.with_suffix(".cubin").exists() and path.with_suffix(".json").exists():
        meta = json.loads(path.with_suffix(".json").read_text())
        return Compiled(path.with_suffix(".cubin").read_bytes(), meta["symbols"], meta["log"])
    from cuda.core import Program, ProgramOptions

    log = io.StringIO()
    program = Program(source, "c++", ProgramOptions(arch=arch, name=f"ddtree_{arch}.cu", **OPTIONS))
    obj = program.compile("cubin", name_expressions=names, logs=log)  # raises with the log on error
    symbols = {n: (m.decode() if isinstance(m, bytes) else m) for n, m in obj.symbol_mapping.items()}
    out = Compiled(bytes(obj.code), symbols, log.getvalue())
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # write-then-rename: concurrent ranks never see half a file
    tmp.write_bytes(out.cubin)
    tmp.replace(path.with_suffix(".cubin"))
    tmp.write_text(json.dumps({"symbols": out.symbols, "log": out.log}))
    tmp.replace(path.with_suffix(".json"))
    return out


_SPILLS = r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"


def resources(compiled: Compiled) -> dict[str, dict[str, int]]:
    """ptxas -v report -> {name expression: {regs, smem, stack, spill_st, spill_ld}} (static smem only)."""
    by_mangled = {m: n for n, m in compiled.symbols.items()}
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in compiled.log.splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            current = out.setdefault(by_mangled.get(m[1], m[1]), {"smem": 0})
        elif current is not None and (m := re.search(_SPILLS, line)):
            current.update(stack=int(m[1]), spill_st=int(m[2]), spill_ld=int(m[3]))
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["regs"] = int(m[1])
            if s := re.search(r"(\d+) bytes smem", line):
                current["smem"] = int(s[1])
    return out


def get_kernels(source: str, names: tuple[str, ...], device: int | None = None) -> dict:
    """Compile for the device's arch (cached) and load: {name expression: cuda.core Kernel}. The module
    is loaded once per device (default: the current one), since each GPU has its own context."""
    import torch

    return _load(source, names, torch.cuda.current_device() if device is None else device)


@functools.cache
def _load(source: str, names: tuple[str, ...], device: int) -> dict:
    from cuda.core import Device, ObjectCode

    dev = Device(device)
    dev.set_current()  # the primary context, which torch uses too
    compiled = compile_cubin(source, target_arch(f"sm_{dev.arch}"), names)
    mangled = {n: m.encode() for n, m in compiled.symbols.items()}  # bytes, as NVRTC reports them
    module = ObjectCode.from_cubin(compiled.cubin, symbol_mapping=mangled)
    return {n: module.get_kernel(n) for n in names}


@dataclass(frozen=True)
class DeviceLimits:
    """What the launchers size grids and shared memory by (one query per device)."""

    sms: int  # streaming multiprocessors
    smem_block: int  # opt-in dynamic shared memory per block, bytes (227 KB on H200, 99 KB on sm_120)
    smem_sm: int  # shared memory per SM, bytes
    major: int  # compute capability major (9: Hopper's wgmma and TMA)


@functools.cache
def device_limits(device: int) -> DeviceLimits:
    import torch

    p = torch.cuda.get_device_properties(device)
    per_block = getattr(p, "shared_memory_per_block_optin", 99 * 1024)
    return DeviceLimits(p.multi_processor_count, per_block, getattr(p, "shared_memory_per_multiprocessor", per_block),
                        p.major)


class _TorchStream:
    """The `__cuda_stream__` protocol cuda.core accepts, for a torch stream."""

    def __init__(self, stream):
        self.stream = stream

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.stream.cuda_stream


# (device, torch stream handle) -> cuda.core Stream wrapping it (kept alive). The device is part of the key:
# every device's default stream has handle 0.
_STREAMS: dict[tuple[int, int], object] = {}


def _current_stream():
    """cuda.core Stream of torch's current stream on the current device. The raw handle is what
    Inductor's generated code reads (`torch._C._cuda_getCurrentRawStream`): torch.cuda.current_stream()
    resolves the device through is_available() on every call (~50 us of a drafter step's host time)."""
    import torch

    device = torch.cuda.current_device()
    key = (device, torch._C._cuda_getCurrentRawStream(device))
    s = _STREAMS.get(key)
    if s is None:
        from cuda.core import Device

        s = _STREAMS[key] = Device(device).create_stream(_TorchStream(torch.cuda.current_stream(device)))
    return s


@functools.lru_cache(maxsize=1024)
def _config(grid, block, smem: int, pdl: bool, cluster):
    from cuda.core import LaunchConfig

    return LaunchConfig(grid=grid, cluster=cluster, block=block, shmem_size=smem,
                        programmatic_stream_serialization=pdl)


def launch(kernel, grid, block, *args, smem: int = 0, pdl: bool = False, cluster: int | None = None) -> None:
    """Launch on torch's current stream. Tensors pass as device pointers (None as a null one), Python ints as
    int32, floats as float32, numpy scalars as themselves (use np.int64 etc. for other widths).
    pdl: programmatic dependent launch (sm_90+): the kernel may start while the previous one on the
    stream still runs, and must `griddepcontrol.wait` before reading what that one writes; CUDA graph
    capture keeps it as a programmatic edge.
    cluster: blocks per thread-block cluster along x (sm_90+); `grid` then counts clusters, not blocks."""
    import torch
    from cuda.core import launch as cuda_launch

    if smem > 48 * 1024:
        _allow_smem(kernel, smem, torch.cuda.current_device())
    cuda_launch(_current_stream(), _config(grid, block, smem, pdl, cluster), kernel, *map(_arg, args))
    if os.environ.get("DDTREE_KERNEL_SYNC") == "1" and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()  # raises on an asynchronous fault of this launch


def _arg(a):
    import torch

    if isinstance(a, torch.Tensor):
        assert a.is_cuda, "kernel arguments must be CUDA tensors"
        return np.uint64(a.data_ptr())
    if a is None:
        return np.uint64(0)
    if isinstance(a, bool) or isinstance(a, np.generic):
        return a
    if isinstance(a, int):
        assert -(2**31) <= a < 2**31, f"{a} does not fit int32: pass np.int64"
        return np.int32(a)
    if isinstance(a, float):
        return np.float32(a)
    raise TypeError(f"unsupported kernel argument {type(a)}")


@functools.lru_cache(maxsize=1024)
def resident_blocks(kernel, threads: int, smem: int, device: int) -> int:
    """Blocks of `kernel` the device holds at once with `threads` threads and `smem` bytes of dynamic shared memory
    each: the occupancy query per SM × the SMs (at least one per SM). Grids sized in waves of these."""
    if smem > 48 * 1024:
        _allow_smem(kernel, smem, device)
    per_sm = kernel.occupancy.max_active_blocks_per_multiprocessor(threads, smem)
    return max(1, per_sm) * device_limits(device).sms


# (kernel, device) -> the dynamic shared memory it is allowed now. The attribute is one maximum per kernel, so it
# only ever grows: setting it per launch size would let a smaller launch revoke a larger size that is cached.
_SMEM_ALLOWED: dict = {}


def _allow_smem(kernel, nbytes: int, device: int) -> None:
    """Opt in to more than 48 KB of dynamic shared memory (once per kernel, raised as larger sizes come)."""
    from cuda.bindings import driver

    if _SMEM_ALLOWED.get((kernel, device), 0) >= nbytes:
        return
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    handle = kernel.handle
    if isinstance(handle, driver.CUkernel):
        (err,) = driver.cuKernelSetAttribute(attr, nbytes, handle, device)
    else:
        (err,) = driver.cuFuncSetAttribute(handle, attr, nbytes)
    _check(err)
    _SMEM_ALLOWED[kernel, device] = nbytes


def _check(err) -> None:
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err!r}")
