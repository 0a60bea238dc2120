"""The Hopper building blocks (kernels_cu/common/hopper.cuh, wgmma_ops.cuh) on a small wgmma GEMM
(tests/cuda/wgmma_gemm.cu): compiled offline for sm_90a in the CPU tier (HGMMA, UTMALDG, USETMAXREG
present; no spills, no serialising advisory), and checked against NumPy on an H200 in the GPU tier —
K-major and MN-major B, A from shared memory (K-major or MN-major) and from registers."""
import itertools
from pathlib import Path

import numpy as np
import pytest

from cuflash import compile_report
from cuflash._jit import Variant

SRC = str(Path(__file__).resolve().parent / "cuda" / "wgmma_gemm.cu")
VARIANTS = [(k, n, b_mn, a_regs, 0) for k, n, b_mn, a_regs in itertools.product((64, 256), (64, 128), (0, 1), (0, 1))]
VARIANTS += [(64, 64, 1, 0, 1), (256, 128, 1, 0, 1)]  # MN-major A (the FA3 backward's dQ)


def _variant(k, n, b_mn, a_regs, a_mn=0, dtype_code=0):
    stages = k // 64
    smem = stages * (64 * 128 + n * 128) + 8 * stages + 2048  # + barriers, + room to align to 1024
    return Variant("probe", SRC, "wgmma_gemm",
                   (("CUFLASH_K", k), ("CUFLASH_N", n), ("CUFLASH_B_MN", b_mn), ("CUFLASH_A_REGS", a_regs),
                    ("CUFLASH_A_MN", a_mn), ("CUFLASH_DTYPE", dtype_code)), threads=256, smem_bytes=smem)


@pytest.mark.parametrize("k,n,b_mn,a_regs,a_mn", VARIANTS)
def test_probe_machine_code(k, n, b_mn, a_regs, a_mn):
    row = compile_report.report_variant(_variant(k, n, b_mn, a_regs, a_mn), "sm_90a")
    assert row["ok"], row.get("error")
    assert not compile_report.problems(row), compile_report.problems(row)
    ops = row["opcodes"]
    assert ops["HGMMA"] >= 4, ops  # 4 per K slice; the slice loop may stay rolled
    assert ops["UTMALDG"] >= 2 and ops["USETMAXREG"] == 2, ops


def _run(k, n, b_mn, a_regs, a_mn, dtype, lbo, sbo):
    import cupy

    from cuflash import _tma
    from cuflash._jit import get_function

    rng = np.random.default_rng(0)
    a = cupy.asarray(rng.standard_normal((64, k), dtype=np.float32)).astype(dtype)
    b_kn = rng.standard_normal((k, n), dtype=np.float32)  # the math: C = A @ b_kn
    if b_mn:
        b = cupy.asarray(b_kn).astype(dtype)  # stored [K][N]
        map_b = _tma.encode_tiled(b.data.ptr, dtype, (n, k), (n * 2,), (64, 64))
    else:
        b = cupy.asarray(np.ascontiguousarray(b_kn.T)).astype(dtype)  # stored [N][K]
        map_b = _tma.encode_tiled(b.data.ptr, dtype, (k, n), (k * 2,), (64, n))
    if a_mn:
        a_t = cupy.ascontiguousarray(a.T)  # stored [K][M]
        map_a = _tma.encode_tiled(a_t.data.ptr, dtype, (64, k), (64 * 2,), (64, 64))
    else:
        map_a = _tma.encode_tiled(a.data.ptr, dtype, (k, 64), (k * 2,), (64, 64))
    c = cupy.full((64, n), np.nan, dtype=cupy.float32)
    v = _variant(k, n, b_mn, a_regs, a_mn, 0 if dtype == "bfloat16" else 1)
    get_function(v)((1,), (256,), (map_a, map_b, a, c, np.uint32(lbo), np.uint32(sbo)), shared_mem=v.smem_bytes)
    b_rounded = b.astype(cupy.float32).get()  # the operand as the kernel sees it (rounded to 16 bits)
    want = a.astype(cupy.float32).get() @ (b_rounded if b_mn else b_rounded.T)
    return c.get(), want


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,b_mn,a_regs,a_mn", VARIANTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_probe_gemm_matches_numpy(k, n, b_mn, a_regs, a_mn, dtype):
    from cuflash import _device

    if _device.compute_capability() != (9, 0):
        pytest.skip("needs sm_90")
    lbo, sbo = 64 * 128, 1024  # MN-major: N atoms 64 rows x 128 B apart, K groups of 8 rows 1024 B apart
    got, want = _run(k, n, b_mn, a_regs, a_mn, dtype, lbo, sbo)
    if b_mn and not np.allclose(got, want, rtol=1e-3, atol=1e-3):
        swapped, _ = _run(k, n, b_mn, a_regs, a_mn, dtype, sbo, lbo)
        hint = "the swapped (leading, stride) offsets match" if np.allclose(swapped, want, rtol=1e-3, atol=1e-3) \
            else "the swapped offsets do not match either"
        pytest.fail(f"MN-major B with (lbo={lbo}, sbo={sbo}) is wrong; {hint}")
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
