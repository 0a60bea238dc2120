"""Attention references (exact and naive low precision) and a NumPy model of the tiled FlashAttention-1 algorithm.

Everything here is plain array code: it runs on NumPy arrays and on CuPy arrays (the array module is
picked from the inputs), except the two ``fa1_tiled_*_model`` functions, which are NumPy-only float64
models of what the FA1 CUDA kernel does block by block.

Layout
------
``q``: (batch, seqlen_q, heads, headdim); ``k``, ``v``: (batch, seqlen_k, kv_heads, headdim) with
``heads % kv_heads == 0``. GQA/MQA: query head ``h`` uses KV head ``h // (heads // kv_heads)``.
``lse`` (log-sum-exp of the scaled scores of each row): (batch, heads, seqlen_q).
``softmax_scale`` defaults to ``1 / sqrt(headdim)``.

Masks (i = query row, j = key column, both 0-based; Sq = seqlen_q, Sk = seqlen_k)
------------------------------------------------------------------------------
The diagonal is aligned to the *bottom-right* corner: row i's "own" key is ``j = i + (Sk - Sq)``.

* ``causal=True``: key j is visible iff ``j <= i + (Sk - Sq)``.
* ``window_size=(left, right)`` (inclusive, -1 = unbounded on that side): key j is visible iff
  ``i + (Sk - Sq) - left <= j <= i + (Sk - Sq) + right``.
  ``causal=True`` is the same as ``right = 0`` (with whatever ``left`` is given).
* A row that sees no key at all (possible when Sq > Sk with causal, or with a window) gives
  ``out = 0`` and ``lse = -inf`` -- never NaN. Its gradients are 0.

Causal, Sq = 3 < Sk = 5 (offset Sk - Sq = 2)::

         j: 0 1 2 3 4
    i = 0:  x x x . .
    i = 1:  x x x x .
    i = 2:  x x x x x

Causal, Sq = 5 > Sk = 3 (offset -2: the two top rows see nothing -> out 0, lse -inf)::

         j: 0 1 2
    i = 0:  . . .
    i = 1:  . . .
    i = 2:  x . .
    i = 3:  x x .
    i = 4:  x x x

Window (left=1, right=1), Sq = Sk = 5::

         j: 0 1 2 3 4
    i = 0:  x x . . .
    i = 1:  x x x . .
    i = 2:  . x x x .
    i = 3:  . . x x x
    i = 4:  . . . x x

Tolerance rule (FlashAttention's): ``max|out - ref| <= 2 * max|out_lowp - ref| + atol`` where ``ref`` is
the exact fp32/fp64 result (``attention_ref``) and ``out_lowp`` the same math done naively in the input's
bf16/fp16 (``attention_ref_lowp``): a kernel may be at most twice as wrong as a plain low-precision
implementation. ``check_close`` applies it, and also catches NaN/inf (poisoned, unwritten outputs) and
checks that ``-inf`` LSE entries match exactly.
"""
from __future__ import annotations

import math

import numpy

__all__ = [
    "mask_matrix",
    "attention_ref",
    "attention_ref_lowp",
    "attention_ref_backward",
    "attention_ref_backward_lowp",
    "check_close",
    "rounding_atol",
    "attention_naive",
    "attention_naive_backward",
    "kv_block_range",
    "fa1_tiled_forward_model",
    "fa1_tiled_backward_model",
    "dropout_mask",
    "rotary_ref",
    "kvcache_update_ref",
    "gather_kv_ref",
    "kvcache_attention_ref",
    "combine_ref",
    "decode_split_tiles",
    "decode_split_model",
    "attention_fp8_ref",
]


# ----------------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------------

def _get_xp(*arrays):
    """The array module of the inputs: cupy for CuPy arrays, numpy otherwise (or when CuPy is absent)."""
    try:
        import cupy
    except Exception:  # no CuPy, or a broken install: everything is NumPy
        return numpy
    return cupy.get_array_module(*[a for a in arrays if a is not None])


def _is_cupy(xp) -> bool:
    return xp is not numpy and getattr(xp, "__name__", "") == "cupy"


def _as_dtype(dtype):
    """numpy dtype from a dtype, type or name; "bfloat16" needs ml_dtypes (imported on demand)."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return numpy.dtype(ml_dtypes.bfloat16)
    try:
        return numpy.dtype(dtype)
    except TypeError:
        import ml_dtypes  # noqa: F401  (registers "bfloat16" and friends with numpy)

        return numpy.dtype(dtype)


def _round_to(x, dtype):
    """Round float values to ``dtype`` (bf16/fp16/fp32) and hand them back as float32."""
    return x.astype(_as_dtype(dtype)).astype(numpy.float32)


def _to_numpy(x):
    """Host numpy copy of a numpy or cupy array (no dtype change)."""
    if x is None or isinstance(x, numpy.ndarray):
        return x
    get = getattr(x, "get", None)
    if get is not None:
        return get()
    return numpy.asarray(x)


def _full_like_scalar(xp, value, dtype):
    return xp.asarray(value, dtype=dtype)


def _check_shapes(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-D (batch, seqlen, heads, headdim); got {q.shape}, {k.shape}, {v.shape}")
    b, _, h, d = q.shape
    bk, sk, hkv, dk = k.shape
    if k.shape[:3] != v.shape[:3] or bk != b or dk != d:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"heads ({h}) must be a multiple of kv_heads ({hkv})")
    return b, q.shape[1], sk, h, hkv, d, v.shape[3]


def _scale(softmax_scale, d):
    return 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)


def _effective_window(causal, window_size):
    """(left, right) with -1 meaning unbounded; causal forces right = 0."""
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    left = -1 if left < 0 else left
    right = -1 if right < 0 else right
    return left, right


def _visible(i, j, seqlen_q, seqlen_k, causal, window_size):
    """Broadcasting visibility test of query rows ``i`` against key columns ``j`` (integer arrays)."""
    left, right = _effective_window(causal, window_size)
    diag = i + (seqlen_k - seqlen_q)  # the bottom-right aligned diagonal
    vis = (i >= 0) & (j >= 0)  # all True, with the broadcast shape and the right module
    if right >= 0:
        vis = vis & (j <= diag + right)
    if left >= 0:
        vis = vis & (j >= diag - left)
    return vis


def _has_mask(causal, window_size):
    left, right = _effective_window(causal, window_size)
    return left >= 0 or right >= 0


def _split_heads(x, kv_heads):
    """(B, S, H, D) -> (B, Hkv, g*S, D): the g query heads of one KV head stacked along rows.

    Stacking the group along the row axis lets one matmul against K (B, Hkv, D, Sk) serve every query
    head of the group without repeating K/V, and makes ``P^T @ dO`` sum dK/dV over the group for free.
    """
    b, s, h, d = x.shape
    g = h // kv_heads
    return x.reshape(b, s, kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * s, d)


def _merge_heads(x, seqlen):
    """Inverse of ``_split_heads``: (B, Hkv, g*S, D) -> (B, S, H, D)."""
    b, hkv, gs, d = x.shape
    g = gs // seqlen
    return x.reshape(b, hkv, g, seqlen, d).transpose(0, 3, 1, 2, 4).reshape(b, seqlen, hkv * g, d)


def _lse_layout(lse_rows, seqlen):
    """(B, Hkv, g*S) -> (B, H, S)."""
    b, hkv, gs = lse_rows.shape
    return lse_rows.reshape(b, hkv * (gs // seqlen), seqlen)


def _bhs_to_rows(x, kv_heads):
    """(B, H, S) -> (B, Hkv, g*S): LSE / D in the stacked-row order of ``_split_heads``."""
    b, h, s = x.shape
    return x.reshape(b, kv_heads, (h // kv_heads) * s)


def _apply_mask(s, mask, g, xp):
    """Set invisible scores to -inf. ``s`` is (B, Hkv, g*Sq, Sk); ``mask`` (Sq, Sk) or None."""
    if mask is None:
        return s
    b, hkv, gs, sk = s.shape
    s5 = s.reshape(b, hkv, g, gs // g, sk)
    s5 = xp.where(mask, s5, _full_like_scalar(xp, -numpy.inf, s.dtype))
    return s5.reshape(b, hkv, gs, sk)


def _softmax_rows(s, xp):
    """Row softmax of masked scores; rows that are all -inf give p = 0 and lse = -inf (no NaN)."""
    m = s.max(axis=-1, keepdims=True)
    m_safe = xp.where(xp.isfinite(m), m, _full_like_scalar(xp, 0, s.dtype))
    p = xp.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    nonempty = l > 0
    l_safe = xp.where(nonempty, l, _full_like_scalar(xp, 1, s.dtype))
    p = p / l_safe
    lse = xp.where(nonempty, m_safe + xp.log(l_safe), _full_like_scalar(xp, -numpy.inf, s.dtype))
    return p, lse[..., 0]


def mask_matrix(seqlen_q, seqlen_k, *, causal=False, window_size=(-1, -1), xp=numpy):
    """Bool (seqlen_q, seqlen_k) matrix, True where query row i may see key j (see module docstring)."""
    i = xp.arange(seqlen_q)[:, None]
    j = xp.arange(seqlen_k)[None, :]
    return xp.broadcast_to(_visible(i, j, seqlen_q, seqlen_k, causal, window_size), (seqlen_q, seqlen_k)).copy()


def _mask_or_none(seqlen_q, seqlen_k, causal, window_size, xp):
    if not _has_mask(causal, window_size):
        return None
    return mask_matrix(seqlen_q, seqlen_k, causal=causal, window_size=window_size, xp=xp)


# ----------------------------------------------------------------------------------------------------
# exact references
# ----------------------------------------------------------------------------------------------------

def _philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint64 numpy arrays holding 32-bit values (same rounds as kernels_cu/common/philox.cuh)."""
    m = numpy.uint64(0xFFFFFFFF)
    for _ in range(10):
        p0 = numpy.uint64(0xD2511F53) * c0
        p1 = numpy.uint64(0xCD9E8D57) * c2
        hi0, lo0 = p0 >> numpy.uint64(32), p0 & m
        hi1, lo1 = p1 >> numpy.uint64(32), p1 & m
        c0, c1, c2, c3 = (hi1 ^ c1 ^ k0) & m, lo1, (hi0 ^ c3 ^ k1) & m, lo0
        k0 = (k0 + numpy.uint64(0x9E3779B9)) & m
        k1 = (k1 + numpy.uint64(0xBB67AE85)) & m
    return c0, c1, c2, c3


def dropout_mask(batch, heads, seqlen_q, seqlen_k, p, seed, offset=0):
    """The keep mask (batch, heads, seqlen_q, seqlen_k) of cuflash's dropout (kernels_cu/common/philox.cuh):
    element (i, j) of (b, h) keeps when its 16 Philox bits are >= round(p * 65536). NumPy, bool."""
    u = numpy.uint64
    i = numpy.arange(seqlen_q, dtype=u)[:, None]
    j = numpy.arange(seqlen_k, dtype=u)[None, :]
    bh = numpy.arange(batch * heads, dtype=u)[:, None, None]
    c0 = numpy.broadcast_to(j >> u(4), (batch * heads, seqlen_q, seqlen_k))
    c1 = numpy.broadcast_to(i >> u(4), c0.shape)
    c2 = numpy.broadcast_to(bh, c0.shape)
    c3 = numpy.broadcast_to((u(offset) * u(32) + (i % u(8)) * u(4) + (j % u(8)) // u(2)) & u(0xFFFFFFFF), c0.shape)
    words = _philox4x32_10(c0.copy(), c1.copy(), c2.copy(), c3.copy(), u(seed & 0xFFFFFFFF), u((seed >> 32) & 0xFFFFFFFF))
    w = ((j % u(16)) // u(8)) * u(2) + (i % u(16)) // u(8)
    word = numpy.choose(w.astype(numpy.int64) + numpy.zeros(c0.shape, dtype=numpy.int64), words)
    bits = numpy.where((j % u(2)) == u(0), word & u(0xFFFF), word >> u(16))
    threshold = min(int(round(p * 65536)), 65536)
    return (bits >= u(threshold)).reshape(batch, heads, seqlen_q, seqlen_k)


def _apply_dropout(p, keep, dropout_p, hkv, g, xp):
    """P (B, Hkv, g*Sq, Sk) -> P o keep / (1 - p) with keep given as (B, H, Sq, Sk)."""
    if keep is None:
        return p
    b, _, gs, sk = p.shape
    keep = xp.asarray(keep).reshape(b, hkv, gs, sk)
    return p * keep.astype(p.dtype) / p.dtype.type(1.0 - dropout_p)


def _alibi_bias(slopes, sq, sk, hkv, g, dtype, xp):
    """ALiBi bias -slope[h] * |i + (Sk - Sq) - j| as (1, Hkv, g*Sq, Sk), in the stacked-row order."""
    i = xp.arange(sq)[:, None]
    j = xp.arange(sk)[None, :]
    dist = xp.abs(i + (sk - sq) - j).astype(dtype)  # (Sq, Sk)
    slopes = xp.asarray(slopes).astype(dtype).reshape(hkv, g, 1, 1)
    return (-slopes * dist).reshape(1, hkv, g * sq, sk)


def _forward_probs(q, k, *, causal, softmax_scale, window_size, dtype, round_dtype=None, softcap=0.0,
                   alibi_slopes=None):
    """Scores -> probabilities in ``dtype``; with ``round_dtype`` S is rounded as a low-precision run would.

    Logits are scale * S, or softcap * tanh(scale * S / softcap) when softcap > 0, plus the ALiBi bias
    -slope[h] * |i + Sk - Sq - j| when slopes are given. Returns P (B, Hkv, g*Sq, Sk), lse rows
    (B, Hkv, g*Sq), the mask, the scale, and dlogits/dS (None without softcap).
    """
    xp = _get_xp(q, k)
    b, sq, sk, h, hkv, d, _ = _check_shapes(q, k, k)
    g = h // hkv
    scale = _scale(softmax_scale, d)
    qs = _split_heads(q.astype(dtype), hkv)
    kt = k.astype(dtype).transpose(0, 2, 3, 1)  # (B, Hkv, D, Sk)
    s = xp.matmul(qs, kt)
    if round_dtype is not None:
        # bf16/fp16 GEMM: fp32 accumulation, result stored in the low dtype; then the scaling multiply
        # also happens in the low dtype (what `q @ k.T * scale` does in PyTorch on bf16 tensors).
        s = _round_to(s, round_dtype)
        s = _round_to(s * numpy.float32(scale), round_dtype)
    else:
        s = s * dtype.type(scale)
    dlogits = None
    if softcap > 0:
        t = xp.tanh(s / dtype.type(softcap))
        s = dtype.type(softcap) * t
        dlogits = dtype.type(scale) * (1 - t * t)
    if alibi_slopes is not None:
        s = s + _alibi_bias(alibi_slopes, sq, sk, hkv, g, dtype, xp)
    mask = _mask_or_none(sq, sk, causal, window_size, xp)
    s = _apply_mask(s, mask, g, xp)
    p, lse = _softmax_rows(s, xp)
    return p, lse, mask, scale, dlogits


def attention_ref(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), compute_dtype="float32",
                  softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_keep=None):
    """Exact attention in ``compute_dtype`` ("float32" or "float64"), optionally with a softcap
    (logits = softcap * tanh(scale * S / softcap)) and ALiBi slopes (one per query head). Dropout:
    ``dropout_keep`` (B, H, Sq, Sk) bool (``dropout_mask``) with ``dropout_p``; the LSE is the undropped one.

    Returns ``out`` (B, Sq, H, D) and ``lse`` (B, H, Sq), both in ``compute_dtype``.
    """
    xp = _get_xp(q, k, v)
    dtype = _as_dtype(compute_dtype)
    b, sq, sk, h, hkv, d, dv = _check_shapes(q, k, v)
    p, lse, _, _, _ = _forward_probs(q, k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                     dtype=dtype, softcap=softcap, alibi_slopes=alibi_slopes)
    p = _apply_dropout(p, dropout_keep, dropout_p, hkv, h // hkv, xp)
    o = xp.matmul(p, v.astype(dtype).transpose(0, 2, 1, 3))  # (B, Hkv, g*Sq, Dv)
    return _merge_heads(o, sq), _lse_layout(lse, sq)


def attention_ref_lowp(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, dropout_p=0.0, dropout_keep=None):
    """The same attention done naively in the input's precision (as plain bf16/fp16 PyTorch code would).

    S = q @ k^T (fp32 accumulation) rounded to the input dtype, scaled (and rounded again), softmax in
    fp32, P rounded to the input dtype, out = P @ v (fp32 accumulation) rounded to the input dtype.
    Returns ``out`` as float32 holding low-precision values, and ``lse`` float32.
    """
    xp = _get_xp(q, k, v)
    low = q.dtype
    f32 = numpy.dtype(numpy.float32)
    _, sq, *_ = _check_shapes(q, k, v)
    p, lse, _, _, _ = _forward_probs(q, k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                     dtype=f32, round_dtype=low, softcap=softcap, alibi_slopes=alibi_slopes)
    _, _, _, h, hkv, _, _ = _check_shapes(q, k, v)
    p = _round_to(_apply_dropout(p, dropout_keep, dropout_p, hkv, h // hkv, xp), low)
    o = _round_to(xp.matmul(p, v.astype(f32).transpose(0, 2, 1, 3)), low)
    return _merge_heads(o, sq), _lse_layout(lse, sq)


def attention_ref_backward(dout, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                           compute_dtype="float32", softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_keep=None):
    """Exact gradients (dq, dk, dv) of ``attention_ref``'s out for the upstream gradient ``dout``.

    Shapes like q, k, v, dtype ``compute_dtype``; for GQA dk/dv are summed over each group's query heads.
    """
    xp = _get_xp(dout, q, k, v)
    dtype = _as_dtype(compute_dtype)
    b, sq, sk, h, hkv, d, _ = _check_shapes(q, k, v)
    p, _, _, scale, dlogits = _forward_probs(q, k, causal=causal, softmax_scale=softmax_scale,
                                             window_size=window_size, dtype=dtype, softcap=softcap,
                                             alibi_slopes=alibi_slopes)
    do = _split_heads(dout.astype(dtype), hkv)          # (B, Hkv, g*Sq, Dv)
    qs = _split_heads(q.astype(dtype), hkv)             # (B, Hkv, g*Sq, D)
    kk = k.astype(dtype).transpose(0, 2, 1, 3)          # (B, Hkv, Sk, D)
    vv = v.astype(dtype).transpose(0, 2, 1, 3)          # (B, Hkv, Sk, Dv)
    # Dropout: O = (P o Z / (1 - p)) V; dP flows back through the same mask.
    pd = _apply_dropout(p, dropout_keep, dropout_p, hkv, h // hkv, xp)
    dv = xp.matmul(pd.transpose(0, 1, 3, 2), do)        # sums over the group's stacked rows
    dp = _apply_dropout(xp.matmul(do, vv.transpose(0, 1, 3, 2)), dropout_keep, dropout_p, hkv, h // hkv, xp)
    delta = (p * dp).sum(axis=-1, keepdims=True)        # = rowsum(dO * O)
    ds = p * (dp - delta)                               # masked / empty rows: p = 0 -> ds = 0
    if dlogits is None:
        ds = ds * dtype.type(scale)
    else:
        ds = ds * dlogits                               # chain rule through the softcap's tanh
    dq = xp.matmul(ds, kk)
    dk = xp.matmul(ds.transpose(0, 1, 3, 2), qs)
    return _merge_heads(dq, sq), dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)


def attention_ref_backward_lowp(dout, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                                softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_keep=None):
    """Naive low-precision gradients (float32 arrays holding values rounded to the input dtype).

    Forward as ``attention_ref_lowp`` (its output O rounded); then dP = dO @ V^T rounded, dV = P^T @ dO
    rounded, D = rowsum(dO * O), dS = P * (dP - D) in fp32 rounded, scaled and rounded, dQ = dS @ K and
    dK = dS^T @ Q (fp32 accumulation, rounded). GQA sums dK/dV over the group in fp32 before the final
    rounding.
    """
    xp = _get_xp(dout, q, k, v)
    low = q.dtype
    f32 = numpy.dtype(numpy.float32)
    b, sq, sk, h, hkv, d, _ = _check_shapes(q, k, v)
    p32, _, _, scale, dlogits = _forward_probs(q, k, causal=causal, softmax_scale=softmax_scale,
                                               window_size=window_size, dtype=f32, round_dtype=low,
                                               softcap=softcap, alibi_slopes=alibi_slopes)
    p = _round_to(p32, low)
    do = _round_to(_split_heads(dout.astype(f32), hkv), low)
    qs = _split_heads(q.astype(f32), hkv)
    kk = k.astype(f32).transpose(0, 2, 1, 3)
    vv = v.astype(f32).transpose(0, 2, 1, 3)
    g = h // hkv
    pd = _round_to(_apply_dropout(p, dropout_keep, dropout_p, hkv, g, xp), low)
    dv = _round_to(xp.matmul(pd.transpose(0, 1, 3, 2), do), low)
    dp = _round_to(_apply_dropout(xp.matmul(do, vv.transpose(0, 1, 3, 2)), dropout_keep, dropout_p, hkv, g, xp), low)
    # D = rowsum(dO o O) from the forward's output as it was stored (rounded), as flash backwards compute it:
    # where dP - D cancels (a row that sees few keys) the rounding of O moves dS by more than all the rest.
    o = _round_to(xp.matmul(pd, vv), low)
    delta = (do * o).sum(axis=-1, keepdims=True)
    ds = _round_to(p * (dp - delta), low)
    ds = _round_to(ds * (numpy.float32(scale) if dlogits is None else dlogits), low)
    dq = _round_to(xp.matmul(ds, kk), low)
    dk = _round_to(xp.matmul(ds.transpose(0, 1, 3, 2), qs), low)
    return _merge_heads(dq, sq), dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)


# ----------------------------------------------------------------------------------------------------
# tolerance rule
# ----------------------------------------------------------------------------------------------------

def _host_f64(x):
    x = _to_numpy(x)
    return numpy.asarray(x).astype(numpy.float64)


def check_close(name, out, ref, lowp_ref, *, atol=1e-3):
    """FlashAttention's tolerance rule: ``max|out - ref| <= 2 * max|lowp_ref - ref| + atol``.

    Also fails when ``out`` is NaN/inf where ``ref`` is finite (poisoned or unwritten output), and
    requires ``out == -inf`` exactly wherever ``ref == -inf`` (empty rows' LSE); those positions are
    left out of the maxima. Arrays may be numpy or cupy, any float dtype. Returns the max error.
    Raises AssertionError naming ``name``, the error, the bound and the worst index.
    """
    o, r, lo = _host_f64(out), _host_f64(ref), _host_f64(lowp_ref)
    if o.shape != r.shape or lo.shape != r.shape:
        raise AssertionError(f"{name}: shape mismatch: out {o.shape}, ref {r.shape}, lowp_ref {lo.shape}")
    if numpy.isnan(r).any():
        idx = tuple(int(i) for i in numpy.argwhere(numpy.isnan(r))[0])
        raise AssertionError(f"{name}: reference has NaN (first at index {idx})")
    neg_inf = r == -numpy.inf
    bad_inf = neg_inf & (o != -numpy.inf)
    if bad_inf.any():
        idx = tuple(int(i) for i in numpy.argwhere(bad_inf)[0])
        raise AssertionError(f"{name}: ref is -inf but out is {o[idx]!r} at index {idx} "
                             f"({int(bad_inf.sum())} such elements)")
    finite = numpy.isfinite(r)
    poisoned = finite & ~numpy.isfinite(o)
    if poisoned.any():
        idx = tuple(int(i) for i in numpy.argwhere(poisoned)[0])
        raise AssertionError(f"{name}: out is non-finite ({o[idx]!r}) where ref is finite ({r[idx]!r}) at index "
                             f"{idx} ({int(poisoned.sum())} such elements)")
    with numpy.errstate(invalid="ignore"):  # -inf - -inf at the excluded positions
        err = numpy.where(finite, numpy.abs(o - r), 0.0)
        low_err = numpy.where(finite & numpy.isfinite(lo), numpy.abs(lo - r), 0.0)
    max_err = float(err.max()) if err.size else 0.0
    max_low = float(low_err.max()) if low_err.size else 0.0
    bound = 2.0 * max_low + float(atol)
    if not max_err <= bound:
        idx = tuple(int(i) for i in numpy.unravel_index(int(numpy.argmax(err)), err.shape))
        raise AssertionError(f"{name}: max |out - ref| = {max_err:.3e} > allowed {bound:.3e} "
                             f"(= 2 * lowp error {max_low:.3e} + atol {float(atol):.1e}); worst at index {idx}: "
                             f"out {o[idx]!r}, ref {r[idx]!r}")
    return max_err


def rounding_atol(ref, dtype):
    """FlashAttention-3's ``atol`` for gradients: twice the change that adding and then removing 0.3 in
    ``dtype`` makes to the reference's values (``2 * max|(ref + 0.3) - 0.3 - ref|``, each step rounded) --
    the dtype's rounding noise at the magnitude of the largest values, about two units in the last place.

    A tiny case's lowp error is the max over a handful of elements, so ``2 * max|lowp_ref - ref|`` can fall
    under one ulp of a gradient of size ~1 while a kernel that rounds dS at another point than the naive
    reference (every flash backward rounds dS before the softmax scale) sits 2 ulps off; this term is what
    FlashAttention-3's tests add for that. Returns a Python float.
    """
    r = _round_to(numpy.asarray(_host_f64(ref), numpy.float32), dtype)
    moved = _round_to(_round_to(r + numpy.float32(0.3), dtype) - numpy.float32(0.3), dtype)
    with numpy.errstate(invalid="ignore"):
        noise = numpy.where(numpy.isfinite(r), numpy.abs(moved - r), 0.0)
    return 2.0 * float(noise.max()) if noise.size else 0.0


# Rows per FP8 descale that the FP8 references default to: cuflash.fp8.DEFAULT_BLOCK's value (written here
# again so that the references import nothing of the package they check).
FP8_BLOCK = 256


def fp8_score_error_bound(q_data, k_data, q_descale, k_descale, *, descale_block=(FP8_BLOCK, FP8_BLOCK),
                          softmax_scale=None, aligned=True):
    """How far the FP8 tensor cores may move a scaled score: the largest ``fp8_score_error_units`` over the
    (query, key) pairs of a head, times softmax_scale * 2**-14. ``aligned=False`` leaves out the term of
    keys aligned with their query (see there).

    The products of e4m3 values are exact; Hopper's FP8 wgmma drops low bits of its accumulator as it adds
    them (the DeepSeek-V3 report: about 14 bits kept), by an amount that follows the running sum.
    """
    xp = _get_xp(q_data, k_data)
    q_block, kv_block = (int(b) for b in descale_block)
    q = _dequantize_e4m3(q_data, q_descale, q_block, numpy.dtype("float64")).transpose(0, 2, 1, 3)
    k = _dequantize_e4m3(k_data, k_descale, kv_block, numpy.dtype("float64")).transpose(0, 2, 3, 1)
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[-1]
    if q.shape[2] == 0 or k.shape[-1] == 0:
        return 0.0
    # GQA: the query heads of group g (heads // kv_heads of them, adjacent) read kv head g
    q = q.reshape(q.shape[0], kv_heads, (heads // kv_heads) * q.shape[2], d)
    units = fp8_score_error_units(d, xp.matmul(abs(q), abs(k)), xp.matmul(q, k) if aligned else None)
    return _scale(softmax_scale, d) * float(units.max()) * 2.0 ** -14


def fp8_score_error_units(d, abs_dot, dot=None):
    """The FP8 forward's score error at head dim d in units of 2**-14 (times the softmax scale), from
    sum_i |q_i k_i| (``abs_dot``) and sum_i q_i k_i (``dot``; None: random keys only):
    (d / 32 + 1) sum_i |q_i k_i| + (d / 4) |sum_i q_i k_i|.

    Measured on the H200 (tests/test_fp8_attention_gpu.py::test_score_error_within_bound, three runs, in
    units of sum_i |q_i k_i|): a random key moved its score by up to 2.16 / 2.4 / 4.3 at d = 64 / 128 / 256
    (the first term: 3 / 5 / 9; session 16's d / 32 alone, 2 at d = 64, held two runs and failed the third
    by 8 %: whatever the number of 32-deep steps, one unit of rounding comes on top); a key that is a
    multiple of its query (every product positive, the running sum as large as it gets) by up to 11.5 /
    20.7 / 52, within both (19 / 37 / 73): a dominant "needle" key carries its row's LSE with it. For a
    random key |sum q k| is ~sqrt(d) times smaller than sum |q k|, so the second term adds little there.
    """
    units = (d / 32 + 1) * abs_dot
    return units if dot is None else units + (d / 4) * abs(dot)


def check_fp8_attention(name, out, lse, data, descales, *, descale_block=(FP8_BLOCK, FP8_BLOCK),
                        causal=False, softmax_scale=None, atol=1e-2):
    """The FP8 forward's ``out`` and ``lse`` against ``attention_fp8_ref`` of the same e4m3 bytes ``data`` =
    (q, k, v) and ``descales``, by ``check_close``: out with the model that rounds P to e4m3 (and the output
    to bf16) as the low-precision reference, the LSE against the exact one, both with ``atol`` or twice
    ``fp8_score_error_bound`` where that is larger (large scores: a softmax scale above 1/sqrt(d)) -- for
    out without the aligned keys' term: an error common to a row's dominant keys moves its LSE, not its
    weights. tests/test_fp8_attention_gpu.py derives these tolerances. Raises AssertionError naming ``name``."""
    kw = dict(descale_block=descale_block, causal=causal, softmax_scale=softmax_scale)
    bound = lambda aligned: fp8_score_error_bound(*data[:2], *descales[:2], descale_block=descale_block,  # noqa: E731
                                                  softmax_scale=softmax_scale, aligned=aligned)
    o_ref, lse_ref = attention_fp8_ref(*data, *descales, **kw)
    o_model, _ = attention_fp8_ref(*data, *descales, **kw, round_p=True)
    check_close(f"{name} out", out, o_ref, _round_to(o_model, "bfloat16"), atol=max(float(atol), 2.0 * bound(False)))
    check_close(f"{name} lse", lse, lse_ref, lse_ref, atol=max(float(atol), 2.0 * bound(True)))


# ----------------------------------------------------------------------------------------------------
# materialised "standard attention" (the benchmark peer)
# ----------------------------------------------------------------------------------------------------

def _gemm_operand(x, cupy):
    """A (..., R, C) cupy array as a strided-batched cuBLAS operand without copying when possible.

    cuBLAS is column-major: a row-major (R, C) buffer *is* the column-major (C, R) matrix x^T (op N,
    ld = C), and the transposed view of a row-major (C, R) buffer is the column-major (R, C) matrix x
    (op T, ld = R). Returns (array, transposed, ld, batch_stride) with strides in elements.
    """
    r, c = x.shape[-2:]
    item = x.itemsize
    if x.strides[-1] == item and (x.strides[-2] == c * item or r == 1):
        transposed, ld, mat = False, c, r * c
    elif x.strides[-2] == item and (x.strides[-1] == r * item or c == 1):
        transposed, ld, mat = True, r, r * c
    else:
        x = cupy.ascontiguousarray(x)
        transposed, ld, mat = False, c, r * c
    # batch dims must collapse into one uniform stride (true for the transposes used here)
    expect = mat * item
    for size, stride in zip(reversed(x.shape[:-2]), reversed(x.strides[:-2])):
        if size != 1 and stride != expect:
            return _gemm_operand(cupy.ascontiguousarray(x), cupy)
        expect *= size
    return x, transposed, ld, mat


def _cublas_bf16_matmul(a, b):
    """bf16 (..., M, K) @ (..., K, N) -> bf16 (..., M, N) through cublasGemmStridedBatchedEx, fp32 compute.

    CuPy's matmul has no bfloat16 kernel, so the naive peer calls cuBLAS itself (tensor cores, as
    PyTorch would). Row-major C = A B is column-major C^T = B^T A^T, hence B is passed first.
    """
    import cupy
    from cupy_backends.cuda.libs import cublas

    if a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"bf16 matmul: shapes {a.shape} and {b.shape} do not match (no broadcasting here)")
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = a.shape[:-2]
    nbatch = int(numpy.prod(batch)) if batch else 1
    out = cupy.empty(batch + (m, n), dtype=a.dtype)
    if out.size == 0:
        return out
    if k == 0:
        out.fill(0)
        return out
    a, ta, lda, sa = _gemm_operand(a, cupy)
    b, tb, ldb, sb = _gemm_operand(b, cupy)
    op = {False: cublas.CUBLAS_OP_N, True: cublas.CUBLAS_OP_T}
    cuda_r_16bf, compute_32f, gemm_default = 14, 68, -1  # CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT
    one = numpy.ones((), numpy.float32)
    zero = numpy.zeros((), numpy.float32)
    handle = cupy.cuda.device.get_cublas_handle()
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        cublas.gemmStridedBatchedEx(
            handle, op[tb], op[ta], n, m, k,
            one.ctypes.data, b.data.ptr, cuda_r_16bf, ldb, sb,
            a.data.ptr, cuda_r_16bf, lda, sa,
            zero.ctypes.data, out.data.ptr, cuda_r_16bf, n, m * n,
            nbatch, compute_32f, gemm_default)
    finally:
        cublas.setPointerMode(handle, mode)
    return out


def _mm_low(a, b, dtype, xp):
    """Matmul in the input dtype. CuPy: a real bf16/fp16 cuBLAS GEMM (tensor cores, fp32 accumulation);
    bf16 goes to cuBLAS directly since cupy.matmul has no bf16 path. NumPy has no fast low-precision
    GEMM, so it accumulates in fp32 and rounds -- the same numbers up to summation order."""
    if _is_cupy(xp):
        a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
        if numpy.dtype(dtype).name == "bfloat16":
            return _cublas_bf16_matmul(a, b)
        return xp.matmul(a, b)
    f32 = numpy.float32
    return xp.matmul(a.astype(f32), b.astype(f32)).astype(dtype)


def _naive_probs(q, k, causal, softmax_scale, xp):
    """Full (B, H, Sq, Sk) float32 probability matrix, the standard-attention way (K repeated for GQA)."""
    b, sq, sk, h, hkv, d, _ = _check_shapes(q, k, k)
    scale = _scale(softmax_scale, d)
    if h != hkv:
        k = xp.repeat(k, h // hkv, axis=2)
    s = _mm_low(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1), q.dtype, xp)  # (B, H, Sq, Sk), input dtype
    s = s.astype(numpy.float32)
    s *= numpy.float32(scale)
    if causal:
        mask = mask_matrix(sq, sk, causal=True, xp=xp)
        s = xp.where(mask, s, _full_like_scalar(xp, -numpy.inf, s.dtype))
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, _full_like_scalar(xp, 0, s.dtype))  # empty rows: avoid -inf - -inf
    s -= m
    xp.exp(s, out=s)
    l = s.sum(axis=-1, keepdims=True)
    l = xp.where(l > 0, l, _full_like_scalar(xp, 1, s.dtype))
    s /= l
    return s, scale


def attention_naive(q, k, v, *, causal=False, softmax_scale=None):
    """Standard attention with the full Sq x Sk matrix in memory: GEMMs in the input dtype, softmax in fp32.

    Returns out (B, Sq, H, D) in the input dtype. Works on CuPy (fast, cuBLAS) and NumPy (slow).
    """
    xp = _get_xp(q, k, v)
    b, sq, sk, h, hkv, d, _ = _check_shapes(q, k, v)
    p, _ = _naive_probs(q, k, causal, softmax_scale, xp)
    if h != hkv:
        v = xp.repeat(v, h // hkv, axis=2)
    o = _mm_low(p.astype(q.dtype), v.transpose(0, 2, 1, 3), q.dtype, xp)  # (B, H, Sq, D)
    return xp.ascontiguousarray(o.transpose(0, 2, 1, 3))


def attention_naive_backward(dout, q, k, v, out, *, causal=False, softmax_scale=None):
    """Standard materialised backward: recompute P, then dV = P^T dO, dP = dO V^T, dS = P (dP - D),
    dQ = scale dS K, dK = scale dS^T Q with GEMMs in the input dtype and the softmax part in fp32.

    Returns (dq, dk, dv) shaped like q, k, v in the input dtype (GQA: summed over each group in fp32).
    """
    xp = _get_xp(dout, q, k, v, out)
    b, sq, sk, h, hkv, d, _ = _check_shapes(q, k, v)
    dt = q.dtype
    g = h // hkv
    p, scale = _naive_probs(q, k, causal, softmax_scale, xp)          # fp32 (B, H, Sq, Sk)
    kr = xp.repeat(k, g, axis=2) if g > 1 else k
    vr = xp.repeat(v, g, axis=2) if g > 1 else v
    do = dout.astype(dt).transpose(0, 2, 1, 3)                       # (B, H, Sq, D)
    dv = _mm_low(p.astype(dt).transpose(0, 1, 3, 2), do, dt, xp)      # (B, H, Sk, D)
    dp = _mm_low(do, vr.transpose(0, 2, 3, 1), dt, xp)                # (B, H, Sq, Sk)
    delta = (dout.astype(numpy.float32) * out.astype(numpy.float32)).sum(axis=-1)  # (B, Sq, H)
    delta = delta.transpose(0, 2, 1)[..., None]                       # (B, H, Sq, 1)
    ds = dp.astype(numpy.float32)
    ds -= delta
    ds *= p
    ds *= numpy.float32(scale)
    ds = ds.astype(dt)
    dq = _mm_low(ds, kr.transpose(0, 2, 1, 3), dt, xp)                # (B, H, Sq, D)
    dk = _mm_low(ds.transpose(0, 1, 3, 2), q.transpose(0, 2, 1, 3), dt, xp)  # (B, H, Sk, D)
    if g > 1:
        dk = dk.astype(numpy.float32).reshape(b, hkv, g, sk, d).sum(axis=2).astype(dt)
        dv = dv.astype(numpy.float32).reshape(b, hkv, g, sk, dv.shape[-1]).sum(axis=2).astype(dt)
    return (xp.ascontiguousarray(dq.transpose(0, 2, 1, 3)), xp.ascontiguousarray(dk.transpose(0, 2, 1, 3)),
            xp.ascontiguousarray(dv.transpose(0, 2, 1, 3)))


# ----------------------------------------------------------------------------------------------------
# NumPy model of the tiled FlashAttention-1 algorithm
# ----------------------------------------------------------------------------------------------------

def visible_key_span(row_first, row_last, *, seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)):
    """Keys that query rows ``row_first`` .. ``row_last`` see together: ``(first, last)`` inclusive, clipped
    to [0, Sk) (``last < first``: none). Row i sees [i + off - left, i + off + right], off = Sk - Sq
    (bottom-right aligned, as kernels_cu/common/mask.cuh)."""
    left, right = _effective_window(causal, window_size)
    off = seqlen_k - seqlen_q
    first = max(0, row_first + off - left) if left >= 0 else 0
    last = min(seqlen_k - 1, row_last + off + right) if right >= 0 else seqlen_k - 1
    return first, last


def kv_block_range(m_block, *, seqlen_q, seqlen_k, block_m, block_n, causal=False, window_size=(-1, -1)):
    """K/V blocks that Q block ``m_block`` must visit: ``(n_block_min, n_block_max)``, max exclusive.

    Exactly the blocks holding at least one visible (row, key) pair of the Q block's real rows
    (rows past seqlen_q are not counted). Why a contiguous range is exact: row i sees the interval
    [i + off - left, i + off + right] (off = Sk - Sq), consecutive rows' intervals shift by one and are
    at least one key long, so the union over the Q block is one interval, clipped to [0, Sk).
    An empty result is returned as (0, 0): the kernel writes out = 0, lse = -inf for the whole Q block.

    Note for C: the divisions below are floor divisions of possibly negative numbers; C's ``/``
    truncates toward zero, so clamp to >= 0 before dividing (as done here) or use a floor-div helper.
    """
    row_lo = m_block * block_m
    row_hi = min((m_block + 1) * block_m, seqlen_q) - 1  # last real row of the block
    if row_lo > row_hi or seqlen_k <= 0:
        return 0, 0
    key_lo, key_hi = visible_key_span(row_lo, row_hi, seqlen_q=seqlen_q, seqlen_k=seqlen_k, causal=causal,
                                      window_size=window_size)
    if key_hi < key_lo:
        return 0, 0
    return key_lo // block_n, key_hi // block_n + 1


def _model_inputs(*arrays):
    return [None if a is None else _to_numpy(a).astype(numpy.float64) for a in arrays]


def fa1_tiled_forward_model(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                            block_m=64, block_n=64):
    """FlashAttention-1 forward, block by block, in float64 (NumPy only). Returns (out, lse) like
    ``attention_ref``. One (batch, head, Q block) is what one CUDA thread block does."""
    q, k, v = _model_inputs(q, k, v)
    b, sq, sk, h, hkv, d, dv = _check_shapes(q, k, v)
    g = h // hkv
    scale = _scale(softmax_scale, d)
    masked = _has_mask(causal, window_size)
    out = numpy.zeros((b, sq, h, dv))
    lse = numpy.full((b, h, sq), -numpy.inf)
    n_m_blocks = -(-sq // block_m)
    for bi in range(b):
        for hi in range(h):
            kvh = hi // g  # GQA: query head -> its KV head
            for m_block in range(n_m_blocks):
                r0, r1 = m_block * block_m, min((m_block + 1) * block_m, sq)
                qi = q[bi, r0:r1, hi]  # (rows, D), stays "in shared memory/registers" for the whole loop
                rows = numpy.arange(r0, r1)[:, None]
                n_min, n_max = kv_block_range(m_block, seqlen_q=sq, seqlen_k=sk, block_m=block_m,
                                              block_n=block_n, causal=causal, window_size=window_size)
                # running statistics of the online softmax: max m, sum l (of exp(s - m)), normalised O
                m = numpy.full(r1 - r0, -numpy.inf)
                l = numpy.zeros(r1 - r0)
                o = numpy.zeros((r1 - r0, dv))
                for n_block in range(n_min, n_max):  # blocks outside the range are fully masked: skipped
                    c0, c1 = n_block * block_n, min((n_block + 1) * block_n, sk)
                    s = scale * (qi @ k[bi, c0:c1, kvh].T)
                    if masked:  # only blocks crossing a mask edge need it; applying it everywhere is harmless
                        cols = numpy.arange(c0, c1)[None, :]
                        s = numpy.where(_visible(rows, cols, sq, sk, causal, window_size), s, -numpy.inf)
                    # block statistics: m~ = rowmax(S), P~ = exp(S - m~), l~ = rowsum(P~).
                    # A row with nothing visible in this block has m~ = -inf: use 0 as the shift so that
                    # exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
                    m_blk = s.max(axis=1)
                    p = numpy.exp(s - numpy.where(numpy.isfinite(m_blk), m_blk, 0.0)[:, None])
                    l_blk = p.sum(axis=1)
                    # merge: m_new = max(m, m~), l_new = e^{m - m_new} l + e^{m~ - m_new} l~.
                    # Same -inf care: a row that has seen nothing yet has m = m_new = -inf.
                    m_new = numpy.maximum(m, m_blk)
                    m_new_safe = numpy.where(numpy.isfinite(m_new), m_new, 0.0)
                    alpha = numpy.exp(m - m_new_safe)      # rescales the old state (0 when m = -inf)
                    beta = numpy.exp(m_blk - m_new_safe)   # rescales this block (0 when m~ = -inf)
                    l_new = alpha * l + beta * l_blk
                    # O_new = diag(l_new)^-1 (diag(l) e^{m - m_new} O + e^{m~ - m_new} P~ V)
                    num = (alpha * l)[:, None] * o + beta[:, None] * (p @ v[bi, c0:c1, kvh])
                    o = num / numpy.where(l_new > 0, l_new, 1.0)[:, None]  # l_new = 0: row still empty, O = 0
                    m, l = m_new, l_new
                out[bi, r0:r1, hi] = o
                with numpy.errstate(divide="ignore"):
                    lse[bi, hi, r0:r1] = numpy.where(l > 0, m + numpy.log(l), -numpy.inf)
    return out, lse


def fa1_tiled_backward_model(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                             window_size=(-1, -1), block_m=64, block_n=64):
    """FlashAttention-1 backward (paper's Algorithm 4), block by block, float64, NumPy only.

    Outer loop over K/V blocks j (one CUDA thread block per (batch, KV head, j)), inner loop over the
    query heads of the GQA group and the Q blocks whose visible range includes j. dK_j, dV_j live in
    registers for the whole inner loop; dQ_i is accumulated across outer iterations (atomicAdd in the
    kernel). P is recomputed from Q, K and the forward's LSE; nothing N x N is stored.
    """
    dout, q, k, v, out, lse = _model_inputs(dout, q, k, v, out, lse)
    b, sq, sk, h, hkv, d, dv_dim = _check_shapes(q, k, v)
    g = h // hkv
    scale = _scale(softmax_scale, d)
    masked = _has_mask(causal, window_size)
    # D_i = rowsum(dO_i * O_i) (= rowsum(P * dP)); a preprocessing kernel computes it once per row.
    delta = (dout * out).sum(axis=-1)  # (B, Sq, H)
    dq = numpy.zeros_like(q)
    dk = numpy.zeros_like(k)
    dv = numpy.zeros_like(v)
    n_m_blocks = -(-sq // block_m)
    n_n_blocks = -(-sk // block_n)
    ranges = [kv_block_range(mb, seqlen_q=sq, seqlen_k=sk, block_m=block_m, block_n=block_n,
                             causal=causal, window_size=window_size) for mb in range(n_m_blocks)]
    for bi in range(b):
        for kvh in range(hkv):
            for n_block in range(n_n_blocks):
                c0, c1 = n_block * block_n, min((n_block + 1) * block_n, sk)
                kj, vj = k[bi, c0:c1, kvh], v[bi, c0:c1, kvh]
                dk_j = numpy.zeros_like(kj)
                dv_j = numpy.zeros_like(vj)
                cols = numpy.arange(c0, c1)[None, :]
                for hi in range(kvh * g, (kvh + 1) * g):  # the query heads sharing this KV head
                    for m_block in range(n_m_blocks):
                        n_min, n_max = ranges[m_block]
                        if not n_min <= n_block < n_max:  # (Q block, K block) pair fully masked: skip
                            continue
                        r0, r1 = m_block * block_m, min((m_block + 1) * block_m, sq)
                        qi, doi = q[bi, r0:r1, hi], dout[bi, r0:r1, hi]
                        lse_i = lse[bi, hi, r0:r1]
                        s = scale * (qi @ kj.T)
                        # P = exp(scale*S - lse). Rows with lse = -inf saw no key: P = 0 (not exp(+inf)).
                        with numpy.errstate(invalid="ignore", over="ignore"):
                            p = numpy.exp(s - numpy.where(numpy.isfinite(lse_i), lse_i, numpy.inf)[:, None])
                        if masked:
                            rows = numpy.arange(r0, r1)[:, None]
                            p = numpy.where(_visible(rows, cols, sq, sk, causal, window_size), p, 0.0)
                        dv_j += p.T @ doi
                        dp = doi @ vj.T
                        ds = p * (dp - delta[bi, r0:r1, hi][:, None])
                        dk_j += scale * (ds.T @ qi)
                        dq[bi, r0:r1, hi] += scale * (ds @ kj)  # atomicAdd in the kernel
                dk[bi, c0:c1, kvh] = dk_j
                dv[bi, c0:c1, kvh] = dv_j
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------
# KV-cache (inference) references: rotary embeddings, the cache update, attention over the cache, the
# split-KV (Flash-Decoding) model and the combine of partial results
# ----------------------------------------------------------------------------------------------------

def rotary_ref(x, cos, sin, positions, *, interleaved=False):
    """Rotary position embedding of ``x`` (B, S, H, D) at integer ``positions`` (B, S), in float32.

    ``cos``/``sin`` are (seqlen_ro, rotary_dim / 2); the first rotary_dim channels are rotated, the rest
    pass through. Pair (x1, x2) becomes (x1 cos - x2 sin, x2 cos + x1 sin) with angle index i, where
    the pairs are flash-attn's:

    * ``interleaved=False`` (GPT-NeoX, "half split"): x1 = x[i], x2 = x[i + rotary_dim / 2];
    * ``interleaved=True`` (GPT-J): x1 = x[2 i], x2 = x[2 i + 1].

    Returns float32 values (round them to the storage dtype to get what the kernels store).
    """
    xp = _get_xp(x, cos, sin)
    f32 = numpy.float32
    x = x.astype(f32)
    half = cos.shape[1]
    rd = 2 * half
    pos = xp.asarray(positions)
    c = cos.astype(f32)[pos][:, :, None, :]  # (B, S, 1, rd/2)
    s = sin.astype(f32)[pos][:, :, None, :]
    out = x.copy()
    if interleaved:
        x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
        out[..., 0:rd:2] = x1 * c - x2 * s
        out[..., 1:rd:2] = x2 * c + x1 * s
    else:
        x1, x2 = x[..., :half], x[..., half:rd]
        out[..., :half] = x1 * c - x2 * s
        out[..., half:rd] = x2 * c + x1 * s
    return out


def _cache_rows(b, n, *, page_table, cache_batch_idx, page_size):
    """(first index, second index) arrays addressing logical keys 0..n-1 of batch entry b in the cache:
    contiguous caches (cache_batch, key), paged caches (page_table[b, j // page_size], j % page_size)."""
    j = numpy.arange(n)
    if page_table is not None:
        return numpy.asarray(page_table)[b, j // page_size].astype(numpy.int64), j % page_size
    cb = b if cache_batch_idx is None else int(numpy.asarray(cache_batch_idx)[b])
    return numpy.full(n, cb, dtype=numpy.int64), j


def kvcache_update_ref(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, page_table=None, cache_batch_idx=None,
                       rotary_cos=None, rotary_sin=None, rotary_interleaved=False, causal=False,
                       window_size=(-1, -1)):
    """What ``flash_attn_with_kvcache`` does before the attention, on copies (inputs are not modified).

    Returns (q_used, k_cache_new, v_cache_new, seqlens_k): q after rotary (rounded to q's dtype, or q
    itself), the caches with k/v (rotary applied to k) written at positions cache_seqlens[b] ..
    cache_seqlens[b] + seqlen_new - 1, and the per-entry key counts cache_seqlens + seqlen_new (NumPy
    int64). Rotary positions: k's token j sits at cache_seqlens[b] + j; q's token i at
    cache_seqlens[b] + i when causal or windowed, else every q token at cache_seqlens[b] (flash-attn's rule).
    """
    xp = _get_xp(q, k_cache, v_cache)
    batch, sq = q.shape[:2]
    seqlens = numpy.broadcast_to(numpy.asarray(_to_numpy(cache_seqlens), dtype=numpy.int64), (batch,)).copy()
    pt = None if page_table is None else _to_numpy(page_table)
    cbi = None if cache_batch_idx is None else _to_numpy(cache_batch_idx)
    page_size = k_cache.shape[1]
    rotary = rotary_cos is not None
    q_used = q
    if rotary:
        step = 1 if (causal or tuple(window_size) != (-1, -1)) else 0
        pos = seqlens[:, None] + step * numpy.arange(sq)[None, :]
        q_used = rotary_ref(q, rotary_cos, rotary_sin, xp.asarray(pos), interleaved=rotary_interleaved)
        q_used = _round_to(q_used, q.dtype).astype(q.dtype)
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    seqlen_new = 0 if k is None else k.shape[1]
    if k is not None:
        k_new = k
        if rotary:
            pos = seqlens[:, None] + numpy.arange(seqlen_new)[None, :]
            k_new = rotary_ref(k, rotary_cos, rotary_sin, xp.asarray(pos), interleaved=rotary_interleaved)
            k_new = _round_to(k_new, k.dtype).astype(k.dtype)
        for b in range(batch):
            first, second = _cache_rows(b, int(seqlens[b]) + seqlen_new, page_table=pt, cache_batch_idx=cbi,
                                        page_size=page_size)
            first, second = first[int(seqlens[b]):], second[int(seqlens[b]):]
            k_cache[xp.asarray(first), xp.asarray(second)] = k_new[b]
            v_cache[xp.asarray(first), xp.asarray(second)] = v[b]
    return q_used, k_cache, v_cache, seqlens + seqlen_new


def gather_kv_ref(k_cache, v_cache, b, n, *, page_table=None, cache_batch_idx=None):
    """Logical keys and values 0..n-1 of batch entry b as (1, n, kv_heads, d) arrays."""
    xp = _get_xp(k_cache, v_cache)
    first, second = _cache_rows(b, n, page_table=None if page_table is None else _to_numpy(page_table),
                                cache_batch_idx=None if cache_batch_idx is None else _to_numpy(cache_batch_idx),
                                page_size=k_cache.shape[1])
    first, second = xp.asarray(first), xp.asarray(second)
    return k_cache[first, second][None], v_cache[first, second][None]


def kvcache_attention_ref(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, page_table=None,
                          cache_batch_idx=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                          softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                          compute_dtype="float32", lowp=False):
    """``flash_attn_with_kvcache``'s result, exactly (``compute_dtype``) or naively in q's precision
    (``lowp=True``, see ``attention_ref_lowp``). Entry b attends over its cache_seqlens[b] + seqlen_new
    keys with the masks aligned bottom-right (query i sees key j iff j <= i + keys_b - seqlen_q when
    causal); an entry with no keys gives out 0 and lse -inf.

    Returns (out (B, Sq, H, D), lse (B, H, Sq), k_cache_new, v_cache_new).
    """
    xp = _get_xp(q, k_cache, v_cache)
    q_used, kc, vc, seqlens_k = kvcache_update_ref(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, page_table=page_table,
        cache_batch_idx=cache_batch_idx, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, causal=causal, window_size=window_size)
    batch, sq, h, d = q.shape
    out_dtype = numpy.float32 if lowp else _as_dtype(compute_dtype)
    out = xp.zeros((batch, sq, h, d), dtype=out_dtype)
    lse = xp.full((batch, h, sq), -numpy.inf, dtype=out_dtype)
    fn = attention_ref_lowp if lowp else attention_ref
    options = dict(causal=causal, softmax_scale=_scale(softmax_scale, d), window_size=window_size, softcap=softcap)
    if not lowp:
        options["compute_dtype"] = compute_dtype
    for b in range(batch):
        n = int(seqlens_k[b])
        if n == 0:
            continue
        kb, vb = gather_kv_ref(kc, vc, b, n, page_table=page_table, cache_batch_idx=cache_batch_idx)
        ob, lb = fn(q_used[b:b + 1], kb, vb, **options)
        out[b] = ob[0]
        lse[b] = lb[0]
    return out, lse, kc, vc


def combine_ref(out_partial, lse_partial):
    """Merge partial attention results by their log-sum-exp (what ``flash_attn_combine`` computes).

    ``out_partial`` (splits, B, Sq, H, D), each normalised over its own keys; ``lse_partial``
    (splits, B, H, Sq). out = sum_s exp(lse_s - lse) out_s with lse = log sum_s exp(lse_s). Splits with
    lse -inf (no keys) get weight 0 and their out_s is never read (it may be anything, NaN included);
    a row whose splits are all -inf gives out 0 and lse -inf. Float64 NumPy.
    """
    o = _to_numpy(out_partial).astype(numpy.float64)
    lse = _to_numpy(lse_partial).astype(numpy.float64)
    m = lse.max(axis=0)
    m_safe = numpy.where(numpy.isfinite(m), m, 0.0)
    with numpy.errstate(invalid="ignore"):
        w = numpy.where(lse == -numpy.inf, 0.0, numpy.exp(lse - m_safe))  # (splits, B, H, Sq)
    total = w.sum(axis=0)
    with numpy.errstate(divide="ignore"):
        lse_out = numpy.where(total > 0, m_safe + numpy.log(numpy.where(total > 0, total, 1.0)), -numpy.inf)
    w = w / numpy.where(total > 0, total, 1.0)
    w = w.transpose(0, 1, 3, 2)[..., None]  # (splits, B, Sq, H, 1)
    out = numpy.where(w > 0, w * numpy.where(numpy.isfinite(o), o, 0.0), 0.0).sum(axis=0)
    return out, lse_out


def decode_split_tiles(split, num_splits, key_first, key_last, block_n):
    """Key tiles [lo, hi) (units of block_n keys) that split ``split`` of ``num_splits`` streams when a
    thread block's rows see keys key_first..key_last (inclusive; key_last < key_first: none).

    The block's tiles are dealt out in contiguous runs of ceil(tiles / num_splits); trailing splits may
    get nothing (lo == hi), and then write out 0 / lse -inf. kernels_cu/decode/fwd.cu does the same.
    """
    if key_last < key_first:
        return 0, 0
    t_lo, t_hi = key_first // block_n, key_last // block_n + 1
    per = -(-(t_hi - t_lo) // num_splits)
    lo = t_lo + split * per
    hi = min(lo + per, t_hi)
    return (lo, hi) if lo < hi else (0, 0)


def decode_split_model(q, k_cache, v_cache, *, seqlens_k, page_table=None, cache_batch_idx=None, softmax_scale=None,
                       causal=False, window_size=(-1, -1), softcap=0.0, num_splits=1, block_m=16, block_n=64):
    """NumPy float64 model of the split-KV decode kernel: the work split, the tile loop and the partial
    results, before the combine.

    ``q`` is the (already rotated) query, the caches already hold the new keys, ``seqlens_k`` (B,) the
    key count of each entry. Like the kernel: one thread block per (m-block, split, KV head, batch) whose
    16 rows are the group's query heads packed with the queries (row r = query r // g, head r % g of the
    group, g = heads // kv_heads); the keys its real rows can see, rounded out to tiles of block_n, are
    dealt to the splits by ``decode_split_tiles``; each split runs an online softmax over its tiles with
    the per-element mask (key < seqlen, causal / window bottom-right) and writes its normalised out and
    lse (0 and -inf when it has no tile or sees nothing).

    Returns (out_partial (splits, B, Sq, H, D), lse_partial (splits, B, H, Sq)); ``combine_ref`` of
    them must equal ``kvcache_attention_ref``.
    """
    q = _to_numpy(q).astype(numpy.float64)
    kc = _to_numpy(k_cache).astype(numpy.float64)
    vc = _to_numpy(v_cache).astype(numpy.float64)
    batch, sq, h, d = q.shape
    hkv = kc.shape[2]
    g = h // hkv
    scale = _scale(softmax_scale, d)
    left, right = _effective_window(causal, window_size)
    rows = g * sq
    m_blocks = -(-rows // block_m)
    o_part = numpy.zeros((num_splits, batch, sq, h, d))
    lse_part = numpy.full((num_splits, batch, h, sq), -numpy.inf)
    for b in range(batch):
        n = int(seqlens_k[b])
        kb, vb = gather_kv_ref(kc, vc, b, n, page_table=page_table, cache_batch_idx=cache_batch_idx)
        kb, vb = kb[0], vb[0]
        diag = n - sq
        for kvh in range(hkv):
            for mb in range(m_blocks):
                r = numpy.arange(mb * block_m, min((mb + 1) * block_m, rows))
                qi, head = r // g, kvh * g + r % g
                # keys each real row sees, inclusive [lo, hi] (the kernel's per-element mask)
                lo = numpy.maximum(0, qi + diag - left) if left >= 0 else numpy.zeros_like(qi)
                hi = numpy.minimum(n - 1, qi + diag + right) if right >= 0 else numpy.full_like(qi, n - 1)
                key_first = max(0, qi[0] + diag - left) if left >= 0 else 0
                key_last = min(n - 1, qi[-1] + diag + right) if right >= 0 else n - 1
                qrows = q[b, qi, head]  # (rows, d)
                for split in range(num_splits):
                    t_lo, t_hi = decode_split_tiles(split, num_splits, key_first, key_last, block_n)
                    m = numpy.full(len(r), -numpy.inf)
                    l = numpy.zeros(len(r))
                    acc = numpy.zeros((len(r), d))
                    for t in range(t_lo, t_hi):
                        j = numpy.arange(t * block_n, min((t + 1) * block_n, n))
                        s = scale * (qrows @ kb[j, kvh].T)
                        if softcap > 0:
                            s = softcap * numpy.tanh(s / softcap)
                        vis = (j[None, :] >= lo[:, None]) & (j[None, :] <= hi[:, None])
                        s = numpy.where(vis, s, -numpy.inf)
                        m_new = numpy.maximum(m, s.max(axis=1))
                        m_safe = numpy.where(numpy.isfinite(m_new), m_new, 0.0)
                        alpha = numpy.exp(m - m_safe)
                        p = numpy.exp(s - m_safe[:, None])
                        l = alpha * l + p.sum(axis=1)
                        acc = alpha[:, None] * acc + p @ vb[j, kvh]
                        m = m_new
                    seen = l > 0
                    o_part[split, b, qi, head] = numpy.where(seen[:, None], acc / numpy.where(seen, l, 1.0)[:, None],
                                                             0.0)
                    with numpy.errstate(divide="ignore"):
                        lse_part[split, b, head, qi] = numpy.where(seen, m + numpy.log(numpy.where(seen, l, 1.0)),
                                                                   -numpy.inf)
    return o_part, lse_part


# ----------------------------------------------------------------------------------------------------
# FP8 quantisation (cuflash.fp8.quantize)
# ----------------------------------------------------------------------------------------------------

def fwht(x):
    """Un-normalised fast Walsh-Hadamard transform along the last axis: x @ H_d, H_d the Sylvester Hadamard
    matrix (symmetric, H_d H_d = d I). Computed in x's dtype with the kernel's butterflies in its order:
    stage h = 1, 2, ..., d/2 maps each pair (i, i + h), bit h of i clear, to (x_i + x_{i+h}, x_i - x_{i+h}),
    so in float32 it reproduces the kernel's rounding exactly."""
    x = numpy.asarray(x)
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"the last dimension must be a power of two; got {d}")
    y, h = x, 1
    while h < d:
        pairs = y.reshape(x.shape[:-1] + (d // (2 * h), 2, h))
        lo, hi = pairs[..., 0, :], pairs[..., 1, :]
        y = numpy.stack((lo + hi, lo - hi), axis=-2).reshape(x.shape)
        h *= 2
    return y


def hadamard_rotate(x, seed, *, inverse=False):
    """The rotation of ``cuflash.fp8.quantize(hadamard=True, seed=seed)`` in float64 along the last axis:
    x diag(s) H_d / sqrt(d), or with ``inverse=True`` its inverse (and transpose) y H_d diag(s) / sqrt(d)."""
    from .fp8 import hadamard_signs

    x = _to_numpy(x).astype(numpy.float64)
    d = x.shape[-1]
    s = hadamard_signs(d, seed).astype(numpy.float64)
    if inverse:
        return fwht(x) / math.sqrt(d) * s
    return fwht(x * s) / math.sqrt(d)


def e4m3_bits(x):
    """float32 values -> OCP float8_e4m3fn bit patterns (uint8): round to nearest even, saturating to
    ±448 (``cvt.rn.satfinite``: finite values and ±inf clip to ±448, NaN stays NaN)."""
    import ml_dtypes

    x = numpy.asarray(x, dtype=numpy.float32)
    return numpy.clip(x, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).view(numpy.uint8)


def e4m3_table():
    """The 256 values of OCP float8_e4m3fn, float64, indexed by the bit pattern, from the format's definition:
    1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent field 0 holds the subnormals m/8 * 2^-6
    (and +-0); 0x7F and 0xFF are NaN; no infinities, so exponent field 15 holds finite values up to 448."""
    bits = numpy.arange(256)
    exponent, mantissa = (bits >> 3) & 0xF, (bits & 0x7).astype(numpy.float64)
    magnitude = numpy.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * numpy.exp2(exponent - 7.0))
    magnitude[(bits & 0x7F) == 0x7F] = numpy.nan
    return numpy.where(bits & 0x80, -magnitude, magnitude)


def _e4m3_lookup(bits, dtype, xp):
    """``e4m3_table`` values of uint8 ``bits`` in ``dtype`` (the index widened first: every CuPy version takes
    a signed index array)."""
    return xp.asarray(e4m3_table(), dtype=dtype)[xp.asarray(bits, dtype=xp.uint8).astype(xp.intp)]


def e4m3_values(bits):
    """uint8 e4m3 bit patterns -> float32 values (NumPy or CuPy, like ``bits``), through ``e4m3_table``."""
    xp = _get_xp(bits)
    return _e4m3_lookup(bits, xp.float32, xp)


def round_e4m3(x):
    """Values rounded to the nearest e4m3 value, ties to even, saturating to +-448 (``cvt.rn.satfinite``);
    NumPy or CuPy, in x's float dtype. In [2^e, 2^(e+1)), e >= -6, e4m3 values are 2^(e-3) apart (3 mantissa
    bits), below 2^-6 (subnormals) 2^-9 apart; x / step is exact, and rint's ties-to-even on it is even in
    the last mantissa bit."""
    xp = _get_xp(x)
    _, e = xp.frexp(x)  # |x| in [2^(e-1), 2^e)
    step = xp.ldexp(xp.ones_like(x), xp.maximum(e - 1, -6) - 3)
    return xp.clip(xp.rint(x / step) * step, -448.0, 448.0)


def e4m3_ulp_distance(a, b):
    """How many e4m3 steps apart two arrays of e4m3 bit patterns are (int array; +0 and -0 are 0 apart).
    NaN patterns (0x7f, 0xff) are 0 apart from each other and 255 from anything else."""
    a, b = (numpy.asarray(v, dtype=numpy.uint8).astype(numpy.int32) for v in (a, b))

    def ordered(v):  # sign-magnitude -> a line of integers
        mag = v & 0x7F
        return numpy.where(v & 0x80, -mag, mag)

    nan_a, nan_b = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    dist = numpy.abs(ordered(a) - ordered(b))
    return numpy.where(nan_a | nan_b, numpy.where(nan_a & nan_b, 0, 255), dist)


def _group_amax(y, block):
    """max |y| (NaN left out) over each (batch, head, block of rows) of y (batch, seqlen, heads, d):
    (batch, heads, num_blocks), in y's dtype."""
    b, s, h, d = y.shape
    nblk = -(-s // block)
    a = numpy.abs(y)
    if nblk * block != s:  # zero rows do not change a max of absolute values
        a = numpy.concatenate((a, numpy.zeros((b, nblk * block - s, h, d), a.dtype)), axis=1)
    a = a.reshape(b, nblk, block, h, d).transpose(0, 3, 1, 2, 4).reshape(b, h, nblk, block * d)
    return numpy.fmax.reduce(a, axis=-1, initial=0.0)  # fmax: NaN loses


def _per_row(g, block, seqlen):
    """(batch, heads, num_blocks) -> (batch, seqlen, heads, 1): each row gets its group's value."""
    return numpy.repeat(g, block, axis=2)[:, :, :seqlen].transpose(0, 2, 1)[..., None]


def fp8_quantize(x, block=FP8_BLOCK, hadamard=True, seed=0, *, compute_dtype="float64"):
    """NumPy reference of ``cuflash.fp8.quantize``: ``(data, descale)``, data uint8 (batch, seqlen, heads, d)
    e4m3 bit patterns, descale float32 (batch, heads, ceil(seqlen / block)).

    ``compute_dtype="float64"`` (default) is the math: x_rot = x diag(s) H_d / sqrt(d) (or x), amax = max
    |x_rot| per (batch, head, block of rows) (NaN left out), descale = amax / 448, data = e4m3(x_rot /
    descale); the float64 quotient is rounded to float32, then to e4m3 (ml_dtypes converts through float32
    too). ``"float32"`` repeats the kernel's own fp32 arithmetic (kernels_cu/fp8/quantize.cu, top comment):
    y = fwht(x * s) un-normalised in fp32, a = max |y|, data = e4m3(y * fp32(448 / a)), descale = a *
    fp32(1 / (448 sqrt(d))); the kernel should match it bit for bit. Both apply the kernel's edge rules: a
    group of zeros gets descale 1, and an amax below fp8.AMAX_FLOOR (on the un-normalised values) is
    raised to it.
    """
    from .fp8 import AMAX_FLOOR, FP8_MAX, descale_per_amax, hadamard_signs

    x = _to_numpy(x)
    b, s, h, d = x.shape
    blk = s if block is None else min(int(block), s)
    ct = numpy.dtype(compute_dtype)
    y = x.astype(numpy.float32).astype(ct)  # bf16 / fp16 -> float32 is exact
    if hadamard:
        y = fwht(y * hadamard_signs(d, seed).astype(ct))
    amax = _group_amax(y, blk)  # of the un-normalised values
    zero = amax == 0
    a = numpy.fmax(amax, ct.type(AMAX_FLOOR))
    if ct == numpy.float64:
        norm = math.sqrt(d) if hadamard else 1.0
        descale = numpy.where(zero, 1.0, a / (FP8_MAX * norm))  # amax(x_rot) / 448
        q = (y / norm) / _per_row(descale, blk, s)
        data = e4m3_bits(q.astype(numpy.float32))
        return numpy.ascontiguousarray(data), numpy.ascontiguousarray(descale, dtype=numpy.float32)
    if ct != numpy.float32:
        raise ValueError(f"compute_dtype must be 'float64' or 'float32'; got {compute_dtype!r}")
    with numpy.errstate(divide="ignore"):
        inv = numpy.where(zero, numpy.float32(1), numpy.float32(FP8_MAX) / a).astype(numpy.float32)
    descale = numpy.where(zero, numpy.float32(1), a * descale_per_amax(d, hadamard)).astype(numpy.float32)
    data = e4m3_bits(y * _per_row(inv, blk, s))
    return numpy.ascontiguousarray(data), numpy.ascontiguousarray(descale)


def fp8_dequantize(data, descale, block=FP8_BLOCK, hadamard=True, seed=0):
    """float64 x back from ``fp8_quantize``'s / ``cuflash.fp8.quantize``'s output: e4m3 values times their
    group's descale, then the rotation undone (``hadamard_rotate(..., inverse=True)``)."""
    data, descale = _to_numpy(data), _to_numpy(descale)
    x_rot = _dequantize_e4m3(data, descale, data.shape[1] if block is None else int(block), numpy.float64)
    return hadamard_rotate(x_rot, seed, inverse=True) if hadamard else x_rot


def _dequantize_e4m3(data, descale, block, dtype):
    """e4m3 bytes (batch, seqlen, heads, d) times their descale (batch, heads, n), in ``dtype``: n == 1 is one
    scale per (batch, head), else row i takes entry i // block and n must be ceil(seqlen / block)."""
    xp = _get_xp(data, descale)
    b, s, h, _ = data.shape
    n = -(-s // block)
    if descale.shape[:2] != (b, h) or descale.ndim != 3 or descale.shape[2] not in (1, n):
        raise ValueError(f"descale must be (batch, heads, 1) or (batch, heads, ceil(seqlen / block)) = {(b, h, n)} "
                         f"for data {data.shape} and block {block}; got {descale.shape}")
    rows = xp.arange(s) // block if descale.shape[2] > 1 else xp.zeros(s, dtype=xp.int64)
    per_row = xp.asarray(descale).astype(dtype)[:, :, rows].transpose(0, 2, 1)[..., None]  # (b, s, h, 1)
    return _e4m3_lookup(data, dtype, xp) * per_row


def attention_fp8_ref(q_data, k_data, v_data, q_descale, k_descale, v_descale, *,
                      descale_block=(FP8_BLOCK, FP8_BLOCK),
                      causal=False, softmax_scale=None, round_p=False, compute_dtype="float64"):
    """Attention of FP8 inputs as ``flash_attn_func(..., fp8_format="e4m3")`` defines it, on NumPy or CuPy
    arrays: q, k, v dequantised exactly (``e4m3_table`` values times their descale: q_descale (batch, heads,
    nq), k/v_descale (batch, kv_heads, nk), n == 1 or one entry per ``descale_block`` rows/keys), then
    ``attention_ref`` in ``compute_dtype``. Causal is bottom-right aligned; GQA/MQA as everywhere.

    ``round_p=True`` models the kernel's one further rounding: the unnormalised probabilities exp(s - m),
    m the row maximum, rounded to e4m3 (``round_e4m3``) before the product with V, the row sum taken over
    the unrounded values (the kernel sums P in fp32 before converting it). The kernel's running maximum
    differs from the final m only by the factor the online softmax rescales by, so the model has the
    kernel's kind and size of error, not its exact bits.

    Returns ``out`` (batch, seqlen_q, heads, d) and ``lse`` (batch, heads, seqlen_q) in ``compute_dtype``
    (lse is the unrounded one in both modes).
    """
    xp = _get_xp(q_data, k_data, v_data)
    dtype = _as_dtype(compute_dtype)
    q_block, kv_block = (int(b) for b in descale_block)
    q = _dequantize_e4m3(q_data, q_descale, q_block, dtype)
    k = _dequantize_e4m3(k_data, k_descale, kv_block, dtype)
    v = _dequantize_e4m3(v_data, v_descale, kv_block, dtype)
    if not round_p:
        return attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale, compute_dtype=compute_dtype)
    sq = q.shape[1]
    p, lse, _, _, _ = _forward_probs(q, k, causal=causal, softmax_scale=softmax_scale, window_size=(-1, -1),
                                     dtype=dtype)
    # p = exp(s - lse); its row maximum exp(m - lse) is 1 / sum(exp(s - m)), so exp(s - m) = p / p_max and
    # out = sum(e4m3(exp(s - m)) v) * p_max. Rows that see no key have p = 0 and keep out = 0.
    p_max = p.max(axis=-1, keepdims=True)
    p8 = round_e4m3(p / xp.where(p_max > 0, p_max, dtype.type(1))) * p_max
    o = xp.matmul(p8, v.transpose(0, 2, 1, 3))
    return _merge_heads(o, sq), _lse_layout(lse, sq)
