"""Tensor maps (TMA descriptors) for the Hopper kernels, encoded on the host.

CuPy exposes no ``cuTensorMapEncodeTiled``; ``cuda.bindings.driver`` does (the ``cuda-bindings``
dependency). The encoded ``CUtensorMap`` is 128 opaque bytes; it is handed to a kernel
by value as a size-1 numpy array of a 128-byte dtype, for a ``const __grid_constant__ TensorMap``
parameter (kernels_cu/common/hopper.cuh). The launch passes a pointer per parameter and the driver copies
each into the kernel's own parameter layout, where ``TensorMap`` is 64-byte aligned; the host copy
needs no particular alignment.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

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
    ``box`` elements per copy. Out-of-range elements of a box read as zeros. Returns the kernel argument
    (do not modify it: it is shared).

    Encoding through cuda.bindings costs tens of microseconds of Python per map, as much as a short
    attention kernel runs; a map is a pure function of its arguments, so repeated calls (a training or
    decode loop, whose allocator hands back the same buffers) take it from a small cache.
    """
    return _encode_tiled_cached(ptr, dtype, tuple(shape), tuple(strides_bytes), tuple(box), swizzle)


@functools.lru_cache(maxsize=512)
def _encode_tiled_cached(ptr: int, dtype: str, shape: tuple[int, ...], strides_bytes: tuple[int, ...],
                         box: tuple[int, ...], swizzle: int) -> np.ndarray:
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


class MapLayout(NamedTuple):
    """Everything of a tensor map but its base address (encode_tiled's arguments): what a planned call
    fixes once for its shapes, so that each call only looks up the map at its arrays' addresses."""

    dtype: str
    shape: tuple[int, ...]
    strides_bytes: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: int = 128


@functools.lru_cache(maxsize=512)
def encoded(ptr: int, layout: MapLayout) -> tuple[np.ndarray, int]:
    """The map of ``layout`` at ``ptr`` and its host address (to pass by pointer); keep the pair until the
    launch has been issued (the cache may drop its entry before that)."""
    tmap = _encode_tiled_cached(ptr, *layout)
    return tmap, tmap.ctypes.data
