"""Public functions: exact attention forward and backward on CuPy / DLPack arrays.

Names and semantics follow flash-attn, so switching is a change of import.
"""
from __future__ import annotations

import dataclasses
import numbers

from . import _validate, fa1, fa2, fa3, fp8_attention
from ._interop import Call
from .heuristics import IMPL_PREFERENCE

_FAMILIES = {"fa1": fa1, "fa2": fa2, "fa3": fa3}
IMPLS = tuple(_FAMILIES)

_MASK_DOC = """
    Layout: q is (batch, seqlen_q, heads, headdim); k and v are (batch, seqlen_k, kv_heads, headdim)
    with heads a multiple of kv_heads (GQA/MQA: query head h reads KV head h // (heads // kv_heads)).
    fp16 or bf16; the last dimension contiguous; other strides free (multiples of 8 elements).

    ``causal=True`` is aligned to the bottom-right corner: query i sees key j iff
    j <= i + seqlen_k - seqlen_q. With seqlen_q = 2, seqlen_k = 5 (x = visible)::

        x x x x .
        x x x x x

    and with seqlen_q = 5, seqlen_k = 2 the first three rows see nothing (their output is 0 and their
    log-sum-exp -inf)::

        . .
        . .
        . .
        x .
        x x

    ``window_size=(left, right)`` keeps keys i + seqlen_k - seqlen_q - left <= j <= ... + right
    (-1 = unbounded); ``causal=True`` sets right = 0.
"""


def available_impls(direction: str | None = None) -> list[str]:
    """The cuflash implementations that run on the current GPU (empty without one).

    ``direction="forward"`` or ``"backward"`` keeps only those with a kernel for that direction.
    """
    from ._device import compute_capability, has_gpu

    if direction not in (None, "forward", "backward"):
        raise ValueError(f"direction must be None, 'forward' or 'backward'; got {direction!r}")
    if not has_gpu():
        return []
    features = {"forward": "FWD_FEATURES", "backward": "BWD_FEATURES"}.get(direction)
    return [name for name, fam in _FAMILIES.items()
            if _supports_arch(fam, compute_capability()) is None
            and (features is None or getattr(fam, features) is not None)]


def _supports_arch(family, cc) -> str | None:
    """Why ``family`` cannot run on a GPU of compute capability ``cc`` (None when it can)."""
    if cc < family.MIN_CC:
        return f"it needs sm_{family.MIN_CC[0]}{family.MIN_CC[1]} or newer (this GPU is sm_{cc[0]}{cc[1]})"
    archs = getattr(family, "ARCHS", None)  # arch-specific code (sm_90a) runs on that arch only
    if archs is not None and f"sm_{cc[0]}{cc[1]}a" not in archs:
        return f"it is built for {', '.join(archs)} only (this GPU is sm_{cc[0]}{cc[1]})"
    return None


def headdims(family, direction: str) -> tuple[int, ...]:
    """The head dims of ``family``'s kernel for ``direction`` (a backward may cover fewer than the forward)."""
    return getattr(family, "BWD_HEADDIMS", family.HEADDIMS) if direction == "backward" else family.HEADDIMS


def _supports(family, headdim: int, cc, direction: str, features: set[str], headdim_v: int | None = None) -> str | None:
    """Why ``family`` cannot run this call (None when it can). ``headdim_v``: v's head dim where it differs
    from q and k's."""
    supported = family.FWD_FEATURES if direction == "forward" else family.BWD_FEATURES
    if supported is None:
        return f"it has no {direction} kernel yet"
    why = _supports_arch(family, cc)
    if why is not None:
        return why
    dims = headdims(family, direction)
    if headdim not in dims:
        return f"head dim {headdim} is not supported (supported: {list(dims)})"
    if headdim_v is not None:
        pairs = getattr(family, "FWD_HEADDIM_V", {}) if direction == "forward" else {}
        if headdim_v not in pairs.get(headdim, ()):
            have = ", ".join(f"{d}/{dv}" for d, dvs in sorted(pairs.items()) for dv in dvs) or "none"
            return (f"v's head dim {headdim_v} differs from q and k's {headdim}, which its {direction} does not "
                    f"support (q-k / v head dims it takes: {have})")
    missing = sorted(features - supported)
    if missing:
        return f"its {direction} does not support {', '.join(missing)}"
    return None


def _backward_impl_for(impl: str, headdim: int, features) -> str:
    """The ``impl`` for the backward of a forward that ran on ``impl``: the same family where its backward
    takes this head dim and these features, else "auto" (a forward on impl="fa3" with softcap: FA3's
    backward has no softcap yet, FA2's has). The framework adapters use it so that a training step does
    not fail in the backward after its forward ran."""
    family = _FAMILIES.get(impl)
    if family is None:  # "auto", or a name flash_attn_backward refuses itself
        return impl
    if (family.BWD_FEATURES is None or headdim not in headdims(family, "backward")
            or set(features) - family.BWD_FEATURES):
        return "auto"
    return impl


def _pick_impl(impl: str, headdim: int, device: int, direction: str = "forward", features=frozenset(),
               headdim_v: int | None = None):
    """The kernel family module that runs this call; ValueError saying why when none can."""
    from ._device import compute_capability

    if impl not in IMPLS + ("auto",):
        raise ValueError(f"impl must be one of {IMPLS + ('auto',)}; got {impl!r}")
    cc = compute_capability(device)
    names = IMPL_PREFERENCE[direction] if impl == "auto" else (impl,)
    reasons = {}
    for name in names:
        reasons[name] = _supports(_FAMILIES[name], headdim, cc, direction, set(features), headdim_v)
        if reasons[name] is None:
            return _FAMILIES[name]
    why = "; ".join(f"impl={n!r}: {r}" for n, r in reasons.items())
    raise ValueError(f"no cuflash implementation can run this {direction} call: {why}")


def _features(causal: bool, window: tuple, softcap: float, alibi_slopes, deterministic: bool = False,
              varlen: bool = False, dropout=None) -> set[str]:
    feats = {"gqa"}
    if dropout is not None:
        feats.add("dropout")
    if varlen:
        feats.add("varlen")
    if deterministic:
        feats.add("deterministic")
    if causal:
        feats.add("causal")
    if tuple(window) != (-1, -1):
        feats.add("window")
    if softcap:
        feats.add("softcap")
    if alibi_slopes is not None:
        feats.add("alibi")
    return feats


def _kernel_options(softcap: float, alibi_slopes, dropout, deterministic: bool = False, cu_seqlens=None) -> dict:
    """The optional keyword arguments of a family's forward/backward for the features a call uses."""
    options = {}
    if softcap:
        options["softcap"] = softcap
    if alibi_slopes is not None:
        options["alibi_slopes"] = alibi_slopes
    if dropout is not None:
        options["dropout"] = dropout
    if deterministic:
        options["deterministic"] = True
    if cu_seqlens is not None:
        options["cu_seqlens"] = cu_seqlens
    return options


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What every public call resolves before launching: scale, window, kernel family, kernel options."""

    scale: float
    window: tuple[int, int]
    family: object
    options: dict


def _plan(call, dims, direction: str, *, alibi_index: int, impl, causal, softmax_scale, window_size, softcap,
          alibi_slopes, dropout_p, dropout_seed, dropout_offset, deterministic=False, cu_seqlens=None) -> _Plan:
    """Checks the options shared by the four public functions (in a fixed order, each naming its argument)
    and picks the kernel family. ``alibi_index``: where alibi_slopes sits in ``call``'s arrays."""
    scale = _validate.softmax_scale_or_default(softmax_scale, dims.headdim)
    window = _validate.window_bounds(window_size, causal, dims)
    softcap = _validate.softcap_value(softcap)
    dropout = _validate.dropout_args(dropout_p, dropout_seed, dropout_offset)
    alibi = None
    if alibi_slopes is not None:
        _validate.check_alibi_slopes(call.specs[alibi_index], dims, call.specs[0])
        alibi = call.arrays[alibi_index]
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool; got {type(deterministic).__name__}")
    features = _features(causal, window_size, softcap, alibi_slopes, deterministic, varlen=cu_seqlens is not None,
                         dropout=dropout)
    family = _pick_impl(impl, dims.headdim, call.device.id, direction, features, dims.headdim_v)
    return _Plan(scale, window, family, _kernel_options(softcap, alibi, dropout, deterministic, cu_seqlens))


# Public calls' checks by outcome: (dims, _Plan) of a call, by its arrays' layout (Call.layout), the compute
# capability of their device and its options with their types (so that a refused value never shares a key with
# an accepted one that compares equal, as False and 0.0 do). A call like one checked before skips its checks and
# its choice of kernel family; the families' own plans (fa3.clear_plans) skip the rest.
_CHECKED: dict = {}
_MAX_CHECKED = 1024


def clear_plans() -> None:
    """Forget every memoised check and planned launch: the next call of each layout is checked and planned
    again. Call it after editing ``cuflash.heuristics`` (tile tables, thresholds) at run time, which the plans
    read when they are made."""
    _CHECKED.clear()
    fa3.clear_plans()


def _types(x):
    """The type of ``x``, and of each item of a tuple, all the way down: (-1.0, -1.0) equals (-1, -1) but is
    refused as a window_size."""
    return (tuple, tuple(map(_types, x))) if type(x) is tuple else type(x)


def _checked(call, options: tuple, check, alibi_slopes=None):
    """``check()``'s result for ``call`` with ``options``, memoised (see _CHECKED); unmemoised when the call
    has no layout key, an option is unhashable (a list for window_size) or it has ALiBi slopes (its plan holds
    the slopes array itself)."""
    from ._device import compute_capability

    layout = None if alibi_slopes is not None else call.layout
    if layout is None:
        return check()
    key = (layout, compute_capability(call.device.id), options, _types(options))
    try:
        result = _CHECKED.get(key)
    except TypeError:
        return check()
    if result is None:
        result = check()
        if len(_CHECKED) >= _MAX_CHECKED:
            _CHECKED.clear()
        _CHECKED[key] = result
    return result


def flash_attn_func(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0, return_lse=False,
                    impl="auto", q_descale=None, k_descale=None, v_descale=None, fp8_format=None,
                    descale_block=fp8_attention.DEFAULT_DESCALE_BLOCK):
    """Exact attention softmax(scale · q kᵀ) v without materialising the attention matrix.

    Returns ``out`` (like q; with v's head dim where that differs, which FA3's forward takes at the
    q-k / v head dims ``cuflash.fa3.FWD_HEADDIM_V`` lists, e.g. 192 / 128, and no backward does yet), or
    ``(out, lse)`` with ``return_lse=True``: lse is the fp32 natural
    log-sum-exp of the scaled scores of each row, shape (batch, heads, seqlen_q), -inf for rows that
    see no key. The result is in the caller's framework and computed on its current stream.
    ``softmax_scale`` defaults to 1/sqrt(headdim). ``softcap > 0`` caps the logits:
    softcap · tanh(scale · qkᵀ / softcap) (Gemma-2 style). ``alibi_slopes``: float32 (heads,) array;
    adds -slope[h] · |i + seqlen_k - seqlen_q - j| to the logits. ``dropout_p`` drops attention
    probabilities (after the softmax normalisation, kept ones scaled by 1 / (1 - p)); the mask is a
    function of (``dropout_seed``, ``dropout_offset``, batch, head, row, key) only (Philox, counter
    based), so the backward regenerates it from the same seed and offset and a seed reproduces it;
    ``cuflash.reference.dropout_mask`` computes it. ``impl``: "fa1", "fa2", "fa3" (Hopper) or "auto"
    (the fastest implementation that supports the call on this GPU).

    FP8 (forward only, FA3's Hopper kernel, sm_90a): q, k and v all e4m3, as uint8 arrays of OCP
    float8_e4m3fn bytes with ``fp8_format="e4m3"`` (the only format), or as torch ``float8_e4m3fn`` tensors
    (viewed as uint8 for you: CuPy and DLPack cannot carry fp8). ``cuflash.fp8.quantize`` writes the bytes
    and their scales. ``q_descale``: float32 (batch, heads, nq); ``k_descale``, ``v_descale``: float32
    (batch, kv_heads, nk); None = 1.0. n is 1 (one scale per batch entry and head) or ceil(seqlen /
    block) with ``descale_block=(q_block, kv_block)``: query row i is e4m3(q[b, i, h]) * q_descale[b, h,
    i // q_block], key j likewise with kv_block, which must be a multiple of 128 (the kernel's key tile)
    when nk > 1; the default (256, 256) is ``cuflash.fp8.quantize``'s default block (at d = 128 a kv_block
    that 256 divides takes the faster 256-key tiles). The scores are softmax_scale * (dequantised q)
    (dequantised k)^T; P is rounded to e4m3 for the product with V. Returns bfloat16 out (batch, seqlen_q, heads, headdim) and, with
    ``return_lse=True``, the fp32 LSE. Head dims 64, 128, 256; causal and GQA/MQA; no window_size,
    softcap, alibi_slopes or dropout; ``impl`` "auto" or "fa3". ``cuflash.reference.attention_fp8_ref``
    is the reference.
    """
    import cupy

    if fp8_attention.is_fp8_call(q, k, v, q_descale, k_descale, v_descale, fp8_format, descale_block):
        return fp8_attention.forward(
            q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, fp8_format=fp8_format,
            descale_block=descale_block, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
            dropout_offset=dropout_offset, return_lse=return_lse, impl=impl)
    arrays = [("q", q), ("k", k), ("v", v)] + ([("alibi_slopes", alibi_slopes)] if alibi_slopes is not None else [])
    with Call(arrays) as call:
        def check():
            qs, ks, vs = call.specs[:3]
            dims = _validate.check_qkv(qs, ks, vs)
            return dims, _plan(call, dims, "forward", alibi_index=3, impl=impl, causal=causal,
                               softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                               alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                               dropout_offset=dropout_offset)

        options = ("forward", impl, causal, softmax_scale, window_size, softcap, dropout_p, dropout_seed, dropout_offset)
        dims, plan = _checked(call, options, check, alibi_slopes)
        qa, ka, va = call.arrays[:3]
        out = cupy.empty((dims.batch, dims.seqlen_q, dims.heads, dims.dv), dtype=qa.dtype)
        lse = cupy.empty((dims.batch, dims.heads, dims.seqlen_q), dtype=cupy.float32)
        plan.family.forward(qa, ka, va, out, lse, dims, plan.window, plan.scale, call.stream, **plan.options)
        return (call.wrap(out), call.wrap(lse)) if return_lse else call.wrap(out)


def flash_attn_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0,
                        deterministic=False, impl="auto"):
    """Gradients (dq, dk, dv) of ``flash_attn_func`` given the output gradient ``dout``.

    ``out`` and ``lse`` are what the forward returned (``return_lse=True``); P is recomputed from
    q, k and lse, so nothing of size seqlen_q × seqlen_k is stored. dk and dv have k's shape: for
    GQA/MQA they are summed over the query heads that share a KV head. ``causal``, ``softmax_scale``,
    ``window_size``, ``softcap``, ``alibi_slopes`` and the dropout arguments must be the forward's.
    ``deterministic=True``
    adds the dQ contributions in a fixed order, so the gradients are bit-identical run to run (FA2).
    """
    import cupy

    arrays = [("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse)]
    if alibi_slopes is not None:
        arrays.append(("alibi_slopes", alibi_slopes))
    with Call(arrays) as call:
        def check():
            qs, ks, vs, os_, dos, lses = call.specs[:6]
            dims = _validate.check_qkv(qs, ks, vs)
            _validate.check_v_headdim_is_q_s(dims, "the backward")
            _validate.check_like(os_, qs)
            _validate.check_like(dos, qs)
            _validate.check_lse(lses, dims, qs)
            return dims, _plan(call, dims, "backward", alibi_index=6, impl=impl, causal=causal,
                               softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                               alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                               dropout_offset=dropout_offset, deterministic=deterministic)

        options = ("backward", impl, causal, softmax_scale, window_size, softcap, dropout_p, dropout_seed,
                   dropout_offset, deterministic)
        dims, plan = _checked(call, options, check, alibi_slopes)
        qa, ka, va, oa, doa, lsea = call.arrays[:6]
        dq = cupy.empty_like(qa)
        dk = cupy.empty((dims.batch, dims.seqlen_k, dims.kv_heads, dims.headdim), dtype=qa.dtype)
        dv = cupy.empty_like(dk)
        # (rows of padding before row 0 that the family's backward adds into: fa3's bwd_row_shift)
        shift_of = getattr(plan.family, "bwd_row_shift", None)
        lead = shift_of(dims, plan.window, **plan.options) if shift_of else 0
        dq_accum = cupy.empty((dims.batch, dims.heads, lead + dims.seqlen_q, dims.headdim), dtype=cupy.float32)
        dsum = cupy.empty((dims.batch, dims.heads, dims.seqlen_q), dtype=cupy.float32)
        plan.family.backward(doa, qa, ka, va, oa, lsea, dq, dk, dv, dq_accum, dsum, dims, plan.window, plan.scale,
                             call.stream, **plan.options)
        return call.wrap(dq), call.wrap(dk), call.wrap(dv)


_VARLEN_DOC = """
    Variable-length batches are packed: q is (total_q, heads, headdim) holding the sequences one
    after another, k and v (total_k, kv_heads, headdim); ``cu_seqlens_q`` / ``cu_seqlens_k`` are int32
    (batch + 1,) offsets (sequence b is rows cu[b] .. cu[b + 1] - 1; empty sequences allowed) and
    ``max_seqlen_q`` / ``max_seqlen_k`` the longest lengths. The LSE is (heads, total_q). Masks apply
    per sequence (causal aligned bottom-right within each). ``validate=True`` copies the offsets to
    the host to check them (non-decreasing, within the arrays, within the maxima) — a synchronisation;
    pass ``validate=False`` inside CUDA graphs or hot loops once the inputs are known good. The Hopper
    kernel (FA3) reads K/V a whole tile at a time: rows of k and v after ``cu_seqlens_k[-1]``, if the
    arrays have any, are multiplied by exactly zero but must hold finite numbers (0 × NaN is NaN).
"""


def _varlen_setup(call, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate):
    qs, ks, vs, cqs, cks = call.specs[:5]
    dims = _validate.check_varlen(qs, ks, vs, cqs, cks, max_seqlen_q, max_seqlen_k)
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool; got {type(validate).__name__}")
    if validate:
        cu_q, cu_k = (a.get() for a in call.arrays[3:5])
        _validate.check_cu_seqlens_values("cu_seqlens_q", cu_q, qs.shape[0], dims.seqlen_q, "max_seqlen_q")
        _validate.check_cu_seqlens_values("cu_seqlens_k", cu_k, ks.shape[0], dims.seqlen_k, "max_seqlen_k")
    return dims


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                           softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                           dropout_seed=None, dropout_offset=0, return_lse=False, impl="auto", validate=True):
    """``flash_attn_func`` over a batch of sequences of different lengths, packed without padding.

    Returns ``out`` (like q), or ``(out, lse)`` with ``return_lse=True``.
    """
    import cupy

    arrays = [("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)]
    if alibi_slopes is not None:
        arrays.append(("alibi_slopes", alibi_slopes))
    with Call(arrays) as call:
        dims = _varlen_setup(call, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate)
        qa, ka, va, cu_q, cu_k = call.arrays[:5]
        plan = _plan(call, dims, "forward", alibi_index=5, impl=impl, causal=causal, softmax_scale=softmax_scale,
                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                     dropout_seed=dropout_seed, dropout_offset=dropout_offset, cu_seqlens=(cu_q, cu_k))
        # Rows after cu_seqlens_q[-1] belong to no sequence: they stay 0 with LSE -inf.
        out = cupy.zeros(qa.shape[:2] + (dims.dv,), dtype=qa.dtype)
        lse = cupy.full((dims.heads, qa.shape[0]), -cupy.inf, dtype=cupy.float32)
        if dims.batch and dims.seqlen_q:
            plan.family.forward(qa, ka, va, out, lse, dims, plan.window, plan.scale, call.stream, **plan.options)
        return (call.wrap(out), call.wrap(lse)) if return_lse else call.wrap(out)


def flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                               causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0,
                               deterministic=False, impl="auto", validate=True):
    """Gradients (dq, dk, dv) of ``flash_attn_varlen_func``; arguments as there and as in
    ``flash_attn_backward``."""
    import cupy

    arrays = [("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
              ("out", out), ("dout", dout), ("lse", lse)]
    if alibi_slopes is not None:
        arrays.append(("alibi_slopes", alibi_slopes))
    with Call(arrays) as call:
        dims = _varlen_setup(call, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate)
        _validate.check_v_headdim_is_q_s(dims, "the backward")
        qs, os_, dos, lses = call.specs[0], call.specs[5], call.specs[6], call.specs[7]
        _validate.check_like(os_, qs, packed=True)
        _validate.check_like(dos, qs, packed=True)
        want = (dims.heads, qs.shape[0])
        if lses.shape != want or lses.dtype != "float32" or lses.strides != (qs.shape[0], 1):
            raise ValueError(f"lse must be a contiguous float32 array of shape (heads, total_q) = {want}; got "
                             f"{lses.dtype} {lses.shape} with strides {lses.strides}")
        _validate.check_same_device([qs, lses])
        qa, ka, va, cu_q, cu_k, oa, doa, lsea = call.arrays[:8]
        plan = _plan(call, dims, "backward", alibi_index=8, impl=impl, causal=causal, softmax_scale=softmax_scale,
                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                     dropout_seed=dropout_seed, dropout_offset=dropout_offset, deterministic=deterministic,
                     cu_seqlens=(cu_q, cu_k))
        dq = cupy.zeros_like(qa)  # rows past cu_q[-1] belong to no sequence: 0
        dk = cupy.zeros_like(ka)
        dv = cupy.zeros_like(va)
        if dims.batch and dims.seqlen_q and dims.seqlen_k:
            dq_accum = cupy.empty((dims.heads, qa.shape[0], dims.headdim), dtype=cupy.float32)
            dsum = cupy.empty((dims.heads, qa.shape[0]), dtype=cupy.float32)
            plan.family.backward(doa, qa, ka, va, oa, lsea, dq, dk, dv, dq_accum, dsum, dims, plan.window,
                                 plan.scale, call.stream, **plan.options)
        return call.wrap(dq), call.wrap(dk), call.wrap(dv)


flash_attn_func.__doc__ += _MASK_DOC
flash_attn_backward.__doc__ += _MASK_DOC
flash_attn_varlen_func.__doc__ += _MASK_DOC + _VARLEN_DOC
flash_attn_varlen_backward.__doc__ += _VARLEN_DOC


# ---------------------------------------------------------------------------------------------------------
# Inference: attention over a KV cache (Flash-Decoding) and the merge of split results


def _kv_arrays(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, rotary_cos, rotary_sin):
    """(name, array) of every array argument that is given; cache_seqlens only when it is not a Python int."""
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("page_table", page_table),
             ("cache_batch_idx", cache_batch_idx), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)]
    named = [(n, a) for n, a in named if a is not None]
    if not isinstance(cache_seqlens, numbers.Integral) or isinstance(cache_seqlens, bool):
        named.append(("cache_seqlens", cache_seqlens))
    return named


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, page_table=None,
                            cache_batch_idx=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, num_splits=0,
                            return_softmax_lse=False, check=True, out=None, workspace=None):
    """Attention of new queries over a KV cache, appending new keys/values to the cache first (inference).

    Shapes (fp16 or bf16, last dimension contiguous, other strides free)::

        q                 (batch, seqlen_q, heads, headdim)          seqlen_q >= 1 (1 = plain decoding)
        k_cache, v_cache  (batch_cache, max_seqlen, kv_heads, headdim)  contiguous cache, or
                          (num_pages, page_size, kv_heads, headdim)  paged cache (with page_table)
        k, v              (batch, seqlen_new, kv_heads, headdim)     new tokens, optional
        cache_seqlens     int32 (batch,) on the GPU, or a Python int: the keys already in each entry's cache
        page_table        int32 (batch, max_pages): entry b's key j lives in row j % page_size of page
                          page_table[b, j // page_size] (any page_size >= 1)
        cache_batch_idx   int32 (batch,): entry b uses row cache_batch_idx[b] of a contiguous cache
                          (default: row b; batch_cache must then equal batch)
        rotary_cos/sin    (seqlen_ro, rotary_dim / 2), q's dtype; rotary_dim a multiple of 16, <= headdim

    Paged layout, page_size = 4, page_table[b] = [7, 2, 5, ...], cache_seqlens[b] = 10::

        key j:      0 1 2 3 | 4 5 6 7 | 8 9
        page, row:  7,0..7,3 | 2,0..2,3 | 5,0 5,1

    Steps: (1) k and v are written into the cache **in place** at positions cache_seqlens[b] ..
    cache_seqlens[b] + seqlen_new - 1 (rotary applied to k first when rotary_cos/sin are given);
    (2) q is rotated (positions cache_seqlens[b] + i when causal or windowed, else cache_seqlens[b] for
    every query, as in flash-attn; q itself is not modified); (3) each entry's queries attend to its
    keys_b = cache_seqlens[b] + seqlen_new keys. ``rotary_interleaved=False`` rotates channel i with
    i + rotary_dim / 2 (GPT-NeoX); True rotates pairs (2i, 2i + 1) (GPT-J). Note that flash-attn's
    default is True.

    ``causal=True`` is aligned bottom-right within each entry: query i sees key j iff
    j <= i + keys_b - seqlen_q, so the last query sees every key. seqlen_q = 3, keys_b = 6::

        x x x x . .
        x x x x x .
        x x x x x x

    ``window_size=(left, right)``, ``softcap`` and ``softmax_scale`` as in ``flash_attn_func``. GQA: the
    query heads that share a KV head are processed together, so K/V are read once.

    ``num_splits``: the keys of each entry are split over this many thread blocks whose fp32 partial
    results are merged by their log-sum-exp (Flash-Decoding), which fills the GPU when batch x kv_heads
    is small; 0 lets ``cuflash.heuristics.decode_num_splits`` choose, 1 never splits.

    ``check=True`` (default) copies cache_seqlens, page_table and cache_batch_idx to the host and refuses
    values that would read or write outside the arrays (cache_seqlens + seqlen_new beyond the cache, page
    numbers out of range, rotary positions past seqlen_ro) -- a synchronisation. Pass ``check=False``
    inside CUDA graphs and hot loops once the inputs are known good; wrong values then read or write
    out of bounds. Shapes, dtypes and strides are always checked. With ``check=False`` the call reads no
    device value on the host: ``num_splits=0`` is chosen from the shapes alone (the longest entry is
    taken to fill the cache's capacity; see ``kvcache_num_splits``), so the call can be captured in a
    CUDA graph, and the captured kernels read cache_seqlens / page_table / cache_batch_idx from device
    memory on every replay (new values written in place are honoured).

    ``out`` (optional): the output array, q's shape and dtype on q's device (last dimension contiguous,
    other strides free, not overlapping q); written and returned instead of a new array.
    ``workspace`` (optional): contiguous device memory (any dtype) of at least ``kvcache_workspace_bytes(
    batch, heads, seqlen_q, headdim, num_splits, ...)`` bytes, for the scratch a call would otherwise
    allocate: the fp32 LSE, the fp32 partial results of the KV splits, the rotated q and the device copy
    of an int cache_seqlens. With both, the call allocates nothing, so a captured graph replays into
    fixed addresses that the caller owns (serving engines allocate these once per batch size). Size the
    workspace with the split count the call will use: ``num_splits`` when given, else
    ``kvcache_num_splits(..., paged=page_table is not None)`` at the cache's capacity, an upper bound of
    what check=True picks. A
    workspace that is too small is refused from the shapes alone. With ``return_softmax_lse=True`` the
    returned lse is a view into the workspace.

    Returns ``out`` (like q), or ``(out, lse)`` with ``return_softmax_lse=True`` (lse fp32 (batch, heads,
    seqlen_q), -inf for rows that see no key, whose out is 0).

    CUDA-graph capture (CuPy ``stream.begin_capture()`` / torch ``torch.cuda.graph``): call once eagerly
    first (the first call of a variant compiles and loads it), then capture a ``check=False`` call,
    ideally with ``out=`` and ``workspace=``; without them the outputs and scratch come from the current
    allocator during capture and must stay reserved for the graph's lifetime (a private memory pool).
    """
    import cupy

    from . import decode
    from ._device import compute_capability, device_properties, max_smem_per_block
    from .heuristics import DECODE_MAX_SPLITS, decode_num_splits

    named = _kv_arrays(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cache_batch_idx, rotary_cos, rotary_sin)
    named += [(n, a) for n, a in (("out", out), ("workspace", workspace)) if a is not None]
    with Call(named) as call:
        spec = {s.name: s for s in call.specs}
        arr = {s.name: a for s, a in zip(call.specs, call.arrays)}
        seqlens_arg = spec.get("cache_seqlens", cache_seqlens)
        dims = _validate.check_kvcache(spec["q"], spec["k_cache"], spec["v_cache"], spec.get("k"), spec.get("v"),
                                       seqlens_arg, spec.get("page_table"), spec.get("cache_batch_idx"),
                                       spec.get("rotary_cos"), spec.get("rotary_sin"))
        if not isinstance(rotary_interleaved, bool):
            raise TypeError(f"rotary_interleaved must be a bool; got {type(rotary_interleaved).__name__}")
        scale = _validate.softmax_scale_or_default(softmax_scale, dims.headdim)
        window = _validate.window_bounds(window_size, causal, _validate.Dims(
            dims.batch, dims.seqlen_q, dims.capacity, dims.heads, dims.kv_heads, dims.headdim, dims.dtype))
        softcap = _validate.softcap_value(softcap)
        splits = _validate.num_splits_value(num_splits, DECODE_MAX_SPLITS)
        if not isinstance(check, bool):
            raise TypeError(f"check must be a bool; got {type(check).__name__}")
        q_step = 1 if (causal or tuple(window_size) != (-1, -1)) else 0
        max_keys = dims.capacity
        if check:
            host_seqlens = arr["cache_seqlens"].get() if "cache_seqlens" in arr else [int(cache_seqlens)] * dims.batch
            _validate.check_kvcache_values(
                dims, host_seqlens, arr["page_table"].get() if "page_table" in arr else None,
                arr["cache_batch_idx"].get() if "cache_batch_idx" in arr else None,
                spec["rotary_cos"].shape[0] if "rotary_cos" in spec else None, q_step)
            max_keys = int(max(host_seqlens)) + dims.seqlen_new
        cc = compute_capability(call.device.id)
        why = _supports_arch(decode, cc)
        if why is None and dims.headdim not in decode.HEADDIMS:
            why = f"head dim {dims.headdim} is not supported (supported: {list(decode.HEADDIMS)})"
        if why is not None:
            raise ValueError(f"flash_attn_with_kvcache cannot run this call: {why}")
        mb = decode.m_blocks(dims)
        num_sms = device_properties(call.device.id)["multiProcessorCount"]
        max_smem = max_smem_per_block(call.device.id)
        if splits == 0:
            tiles = decode.tiles(dims.headdim, max_smem)
            splits = decode_num_splits(dims.batch, dims.kv_heads, mb, max_keys, tiles.block_n, num_sms,
                                       paged=dims.paged and tiles.paged_rule,
                                       page_size=dims.page_size if dims.paged else None)
        _validate.check_grid_x(splits * mb, "flash_attn_with_kvcache (num_splits x query blocks)")
        if "out" in spec:
            _validate.check_like(spec["out"], spec["q"])
            if spec["out"].ptr == spec["q"].ptr:
                raise ValueError("out must not be q itself (the kernels read q while out is written)")
        rotary, int_seqlens = "rotary_cos" in arr, "cache_seqlens" not in arr
        scratch = None
        if "workspace" in spec:
            layout, need = decode.workspace_layout(dims.batch, dims.seqlen_q, dims.heads, dims.headdim, splits,
                                                   dims.dtype, rotary=rotary, seqlens_vector=int_seqlens)
            decode.check_workspace(spec["workspace"], spec["q"], need, _workspace_parts(splits, rotary, int_seqlens))
            scratch = decode.carve(arr["workspace"], layout, arr["q"].dtype)

        def buffer(name, shape, dtype):  # from the workspace when there is one, else a new array
            return scratch[name] if scratch is not None else cupy.empty(shape, dtype=dtype)

        qa = arr["q"]
        seqlens_dev = arr.get("cache_seqlens")
        if seqlens_dev is None:
            seqlens_dev = buffer("cache_seqlens", (dims.batch,), cupy.int32)
            seqlens_dev.fill(int(cache_seqlens))
        pt, cbi = arr.get("page_table"), arr.get("cache_batch_idx")
        rc, rs = arr.get("rotary_cos"), arr.get("rotary_sin")
        q_rot = buffer("q_rot", qa.shape, qa.dtype) if rotary else None
        if q_rot is not None or dims.seqlen_new:
            decode.append(qa, arr["k_cache"], arr["v_cache"], arr.get("k"), arr.get("v"), q_rot, seqlens_dev, pt, cbi,
                          rc, rs, dims, rotary_interleaved, q_step, call.stream)
        out_arr = arr["out"] if "out" in arr else cupy.empty(qa.shape, dtype=qa.dtype)
        lse = buffer("lse", (dims.batch, dims.heads, dims.seqlen_q), cupy.float32)
        o_part = lse_part = None
        if splits > 1:
            o_part = buffer("o_partial", (splits,) + qa.shape, cupy.float32)
            lse_part = buffer("lse_partial", (splits, dims.batch, dims.heads, dims.seqlen_q), cupy.float32)
        decode.forward(qa if q_rot is None else q_rot, arr["k_cache"], arr["v_cache"], out_arr, lse, seqlens_dev, pt,
                       cbi, dims, window, scale, softcap, splits, num_sms, call.stream, o_partial=o_part,
                       lse_partial=lse_part, max_smem=max_smem)
        result = out if out is not None else call.wrap(out_arr)
        return (result, call.wrap(lse)) if return_softmax_lse else result


def _workspace_parts(splits: int, rotary: bool, int_seqlens: bool) -> str:
    parts = ["the fp32 LSE"]
    if splits > 1:
        parts.append(f"the fp32 partial results of {splits} KV splits")
    if rotary:
        parts.append("the rotated q")
    if int_seqlens:
        parts.append("cache_seqlens as an int32 vector")
    return ", ".join(parts)


def kvcache_num_splits(batch, heads, kv_heads, seqlen_q, headdim, max_keys, *, paged=False, page_size=None,
                       device=None) -> int:
    """The number of KV splits ``flash_attn_with_kvcache(num_splits=0)`` uses on ``device`` (default: the
    current one) for this call's sizes; ``paged=True`` for a paged cache (a call with a ``page_table``), which
    may take more splits, and its ``page_size`` (k_cache.shape[1]; None: the count of the smallest pages,
    an upper bound for any). ``max_keys``: the keys of the longest entry after the append --
    with ``check=False`` the call takes the cache's capacity (k_cache.shape[1], or page_table.shape[1] x
    page_size); with ``check=True`` max(cache_seqlens) + seqlen_new, never more than the capacity, and the
    count never grows with fewer keys: the capacity's count bounds both (size workspaces with it)."""
    from . import decode
    from ._device import device_id, device_properties, max_smem_per_block
    from .heuristics import DECODE_TILES, decode_num_splits

    if headdim not in DECODE_TILES:
        raise ValueError(f"head dim {headdim} is not supported by flash_attn_with_kvcache "
                         f"(supported: {sorted(DECODE_TILES)})")
    if min(batch, heads, kv_heads, seqlen_q) < 1 or heads % kv_heads or max_keys < 0:
        raise ValueError(f"kvcache_num_splits: need batch, heads, kv_heads, seqlen_q >= 1 with heads a multiple of "
                         f"kv_heads and max_keys >= 0; got {batch}, {heads}, {kv_heads}, {seqlen_q}, {max_keys}")
    dims = _validate.KvDims(batch, seqlen_q, heads, kv_heads, headdim, "bfloat16", 0, False, 0, batch, max_keys)
    dev = device_id() if device is None else device
    sms = device_properties(dev)["multiProcessorCount"]
    if not isinstance(paged, bool):
        raise TypeError(f"paged must be a bool; got {type(paged).__name__}")
    if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1):
        raise ValueError(f"page_size must be a positive int or None; got {page_size!r}")
    tiles = decode.tiles(headdim, max_smem_per_block(dev))
    return decode_num_splits(batch, kv_heads, decode.m_blocks(dims), max_keys, tiles.block_n, sms,
                             paged=paged and tiles.paged_rule, page_size=page_size)


def kvcache_workspace_bytes(batch, heads, seqlen_q, headdim, num_splits, *, dtype="bfloat16", rotary=False,
                            int_cache_seqlens=False) -> int:
    """Bytes of the ``workspace=`` a ``flash_attn_with_kvcache`` call with these sizes needs: q of shape
    (batch, seqlen_q, heads, headdim) in ``dtype``, ``num_splits`` KV splits (the count the call uses:
    the argument when nonzero, else ``kvcache_num_splits``), ``rotary`` when rotary_cos/sin are given,
    ``int_cache_seqlens`` when cache_seqlens is a Python int. A larger workspace serves every smaller
    call (fewer splits, smaller batch)."""
    from . import decode

    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 1:
        raise ValueError(f"num_splits must be the split count the call uses (>= 1); got {num_splits!r}")
    return decode.workspace_layout(batch, seqlen_q, heads, headdim, int(num_splits), _dtype_name(dtype),
                                   rotary=rotary, seqlens_vector=int_cache_seqlens)[1]


def flash_attn_combine(out_partial, lse_partial, *, out_dtype=None):
    """Merge partial attention results computed over disjoint key sets by their log-sum-exp.

    ``out_partial`` float32 (num_splits, batch, seqlen, heads, headdim), each split normalised over its own
    keys (last dimension contiguous, other strides free); ``lse_partial`` float32 (num_splits, batch, heads,
    seqlen). Returns ``(out, lse)``: out (batch, seqlen, heads, headdim) in ``out_dtype`` ("float32"
    (default), "float16" or "bfloat16"), out = sum_s exp(lse_s - lse) out_s, and lse (batch, heads,
    seqlen) float32 = log sum_s exp(lse_s). A split with lse -inf contributes nothing (its out may hold
    anything, NaN included); a row whose splits are all -inf gives out 0 and lse -inf.
    """
    import cupy

    from . import decode

    with Call([("out_partial", out_partial), ("lse_partial", lse_partial)]) as call:
        op_spec, lp_spec = call.specs
        ns, b, s, h, d = _validate.check_combine(op_spec, lp_spec)
        name = _dtype_name(out_dtype)
        if name not in decode.COMBINE_DTYPE_CODES:
            raise ValueError(f"out_dtype must be None, 'float32', 'float16' or 'bfloat16'; got {out_dtype!r}")
        cc = _device_cc(call)
        if cc < decode.MIN_CC:
            raise ValueError(f"flash_attn_combine needs sm_{decode.MIN_CC[0]}{decode.MIN_CC[1]} or newer "
                             f"(this GPU is sm_{cc[0]}{cc[1]})")
        out = cupy.empty((b, s, h, d), dtype=name)
        lse = cupy.empty((b, h, s), dtype=cupy.float32)
        decode.combine(call.arrays[0], call.arrays[1], out, lse, call.stream)
        return call.wrap(out), call.wrap(lse)


def _dtype_name(dt) -> str:
    """"float32" / "float16" / "bfloat16" from None, a string, a NumPy/CuPy dtype or type, or a torch dtype."""
    if dt is None:
        return "float32"
    if isinstance(dt, str):
        return dt
    name = getattr(dt, "name", None)  # numpy dtypes
    if isinstance(name, str):
        return name
    text = str(dt)  # "torch.bfloat16", "<class 'numpy.float16'>"
    for n in ("bfloat16", "float16", "float32"):
        if text.endswith(n) or text.endswith(n + "'>"):
            return n
    return text


def _device_cc(call):
    from ._device import compute_capability

    return compute_capability(call.device.id)
