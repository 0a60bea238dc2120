"""FA2 family: variant keys, parameter structs and launches of kernels_cu/fa2/.

sm_80 and newer: mma.sync tensor cores fed by cp.async double-buffered, swizzled shared memory.
Forward and backward (dQ by fp32 atomics, or in a fixed order with ``deterministic=True``).
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from . import _bwd_aux
from ._device import ARCH_SMEM_PER_BLOCK, compute_capability, device_id, max_smem_per_block
from ._jit import Variant, launch
from ._params import (DIMS_FIELDS, DTYPE_CODES, fill_dims, fill_row_strides, fill_strides, logit_scales,
                      pointer_fields, smem_tile_bytes, stride_fields)
from ._validate import Dims
from .heuristics import (FA2_BWD_TILES, FA2_BWD_TILES_PLAIN, FA2_BWD_TILES_PLAIN_SM90, FA2_BWD_TILES_SMALL_SMEM,
                         FA2_TILES, FA2_TILES_SM90)

FAMILY = "fa2"
HEADDIMS = tuple(sorted(FA2_TILES))
MIN_CC = (8, 0)
FWD_FEATURES = frozenset({"causal", "window", "gqa", "softcap", "alibi", "varlen", "dropout"})
BWD_FEATURES = frozenset({"causal", "window", "gqa", "softcap", "alibi", "varlen", "dropout", "deterministic"})

_DROPOUT_FIELDS = [(n, np.uint32) for n in ("dropout_seed_lo", "dropout_seed_hi", "dropout_offset",
                                             "dropout_threshold")] + [("dropout_scale", np.float32)]

# Mirror of Fa2FwdParams in kernels_cu/fa2/params.cuh (same order, C alignment).
FWD_PARAMS = np.dtype(
    pointer_fields("q", "k", "v", "o", "lse", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k")
    + stride_fields("q", "k", "v", "o") + [("row_batch_stride", np.int64), ("row_head_stride", np.int64)]
    + DIMS_FIELDS
    + [("scale_log2", np.float32), ("softcap_pre", np.float32)] + _DROPOUT_FIELDS,
    align=True,
)

BWD_PARAMS = np.dtype(
    pointer_fields("q", "k", "v", "dout", "dq_accum", "dk", "dv", "lse", "dsum", "alibi_slopes", "dq_semaphore",
                   "cu_seqlens_q", "cu_seqlens_k")
    + stride_fields("q", "k", "v", "do", "dk", "dv") + [("row_batch_stride", np.int64), ("row_head_stride", np.int64)]
    + DIMS_FIELDS
    + [("scale_log2", np.float32), ("softcap_pre", np.float32), ("scale", np.float32)] + _DROPOUT_FIELDS,
    align=True,
)


def _feature_defines(dtype: str, softcap: bool, alibi: bool, dropout: bool) -> tuple:
    return (("CUFLASH_DTYPE", DTYPE_CODES[dtype]), ("CUFLASH_SOFTCAP", int(softcap)), ("CUFLASH_ALIBI", int(alibi)),
            ("CUFLASH_DROPOUT", int(dropout)))


def fwd_tiles(headdim: int, softcap: bool = False, alibi: bool = False, dropout: bool = False, sm90: bool = False):
    """The tiles of a forward variant: FA2_TILES_SM90's row on sm_90 (``sm90``) without dropout, else
    FA2_TILES'; except that with all three optional features at once a warp takes one 16-row m-tile instead
    of two (twice the warps): their extra registers (tanh, the ALiBi distance, the Philox state) made ptxas
    spill at d = 128 on sm_80. Q stays in registers (``q_in_regs``) only in the plain variant (no softcap,
    ALiBi or dropout)."""
    t = FA2_TILES_SM90[headdim] if sm90 and not dropout and headdim in FA2_TILES_SM90 else FA2_TILES[headdim]
    if softcap and alibi and dropout and t.block_m // t.warps > 16:
        t = dataclasses.replace(t, warps=t.block_m // 16)
    if t.q_in_regs and (softcap or alibi or dropout):  # Q in registers fits only next to the plain softmax
        t = dataclasses.replace(t, q_in_regs=False)
    return t


def fwd_variant(headdim: int, dtype: str, softcap: bool = False, alibi: bool = False, dropout: bool = False,
                sm90: bool = False) -> Variant:
    """``sm90``: the GPU it runs on is sm_90 (fwd_tiles)."""
    t = fwd_tiles(headdim, softcap, alibi, dropout, sm90)
    swizzled = headdim % 64 == 0
    kv_bytes = 2 * t.kv_stages * smem_tile_bytes(t.block_n, headdim, swizzled)
    smem = smem_tile_bytes(t.block_m, headdim, swizzled) + kv_bytes
    # defined only away from the kernel's default (2 stages), so the other variants keep their names
    non_default = (("CUFLASH_KV_STAGES", t.kv_stages),) if t.kv_stages != 2 else ()
    return Variant(
        FAMILY,
        "fa2/fwd.cu",
        "fa2_fwd",
        (("CUFLASH_HEADDIM", headdim), ("CUFLASH_BLOCK_M", t.block_m), ("CUFLASH_BLOCK_N", t.block_n),
         ("CUFLASH_BLOCK_N_COMPUTE", t.compute_n or t.block_n), ("CUFLASH_WARPS", t.warps),
         ("CUFLASH_Q_REGS", int(t.q_in_regs))) + non_default
        + _feature_defines(dtype, softcap, alibi, dropout),
        threads=t.warps * 32,
        smem_bytes=smem,
    )


def bwd_tiles(headdim: int, softcap: bool = False, alibi: bool = False, dropout: bool = False, sm90: bool = False,
              max_smem: int | None = None):
    """The tiles of a backward variant: when no feature needs extra registers, FA2_BWD_TILES_PLAIN_SM90's
    row on sm_90 (``sm90``), else FA2_BWD_TILES_PLAIN's; otherwise FA2_BWD_TILES's -- and
    FA2_BWD_TILES_SMALL_SMEM's where that row needs more than ``max_smem`` bytes of shared memory per
    block (sm_86 / sm_89: 99 KB)."""
    t = FA2_BWD_TILES[headdim]
    if not (softcap or alibi or dropout):
        if sm90 and headdim in FA2_BWD_TILES_PLAIN_SM90:
            t = FA2_BWD_TILES_PLAIN_SM90[headdim]
        elif headdim in FA2_BWD_TILES_PLAIN:
            t = FA2_BWD_TILES_PLAIN[headdim]
    if max_smem is not None and bwd_smem_bytes(headdim, t) > max_smem and headdim in FA2_BWD_TILES_SMALL_SMEM:
        t = FA2_BWD_TILES_SMALL_SMEM[headdim]
    return t


def bwd_smem_bytes(headdim: int, t) -> int:
    """Dynamic shared memory of a backward block with tiles ``t``: K, V, the Q / dO stages, P, dS, and the
    stages' LSE and D rows."""
    sw_d, sw_n = headdim % 64 == 0, t.block_n % 64 == 0
    return (2 * smem_tile_bytes(t.block_n, headdim, sw_d) + 2 * t.q_stages * smem_tile_bytes(t.block_m, headdim, sw_d)
            + 2 * smem_tile_bytes(t.block_m, t.block_n, sw_n) + 2 * t.q_stages * t.block_m * 4)


def bwd_variant(headdim: int, dtype: str, softcap: bool = False, alibi: bool = False, dropout: bool = False,
                sm90: bool = False, max_smem: int | None = None) -> Variant:
    """The deterministic mode is a run-time choice of the same variant (a dQ semaphore array or none).
    ``sm90``, ``max_smem``: the GPU it runs on (bwd_tiles)."""
    t = bwd_tiles(headdim, softcap, alibi, dropout, sm90, max_smem)
    return Variant(
        FAMILY,
        "fa2/bwd.cu",
        "fa2_bwd",
        (("CUFLASH_HEADDIM", headdim), ("CUFLASH_BLOCK_M", t.block_m), ("CUFLASH_BLOCK_N", t.block_n),
         ("CUFLASH_WARPS", t.warps), ("CUFLASH_QSTAGES", t.q_stages), ("CUFLASH_WARPS_S_M", t.warps_s_m),
         ("CUFLASH_WARPS_KV_N", t.warps_kv_n), ("CUFLASH_WARPS_Q_M", t.warps_q_m), ("CUFLASH_S_SPLIT", t.s_split),
         ("CUFLASH_Q_SPLIT", t.q_split))
        + _feature_defines(dtype, softcap, alibi, dropout),
        threads=t.warps * 32,
        smem_bytes=bwd_smem_bytes(headdim, t),
    )


def all_variants(arch: str = "sm_80") -> list[Variant]:
    """The variants a GPU of ``arch`` runs (the backward's plain tiles differ on sm_90, and where a block
    has less shared memory: _device.ARCH_SMEM_PER_BLOCK)."""
    sm90, max_smem = arch.startswith("sm_90"), ARCH_SMEM_PER_BLOCK.get(arch)
    out = []
    for dtype in DTYPE_CODES:
        for d in HEADDIMS:
            for softcap, alibi, dropout in itertools.product((False, True), repeat=3):
                out.append(fwd_variant(d, dtype, softcap, alibi, dropout, sm90))
                out.append(bwd_variant(d, dtype, softcap, alibi, dropout, sm90, max_smem))
    return out


def _dropout_fields(p, dropout) -> None:
    """``dropout``: None or (p, seed, offset) -> the kernels' Philox key, counter offset and 16-bit bound."""
    if dropout is None:
        return
    prob, seed, offset = dropout
    p["dropout_seed_lo"], p["dropout_seed_hi"] = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    p["dropout_offset"] = offset & 0xFFFFFFFF
    p["dropout_threshold"] = min(int(round(prob * 65536)), 65536)
    p["dropout_scale"] = 1.0 / (1.0 - prob)


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr


def forward(q, k, v, out, lse, dims: Dims, window: tuple[int, int], scale: float, stream, *, softcap: float = 0.0,
            alibi_slopes=None, cu_seqlens=None, dropout=None) -> None:
    """Launch the forward on ``stream``: writes ``out`` (like q) and ``lse`` ((batch, heads, seqlen_q), or
    (heads, total_q) for variable length).

    ``alibi_slopes``: a contiguous float32 array of shape (heads,) or None. ``cu_seqlens``: None, or
    (cu_seqlens_q, cu_seqlens_k) int32 arrays for packed variable-length inputs, with ``dims`` carrying
    the maximum lengths. ``dropout``: None or (p, seed, offset).
    """
    features = (softcap > 0, alibi_slopes is not None, dropout is not None)
    sm90 = compute_capability(device_id())[0] == 9
    variant = fwd_variant(dims.headdim, dims.dtype, *features, sm90)
    cu_q, cu_k = cu_seqlens or (None, None)
    p = np.zeros(1, FWD_PARAMS)
    for name, a in (("q", q), ("k", k), ("v", v), ("o", out), ("lse", lse), ("alibi_slopes", alibi_slopes),
                    ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        p[name] = _ptr(a)
    for name, a in (("q", q), ("k", k), ("v", v), ("o", out)):
        fill_strides(p, name, a)
    fill_row_strides(p, dims, None if cu_q is None else q.shape[0])
    fill_dims(p, dims, window)
    p["scale_log2"], p["softcap_pre"] = logit_scales(scale, softcap)
    _dropout_fields(p, dropout)
    block_m = fwd_tiles(dims.headdim, *features, sm90).block_m
    grid = ((dims.seqlen_q + block_m - 1) // block_m, dims.heads, dims.batch)
    launch(variant, grid, (p,), stream)


def backward(dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, dims: Dims, window, scale: float, stream, *,
             softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False, cu_seqlens=None,
             dropout=None) -> None:
    """Launch preprocess, main and dQ conversion on ``stream``; ``dq_accum`` and ``dsum`` are scratch
    with lse's row layout (times headdim for dq_accum).

    ``deterministic``: dQ contributions are added in a fixed order (bit-identical results run to run).
    ``cu_seqlens``, ``dropout``: as in ``forward``.
    """
    import cupy

    cu_q, cu_k = cu_seqlens or (None, None)
    _bwd_aux.preprocess(out, dout, dq, dq_accum, dsum, _aux_dims(dims, q, cu_q), scale, stream)

    features = (softcap > 0, alibi_slopes is not None, dropout is not None)
    dev = device_id()
    sm90, max_smem = compute_capability(dev)[0] == 9, max_smem_per_block(dev)
    t = bwd_tiles(dims.headdim, *features, sm90, max_smem)
    variant = bwd_variant(dims.headdim, dims.dtype, *features, sm90, max_smem)
    q_blocks = (dims.seqlen_q + t.block_m - 1) // t.block_m
    semaphore = cupy.zeros((dims.batch, dims.heads, q_blocks), dtype=cupy.int32) if deterministic else None
    p = np.zeros(1, BWD_PARAMS)
    arrays = {"q": q, "k": k, "v": v, "dout": dout, "dq_accum": dq_accum, "dk": dk, "dv": dv, "lse": lse,
              "dsum": dsum, "alibi_slopes": alibi_slopes, "dq_semaphore": semaphore, "cu_seqlens_q": cu_q,
              "cu_seqlens_k": cu_k}
    for name, a in arrays.items():
        p[name] = _ptr(a)
    for prefix, a in (("q", q), ("k", k), ("v", v), ("do", dout), ("dk", dk), ("dv", dv)):
        fill_strides(p, prefix, a)
    fill_row_strides(p, dims, None if cu_q is None else q.shape[0])
    fill_dims(p, dims, window)
    p["scale_log2"], p["softcap_pre"] = logit_scales(scale, softcap)
    p["scale"] = scale
    _dropout_fields(p, dropout)
    grid = ((dims.seqlen_k + t.block_n - 1) // t.block_n, dims.kv_heads, dims.batch)
    launch(variant, grid, (p,), stream)

    _bwd_aux.convert_dq(out, dout, dq, dq_accum, dsum, _aux_dims(dims, q, cu_q), scale, stream)


def _aux_dims(dims: Dims, q, cu_q) -> Dims:
    """The row passes see a packed variable-length batch as one sequence of total_q rows."""
    if cu_q is None:
        return dims
    return dataclasses.replace(dims, batch=1, seqlen_q=q.shape[0])
