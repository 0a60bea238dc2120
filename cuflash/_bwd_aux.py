"""The passes around every attention backward (kernels_cu/common/bwd_aux.cu): D = rowsum(dO o O) with
the dQ accumulator zeroed, and the final fp32 -> fp16/bf16 conversion of dQ."""
from __future__ import annotations

import numpy as np

from ._jit import PreparedLaunch, Variant, launch
from ._params import DTYPE_CODES, fill_strides, pointer_fields, stride_fields

FAMILY = "bwd_aux"
KERNELS = ("bwd_preprocess", "bwd_convert_dq")
THREADS = 128  # a group of lanes per row, one 16-byte chunk each (kernels_cu/common/bwd_aux.cu)


def rows_per_block(headdim: int) -> int:
    """Rows a block covers: the row's lanes are its 16-byte chunks rounded up to a power of two."""
    chunks = headdim // 8
    group = next(g for g in (4, 8, 16, 32) if chunks <= g)
    return THREADS // group

# Mirror of BwdAuxParams (same order, C alignment).
PARAMS = np.dtype(
    pointer_fields("o", "dout", "dq_accum", "dq", "dsum") + stride_fields("o", "do", "dq")
    + [("batch", np.int32), ("heads", np.int32), ("seqlen_q", np.int32), ("scale", np.float32)]
    + pointer_fields("lse", "lse_rows") + [("row_pitch", np.int64)] + pointer_fields("cu_seqlens_q")
    + [("varlen_batch", np.int32), ("row_shift", np.int32), ("accum_planes", np.int32),
       ("accum_plane_stride", np.int64)],
    align=True,
)


def variant(kernel: str, headdim: int, dtype: str) -> Variant:
    return Variant(FAMILY, "common/bwd_aux.cu", kernel,
                   (("CUFLASH_HEADDIM", headdim), ("CUFLASH_DTYPE", DTYPE_CODES[dtype])), threads=THREADS)


def all_variants(headdims) -> list[Variant]:
    return [variant(k, d, dtype) for dtype in DTYPE_CODES for d in headdims for k in KERNELS]


def _layout_params(out, dout, dq, accum_size: int, dims, scale, row_pitch=None, varlen_batch=0, row_shift=0,
                   planes=1) -> np.ndarray:
    """The params but their pointers: strides, sizes, padding; ``varlen_batch`` > 0 for packed batches."""
    p = np.zeros(1, PARAMS)
    for prefix, a in (("o", out), ("do", dout), ("dq", dq)):
        fill_strides(p, prefix, a)
    p["batch"], p["heads"], p["seqlen_q"], p["scale"] = dims.batch, dims.heads, dims.seqlen_q, scale
    p["row_pitch"] = dims.seqlen_q if row_pitch is None else row_pitch
    p["varlen_batch"], p["row_shift"] = varlen_batch, row_shift
    p["accum_planes"], p["accum_plane_stride"] = planes, accum_size // planes
    return p


def _params(out, dout, dq, dq_accum, dsum, dims, scale, lse=None, lse_rows=None, row_pitch=None, cu_seqlens_q=None,
            varlen_batch=0, row_shift=0, planes=1):
    p = _layout_params(out, dout, dq, dq_accum.size, dims, scale, row_pitch,
                       varlen_batch if cu_seqlens_q is not None else 0, row_shift, planes)
    for name, a in (("o", out), ("dout", dout), ("dq_accum", dq_accum), ("dq", dq), ("dsum", dsum)):
        p[name] = a.data.ptr
    if lse_rows is not None:
        p["lse"], p["lse_rows"] = lse.data.ptr, lse_rows.data.ptr
    if cu_seqlens_q is not None:
        p["cu_seqlens_q"] = cu_seqlens_q.data.ptr
    return p


def _grid(dims) -> int:
    """Blocks over the batch x heads x seqlen_q rows (0: nothing to launch)."""
    rows = dims.batch * dims.heads * dims.seqlen_q
    if rows >= 2**31:  # the kernels index rows in 32 bits
        raise ValueError(f"batch x heads x seqlen_q = {rows} rows: the backward supports fewer than 2^31")
    per_block = rows_per_block(dims.headdim)
    return (rows + per_block - 1) // per_block


def _launch(kernel, p, dims, stream):
    grid = _grid(dims)
    if grid:
        launch(variant(kernel, dims.headdim, dims.dtype), (grid,), (p,), stream)


# The pointers a planned pass takes per call (PreparedLaunch), in this order.
PER_CALL = ("o", "dout", "dq_accum", "dq", "dsum", "lse", "lse_rows", "cu_seqlens_q")


def prepared(kernel: str, out, dout, dq, accum_size: int, dims, scale, row_pitch=None, varlen_batch=0, row_shift=0,
             planes=1) -> PreparedLaunch | None:
    """``kernel`` ("bwd_preprocess" or "bwd_convert_dq") planned for arrays of these layouts, its pointers left
    per call (PER_CALL; 0 for those a pass does not take); the other arguments as preprocess / convert_dq
    take them (``varlen_batch`` > 0 only for packed batches), ``accum_size`` the dQ accumulator's elements.
    None when there are no rows."""
    grid = _grid(dims)
    if not grid:
        return None
    p = _layout_params(out, dout, dq, accum_size, dims, scale, row_pitch, varlen_batch, row_shift, planes)
    return PreparedLaunch(variant(kernel, dims.headdim, dims.dtype), (grid,), p, PER_CALL)


def preprocess(out, dout, dq, dq_accum, dsum, dims, scale, stream, *, lse=None, lse_rows=None,
               row_pitch=None, cu_seqlens_q=None, varlen_batch=0, row_shift=0, planes=1) -> None:
    """dsum = rowsum(dout * out); dq_accum = 0. dsum is (batch, heads, row_pitch) (default pitch:
    seqlen_q); with ``lse_rows``, the contiguous (batch, heads, seqlen_q) ``lse`` is copied into it in
    dsum's layout. Entries past seqlen_q of each row are not written. ``cu_seqlens_q`` (packed rows as
    one batch entry, with ``lse_rows``): each sequence's rows go to their 64-aligned place of the head's
    padded row (kernels_cu/common/bwd_aux.cu). ``row_shift`` (fixed length only): every head's rows of
    dsum / lse_rows and of dq_accum (batch, heads, row_shift + seqlen_q, d) start after row_shift rows of
    padding (dsum 0, lse_rows +inf there; dq_accum's left as they are). ``planes``: dq_accum is that many
    equal accumulators one after another (the deterministic FA3 backward's), each zeroed."""
    p = _params(out, dout, dq, dq_accum, dsum, dims, scale, lse, lse_rows, row_pitch, cu_seqlens_q, varlen_batch,
                row_shift, planes)
    _launch("bwd_preprocess", p, dims, stream)


def convert_dq(out, dout, dq, dq_accum, dsum, dims, scale, stream, *, row_shift=0, planes=1) -> None:
    """dq = scale * dq_accum in dq's dtype and strides (dq_accum's rows after row_shift rows of padding;
    ``planes`` accumulators summed in order)."""
    _launch("bwd_convert_dq", _params(out, dout, dq, dq_accum, dsum, dims, scale, row_shift=row_shift, planes=planes),
            dims, stream)
