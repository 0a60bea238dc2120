"""The Hopper building blocks (kernels_cu/common/hopper.cuh) on a small wgmma GEMM (tests/cuda/wgmma_gemm.cu):
compiled offline for sm_90a in the CPU tier (HGMMA, UTMALDG, USETMAXREG present; no spills, no
serialising advisory), and checked against NumPy on an H200 in the GPU tier."""
from pathlib import Path

import numpy as np
import pytest

from cuflash import compile_report
from cuflash._jit import Variant

SRC = str(Path(__file__).resolve().parent / "cuda" / "wgmma_gemm.cu")


def _variant(k, dtype_code=0):
    # dynamic shared memory: A and B stages plus barriers, and 1 KB to align the base to 1024 bytes
    smem = 2 * (k // 64) * 64 * 128 + 8 * (k // 64) + 1024 + 1024
    return Variant("probe", SRC, "wgmma_gemm", (("CUFLASH_K", k), ("CUFLASH_DTYPE", dtype_code)), threads=256,
                   smem_bytes=smem)


@pytest.mark.parametrize("k", [64, 256])
def test_probe_machine_code(k):
    row = compile_report.report_variant(_variant(k), "sm_90a")
    assert row["ok"], row.get("error")
    assert not compile_report.problems(row), compile_report.problems(row)
    ops = row["opcodes"]
    assert ops["HGMMA"] == 4 * (k // 64) and ops["UTMALDG"] == 2 * (k // 64) and ops["USETMAXREG"] == 2, ops


@pytest.mark.gpu
@pytest.mark.parametrize("k", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_probe_gemm_matches_numpy(k, dtype):
    import cupy

    from cuflash import _device, _tma
    from cuflash._jit import get_function

    if _device.compute_capability() != (9, 0):
        pytest.skip("needs sm_90")
    rng = np.random.default_rng()
    a = cupy.asarray(rng.standard_normal((64, k), dtype=np.float32)).astype(dtype)
    b = cupy.asarray(rng.standard_normal((64, k), dtype=np.float32)).astype(dtype)
    c = cupy.full((64, 64), np.nan, dtype=cupy.float32)
    maps = [_tma.encode_tiled(x.data.ptr, dtype, (k, 64), (k * 2,), (64, 64), swizzle=128) for x in (a, b)]
    v = _variant(k, 0 if dtype == "bfloat16" else 1)
    get_function(v)((1,), (256,), (maps[0], maps[1], c), shared_mem=v.smem_bytes)
    want = a.astype(cupy.float32).get() @ b.astype(cupy.float32).get().T
    np.testing.assert_allclose(c.get(), want, rtol=1e-3, atol=1e-3)
