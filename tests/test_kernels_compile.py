"""CPU: every kernel compiles with NVRTC for sm_90 and sm_120 (no GPU needed) and reports resources."""

import pytest

from kernels import _compile, cli


def _nvrtc_available() -> bool:
    try:
        _compile.nvrtc_version()
        return True
    except Exception:  # cuda-python or the NVRTC library missing
        return False


pytestmark = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC unavailable")


def test_check_compiles_every_kernel(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_compile, "CACHE_DIR", tmp_path)
    assert cli.check(["sm_90", "sm_120"]) == 0
    out = capsys.readouterr().out
    for name in cli.MODULES:
        mod = __import__(f"kernels.{name}", fromlist=["NAMES"])
        for expr in mod.NAMES:
            for arch in ("sm_90", "sm_120"):
                assert f"{name}:{expr}" in out and arch in out
    assert len(list(tmp_path.glob("*.cubin"))) == 2 * len(cli.MODULES)


def test_cache_hit_returns_same_cubin(tmp_path, monkeypatch):
    monkeypatch.setattr(_compile, "CACHE_DIR", tmp_path)
    src = _compile.cuda_source('extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.f; }')
    first = _compile.compile_cubin(src, "sm_90", ("k",))
    second = _compile.compile_cubin(src, "sm_90", ("k",))
    assert first == second and _compile.resources(first)["k"]["regs"] > 0


def test_compile_error_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(_compile, "CACHE_DIR", tmp_path)
    with pytest.raises(Exception):
        _compile.compile_cubin("__global__ void k( { }", "sm_90", ())
