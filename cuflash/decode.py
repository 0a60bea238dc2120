"""Decode family (flash_attn_with_kvcache): variant keys, parameter structs and launches of kernels_cu/decode/.

sm_80 and newer. Three kernels, launched in this order on the caller's stream:
  * ``kv_append`` / ``q_rotary`` (decode/append.cu): the new k/v written into the cache (rotary applied
    to k) and q rotated into a scratch copy, when the call has them;
  * ``decode_fwd`` (decode/fwd.cu): grid (num_splits x m_blocks, kv_heads, batch); one thread block
    holds 16 query rows (the query heads of one KV head x the queries) and streams its share of the
    cache's keys through a cp.async ring; writes O and LSE directly (one split) or fp32 partials;
  * ``attn_combine`` (decode/combine.cu): merges the partials by their LSE (also ``flash_attn_combine``).
    After the split kernel it is launched as that kernel's programmatic dependent on sm_90+
    (``_jit.launch_dependent``): ``decode_fwd`` triggers its dependents as it starts and the combine's
    blocks wait (griddepcontrol.wait) for it to complete before reading the partials, so the combine's
    launch hides behind the split kernel's run instead of following it (at batch 1 x 32k keys the
    split kernel takes ~35.5 us of a ~40 us call). Under CUDA-graph capture the pair becomes a
    programmatic edge. Below sm_90, and from ``flash_attn_combine``, it is an ordinary launch.
"""
from __future__ import annotations

import contextvars
import math

import numpy as np

from ._jit import Variant, launch, launch_dependent
from ._params import DTYPE_CODES, pointer_fields, stride_fields
from ._validate import KvDims
from ._device import ARCH_SMEM_PER_BLOCK
from .heuristics import DECODE_BLOCK_M, DECODE_TILES, DECODE_TILES_SMALL_SMEM, DecodeTiles

FAMILY = "decode"
HEADDIMS = tuple(sorted(DECODE_TILES))
MIN_CC = (8, 0)
AUX_THREADS = 128  # kv_append, q_rotary, attn_combine: one warp per row
LOG2E = 1.0 / math.log(2.0)
COMBINE_DTYPE_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}  # CUFLASH_OUT_DTYPE of decode/combine.cu

_I32 = np.int32
# Mirror of DecodeParams in kernels_cu/decode/params.cuh (same order, C alignment).
FWD_PARAMS = np.dtype(
    pointer_fields("q", "k", "v", "o", "lse", "o_partial", "lse_partial", "cache_seqlens", "page_table",
                   "cache_batch_idx")
    + stride_fields("q", "k", "v", "o") + [("page_table_stride", np.int64)]
    + [(n, _I32) for n in ("batch", "heads", "kv_heads", "seqlen_q", "seqlen_new", "page_size", "num_splits",
                           "m_blocks", "window_left", "window_right")]
    + [("scale_log2", np.float32), ("softcap_pre", np.float32)],
    align=True,
)

# Mirror of AppendParams in kernels_cu/decode/params.cuh.
APPEND_PARAMS = np.dtype(
    pointer_fields("k_new", "v_new", "k_cache", "v_cache", "q", "q_rot", "rotary_cos", "rotary_sin", "cache_seqlens",
                   "page_table", "cache_batch_idx")
    + stride_fields("kn", "vn", "kc", "vc", "q", "qr") + [("page_table_stride", np.int64), ("rotary_stride", np.int64)]
    + [(n, _I32) for n in ("batch", "seqlen_new", "seqlen_q", "heads", "kv_heads", "headdim", "rotary_dim",
                           "page_size", "q_position_step", "interleaved")],
    align=True,
)

# Mirror of CombineParams in kernels_cu/decode/combine.cu.
COMBINE_PARAMS = np.dtype(
    pointer_fields("o_partial", "lse_partial", "o", "lse")
    + [(f"op_{s}_stride", np.int64) for s in ("split", "batch", "row", "head")]
    + [(f"lp_{s}_stride", np.int64) for s in ("split", "batch", "head", "row")]
    + stride_fields("o")
    + [(n, _I32) for n in ("num_splits", "batch", "seqlen", "heads", "headdim")],
    align=True,
)


# ----------------------------------------------------------------------------------------------------
# caller-provided scratch (flash_attn_with_kvcache(workspace=...)): no allocation inside a captured call

WORKSPACE_ALIGN = 256  # every part starts 256 bytes after the previous one's start, rounded up
_ITEMSIZE = {"float32": 4, "int32": 4, "bfloat16": 2, "float16": 2}


def _itemsize(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    return size if size is not None else np.dtype(dtype).itemsize


def workspace_layout(batch: int, seqlen_q: int, heads: int, headdim: int, num_splits: int, dtype: str, *,
                     rotary: bool = False, seqlens_vector: bool = False):
    """The scratch arrays one decode call needs, carved in this order from a workspace buffer:
    ``[(name, byte offset, shape, dtype name)]`` and the total bytes.

    * ``lse`` float32 (batch, heads, seqlen_q): always (the kernels write it; returned with
      return_softmax_lse=True);
    * ``o_partial`` float32 (num_splits, batch, seqlen_q, heads, headdim) and ``lse_partial`` float32
      (num_splits, batch, heads, seqlen_q): when num_splits > 1;
    * ``q_rot`` (q's shape and dtype): with rotary_cos/sin;
    * ``cache_seqlens`` int32 (batch,): when cache_seqlens is a Python int.
    """
    parts = [("lse", (batch, heads, seqlen_q), "float32")]
    if num_splits > 1:
        parts += [("o_partial", (num_splits, batch, seqlen_q, heads, headdim), "float32"),
                  ("lse_partial", (num_splits, batch, heads, seqlen_q), "float32")]
    if rotary:
        parts.append(("q_rot", (batch, seqlen_q, heads, headdim), dtype))
    if seqlens_vector:
        parts.append(("cache_seqlens", (batch,), "int32"))
    layout, offset = [], 0
    for name, shape, dt in parts:
        layout.append((name, offset, shape, dt))
        offset += -(-math.prod(shape) * _itemsize(dt) // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
    return layout, offset


def check_workspace(ws, q, need: int, what: str) -> None:
    """``ws`` (a Spec): contiguous device memory on q's device, 16-byte aligned, at least ``need`` bytes.
    Only shapes are read (no synchronisation)."""
    strides, acc = [], 1
    for n in reversed(ws.shape):
        strides.append(acc)
        acc *= n
    if any(n > 1 and s != want for n, s, want in zip(ws.shape, ws.strides, reversed(strides))):
        raise ValueError(f"workspace must be contiguous; got shape {tuple(ws.shape)} with strides {tuple(ws.strides)} "
                         "in elements")
    if ws.ptr % 16:
        raise ValueError(f"workspace must start at a 16-byte aligned address; got {ws.ptr:#x}")
    if ws.device != q.device:
        raise ValueError(f"workspace is on CUDA device {ws.device} but q is on device {q.device}")
    have = math.prod(ws.shape) * _itemsize(ws.dtype)
    if have < need:
        raise ValueError(f"workspace holds {have} bytes but this call needs {need} ({what}); size it with "
                         "cuflash.api.kvcache_workspace_bytes(...)")


def carve(ws, layout, q_dtype) -> dict:
    """CuPy views of ``layout``'s parts inside the CuPy array ``ws`` (q_rot takes q's dtype)."""
    import cupy

    return {name: cupy.ndarray(shape, dtype=q_dtype if name == "q_rot" else dt, memptr=ws.data + offset)
            for name, offset, shape, dt in layout}


# Static shared memory of decode_fwd beside its dynamic ring, at most (warp maxima and sums, the paged ring of
# page-table entries: 2.5 KB at 4 stages of 64 keys): counted when tiles are fitted to a device's limit.
STATIC_SMEM_BOUND = 4096


def _fits(headdim: int, stages: int, block_n: int, max_smem: int | None) -> bool:
    """Whether decode_fwd with this ring fits ``max_smem`` bytes of shared memory per block (None: any)."""
    return max_smem is None or fwd_smem_bytes(headdim, stages, block_n) + STATIC_SMEM_BOUND <= max_smem


def tiles(headdim: int, max_smem: int | None = None) -> DecodeTiles:
    """heuristics.DECODE_TILES' row for ``headdim``, or DECODE_TILES_SMALL_SMEM's where that needs more
    than ``max_smem`` bytes of shared memory per block (sm_86 / sm_89: 99 KB)."""
    t = DECODE_TILES[headdim]
    return t if _fits(headdim, t.stages, t.block_n, max_smem) else DECODE_TILES_SMALL_SMEM.get(headdim, t)


def fwd_stages(headdim: int, paged: bool, one_wave: bool, max_smem: int | None = None) -> int:
    """The cp.async ring's depth: DecodeTiles.paged_wave_stages for a paged cache whose grid is at most
    one block per SM (where it fits ``max_smem``), else the tiles' stages."""
    t = tiles(headdim, max_smem)
    deep = t.paged_wave_stages if paged and one_wave else 0
    if deep and _fits(headdim, deep, t.block_n, max_smem):
        return deep
    return t.stages


def fwd_smem_bytes(headdim: int, stages: int, block_n: int) -> int:
    return DECODE_BLOCK_M * headdim * 2 + 2 * stages * block_n * headdim * 2


def fwd_threads(headdim: int, max_smem: int | None = None) -> int:
    """decode_fwd's block: one warp per 16 keys of a tile."""
    return tiles(headdim, max_smem).block_n // 16 * 32


def fwd_variant(headdim: int, dtype: str, paged: bool, one_wave: bool = False, max_smem: int | None = None) -> Variant:
    """``one_wave``: the grid has at most one block per SM (fwd_stages). ``max_smem``: the device's shared
    memory per block (tiles)."""
    t = tiles(headdim, max_smem)
    stages = fwd_stages(headdim, paged, one_wave, max_smem)
    return Variant(
        FAMILY, "decode/fwd.cu", "decode_fwd",
        (("CUFLASH_HEADDIM", headdim), ("CUFLASH_BLOCK_N", t.block_n), ("CUFLASH_STAGES", stages),
         ("CUFLASH_COPY_CHUNKS", t.paged_copy_chunks if paged else t.copy_chunks),
         ("CUFLASH_PAGED", int(paged)), ("CUFLASH_DTYPE", DTYPE_CODES[dtype])),
        threads=fwd_threads(headdim, max_smem), smem_bytes=fwd_smem_bytes(headdim, stages, t.block_n),
    )


def append_variant(kernel: str, dtype: str) -> Variant:
    """``kv_append`` or ``q_rotary``; head dim, paging and the rotary convention are run-time values."""
    return Variant(FAMILY, "decode/append.cu", kernel, (("CUFLASH_DTYPE", DTYPE_CODES[dtype]),), threads=AUX_THREADS)


def combine_variant(out_dtype: str) -> Variant:
    return Variant(FAMILY, "decode/combine.cu", "attn_combine", (("CUFLASH_OUT_DTYPE", COMBINE_DTYPE_CODES[out_dtype]),),
                   threads=AUX_THREADS)


def all_variants(arch: str = "sm_80") -> list[Variant]:
    """The variants a GPU of ``arch`` runs (tiles fitted to its shared memory: _device.ARCH_SMEM_PER_BLOCK)."""
    max_smem = ARCH_SMEM_PER_BLOCK.get(arch)
    fwd = {fwd_variant(d, dtype, paged, one_wave, max_smem): None for dtype in DTYPE_CODES for d in HEADDIMS
           for paged in (False, True) for one_wave in (False, True)}
    out = list(fwd)
    out += [append_variant(k, dtype) for dtype in DTYPE_CODES for k in ("kv_append", "q_rotary")]
    out += [combine_variant(t) for t in COMBINE_DTYPE_CODES]
    return out


def m_blocks(dims: KvDims) -> int:
    return -(-(dims.heads // dims.kv_heads) * dims.seqlen_q // DECODE_BLOCK_M)


# While set (decode_plan.py), the launches a call issues are also appended here as (variant, grid, params
# struct, dependent): a plan records one call's launches and re-issues them with new addresses.
recorded_launches: contextvars.ContextVar = contextvars.ContextVar("cuflash_decode_launches", default=None)


def _issue(variant: Variant, grid: tuple[int, ...], params: np.ndarray, stream, dependent: bool = False) -> None:
    """Launch ``variant`` with its one params struct (``dependent``: as the programmatic dependent of the
    kernel before it, launch_dependent), recording it for a plan when one is recording."""
    record = recorded_launches.get()
    if record is not None:
        record.append((variant, tuple(grid), params.copy(), dependent))
    (launch_dependent if dependent else launch)(variant, grid, (params,), stream)


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr


_STRIDE_NAMES: dict = {}


def _strides(fields: dict, prefix: str, a, axes=("batch", "row", "head")) -> None:
    """``a``'s strides in elements into ``fields`` as <prefix>_<axis>_stride."""
    names = _STRIDE_NAMES.get((prefix, axes))
    if names is None:
        names = _STRIDE_NAMES[prefix, axes] = tuple(f"{prefix}_{axis}_stride" for axis in axes)
    item, strides = a.dtype.itemsize, a.strides
    for axis, name in enumerate(names):
        fields[name] = strides[axis] // item


def _row_stride(a) -> int:
    return 0 if a is None else a.strides[0] // a.dtype.itemsize


def _struct(dtype: np.dtype, fields: dict) -> np.ndarray:
    """A one-element array of the params struct ``dtype`` holding ``fields`` (0 for the others), written in
    one assignment: a numpy field write costs about a microsecond of Python, and a decode call has ~60."""
    p = np.zeros(1, dtype)
    p[0] = tuple(fields.get(name, 0) for name in dtype.names)
    return p


def append(q, k_cache, v_cache, k, v, q_rot, cache_seqlens, page_table, cache_batch_idx, rotary_cos, rotary_sin,
           dims: KvDims, interleaved: bool, q_position_step: int, stream) -> None:
    """Write k/v (rotary applied to k) into the caches at cache_seqlens; rotate q into ``q_rot``.
    Either part is skipped when it has nothing to do (no k/v; no rotary)."""
    f = {name: _ptr(a) for name, a in (
        ("k_new", k), ("v_new", v), ("k_cache", k_cache), ("v_cache", v_cache), ("q", q), ("q_rot", q_rot),
        ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_seqlens", cache_seqlens),
        ("page_table", page_table), ("cache_batch_idx", cache_batch_idx))}
    for prefix, a in (("kn", k), ("vn", v), ("kc", k_cache), ("vc", v_cache), ("q", q), ("qr", q_rot)):
        if a is not None:
            _strides(f, prefix, a)
    f["page_table_stride"], f["rotary_stride"] = _row_stride(page_table), _row_stride(rotary_cos)
    f["batch"], f["seqlen_new"], f["seqlen_q"] = dims.batch, dims.seqlen_new, dims.seqlen_q
    f["heads"], f["kv_heads"], f["headdim"] = dims.heads, dims.kv_heads, dims.headdim
    f["rotary_dim"] = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    f["page_size"] = dims.page_size
    f["q_position_step"], f["interleaved"] = q_position_step, int(interleaved)
    p = _struct(APPEND_PARAMS, f)
    rows_per_block = AUX_THREADS // 32
    if k is not None and dims.seqlen_new:
        rows = dims.batch * dims.seqlen_new * dims.kv_heads
        _issue(append_variant("kv_append", dims.dtype), (-(-rows // rows_per_block),), p, stream)
    if q_rot is not None:
        rows = dims.batch * dims.seqlen_q * dims.heads
        _issue(append_variant("q_rotary", dims.dtype), (-(-rows // rows_per_block),), p, stream)


def forward(q, k_cache, v_cache, out, lse, cache_seqlens, page_table, cache_batch_idx, dims: KvDims,
            window: tuple[int, int], scale: float, softcap: float, num_splits: int, num_sms: int, stream, *,
            o_partial=None, lse_partial=None, max_smem: int | None = None) -> None:
    """Attention of q over the cache (which already holds the new tokens). ``num_splits == 1`` writes
    ``out``/``lse`` directly; otherwise the kernel writes ``o_partial`` (num_splits, batch, seqlen_q,
    heads, d) and ``lse_partial`` (num_splits, batch, heads, seqlen_q), fp32 scratch, and the combine
    kernel merges them into out/lse. ``num_sms``, ``max_smem``: the device's SM count (fwd_stages) and
    shared memory per block (tiles)."""
    grid = (num_splits * m_blocks(dims), dims.kv_heads, dims.batch)
    variant = fwd_variant(dims.headdim, dims.dtype, dims.paged, math.prod(grid) <= num_sms, max_smem)
    f = {name: _ptr(a) for name, a in (
        ("q", q), ("k", k_cache), ("v", v_cache), ("o", out), ("lse", lse), ("o_partial", o_partial),
        ("lse_partial", lse_partial), ("cache_seqlens", cache_seqlens), ("page_table", page_table),
        ("cache_batch_idx", cache_batch_idx))}
    for prefix, a in (("q", q), ("k", k_cache), ("v", v_cache), ("o", out)):
        _strides(f, prefix, a)
    f["page_table_stride"] = _row_stride(page_table)
    f["batch"], f["heads"], f["kv_heads"] = dims.batch, dims.heads, dims.kv_heads
    f["seqlen_q"], f["seqlen_new"], f["page_size"] = dims.seqlen_q, dims.seqlen_new, dims.page_size
    f["num_splits"], f["m_blocks"] = num_splits, grid[0] // num_splits
    f["window_left"], f["window_right"] = window
    if softcap > 0:
        f["scale_log2"], f["softcap_pre"] = softcap * LOG2E, scale / softcap
    else:
        f["scale_log2"], f["softcap_pre"] = scale * LOG2E, 0.0
    _issue(variant, grid, _struct(FWD_PARAMS, f), stream)
    if num_splits > 1:
        combine(o_partial, lse_partial, out, lse, stream, after_split=True)


def combine(o_partial, lse_partial, out, lse, stream, *, after_split: bool = False) -> None:
    """out (batch, seqlen, heads, d) in its dtype and lse (batch, heads, seqlen) from the partials.

    ``after_split``: the partials are being written by the kernel launched just before on ``stream``
    (decode_fwd): launch as its programmatic dependent. Otherwise (flash_attn_combine) an ordinary launch."""
    ns, b, s, h, d = o_partial.shape
    f = {"o_partial": o_partial.data.ptr, "lse_partial": lse_partial.data.ptr, "o": out.data.ptr, "lse": lse.data.ptr,
         "num_splits": ns, "batch": b, "seqlen": s, "heads": h, "headdim": d}
    _strides(f, "op", o_partial, ("split", "batch", "row", "head"))
    _strides(f, "lp", lse_partial, ("split", "batch", "head", "row"))
    _strides(f, "o", out)
    p = _struct(COMBINE_PARAMS, f)
    grid = (-(-b * s * h // (AUX_THREADS // 32)),)  # one warp per row
    _issue(combine_variant(str(out.dtype)), grid, p, stream, dependent=after_split)
