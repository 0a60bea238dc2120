"""Pieces shared by the kernel families' parameter structs (numpy mirrors of the C structs).

A params struct is a size-1 numpy structured array (align=True gives C's layout); CuPy passes it to
the kernel by value.
"""
from __future__ import annotations

import math

import numpy as np

from ._validate import Dims

DIMS_FIELDS = [(n, np.int32) for n in ("batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "window_left",
                                       "window_right")]
DTYPE_CODES = {"bfloat16": 0, "float16": 1}  # CUFLASH_DTYPE in kernels_cu/common/types.cuh


LOG2E = 1.0 / math.log(2.0)


def logit_scales(scale: float, softcap: float) -> tuple[float, float]:
    """(scale_log2, softcap_pre) of the kernels' logit convention: a score s becomes
    x = s (no softcap) or x = tanh(s · softcap_pre) (softcap > 0, softcap_pre = scale / softcap), and
    P = 2^(x · scale_log2 - m · scale_log2) with scale_log2 = scale · log2 e, or softcap · log2 e."""
    if softcap > 0:
        return softcap * LOG2E, scale / softcap
    return scale * LOG2E, 0.0


def pointer_fields(*names: str) -> list[tuple[str, type]]:
    return [(n, np.uint64) for n in names]


def stride_fields(*prefixes: str) -> list[tuple[str, type]]:
    """``{prefix}_{batch,row,head}_stride`` int64 fields, in elements."""
    return [(f"{p}_{s}_stride", np.int64) for p in prefixes for s in ("batch", "row", "head")]


def fill_strides(params, prefix: str, a) -> None:
    """Strides of a (batch, seqlen, heads, d) array, or of a packed (total, heads, d) variable-length
    array (batch stride 0: the kernels find each entry's first row through cu_seqlens)."""
    item = a.dtype.itemsize
    axes = (0, 1, 2) if a.ndim == 4 else (None, 0, 1)
    for axis, s in zip(axes, ("batch", "row", "head")):
        params[f"{prefix}_{s}_stride"] = 0 if axis is None else a.strides[axis] // item


def fill_row_strides(params, dims: Dims, total_q: int | None) -> None:
    """Layout of the per-row fp32 arrays (LSE, D, dQ accumulator rows): (batch, heads, seqlen_q), or
    (heads, total_q) for variable-length batches (see kernels_cu/common/seqlen.cuh)."""
    if total_q is None:
        params["row_batch_stride"], params["row_head_stride"] = dims.heads * dims.seqlen_q, dims.seqlen_q
    else:
        params["row_batch_stride"], params["row_head_stride"] = 0, total_q


def fill_dims(params, dims: Dims, window: tuple[int, int]) -> None:
    params["batch"], params["heads"], params["kv_heads"] = dims.batch, dims.heads, dims.kv_heads
    params["seqlen_q"], params["seqlen_k"] = dims.seqlen_q, dims.seqlen_k
    params["window_left"], params["window_right"] = window


def smem_tile_bytes(rows: int, cols: int, swizzled: bool = False) -> int:
    """Bytes of a kernels_cu/common/tile.cuh SmemTile: packed when swizzled, else rows padded by 8."""
    return rows * (cols if swizzled else cols + 8) * 2
