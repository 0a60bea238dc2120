"""FA1 family: variant keys, parameter structs and launches of kernels_cu/fa1/.

The kernels run on sm_80 and newer (mma.sync on the tensor cores, synchronous tile loads).
"""
from __future__ import annotations

import numpy as np

from . import _bwd_aux
from ._jit import Variant, launch
from ._params import (DIMS_FIELDS, DTYPE_CODES, fill_dims, fill_strides, pointer_fields, smem_tile_bytes,
                      stride_fields)
from ._validate import Dims
from .heuristics import FA1_TILES

FAMILY = "fa1"
HEADDIMS = tuple(sorted(FA1_TILES))
MIN_CC = (8, 0)
FWD_FEATURES = frozenset({"causal", "window", "gqa"})
BWD_FEATURES = FWD_FEATURES

# Mirrors of Fa1FwdParams / Fa1BwdParams in kernels_cu/fa1/params.cuh (same order, C alignment).
FWD_PARAMS = np.dtype(
    pointer_fields("q", "k", "v", "o", "lse") + stride_fields("q", "k", "v", "o") + DIMS_FIELDS
    + [("scale", np.float32)],
    align=True,
)
BWD_PARAMS = np.dtype(
    pointer_fields("q", "k", "v", "dout", "dq_accum", "dk", "dv", "lse", "dsum")
    + stride_fields("q", "k", "v", "do", "dk", "dv")
    + DIMS_FIELDS
    + [("scale", np.float32)],
    align=True,
)



def fwd_variant(headdim: int, dtype: str) -> Variant:
    t = FA1_TILES[headdim]
    smem = smem_tile_bytes(t.block_m, headdim) + 2 * smem_tile_bytes(t.block_n, headdim)
    return Variant(
        FAMILY,
        "fa1/fwd.cu",
        "fa1_fwd",
        (("CUFLASH_HEADDIM", headdim), ("CUFLASH_BLOCK_M", t.block_m), ("CUFLASH_BLOCK_N", t.block_n),
         ("CUFLASH_DTYPE", DTYPE_CODES[dtype])),
        threads=t.block_m // 16 * 32,
        smem_bytes=smem,
    )


def bwd_variant(headdim: int, dtype: str) -> Variant:
    t = FA1_TILES[headdim]
    block = 16 * t.bwd_key_warps
    smem = 4 * smem_tile_bytes(block, headdim) + smem_tile_bytes(block, block) + 2 * 4 * block
    return Variant(
        FAMILY,
        "fa1/bwd.cu",
        "fa1_bwd",
        (("CUFLASH_HEADDIM", headdim), ("CUFLASH_KEY_WARPS", t.bwd_key_warps), ("CUFLASH_D_SPLIT", t.bwd_d_split),
         ("CUFLASH_DTYPE", DTYPE_CODES[dtype])),
        threads=t.bwd_key_warps * t.bwd_d_split * 32,
        smem_bytes=smem,
    )


def all_variants() -> list[Variant]:
    """Every FA1 variant cuflash can launch (the compile report builds each of them)."""
    out = []
    for dtype in DTYPE_CODES:
        for d in HEADDIMS:
            out += [fwd_variant(d, dtype), bwd_variant(d, dtype)]
    return out


def forward(q, k, v, out, lse, dims: Dims, window: tuple[int, int], scale: float, stream) -> None:
    """Launch the forward on ``stream``: writes ``out`` (like q) and ``lse`` (batch, heads, seqlen_q)."""
    variant = fwd_variant(dims.headdim, dims.dtype)
    p = np.zeros(1, FWD_PARAMS)
    for name, a in (("q", q), ("k", k), ("v", v), ("o", out), ("lse", lse)):
        p[name] = a.data.ptr
    for name, a in (("q", q), ("k", k), ("v", v), ("o", out)):
        fill_strides(p, name, a)
    fill_dims(p, dims, window)
    p["scale"] = scale
    block_m = FA1_TILES[dims.headdim].block_m
    grid = ((dims.seqlen_q + block_m - 1) // block_m, dims.heads, dims.batch)
    launch(variant, grid, (p,), stream)


def backward(dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, dims: Dims, window, scale: float, stream) -> None:
    """Launch preprocess, main and dQ conversion on ``stream``; ``dq_accum`` and ``dsum`` are scratch."""
    _bwd_aux.preprocess(out, dout, dq, dq_accum, dsum, dims, scale, stream)

    p = np.zeros(1, BWD_PARAMS)
    arrays = {"q": q, "k": k, "v": v, "dout": dout, "dq_accum": dq_accum, "dk": dk, "dv": dv, "lse": lse,
              "dsum": dsum}
    for name, a in arrays.items():
        p[name] = a.data.ptr
    for prefix, a in (("q", q), ("k", k), ("v", v), ("do", dout), ("dk", dk), ("dv", dv)):
        fill_strides(p, prefix, a)
    fill_dims(p, dims, window)
    p["scale"] = scale
    main = bwd_variant(dims.headdim, dims.dtype)
    block_n = 16 * FA1_TILES[dims.headdim].bwd_key_warps
    grid = ((dims.seqlen_k + block_n - 1) // block_n, dims.kv_heads, dims.batch)
    launch(main, grid, (p,), stream)

    _bwd_aux.convert_dq(out, dout, dq, dq_accum, dsum, dims, scale, stream)
