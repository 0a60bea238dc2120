"""Argument checks, run before any kernel: every refusal names the argument and what was expected.

They work on ``Spec`` records (shape, strides, dtype, device, pointer), so the CPU test tier can
exercise every message without device memory.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

from ._interop import Spec

FLOAT16_DTYPES = ("bfloat16", "float16")
FP8_DTYPES = ("uint8",)  # FP8 e4m3 data travels as its bytes: CuPy and DLPack have no fp8 dtype
_DTYPES_WANTED = {FLOAT16_DTYPES: "float16 or bfloat16", FP8_DTYPES: "uint8 (FP8 e4m3 bytes)"}
_ITEM_BYTES = {"bfloat16": 2, "float16": 2, "uint8": 1}
_ALIGN_BYTES = 16  # kernels move 16-byte vectors: row starts must be 16-byte aligned
_MAX_GRID_YZ = 65535  # heads and batch are grid dimensions y and z
_MAX_SEQLEN = 2 ** 30 - 1  # the kernels' mask arithmetic (row + diag + right) stays in int32 below 2^30


@dataclasses.dataclass(frozen=True)
class Dims:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    headdim: int  # of q and k
    dtype: str
    headdim_v: int | None = None  # of v and out, where it differs from headdim (FA3's forward only)

    @property
    def dv(self) -> int:
        return self.headdim if self.headdim_v is None else self.headdim_v


def _shape_str(spec: Spec) -> str:
    return "(" + ", ".join(str(s) for s in spec.shape) + ")"


def check_layout(spec: Spec, packed: bool = False, dtypes: tuple = FLOAT16_DTYPES) -> None:
    """Rank 4 (batch, seqlen, heads, headdim) — or 3 (total_tokens, heads, headdim) when ``packed`` —
    a dtype of ``dtypes`` (FLOAT16_DTYPES, or FP8_DTYPES for FP8 attention), last dim contiguous, 16-byte
    aligned rows."""
    rank, what = (3, "(total_tokens, heads, headdim)") if packed else (4, "(batch, seqlen, heads, headdim)")
    if len(spec.shape) != rank:
        raise ValueError(f"{spec.name} must have {rank} dimensions {what}; got shape {_shape_str(spec)}")
    if spec.dtype not in dtypes:
        raise TypeError(f"{spec.name} must be {_DTYPES_WANTED[dtypes]}; got {spec.dtype}")
    if spec.shape[-1] > 1 and spec.strides[-1] != 1:
        raise ValueError(
            f"{spec.name}'s last dimension (headdim) must be contiguous (stride 1); got strides "
            f"{spec.strides} in elements. Make it contiguous first (cupy.ascontiguousarray / .contiguous())."
        )
    item = _ITEM_BYTES[spec.dtype]
    axes = ((0, "tokens"), (1, "heads")) if packed else ((0, "batch"), (1, "seqlen"), (2, "heads"))
    for axis, what in axes:
        if spec.shape[axis] > 1 and (spec.strides[axis] * item) % _ALIGN_BYTES:
            raise ValueError(
                f"{spec.name}'s {what} stride must be a multiple of 16 bytes ({_ALIGN_BYTES // item} elements); got "
                f"{spec.strides[axis]} elements (strides {spec.strides}). Make it contiguous first."
            )
    if spec.ptr % _ALIGN_BYTES:
        raise ValueError(
            f"{spec.name}'s data must start at a 16-byte aligned address; got {spec.ptr:#x} "
            f"(a slice that starts mid-row?). Make a contiguous copy first."
        )


def check_same_device(specs: list[Spec]) -> None:
    first = specs[0]
    for s in specs[1:]:
        if s.device != first.device:
            raise ValueError(f"{s.name} is on CUDA device {s.device} but {first.name} is on device {first.device}")


def check_qkv(q: Spec, k: Spec, v: Spec, dtypes: tuple = FLOAT16_DTYPES) -> Dims:
    for s in (q, k, v):
        check_layout(s, dtypes=dtypes)
    check_same_device([q, k, v])
    for s in (k, v):
        if s.dtype != q.dtype:
            raise TypeError(f"{s.name} must have the dtype of q ({q.dtype}); got {s.dtype}")
    b, sq, h, d = q.shape
    if k.shape[:3] != v.shape[:3]:  # (v's head dim may differ: which impls take that is theirs to say)
        raise ValueError(f"k and v must have the same shape; got k {_shape_str(k)} and v {_shape_str(v)}")
    bk, sk, hk, dk = k.shape
    if bk != b:
        raise ValueError(f"k must have q's batch size {b}; got {bk} (q {_shape_str(q)}, k {_shape_str(k)})")
    if dk != d:
        raise ValueError(f"k must have q's head dim {d}; got {dk}")
    if hk < 1 or h % hk:
        raise ValueError(
            f"the number of query heads ({h}) must be a multiple of the number of KV heads in k/v ({hk})"
        )
    if b < 1 or h < 1:
        raise ValueError(f"q must have at least one batch entry and one head; got shape {_shape_str(q)}")
    if sq < 1:
        raise ValueError(f"seqlen_q must be at least 1; got q of shape {_shape_str(q)} (empty sequences)")
    if sk < 1:
        raise ValueError(f"seqlen_k must be at least 1; got k of shape {_shape_str(k)} (empty sequences)")
    dv = v.shape[3]
    dims = Dims(b, sq, sk, h, hk, d, q.dtype, None if dv == d else dv)
    check_launch_limits(dims)
    return dims


def check_v_headdim_is_q_s(dims: Dims, what: str) -> None:
    """``what`` (a backward, FP8 attention) needs v's head dim to be q and k's."""
    if dims.headdim_v is not None:
        raise ValueError(f"v's head dim {dims.headdim_v} differs from q and k's {dims.headdim}: {what} needs them "
                         "equal (only the FA3 forward takes a different one: cuflash.fa3.FWD_HEADDIM_V)")


def check_like(spec: Spec, ref: Spec, packed: bool = False) -> None:
    """``spec`` (dout, out) must match ``ref`` (q) in shape, dtype and device."""
    check_layout(spec, packed)
    if spec.shape != ref.shape:
        raise ValueError(f"{spec.name} must have the shape of {ref.name} {_shape_str(ref)}; got {_shape_str(spec)}")
    if spec.dtype != ref.dtype:
        raise TypeError(f"{spec.name} must have the dtype of {ref.name} ({ref.dtype}); got {spec.dtype}")
    check_same_device([ref, spec])


def check_lse(spec: Spec, dims: Dims, q: Spec) -> None:
    want = (dims.batch, dims.heads, dims.seqlen_q)
    if spec.shape != want:
        raise ValueError(f"lse must have shape (batch, heads, seqlen_q) = {want}; got {_shape_str(spec)}")
    if spec.dtype != "float32":
        raise TypeError(f"lse must be float32; got {spec.dtype}")
    if spec.strides != (dims.heads * dims.seqlen_q, dims.seqlen_q, 1):
        raise ValueError(f"lse must be contiguous; got strides {spec.strides} in elements")
    check_same_device([q, spec])


def check_headdim(headdim: int, supported, impl: str) -> None:
    if headdim not in supported:
        raise ValueError(f"head dim {headdim} is not supported by impl={impl!r}; supported: {sorted(supported)}")


def softmax_scale_or_default(softmax_scale, headdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None; got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite positive number; got {softmax_scale}")
    return float(softmax_scale)


def window_bounds(window_size, causal: bool, dims: Dims) -> tuple[int, int]:
    """(left, right) for the kernels, -1 ("unbounded") replaced by a bound that reaches every key."""
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)
    ):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 = unbounded; got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded); got {tuple(window_size)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    # A window wider than the sequence is unbounded: left = seqlen_k already reaches key 0 from every row
    # and right = seqlen_q the last key. Clamping there keeps row + diag + right < 2^31 in the kernels'
    # int32 arithmetic for any seqlen below 2^30.
    left = dims.seqlen_k if left < 0 else min(left, dims.seqlen_k)
    right = dims.seqlen_q if right < 0 else min(right, dims.seqlen_q)
    if causal:
        right = 0
    return left, right


def softcap_value(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float (0 = off); got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off); got {softcap}")
    return float(softcap)


def check_alibi_slopes(spec: Spec, dims: Dims, q: Spec) -> None:
    if spec.shape != (dims.heads,):
        raise ValueError(f"alibi_slopes must have shape (heads,) = ({dims.heads},); got {_shape_str(spec)}")
    if spec.dtype != "float32":
        raise TypeError(f"alibi_slopes must be float32; got {spec.dtype}")
    if spec.strides != (1,):
        raise ValueError(f"alibi_slopes must be contiguous; got stride {spec.strides[0]}")
    check_same_device([q, spec])


def check_varlen(q: Spec, k: Spec, v: Spec, cu_q: Spec, cu_k: Spec, max_seqlen_q, max_seqlen_k) -> Dims:
    """Packed variable-length inputs: q (total_q, heads, d), k/v (total_k, kv_heads, d), cu_seqlens
    int32 (batch + 1,). Returns Dims with the batch size and the maximum lengths."""
    for s in (q, k, v):
        check_layout(s, packed=True)
    check_same_device([q, k, v, cu_q, cu_k])
    for s in (k, v):
        if s.dtype != q.dtype:
            raise TypeError(f"{s.name} must have the dtype of q ({q.dtype}); got {s.dtype}")
    if k.shape[:2] != v.shape[:2]:  # (v's head dim may differ: which impls take that is theirs to say)
        raise ValueError(f"k and v must have the same shape; got k {_shape_str(k)} and v {_shape_str(v)}")
    _, h, d = q.shape
    _, hk, dk = k.shape
    if h < 1:
        raise ValueError(f"q must have at least one head; got shape {_shape_str(q)}")
    if dk != d:
        raise ValueError(f"k must have q's head dim {d}; got {dk}")
    if hk < 1 or h % hk:
        raise ValueError(f"the number of query heads ({h}) must be a multiple of the number of KV heads in k/v ({hk})")
    for cu in (cu_q, cu_k):
        if cu.dtype != "int32":
            raise TypeError(f"{cu.name} must be int32; got {cu.dtype}")
        if len(cu.shape) != 1 or cu.shape[0] < 2:
            raise ValueError(f"{cu.name} must be a 1-D array of batch + 1 >= 2 offsets; got shape {_shape_str(cu)}")
        if cu.strides != (1,):
            raise ValueError(f"{cu.name} must be contiguous; got stride {cu.strides[0]}")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); got "
                         f"{cu_q.shape[0]} and {cu_k.shape[0]}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be an int >= 0; got {value!r}")
    dv = v.shape[2]
    dims = Dims(cu_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k), h, hk, d, q.dtype, None if dv == d else dv)
    check_launch_limits(dims)
    return dims


def check_cu_seqlens_values(name: str, cu, total: int, max_seqlen: int, max_name: str) -> None:
    """Checks that need the offsets themselves (a host copy): start at 0, never decrease, stay within
    the packed array, and no sequence is longer than the stated maximum."""
    import numpy as np

    cu = np.asarray(cu, dtype=np.int64)
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0; got {int(cu[0])}")
    lengths = np.diff(cu)
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        raise ValueError(f"{name} must be non-decreasing; {name}[{i + 1}] = {int(cu[i + 1])} < {name}[{i}] = {int(cu[i])}")
    if cu[-1] > total:
        raise ValueError(f"{name}[-1] = {int(cu[-1])} exceeds the {total} packed rows of the matching array")
    if lengths.size and lengths.max() > max_seqlen:
        raise ValueError(f"{max_name} = {max_seqlen} but {name} holds a sequence of length {int(lengths.max())}")


def dropout_args(dropout_p, dropout_seed, dropout_offset):
    """None (no dropout) or (p, seed, offset) for the kernels."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1); got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    if dropout_p == 0.0:
        return None
    if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, numbers.Integral):
        raise TypeError("dropout_seed must be an int in [0, 2**64) when dropout_p > 0 (the backward regenerates "
                        f"the mask from it); got {dropout_seed!r}")
    if not 0 <= dropout_seed < 2 ** 64:
        raise ValueError(f"dropout_seed must be in [0, 2**64); got {dropout_seed}")
    if isinstance(dropout_offset, bool) or not isinstance(dropout_offset, numbers.Integral) \
            or not 0 <= dropout_offset < 2 ** 32:
        raise ValueError(f"dropout_offset must be an int in [0, 2**32); got {dropout_offset!r}")
    return float(dropout_p), int(dropout_seed), int(dropout_offset)


def check_launch_limits(dims: Dims) -> None:
    """Sizes the kernels' grids and int32 index arithmetic can take."""
    if dims.batch > _MAX_GRID_YZ:
        raise ValueError(f"batch must be at most {_MAX_GRID_YZ} (a CUDA grid dimension); got {dims.batch}")
    if dims.heads > _MAX_GRID_YZ:
        raise ValueError(f"heads must be at most {_MAX_GRID_YZ} (a CUDA grid dimension); got {dims.heads}")
    for name, value in (("seqlen_q", dims.seqlen_q), ("seqlen_k", dims.seqlen_k)):
        if value > _MAX_SEQLEN:
            raise ValueError(f"{name} must be below 2**30; got {value}")


# ---------------------------------------------------------------------------------------------
# KV cache (flash_attn_with_kvcache, flash_attn_combine)

_MAX_GRID_X = 2 ** 31 - 1


@dataclasses.dataclass(frozen=True)
class KvDims:
    """Sizes of a ``flash_attn_with_kvcache`` call. ``capacity``: the keys one entry's cache can hold
    (the cache's seqlen, or max_pages * page_size when paged); ``cache_batch``: k_cache.shape[0] (the
    number of pages when paged)."""

    batch: int
    seqlen_q: int
    heads: int
    kv_heads: int
    headdim: int
    dtype: str
    seqlen_new: int
    paged: bool
    page_size: int
    cache_batch: int
    capacity: int


def _check_int_vector(spec: Spec, name_shape: str, length: int) -> None:
    if spec.dtype != "int32":
        raise TypeError(f"{spec.name} must be int32; got {spec.dtype}")
    if spec.shape != (length,):
        raise ValueError(f"{spec.name} must have shape {name_shape} = ({length},); got {_shape_str(spec)}")
    if length > 1 and spec.strides != (1,):
        raise ValueError(f"{spec.name} must be contiguous; got stride {spec.strides[0]}")


def check_kvcache(q: Spec, k_cache: Spec, v_cache: Spec, k: Spec | None, v: Spec | None, cache_seqlens,
                  page_table: Spec | None, cache_batch_idx: Spec | None, rotary_cos: Spec | None,
                  rotary_sin: Spec | None) -> KvDims:
    """Shapes, dtypes, strides and devices of a KV-cache call (no device data is read).
    ``cache_seqlens``: a Spec or a Python int."""
    check_layout(q)
    b, sq, h, d = q.shape
    if b < 1 or h < 1:
        raise ValueError(f"q must have at least one batch entry and one head; got shape {_shape_str(q)}")
    if sq < 1:
        raise ValueError(f"seqlen_q must be at least 1; got q of shape {_shape_str(q)}")
    for s in (k_cache, v_cache):
        check_layout(s)
        if s.dtype != q.dtype:
            raise TypeError(f"{s.name} must have the dtype of q ({q.dtype}); got {s.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape; got k_cache {_shape_str(k_cache)} and "
                         f"v_cache {_shape_str(v_cache)}")
    cache_batch, cache_len, hk, dk = k_cache.shape
    paged = page_table is not None
    what = "(num_pages, page_size, kv_heads, headdim)" if paged else "(batch, max_seqlen, kv_heads, headdim)"
    if dk != d:
        raise ValueError(f"k_cache and v_cache must have q's head dim {d}; got {dk} (k_cache {what} = "
                         f"{_shape_str(k_cache)})")
    if hk < 1 or h % hk:
        raise ValueError(f"the number of query heads ({h}) must be a multiple of the number of KV heads in "
                         f"k_cache/v_cache ({hk})")
    if cache_batch < 1 or cache_len < 1:
        raise ValueError(f"k_cache must hold at least one {'page of one row' if paged else 'row per entry'}; "
                         f"got k_cache {what} = {_shape_str(k_cache)}")
    check_same_device([q, k_cache, v_cache])

    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) must both be given or both be None; got "
                         f"k={'None' if k is None else 'an array'}, v={'None' if v is None else 'an array'}")
    seqlen_new = 0
    if k is not None:
        for s in (k, v):
            check_layout(s)
            if s.dtype != q.dtype:
                raise TypeError(f"{s.name} must have the dtype of q ({q.dtype}); got {s.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape; got k {_shape_str(k)} and v {_shape_str(v)}")
        if k.shape[0] != b or k.shape[2] != hk or k.shape[3] != d:
            raise ValueError(f"k and v must have shape (batch, seqlen_new, kv_heads, headdim) = ({b}, seqlen_new, "
                             f"{hk}, {d}); got {_shape_str(k)}")
        seqlen_new = k.shape[1]
        check_same_device([q, k, v])

    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be used with a paged cache (page_table already says where "
                             "each entry's keys are)")
        if page_table.dtype != "int32":
            raise TypeError(f"page_table must be int32; got {page_table.dtype}")
        if len(page_table.shape) != 2 or page_table.shape[0] != b or page_table.shape[1] < 1:
            raise ValueError(f"page_table must have shape (batch, max_pages) = ({b}, max_pages >= 1); got "
                             f"{_shape_str(page_table)}")
        if page_table.shape[1] > 1 and page_table.strides[1] != 1:
            raise ValueError(f"page_table's rows must be contiguous (stride 1); got strides {page_table.strides}")
        check_same_device([q, page_table])
        capacity = page_table.shape[1] * cache_len
    else:
        if cache_batch_idx is not None:
            _check_int_vector(cache_batch_idx, "(batch,)", b)
            check_same_device([q, cache_batch_idx])
        elif cache_batch != b:
            raise ValueError(f"k_cache must have q's batch size {b} (or pass cache_batch_idx); got k_cache "
                             f"{what} = {_shape_str(k_cache)}")
        capacity = cache_len
    if capacity > _MAX_SEQLEN:
        raise ValueError(f"the cache must hold fewer than 2**30 keys per entry; got {capacity}")
    if seqlen_new > capacity:
        raise ValueError(f"k has seqlen_new = {seqlen_new} new tokens but the cache holds at most {capacity} keys "
                         "per entry")

    if isinstance(cache_seqlens, Spec):
        _check_int_vector(cache_seqlens, "(batch,)", b)
        check_same_device([q, cache_seqlens])
    else:
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, numbers.Integral):
            raise TypeError(f"cache_seqlens must be an int32 array of shape (batch,) or an int; got "
                            f"{type(cache_seqlens).__name__}")
        if not 0 <= cache_seqlens <= capacity - seqlen_new:
            raise ValueError(f"cache_seqlens = {cache_seqlens} is out of range: with {seqlen_new} new tokens the "
                             f"cache of {capacity} keys per entry takes 0 <= cache_seqlens <= {capacity - seqlen_new}")

    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must both be given or both be None")
    if rotary_cos is not None:
        for s in (rotary_cos, rotary_sin):
            if s.dtype != q.dtype:
                raise TypeError(f"{s.name} must have the dtype of q ({q.dtype}); got {s.dtype}")
            if len(s.shape) != 2 or s.shape[0] < 1:
                raise ValueError(f"{s.name} must have shape (seqlen_ro, rotary_dim / 2); got {_shape_str(s)}")
            if s.shape[1] > 1 and s.strides[1] != 1:
                raise ValueError(f"{s.name}'s rows must be contiguous (stride 1); got strides {s.strides}")
            check_same_device([q, s])
        if rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"rotary_cos and rotary_sin must have the same shape; got {_shape_str(rotary_cos)} and "
                             f"{_shape_str(rotary_sin)}")
        rotary_dim = 2 * rotary_cos.shape[1]
        if rotary_dim > d or rotary_dim % 16:
            raise ValueError(f"rotary_cos must have shape (seqlen_ro, rotary_dim / 2) with rotary_dim a multiple "
                             f"of 16 and at most the head dim {d}; got rotary_dim = {rotary_dim}")

    dims = KvDims(b, sq, h, hk, d, q.dtype, seqlen_new, paged, cache_len if paged else capacity, cache_batch, capacity)
    if b > _MAX_GRID_YZ:
        raise ValueError(f"batch must be at most {_MAX_GRID_YZ} (a CUDA grid dimension); got {b}")
    if hk > _MAX_GRID_YZ:
        raise ValueError(f"kv_heads must be at most {_MAX_GRID_YZ} (a CUDA grid dimension); got {hk}")
    if sq > _MAX_SEQLEN:
        raise ValueError(f"seqlen_q must be below 2**30; got {sq}")
    return dims


def num_splits_value(num_splits, max_splits: int) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int (0 = choose automatically); got {type(num_splits).__name__}")
    if not 0 <= num_splits <= max_splits:
        raise ValueError(f"num_splits must be in [0, {max_splits}] (0 = choose automatically); got {num_splits}")
    return int(num_splits)


def check_grid_x(blocks: int, what: str) -> None:
    if blocks > _MAX_GRID_X:
        raise ValueError(f"{what} needs {blocks} thread blocks in one grid dimension (at most 2**31 - 1)")


def check_kvcache_values(dims: KvDims, cache_seqlens, page_table, cache_batch_idx, seqlen_ro: int | None,
                         rotary_q_step: int) -> None:
    """Checks that need device data (host copies as NumPy arrays): cache_seqlens leaves room for the new
    tokens, every page an entry uses is a real page, cache_batch_idx names real cache entries, and the
    rotary tables cover every position rotated. ``rotary_q_step``: 1 when q's tokens sit at consecutive
    positions (causal / window), else 0."""
    import numpy as np

    seqlens = np.asarray(cache_seqlens, dtype=np.int64).reshape(-1)
    room = dims.capacity - dims.seqlen_new
    bad = np.flatnonzero((seqlens < 0) | (seqlens > room))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"cache_seqlens[{i}] = {int(seqlens[i])} is out of range: with {dims.seqlen_new} new tokens "
                         f"the cache of {dims.capacity} keys per entry takes 0 <= cache_seqlens <= {room}")
    if cache_batch_idx is not None:
        idx = np.asarray(cache_batch_idx, dtype=np.int64)
        bad = np.flatnonzero((idx < 0) | (idx >= dims.cache_batch))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"cache_batch_idx[{i}] = {int(idx[i])} is out of range [0, {dims.cache_batch}) "
                             "(k_cache's batch size)")
    if page_table is not None:
        table = np.asarray(page_table, dtype=np.int64)
        used = -(-(seqlens + dims.seqlen_new) // dims.page_size)  # pages each entry reads or writes
        in_use = np.arange(table.shape[1])[None, :] < used[:, None]
        bad = np.argwhere(in_use & ((table < 0) | (table >= dims.cache_batch)))
        if bad.size:
            bi, pi = (int(x) for x in bad[0])
            raise ValueError(f"page_table[{bi}, {pi}] = {int(table[bi, pi])} is out of range [0, {dims.cache_batch}) "
                             f"(k_cache has {dims.cache_batch} pages); entry {bi} uses its first {int(used[bi])} pages")
    if seqlen_ro is not None and seqlens.size:
        last = int(seqlens.max()) + max(dims.seqlen_new, rotary_q_step * dims.seqlen_q, 1) - 1
        if last >= seqlen_ro:
            raise ValueError(f"rotary_cos has {seqlen_ro} positions but position {last} is rotated "
                             f"(cache_seqlens up to {int(seqlens.max())}, {dims.seqlen_new} new tokens, "
                             f"seqlen_q {dims.seqlen_q})")


def check_combine(out_partial: Spec, lse_partial: Spec) -> tuple[int, int, int, int, int]:
    """(splits, batch, seqlen, heads, headdim) of flash_attn_combine's inputs."""
    if out_partial.dtype != "float32":
        raise TypeError(f"out_partial must be float32; got {out_partial.dtype}")
    if len(out_partial.shape) != 5:
        raise ValueError(f"out_partial must have 5 dimensions (num_splits, batch, seqlen, heads, headdim); got "
                         f"shape {_shape_str(out_partial)}")
    if lse_partial.dtype != "float32":
        raise TypeError(f"lse_partial must be float32; got {lse_partial.dtype}")
    ns, b, s, h, d = out_partial.shape
    want = (ns, b, h, s)
    if lse_partial.shape != want:
        raise ValueError(f"lse_partial must have shape (num_splits, batch, heads, seqlen) = {want}; got "
                         f"{_shape_str(lse_partial)}")
    if min(out_partial.shape) < 1:
        raise ValueError(f"out_partial must have no empty dimension; got shape {_shape_str(out_partial)}")
    if d > 1 and out_partial.strides[-1] != 1:
        raise ValueError(f"out_partial's last dimension (headdim) must be contiguous (stride 1); got strides "
                         f"{out_partial.strides}")
    check_same_device([out_partial, lse_partial])
    rows = b * s * h
    if rows >= 2 ** 31 or ns >= 2 ** 31:
        raise ValueError(f"out_partial has too many rows for one launch ({rows} = batch * seqlen * heads)")
    return ns, b, s, h, d
