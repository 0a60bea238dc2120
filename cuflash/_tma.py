"""Tensor maps (TMA descriptors) for the Hopper kernels, encoded on the host.

CuPy exposes no ``cuTensorMapEncodeTiled``; ``cuda.bindings.driver`` does (installed with CUDA Python,
present on the H200 machine). The encoded ``CUtensorMap`` is 128 opaque bytes; it is handed to a kernel
by value as a size-1 numpy array of a 64-byte-aligned 128-byte dtype, matching ``TensorMap`` in
kernels_cu/common/hopper.cuh, for a ``const __grid_constant__ TensorMap`` parameter.
"""
from __future__ import annotations

import numpy as np

TENSOR_MAP = np.dtype({"names": ["opaque"], "formats": [(np.uint64, (16,))], "offsets": [0], "itemsize": 128,
                       "aligned": True})

_DTYPES = {"bfloat16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", "float16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16",
           "float32": "CU_TENSOR_MAP_DATA_TYPE_FLOAT32", "uint8": "CU_TENSOR_MAP_DATA_TYPE_UINT8"}
_SWIZZLE = {0: "CU_TENSOR_MAP_SWIZZLE_NONE", 32: "CU_TENSOR_MAP_SWIZZLE_32B", 64: "CU_TENSOR_MAP_SWIZZLE_64B",
            128: "CU_TENSOR_MAP_SWIZZLE_128B"}


def encode_tiled(ptr: int, dtype: str, shape: tuple[int, ...], strides_bytes: tuple[int, ...], box: tuple[int, ...],
                 swizzle: int = 128) -> np.ndarray:
    """A tensor map over ``shape`` (innermost dimension first, as the driver wants it) whose outer
    dimensions are ``strides_bytes`` apart (one fewer entry than ``shape``; multiples of 16), loading
    ``box`` elements per copy. Out-of-range elements of a box read as zeros. Returns the kernel argument."""
    from cuda.bindings import driver

    rank = len(shape)
    if len(strides_bytes) != rank - 1 or len(box) != rank:
        raise ValueError(f"tensor map of rank {rank} needs {rank - 1} strides and {rank} box sizes")
    if ptr % 16 or any(s % 16 for s in strides_bytes):
        raise ValueError(f"TMA needs 16-byte aligned base and strides; got base {ptr:#x}, strides {strides_bytes}")
    err, tmap = driver.cuTensorMapEncodeTiled(
        getattr(driver.CUtensorMapDataType, _DTYPES[dtype]),
        driver.cuuint32_t(rank),
        ptr,
        [driver.cuuint64_t(s) for s in shape],
        [driver.cuuint64_t(s) for s in strides_bytes],
        [driver.cuuint32_t(b) for b in box],
        [driver.cuuint32_t(1)] * rank,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, _SWIZZLE[swizzle]),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for shape {shape}, strides {strides_bytes}, box {box}")
    out = np.zeros(1, TENSOR_MAP)
    out["opaque"][0] = np.array([int(w) for w in tmap.opaque], dtype=np.uint64)
    return out
