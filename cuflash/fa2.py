"""FA2 family: variant keys, parameter structs and launches of kernels_cu/fa2/.

sm_80 and newer: mma.sync tensor cores fed by cp.async double-buffered, swizzled shared memory.
This slice has the forward; the backward still runs on the FA1 kernels.
"""
from __future__ import annotations

import math

import numpy as np

from ._jit import Variant, get_function
from ._params import DIMS_FIELDS, DTYPE_CODES, fill_dims, fill_strides, pointer_fields, smem_tile_bytes, stride_fields
from ._validate import Dims
from .heuristics import FA2_TILES

FAMILY = "fa2"
HEADDIMS = tuple(sorted(FA2_TILES))
MIN_CC = (8, 0)
FWD_FEATURES = frozenset({"causal", "window", "gqa", "softcap", "alibi"})
BWD_FEATURES = None  # no FA2 backward yet: flash_attn_backward runs FA1

# Mirror of Fa2FwdParams in kernels_cu/fa2/params.cuh (same order, C alignment).
FWD_PARAMS = np.dtype(
    pointer_fields("q", "k", "v", "o", "lse", "alibi_slopes") + stride_fields("q", "k", "v", "o") + DIMS_FIELDS
    + [("scale_log2", np.float32), ("softcap_pre", np.float32)],
    align=True,
)

LOG2E = 1.0 / math.log(2.0)


def fwd_variant(headdim: int, dtype: str, softcap: bool = False, alibi: bool = False) -> Variant:
    t = FA2_TILES[headdim]
    swizzled = headdim % 64 == 0
    smem = smem_tile_bytes(t.block_m, headdim, swizzled) + 4 * smem_tile_bytes(t.block_n, headdim, swizzled)
    return Variant(
        FAMILY,
        "fa2/fwd.cu",
        "fa2_fwd",
        (("CUFLASH_HEADDIM", headdim), ("CUFLASH_BLOCK_M", t.block_m), ("CUFLASH_BLOCK_N", t.block_n),
         ("CUFLASH_BLOCK_N_COMPUTE", t.compute_n or t.block_n), ("CUFLASH_WARPS", t.warps), ("CUFLASH_DTYPE", DTYPE_CODES[dtype]), ("CUFLASH_SOFTCAP", int(softcap)),
         ("CUFLASH_ALIBI", int(alibi))),
        threads=t.warps * 32,
        smem_bytes=smem,
    )


def all_variants() -> list[Variant]:
    return [fwd_variant(d, dtype, softcap, alibi) for dtype in DTYPE_CODES for d in HEADDIMS
            for softcap in (False, True) for alibi in (False, True)]


def forward(q, k, v, out, lse, dims: Dims, window: tuple[int, int], scale: float, stream, *, softcap: float = 0.0,
            alibi_slopes=None) -> None:
    """Launch the forward on ``stream``: writes ``out`` (like q) and ``lse`` (batch, heads, seqlen_q).

    ``alibi_slopes``: a contiguous float32 array of shape (heads,) or None.
    """
    variant = fwd_variant(dims.headdim, dims.dtype, softcap > 0, alibi_slopes is not None)
    p = np.zeros(1, FWD_PARAMS)
    for name, a in (("q", q), ("k", k), ("v", v), ("o", out), ("lse", lse)):
        p[name] = a.data.ptr
    p["alibi_slopes"] = 0 if alibi_slopes is None else alibi_slopes.data.ptr
    for name, a in (("q", q), ("k", k), ("v", v), ("o", out)):
        fill_strides(p, name, a)
    fill_dims(p, dims, window)
    if softcap > 0:
        p["scale_log2"] = softcap * LOG2E
        p["softcap_pre"] = scale / softcap
    else:
        p["scale_log2"] = scale * LOG2E
    block_m = FA2_TILES[dims.headdim].block_m
    grid = ((dims.seqlen_q + block_m - 1) // block_m, dims.heads, dims.batch)
    get_function(variant)(grid, (variant.threads,), (p,), shared_mem=variant.smem_bytes, stream=stream)
