"""CPU tier: one table of every public function x every class of bad input that can be refused without
device memory. Each row must raise ValueError/TypeError before any kernel runs, with a message that
names the argument and says what was expected.

How it runs without a GPU:
  * "spec" rows call the public functions themselves with ``Spec`` records (shape, strides, dtype,
    device, pointer) in place of arrays: ``cuflash.api.Call`` is replaced by a stand-in that hands the
    Specs to the real checks (``cuflash._validate``, ``api._pick_impl``), the GPU's compute capability
    is faked, and the kernel launches are replaced by a sentinel. ``test_good_calls_reach_the_kernel``
    shows that the same calls with the one problem removed pass every check, so each row fails for its
    own reason.
  * "host" rows go through the real ``Call``: host arrays (numpy), host DLPack objects and non-arrays
    are refused with a TypeError naming the argument, before anything is converted.
  * a few rows call a validator directly (``_validate.check_headdim``).
The variable-length functions run on Specs too: their ``cu_seqlens_*`` Specs carry the offsets, and
``.get()`` (the host copy ``validate=True`` makes) returns them, so the checks of the values run as well.
Row ids read "function-argument-problem"; a few arguments are sizes rather than parameters ("headdim",
"batch", "heads", "seqlen_q", "seqlen_k": the grid and int32 launch limits).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import types
from typing import Callable, NamedTuple
from unittest import mock

import numpy as np
import pytest

import cuflash
from cuflash import _device, _validate, api
from cuflash._interop import Spec

B, SQ, SK, H, HKV, D = 2, 64, 80, 8, 2, 64
GOOD_CC = (9, 0)
# packed (variable-length) inputs: three sequences, one of them empty, and unused rows after the last
CU_Q, CU_K = (0, 17, 17, 60), (0, 30, 50, 80)
TQ, TK = 64, 80  # packed rows of q and of k/v
MAXQ, MAXK = 43, 30  # the longest sequences of CU_Q and CU_K
FIXED = ("flash_attn_func", "flash_attn_backward")
VARLEN = ("flash_attn_varlen_func", "flash_attn_varlen_backward")
PUBLIC = FIXED + VARLEN
DIRECTION = {"flash_attn_func": "forward", "flash_attn_backward": "backward",
             "flash_attn_varlen_func": "forward", "flash_attn_varlen_backward": "backward"}
# the positional arguments of each public function, in signature order
# (test_positional_arguments_match_the_signatures keeps this honest)
POSITIONAL = {
    "flash_attn_func": ("q", "k", "v"),
    "flash_attn_backward": ("dout", "q", "k", "v", "out", "lse"),
    "flash_attn_varlen_func": ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
    "flash_attn_varlen_backward": ("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k",
                                   "max_seqlen_q", "max_seqlen_k"),
}
SCALARS = ("max_seqlen_q", "max_seqlen_k")  # positional but not arrays
ARRAY_ARGS = {fn: tuple(n for n in names if n not in SCALARS) for fn, names in POSITIONAL.items()}
FWD_ARRAYS, BWD_ARRAYS = ARRAY_ARGS["flash_attn_func"], ARRAY_ARGS["flash_attn_backward"]
FAMILIES = dict(api._FAMILIES)
ALL_HEADDIMS = sorted({d for fam in FAMILIES.values() for d in fam.HEADDIMS})


# ----------------------------------------------------------------------------------------------------
# Spec builders
# ----------------------------------------------------------------------------------------------------

def spec(shape, dtype="bfloat16", strides=None, device=0, ptr=0x10000) -> Spec:
    """A Spec (strides in elements, C-contiguous by default); the name is set by the call."""
    if strides is None:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= s
        strides = tuple(reversed(strides))
    return Spec("", tuple(shape), tuple(strides), dtype, device, ptr)


def arrays(b=B, sq=SQ, sk=SK, h=H, hkv=HKV, d=D, dtype="bfloat16", **over) -> dict:
    """Good Specs for every array argument of both functions, then ``over`` replaces some."""
    out = {
        "q": spec((b, sq, h, d), dtype), "k": spec((b, sk, hkv, d), dtype), "v": spec((b, sk, hkv, d), dtype),
        "out": spec((b, sq, h, d), dtype), "dout": spec((b, sq, h, d), dtype),
        "lse": spec((b, h, sq), "float32"),
    }
    out.update(over)
    return out


def slopes(n=H, dtype="float32", strides=None, device=0):
    return spec((n,), dtype, strides=strides, device=device)


@dataclasses.dataclass(frozen=True)
class CuSpec(Spec):
    """A cu_seqlens Spec that also holds its offsets: ``.get()`` is the host copy ``validate=True`` reads."""

    values: tuple = ()

    def get(self):
        return np.asarray(self.values, dtype=np.int32)


def cu(values, dtype="int32", shape=None, strides=None, device=0) -> CuSpec:
    values = tuple(values)
    shape = (len(values),) if shape is None else tuple(shape)
    base = spec(shape, dtype, strides=strides, device=device)
    return CuSpec(**{f.name: getattr(base, f.name) for f in dataclasses.fields(Spec)}, values=values)


def varlen_arrays(tq=TQ, tk=TK, h=H, hkv=HKV, d=D, dtype="bfloat16", cu_q=CU_Q, cu_k=CU_K, max_q=MAXQ, max_k=MAXK,
                  **over) -> dict:
    """Good positional arguments of both variable-length functions (packed Specs, offsets, maxima), then
    ``over`` replaces some."""
    out = {
        "q": spec((tq, h, d), dtype), "k": spec((tk, hkv, d), dtype), "v": spec((tk, hkv, d), dtype),
        "out": spec((tq, h, d), dtype), "dout": spec((tq, h, d), dtype), "lse": spec((h, tq), "float32"),
        "cu_seqlens_q": cu(cu_q), "cu_seqlens_k": cu(cu_k), "max_seqlen_q": max_q, "max_seqlen_k": max_k,
    }
    out.update(over)
    return out


def default_arrays(fn) -> dict:
    return varlen_arrays() if fn in VARLEN else arrays()


# ----------------------------------------------------------------------------------------------------
# the table
# ----------------------------------------------------------------------------------------------------

class Case(NamedTuple):
    fn: str  # the function called ("flash_attn_func", "flash_attn_backward", or a validator)
    arg: str  # the argument that is wrong
    problem: str
    mode: str  # "spec", "host" or "direct" (see the module docstring)
    call: Callable[[], object]
    exc: type
    words: tuple  # substrings the message must contain
    cc: tuple = GOOD_CC  # the compute capability the "spec" environment reports
    gap: str = ""  # a known hole in the checks: the row is a strict xfail until it is closed

    @property
    def id(self):
        return f"{self.fn}-{self.arg}-{self.problem}"


def _public(fn_name, arrs, kwargs):
    fn = getattr(cuflash, fn_name)
    return lambda: fn(*(arrs[n] for n in POSITIONAL[fn_name]), **kwargs)


CASES: list[Case] = []


def add(fn, arg, problem, exc, words, *, arrs=None, mode="spec", call=None, cc=GOOD_CC, gap="", **kwargs):
    """One row; ``arrs`` the positional arguments by name (default: good ones for ``fn``), ``kwargs`` the
    public function's keyword arguments."""
    if call is None:
        call = _public(fn, arrs if arrs is not None else default_arrays(fn), kwargs)
    CASES.append(Case(fn, arg, problem, mode, call, exc, tuple(words), cc, gap))


def both(arg, problem, exc, words, **kw):
    """The same problem through both fixed-length functions (they share the q/k/v/scale/window/impl checks)."""
    for fn in FIXED:
        add(fn, arg, problem, exc, words, **kw)


def packed(arg, problem, exc, words, **kw):
    """The same problem through both variable-length functions (they share check_varlen and the host checks)."""
    for fn in VARLEN:
        add(fn, arg, problem, exc, words, **kw)


def every(arg, problem, exc, words, **kw):
    """The same problem through all four public functions (keyword arguments only: the arrays are each
    function's good defaults)."""
    for fn in PUBLIC:
        add(fn, arg, problem, exc, words, **kw)


# --- q, k, v: rank, dtype, shapes, heads, sizes, strides, alignment, device (both functions) ---------
both("q", "rank3", ValueError, ["q must have 4 dimensions", "(batch, seqlen, heads, headdim)", "(2, 64, 512)"],
     arrs=arrays(q=spec((B, SQ, H * D))))
both("q", "rank5", ValueError, ["q must have 4 dimensions", "(2, 64, 8, 64, 1)"], arrs=arrays(q=spec((B, SQ, H, D, 1))))
both("k", "rank3", ValueError, ["k must have 4 dimensions"], arrs=arrays(k=spec((B, SK, HKV * D))))
both("v", "rank2", ValueError, ["v must have 4 dimensions"], arrs=arrays(v=spec((SK, HKV * D))))
for arg, dt in (("q", "float32"), ("q", "float64"), ("k", "int8"), ("v", "float32"), ("q", "uint16")):
    both(arg, f"dtype_{dt}", TypeError, [f"{arg} must be float16 or bfloat16", dt],
         arrs=arrays(**{arg: spec(arrays()[arg].shape, dt)}))
both("k", "dtype_differs_from_q", TypeError, ["k must have the dtype of q (bfloat16)", "float16"],
     arrs=arrays(k=spec((B, SK, HKV, D), "float16")))
both("v", "dtype_differs_from_q", TypeError, ["v must have the dtype of q (float16)", "bfloat16"],
     arrs=arrays(dtype="float16", v=spec((B, SK, HKV, D), "bfloat16")))
both("k", "batch_mismatch", ValueError, ["k must have q's batch size 2", "got 3"],
     arrs=arrays(k=spec((3, SK, HKV, D)), v=spec((3, SK, HKV, D))))
both("v", "shape_differs_from_k", ValueError, ["k and v must have the same shape", "(2, 81, 2, 64)"],
     arrs=arrays(v=spec((B, SK + 1, HKV, D))))
both("v", "heads_differ_from_k", ValueError, ["k and v must have the same shape"], arrs=arrays(v=spec((B, SK, 4, D))))
both("k", "headdim_mismatch", ValueError, ["k must have q's head dim 64", "got 128"],
     arrs=arrays(k=spec((B, SK, HKV, 128)), v=spec((B, SK, HKV, 128))))
# v's head dim may differ from q and k's only in FA3's forward, at the pairs fa3.FWD_HEADDIM_V lists
for _impl in ("fa1", "fa2"):
    add("flash_attn_func", "v", f"headdim_differs_{_impl}", ValueError,
        [f"impl={_impl!r}", "v's head dim 64 differs from q and k's 128", "q-k / v head dims it takes: none"],
        arrs=arrays(d=128, v=spec((B, SK, HKV, 64))), impl=_impl)
add("flash_attn_func", "v", "headdim_pair_fa3_lacks", ValueError,
    ["impl='fa3'", "v's head dim 128 differs from q and k's 64", "128/64, 192/128, 256/128"],
    arrs=arrays(v=spec((B, SK, HKV, 128))), impl="fa3")
add("flash_attn_backward", "v", "headdim_differs", ValueError,
    ["v's head dim 128 differs from q and k's 192", "the backward needs them equal"],
    arrs=arrays(d=192, v=spec((B, SK, HKV, 128)), out=spec((B, SQ, H, 128))))
both("k", "heads_not_divisible", ValueError, ["query heads (8)", "multiple", "KV heads in k/v (3)"],
     arrs=arrays(hkv=3))
both("k", "more_kv_heads_than_heads", ValueError, ["query heads (8)", "KV heads in k/v (16)"], arrs=arrays(hkv=16))
both("k", "zero_kv_heads", ValueError, ["query heads (8)", "KV heads in k/v (0)"], arrs=arrays(hkv=0))
both("q", "zero_heads", ValueError, ["q must have at least one batch entry and one head", "(2, 64, 0, 64)"],
     arrs=arrays(h=0))
both("q", "zero_batch", ValueError, ["q must have at least one batch entry", "(0, 64, 8, 64)"], arrs=arrays(b=0))
both("q", "empty_seqlen", ValueError, ["seqlen_q must be at least 1", "(2, 0, 8, 64)"], arrs=arrays(sq=0))
both("k", "empty_seqlen", ValueError, ["seqlen_k must be at least 1", "(2, 0, 2, 64)"], arrs=arrays(sk=0))
for arg in ("q", "k", "v"):
    shape = arrays()[arg].shape
    c = spec(shape).strides
    both(arg, "headdim_not_contiguous", ValueError,
         [f"{arg}'s last dimension (headdim) must be contiguous (stride 1)", "got strides"],
         arrs=arrays(**{arg: spec(shape, strides=(c[0] * 2, c[1] * 2, c[2] * 2, 2))}))
both("q", "batch_stride_unaligned", ValueError, ["q's batch stride must be a multiple of 16 bytes (8 elements)", "4100"],
     arrs=arrays(q=spec((B, SQ, H, D), strides=(4100, H * D, D, 1))))
both("k", "seqlen_stride_unaligned", ValueError, ["k's seqlen stride must be a multiple of 16 bytes", "132"],
     arrs=arrays(k=spec((B, SK, HKV, D), strides=(SK * 132, 132, 66, 1))))
both("v", "heads_stride_unaligned", ValueError, ["v's heads stride must be a multiple of 16 bytes", "68"],
     arrs=arrays(v=spec((B, SK, HKV, D), strides=(SK * 256, 256, 68, 1))))
for arg, ptr in (("q", 0x10002), ("k", 0x10008), ("v", 0x1000E)):
    both(arg, "pointer_unaligned", ValueError, [f"{arg}'s data must start at a 16-byte aligned address", hex(ptr)],
         arrs=arrays(**{arg: dataclasses.replace(arrays()[arg], ptr=ptr)}))
for arg in ("k", "v"):
    both(arg, "other_device", ValueError, [f"{arg} is on CUDA device 1 but q is on device 0"],
         arrs=arrays(**{arg: dataclasses.replace(arrays()[arg], device=1)}))

# --- launch limits: grid dimensions y/z (heads, batch) and the int32 mask arithmetic (seqlens < 2**30) --
both("batch", "over_grid_limit_65536", ValueError, ["batch must be at most 65535 (a CUDA grid dimension)", "got 65536"],
     arrs=arrays(b=65536))
both("heads", "over_grid_limit_65536", ValueError, ["heads must be at most 65535 (a CUDA grid dimension)", "got 65536"],
     arrs=arrays(h=65536))
both("heads", "over_grid_limit_with_mqa", ValueError, ["heads must be at most 65535", "got 70000"],
     arrs=arrays(h=70000, hkv=1))
both("seqlen_q", "at_2_30", ValueError, ["seqlen_q must be below 2**30", f"got {2 ** 30}"], arrs=arrays(sq=2 ** 30))
both("seqlen_k", "at_2_30", ValueError, ["seqlen_k must be below 2**30", f"got {2 ** 30}"], arrs=arrays(sk=2 ** 30))
both("seqlen_q", "at_2_31", ValueError, ["seqlen_q must be below 2**30", f"got {2 ** 31}"], arrs=arrays(sq=2 ** 31))
packed("batch", "over_grid_limit_65536", ValueError, ["batch must be at most 65535", "got 65536"],
       arrs=varlen_arrays(cu_q=(0,) * 65537, cu_k=(0,) * 65537))
packed("heads", "over_grid_limit_65536", ValueError, ["heads must be at most 65535", "got 65536"],
       arrs=varlen_arrays(h=65536))
packed("seqlen_q", "max_seqlen_q_at_2_30", ValueError, ["seqlen_q must be below 2**30", f"got {2 ** 30}"],
       arrs=varlen_arrays(max_q=2 ** 30))
packed("seqlen_k", "max_seqlen_k_at_2_30", ValueError, ["seqlen_k must be below 2**30", f"got {2 ** 30}"],
       arrs=varlen_arrays(max_k=2 ** 30))

# --- head dim and implementation choice (all four functions) ------------------------------------------
for d in (8, 80, 512):
    both("headdim", f"{d}_unsupported", ValueError,
         ["no cuflash implementation can run this", f"head dim {d} is not supported", "supported: ["],
         arrs=arrays(d=d))
    packed("headdim", f"{d}_unsupported", ValueError,
           ["no cuflash implementation can run this", f"head dim {d} is not supported", "supported: ["],
           arrs=varlen_arrays(d=d))
for fn, direction in DIRECTION.items():
    for name, fam in FAMILIES.items():
        if (fam.FWD_FEATURES if direction == "forward" else fam.BWD_FEATURES) is None:
            add(fn, "impl", f"{name}_has_no_{direction}", ValueError,
                [f"impl={name!r}", f"it has no {direction} kernel yet"], impl=name)
            continue
        for d in ALL_HEADDIMS:
            if d not in api.headdims(fam, direction):
                add(fn, "impl", f"{name}_headdim_{d}", ValueError,
                    [f"impl={name!r}", f"head dim {d} is not supported", str(list(api.headdims(fam, direction)))],
                    arrs=varlen_arrays(d=d) if fn in VARLEN else arrays(d=d), impl=name)
        add(fn, "impl", f"{name}_gpu_too_old", ValueError,
            [f"impl={name!r}", f"sm_{fam.MIN_CC[0]}{fam.MIN_CC[1]} or newer", "sm_75"], impl=name, cc=(7, 5))
    for problem, bad in (("unknown_fa9", "fa9"), ("empty_string", ""), ("none", None), ("wrong_case_FA2", "FA2"),
                         ("int", 2)):
        add(fn, "impl", problem, ValueError, ["impl must be one of", repr(bad)], impl=bad)

# --- scalars: softmax_scale, window_size, causal (all four functions) ---------------------------------
for bad in (0.0, -1.0, math.nan, math.inf, -math.inf):
    every("softmax_scale", f"value_{bad}", ValueError, ["softmax_scale must be a finite positive number", str(bad)],
         softmax_scale=bad)
for bad in ("0.1", True, [0.1], 1j):
    every("softmax_scale", f"type_{type(bad).__name__}", TypeError,
          ["softmax_scale must be a float or None", type(bad).__name__], softmax_scale=bad)
for bad in ((-2, 0), (0, -2), (-5, -5)):
    every("window_size", f"entry_below_-1_{bad[0]}_{bad[1]}", ValueError,
          ["window_size entries must be >= -1", str(bad)], window_size=bad)
for problem, bad in (("one_entry", (1,)), ("three_entries", (1, 2, 3)), ("float_entry", (1.5, 2)), ("string", "ab"),
                     ("none", None), ("bool_entry", (True, 0)), ("int", 4), ("string_entries", ("1", "2"))):
    every("window_size", problem, TypeError, ["window_size must be a pair of ints (left, right)", repr(bad)],
          window_size=bad)
for bad in (1, "yes", None):
    every("causal", f"type_{type(bad).__name__}", TypeError, ["causal must be a bool", type(bad).__name__],
          causal=bad)

# --- softcap, alibi_slopes, deterministic, dropout (every public function that takes them) ------------

def _takes(fn, arg):
    return arg in inspect.signature(getattr(cuflash, fn)).parameters


for fn in PUBLIC:
    if _takes(fn, "softcap"):
        for bad in (-1.0, math.nan, math.inf):
            add(fn, "softcap", f"value_{bad}", ValueError, ["softcap must be a finite number >= 0 (0 = off)", str(bad)],
                softcap=bad)
        for bad in ("5", True, None, [5.0]):
            add(fn, "softcap", f"type_{type(bad).__name__}", TypeError,
                ["softcap must be a float (0 = off)", type(bad).__name__], softcap=bad)
    if _takes(fn, "alibi_slopes"):
        for problem, s, words in (
            ("shape_heads_plus_1", slopes(H + 1), ["alibi_slopes must have shape (heads,) = (8,)", "got (9"]),
            ("shape_kv_heads", slopes(HKV), ["alibi_slopes must have shape (heads,) = (8,)", "got (2"]),
            ("rank2", spec((1, H), "float32"), ["alibi_slopes must have shape (heads,) = (8,)", "(1, 8)"]),
            ("rank0", spec((), "float32"), ["alibi_slopes must have shape (heads,) = (8,)", "()"]),
            ("strided", slopes(strides=(2,)), ["alibi_slopes must be contiguous", "2"]),
            ("other_device", slopes(device=1), ["alibi_slopes is on CUDA device 1 but q is on device 0"]),
        ):
            add(fn, "alibi_slopes", problem, ValueError, words, alibi_slopes=s)
        for dt in ("float16", "bfloat16", "float64", "int32"):
            add(fn, "alibi_slopes", f"dtype_{dt}", TypeError, ["alibi_slopes must be float32", dt],
                alibi_slopes=slopes(dtype=dt))
    if _takes(fn, "deterministic"):
        for bad in (1, "yes", None):
            add(fn, "deterministic", f"type_{type(bad).__name__}", TypeError,
                ["deterministic must be a bool", type(bad).__name__], deterministic=bad)
    if _takes(fn, "dropout_p"):
        for bad in (-0.1, 1.0, 1.5, math.nan):
            add(fn, "dropout_p", f"value_{bad}", ValueError, ["dropout_p must be in [0, 1)", str(bad)],
                dropout_p=bad, dropout_seed=1)
        for bad in ("0.1", True, None):
            add(fn, "dropout_p", f"type_{type(bad).__name__}", TypeError,
                ["dropout_p must be a float in [0, 1)", type(bad).__name__], dropout_p=bad, dropout_seed=1)
        for bad in (None, 1.5, "7"):
            add(fn, "dropout_seed", f"type_{type(bad).__name__}", TypeError,
                ["dropout_seed must be an int in [0, 2**64) when dropout_p > 0"], dropout_p=0.1, dropout_seed=bad)
        for bad in (-1, 2 ** 64):
            add(fn, "dropout_seed", f"value_{bad}", ValueError, ["dropout_seed must be in [0, 2**64)", str(bad)],
                dropout_p=0.1, dropout_seed=bad)
        for bad in (-1, 2 ** 32, 1.5):
            add(fn, "dropout_offset", f"value_{bad}", ValueError, ["dropout_offset must be an int in [0, 2**32)"],
                dropout_p=0.1, dropout_seed=3, dropout_offset=bad)
    # a family asked for a feature it lacks says so
    for name, fam in FAMILIES.items():
        feats = fam.FWD_FEATURES if DIRECTION[fn] == "forward" else fam.BWD_FEATURES
        if feats is None:
            continue
        if fn in VARLEN and "varlen" not in feats:
            # every variable-length call needs "varlen": that is the reason, whatever else is asked for
            add(fn, "impl", f"{name}_without_varlen", ValueError,
                [f"impl={name!r}", f"its {DIRECTION[fn]} does not support varlen"], impl=name)
            continue
        if _takes(fn, "softcap") and "softcap" not in feats:
            add(fn, "impl", f"{name}_with_softcap", ValueError,
                [f"impl={name!r}", f"its {DIRECTION[fn]} does not support softcap"], softcap=5.0, impl=name)
        if _takes(fn, "alibi_slopes") and "alibi" not in feats:
            add(fn, "impl", f"{name}_with_alibi_slopes", ValueError,
                [f"impl={name!r}", f"its {DIRECTION[fn]} does not support alibi"], alibi_slopes=slopes(), impl=name)
        optional = [("causal", dict(causal=True)), ("window", dict(window_size=(8, 8)))]
        if _takes(fn, "dropout_p"):
            optional.append(("dropout", dict(dropout_p=0.1, dropout_seed=1)))
        if _takes(fn, "deterministic"):
            optional.append(("deterministic", dict(deterministic=True)))
        for feat, kw in optional:
            if feat not in feats:
                add(fn, "impl", f"{name}_with_{feat}", ValueError,
                    [f"impl={name!r}", f"its {DIRECTION[fn]} does not support {feat}"], impl=name, **kw)

# --- backward only: out, dout, lse ------------------------------------------------------------------------
BW = "flash_attn_backward"
for arg in ("out", "dout"):
    add(BW, arg, "rank3", ValueError, [f"{arg} must have 4 dimensions"], arrs=arrays(**{arg: spec((B, SQ, H * D))}))
    add(BW, arg, "shape_differs_from_q", ValueError,
        [f"{arg} must have the shape of q (2, 64, 8, 64)", "(2, 63, 8, 64)"],
        arrs=arrays(**{arg: spec((B, SQ - 1, H, D))}))
    add(BW, arg, "heads_differ_from_q", ValueError, [f"{arg} must have the shape of q", "(2, 64, 2, 64)"],
        arrs=arrays(**{arg: spec((B, SQ, HKV, D))}))
    add(BW, arg, "dtype_differs_from_q", TypeError, [f"{arg} must have the dtype of q (bfloat16)", "float16"],
        arrs=arrays(**{arg: spec((B, SQ, H, D), "float16")}))
    add(BW, arg, "dtype_float32", TypeError, [f"{arg} must be float16 or bfloat16", "float32"],
        arrs=arrays(**{arg: spec((B, SQ, H, D), "float32")}))
    add(BW, arg, "headdim_not_contiguous", ValueError, [f"{arg}'s last dimension (headdim) must be contiguous"],
        arrs=arrays(**{arg: spec((B, SQ, H, D), strides=(2 * SQ * H * D, 2 * H * D, 2 * D, 2))}))
    add(BW, arg, "seqlen_stride_unaligned", ValueError, [f"{arg}'s seqlen stride must be a multiple of 16 bytes"],
        arrs=arrays(**{arg: spec((B, SQ, H, D), strides=(SQ * 516, 516, 64, 1))}))
    add(BW, arg, "pointer_unaligned", ValueError, [f"{arg}'s data must start at a 16-byte aligned address"],
        arrs=arrays(**{arg: spec((B, SQ, H, D), ptr=0x10004)}))
    add(BW, arg, "other_device", ValueError, [f"{arg} is on CUDA device 1 but q is on device 0"],
        arrs=arrays(**{arg: spec((B, SQ, H, D), device=1)}))
for problem, s in (("shape_bsh", spec((B, SQ, H), "float32")), ("shape_kv_heads", spec((B, HKV, SQ), "float32")),
                   ("rank2", spec((B * H, SQ), "float32")), ("rank4", spec((B, H, SQ, 1), "float32")),
                   ("seqlen_k", spec((B, H, SK), "float32"))):
    add(BW, "lse", problem, ValueError,
        ["lse must have shape (batch, heads, seqlen_q) = (2, 8, 64)", "got (" + ", ".join(map(str, s.shape))],
        arrs=arrays(lse=s))
for dt in ("bfloat16", "float16", "float64"):
    add(BW, "lse", f"dtype_{dt}", TypeError, ["lse must be float32", dt], arrs=arrays(lse=spec((B, H, SQ), dt)))
for problem, strides in (("padded_rows", (H * 72, 72, 1)), ("transposed", (H * SQ, 1, H)),
                         ("strided", (2 * H * SQ, 2 * SQ, 2))):
    add(BW, "lse", f"not_contiguous_{problem}", ValueError, ["lse must be contiguous", str(strides)],
        arrs=arrays(lse=spec((B, H, SQ), "float32", strides=strides)))
add(BW, "lse", "other_device", ValueError, ["lse is on CUDA device 1 but q is on device 0"],
    arrs=arrays(lse=spec((B, H, SQ), "float32", device=1)))


# --- variable-length functions: packed q, k, v (rank 3: (total, heads, headdim)) ---------------------
packed("q", "rank4_padded_batch", ValueError,
       ["q must have 3 dimensions", "(total_tokens, heads, headdim)", "(2, 64, 8, 64)"],
       arrs=varlen_arrays(q=spec((B, SQ, H, D))))
packed("q", "rank2", ValueError, ["q must have 3 dimensions", "(64, 512)"], arrs=varlen_arrays(q=spec((TQ, H * D))))
packed("k", "rank4", ValueError, ["k must have 3 dimensions", "(1, 80, 2, 64)"],
       arrs=varlen_arrays(k=spec((1, TK, HKV, D)), v=spec((1, TK, HKV, D))))
packed("v", "rank2", ValueError, ["v must have 3 dimensions"], arrs=varlen_arrays(v=spec((TK, HKV * D))))
for arg, dt in (("q", "float32"), ("k", "int8"), ("v", "float32"), ("q", "float64")):
    packed(arg, f"dtype_{dt}", TypeError, [f"{arg} must be float16 or bfloat16", dt],
           arrs=varlen_arrays(**{arg: spec(varlen_arrays()[arg].shape, dt)}))
packed("k", "dtype_differs_from_q", TypeError, ["k must have the dtype of q (bfloat16)", "float16"],
       arrs=varlen_arrays(k=spec((TK, HKV, D), "float16")))
packed("v", "dtype_differs_from_q", TypeError, ["v must have the dtype of q (float16)", "bfloat16"],
       arrs=varlen_arrays(dtype="float16", v=spec((TK, HKV, D), "bfloat16")))
packed("v", "rows_differ_from_k", ValueError, ["k and v must have the same shape", "(81, 2, 64)"],
       arrs=varlen_arrays(v=spec((TK + 1, HKV, D))))
packed("v", "heads_differ_from_k", ValueError, ["k and v must have the same shape", "(80, 4, 64)"],
       arrs=varlen_arrays(v=spec((TK, 4, D))))
packed("k", "headdim_mismatch", ValueError, ["k must have q's head dim 64", "got 128"],
       arrs=varlen_arrays(k=spec((TK, HKV, 128)), v=spec((TK, HKV, 128))))
add("flash_attn_varlen_func", "v", "headdim_differs_fa2", ValueError,
    ["impl='fa2'", "v's head dim 64 differs from q and k's 128"],
    arrs=varlen_arrays(d=128, v=spec((TK, HKV, 64))), impl="fa2")
add("flash_attn_varlen_backward", "v", "headdim_differs", ValueError,
    ["v's head dim 128 differs from q and k's 192", "the backward needs them equal"],
    arrs=varlen_arrays(d=192, v=spec((TK, HKV, 128)), out=spec((TQ, H, 128))))
packed("k", "heads_not_divisible", ValueError, ["query heads (8)", "multiple", "KV heads in k/v (3)"],
       arrs=varlen_arrays(hkv=3))
packed("k", "more_kv_heads_than_heads", ValueError, ["query heads (8)", "KV heads in k/v (16)"],
       arrs=varlen_arrays(hkv=16))
packed("k", "zero_kv_heads", ValueError, ["query heads (8)", "KV heads in k/v (0)"], arrs=varlen_arrays(hkv=0))
packed("q", "zero_heads", ValueError, ["q must have at least one head", "(64, 0, 64)"], arrs=varlen_arrays(h=0))
for arg in ("q", "k", "v"):
    shape = varlen_arrays()[arg].shape
    packed(arg, "headdim_not_contiguous", ValueError,
           [f"{arg}'s last dimension (headdim) must be contiguous (stride 1)", "got strides"],
           arrs=varlen_arrays(**{arg: spec(shape, strides=(2 * shape[1] * D, 2 * D, 2))}))
packed("q", "tokens_stride_unaligned", ValueError,
       ["q's tokens stride must be a multiple of 16 bytes (8 elements)", "516"],
       arrs=varlen_arrays(q=spec((TQ, H, D), strides=(H * D + 4, D, 1))))
packed("k", "tokens_stride_unaligned", ValueError, ["k's tokens stride must be a multiple of 16 bytes", "130"],
       arrs=varlen_arrays(k=spec((TK, HKV, D), strides=(130, 64, 1))))
packed("v", "heads_stride_unaligned", ValueError, ["v's heads stride must be a multiple of 16 bytes", "68"],
       arrs=varlen_arrays(v=spec((TK, HKV, D), strides=(HKV * 68, 68, 1))))
for arg, ptr in (("q", 0x10002), ("k", 0x10008), ("v", 0x1000E)):
    packed(arg, "pointer_unaligned", ValueError, [f"{arg}'s data must start at a 16-byte aligned address", hex(ptr)],
           arrs=varlen_arrays(**{arg: dataclasses.replace(varlen_arrays()[arg], ptr=ptr)}))
for arg in ("k", "v", "cu_seqlens_q", "cu_seqlens_k"):
    packed(arg, "other_device", ValueError, [f"{arg} is on CUDA device 1 but q is on device 0"],
           arrs=varlen_arrays(**{arg: dataclasses.replace(varlen_arrays()[arg], device=1)}))

# --- variable-length functions: cu_seqlens_q / cu_seqlens_k as arrays (int32, (batch + 1,), contiguous) --
for arg, values in (("cu_seqlens_q", CU_Q), ("cu_seqlens_k", CU_K)):
    for dt in ("int64", "uint32", "int16", "float32"):
        packed(arg, f"dtype_{dt}", TypeError, [f"{arg} must be int32", f"got {dt}"],
               arrs=varlen_arrays(**{arg: cu(values, dt)}))
    for problem, shape in (("rank2", (1, len(values))), ("rank2_column", (len(values), 1)), ("rank0", ()),
                           ("length_1", (1,)), ("length_0", (0,))):
        packed(arg, problem, ValueError,
               [f"{arg} must be a 1-D array of batch + 1 >= 2 offsets", "got shape (" + ", ".join(map(str, shape))],
               arrs=varlen_arrays(**{arg: cu(values[:1] if shape == (1,) else () if shape == (0,) else values,
                                             shape=shape)}))
    packed(arg, "not_contiguous", ValueError, [f"{arg} must be contiguous", "got stride 2"],
           arrs=varlen_arrays(**{arg: cu(values, strides=(2,))}))
packed("cu_seqlens_k", "length_differs_from_cu_seqlens_q", ValueError,
       ["cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1)", "got 4 and 5"],
       arrs=varlen_arrays(cu_k=CU_K + (80,)))
packed("cu_seqlens_q", "length_differs_from_cu_seqlens_k", ValueError,
       ["cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1)", "got 3 and 4"],
       arrs=varlen_arrays(cu_q=(0, 17, 60)))

# --- variable-length functions: the offsets themselves (host copy, validate=True) -----------------------
# each message of _validate.check_cu_seqlens_values, for both arrays, through both functions
for arg, values, total, maxname, longest in (("cu_seqlens_q", CU_Q, TQ, "max_seqlen_q", MAXQ),
                                             ("cu_seqlens_k", CU_K, TK, "max_seqlen_k", MAXK)):
    side = arg[-1]
    for problem, bad, words in (
        ("starts_at_1", (1,) + values[1:], [f"{arg} must start at 0", "got 1"]),
        ("starts_negative", (-4,) + values[1:], [f"{arg} must start at 0", "got -4"]),
        ("decreasing", (0, 20, 10, values[-1]), [f"{arg} must be non-decreasing", f"{arg}[2] = 10 < {arg}[1] = 20"]),
        ("decreasing_at_end", values[:-1] + (values[-2] - 1,),
         [f"{arg} must be non-decreasing", f"{arg}[3] = {values[-2] - 1} < {arg}[2] = {values[-2]}"]),
        ("past_the_packed_rows", values[:-1] + (total + 1,),
         [f"{arg}[-1] = {total + 1} exceeds the {total} packed rows of the matching array"]),
    ):
        packed(arg, problem, ValueError, words, arrs=varlen_arrays(**{f"cu_{side}": bad}))
    packed(maxname, "below_the_longest_sequence", ValueError,
           [f"{maxname} = {longest - 1} but {arg} holds a sequence of length {longest}"],
           arrs=varlen_arrays(**{f"max_{side}": longest - 1}))
    packed(maxname, "zero_with_nonempty_sequences", ValueError,
           [f"{maxname} = 0 but {arg} holds a sequence of length {longest}"],
           arrs=varlen_arrays(**{f"max_{side}": 0}))
    # the rows past the last offset belong to no sequence, but the packed array must have them
    packed(arg, "packed_array_too_short", ValueError,
           [f"{arg}[-1] = {values[-1]} exceeds the {values[-1] - 1} packed rows of the matching array"],
           arrs=varlen_arrays(**{f"t{side}": values[-1] - 1}) if side == "q"
           else varlen_arrays(k=spec((values[-1] - 1, HKV, D)), v=spec((values[-1] - 1, HKV, D))))

# --- variable-length functions: max_seqlen_q / max_seqlen_k, validate ---------------------------------
for arg in ("max_seqlen_q", "max_seqlen_k"):
    for problem, bad in (("negative", -1), ("float", 43.0), ("string", "43"), ("none", None), ("bool", True),
                         ("array", np.array([43]))):
        packed(arg, problem, ValueError, [f"{arg} must be an int >= 0", "got " + repr(bad)],
               arrs=varlen_arrays(**{arg: bad}))
for bad in (1, "yes", None):
    packed("validate", f"type_{type(bad).__name__}", TypeError, ["validate must be a bool", type(bad).__name__],
           validate=bad)

# --- variable-length backward only: out, dout (like packed q), lse ((heads, total_q) float32 contiguous) --
VBW = "flash_attn_varlen_backward"
for arg in ("out", "dout"):
    add(VBW, arg, "rank4", ValueError, [f"{arg} must have 3 dimensions (total_tokens, heads, headdim)"],
        arrs=varlen_arrays(**{arg: spec((B, SQ, H, D))}))
    add(VBW, arg, "rows_differ_from_q", ValueError, [f"{arg} must have the shape of q (64, 8, 64)", "(60, 8, 64)"],
        arrs=varlen_arrays(**{arg: spec((60, H, D))}))
    add(VBW, arg, "heads_differ_from_q", ValueError, [f"{arg} must have the shape of q", "(64, 2, 64)"],
        arrs=varlen_arrays(**{arg: spec((TQ, HKV, D))}))
    add(VBW, arg, "dtype_differs_from_q", TypeError, [f"{arg} must have the dtype of q (bfloat16)", "float16"],
        arrs=varlen_arrays(**{arg: spec((TQ, H, D), "float16")}))
    add(VBW, arg, "dtype_float32", TypeError, [f"{arg} must be float16 or bfloat16", "float32"],
        arrs=varlen_arrays(**{arg: spec((TQ, H, D), "float32")}))
    add(VBW, arg, "headdim_not_contiguous", ValueError, [f"{arg}'s last dimension (headdim) must be contiguous"],
        arrs=varlen_arrays(**{arg: spec((TQ, H, D), strides=(2 * H * D, 2 * D, 2))}))
    add(VBW, arg, "tokens_stride_unaligned", ValueError, [f"{arg}'s tokens stride must be a multiple of 16 bytes"],
        arrs=varlen_arrays(**{arg: spec((TQ, H, D), strides=(H * D + 2, D, 1))}))
    add(VBW, arg, "pointer_unaligned", ValueError, [f"{arg}'s data must start at a 16-byte aligned address"],
        arrs=varlen_arrays(**{arg: spec((TQ, H, D), ptr=0x10004)}))
    add(VBW, arg, "other_device", ValueError, [f"{arg} is on CUDA device 1 but q is on device 0"],
        arrs=varlen_arrays(**{arg: spec((TQ, H, D), device=1)}))
LSE_WANT = "lse must be a contiguous float32 array of shape (heads, total_q) = (8, 64)"
for problem, s in (("transposed_total_heads", spec((TQ, H), "float32")),
                   ("fixed_length_layout", spec((1, H, TQ), "float32")),
                   ("batch_heads_maxlen", spec((3, H, MAXQ), "float32")),
                   ("total_k", spec((H, TK), "float32")),
                   ("kv_heads", spec((HKV, TQ), "float32")),
                   ("used_rows_only", spec((H, CU_Q[-1]), "float32")),
                   ("rank1", spec((H * TQ,), "float32"))):
    add(VBW, "lse", problem, ValueError, [LSE_WANT, "got float32 (" + ", ".join(map(str, s.shape))],
        arrs=varlen_arrays(lse=s))
for dt in ("bfloat16", "float16", "float64"):
    add(VBW, "lse", f"dtype_{dt}", ValueError, [LSE_WANT, f"got {dt}"], arrs=varlen_arrays(lse=spec((H, TQ), dt)))
for problem, strides in (("padded_rows", (72, 1)), ("transposed", (1, H)), ("strided", (2 * TQ, 2))):
    add(VBW, "lse", f"not_contiguous_{problem}", ValueError, [LSE_WANT, f"with strides {strides}"],
        arrs=varlen_arrays(lse=spec((H, TQ), "float32", strides=strides)))
add(VBW, "lse", "other_device", ValueError, ["lse is on CUDA device 1 but q is on device 0"],
    arrs=varlen_arrays(lse=spec((H, TQ), "float32", device=1)))


# --- host memory and non-arrays through the real Call (all four functions, every array argument) ------

class _DeviceDLPack:
    """Claims to live on CUDA device 0; the check must refuse the bad argument before converting any."""

    def __dlpack__(self, stream=None):
        raise AssertionError("converted before every argument was checked")

    def __dlpack_device__(self):
        return (2, 0)


class _HostDLPack(_DeviceDLPack):
    """A DLPack producer in host memory (a CPU torch tensor or JAX CPU array behaves like this)."""

    def __dlpack_device__(self):
        return (1, 0)


def _host_args(fn, bad_arg, bad):
    args = {n: _DeviceDLPack() for n in ARRAY_ARGS[fn]}
    args.update(max_seqlen_q=MAXQ, max_seqlen_k=MAXK)
    kwargs = {}
    if bad_arg in args:
        args[bad_arg] = bad
    else:
        kwargs[bad_arg] = bad
    f = getattr(cuflash, fn)
    return lambda: f(*(args[n] for n in POSITIONAL[fn]), **kwargs)


def _host_array(fn, arg):
    """A numpy array of the shape and dtype ``arg`` would have on the device."""
    if arg == "alibi_slopes":
        return np.zeros((H,), np.float32)
    if arg.startswith("cu_seqlens"):
        return np.asarray(CU_Q if arg.endswith("q") else CU_K, np.int32)
    if fn in VARLEN:
        return np.zeros((H, TQ), np.float32) if arg == "lse" else np.zeros((TQ, H, D), np.float16)
    return np.zeros((B, H, SQ), np.float32) if arg == "lse" else np.zeros((B, SQ, H, D), np.float16)


for fn in PUBLIC:
    for arg in ARRAY_ARGS[fn] + (("alibi_slopes",) if _takes(fn, "alibi_slopes") else ()):
        host = _host_array(fn, arg)
        add(fn, arg, "numpy_host_array", TypeError, [f"{arg} must live in CUDA device memory", "numpy.ndarray",
                                                      "host memory", "DLPack device type 1"],
            mode="host", call=_host_args(fn, arg, host))
        add(fn, arg, "host_dlpack", TypeError, [f"{arg} must live in CUDA device memory", "DLPack device type 1"],
            mode="host", call=_host_args(fn, arg, _HostDLPack()))
        add(fn, arg, "python_list", TypeError, [f"{arg} must be a GPU array", "builtins.list"],
            mode="host", call=_host_args(fn, arg, host.tolist()))
        if arg != "alibi_slopes":  # alibi_slopes=None means "no ALiBi"
            add(fn, arg, "none", TypeError, [f"{arg} must be a GPU array", "NoneType"], mode="host",
                call=_host_args(fn, arg, None))

# --- validators called directly ------------------------------------------------------------------------
for name, fam in FAMILIES.items():
    for d in sorted(set(ALL_HEADDIMS + [0, 16, 80, 512]) - set(fam.HEADDIMS)):
        add("check_headdim", "headdim", f"{d}_{name}", ValueError,
            [f"head dim {d} is not supported by impl={name!r}", f"supported: {sorted(fam.HEADDIMS)}"],
            mode="direct", call=(lambda d=d, fam=fam, name=name: _validate.check_headdim(d, fam.HEADDIMS, name)))


# ----------------------------------------------------------------------------------------------------
# the environment of "spec" rows
# ----------------------------------------------------------------------------------------------------

class _ReachedKernel(Exception):
    """Raised by the stand-in launchers: every check passed."""


class _SpecCall:
    """Stand-in for cuflash._interop.Call: the 'arrays' are Spec records, named by the call."""

    layout = None  # (no layout key: every call is checked, never taken from cuflash.api's memo)

    def __init__(self, named_arrays, *args, **kwargs):
        self.specs = [dataclasses.replace(a, name=n) for n, a in named_arrays]
        self.arrays = list(self.specs)
        self.device = types.SimpleNamespace(id=self.specs[0].device)
        self.stream = None
        self.framework = "cupy"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def wrap(self, a):
        return a


@pytest.fixture
def spec_env(monkeypatch):
    """Public functions run on Specs: fake Call, a fake sm_90 GPU (or the row's cc), no allocations or launches."""
    state = {"cc": GOOD_CC}
    monkeypatch.setattr(api, "Call", _SpecCall)
    monkeypatch.setattr(_device, "compute_capability", lambda device=0: state["cc"])
    monkeypatch.setitem(sys.modules, "cupy", mock.MagicMock(name="cupy"))

    def launcher(name, direction):
        def launch(*args, **kwargs):
            raise _ReachedKernel(f"{name}.{direction}")
        return launch

    for name, fam in FAMILIES.items():
        for direction in ("forward", "backward"):
            monkeypatch.setattr(fam, direction, launcher(name, direction), raising=False)
    return state


def _param(case: Case):
    if not case.gap:
        return pytest.param(case, id=case.id)
    # strict: once the check exists the row passes, XPASS fails, and the gap note is to be removed
    return pytest.param(case, id=case.id, marks=pytest.mark.xfail(raises=_ReachedKernel, strict=True,
                                                                 reason=f"known gap: {case.gap}"))


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input(case: Case, request):
    check_refused(case, request)


def check_refused(case: Case, request) -> None:
    """``case.call()`` raises ``case.exc`` whose message has ``case.words`` and names the argument (shared by
    the bad-input tables of other modules: decode, fp8)."""
    if case.mode == "spec":
        request.getfixturevalue("spec_env")["cc"] = case.cc
    elif case.mode == "host":
        pytest.importorskip("cupy")  # Call tells CuPy arrays apart; importing CuPy needs no GPU
    with pytest.raises((ValueError, TypeError)) as info:
        case.call()
    assert isinstance(info.value, case.exc), f"{case.id}: want {case.exc.__name__}, got {info.type.__name__}: {info.value}"
    msg = str(info.value)
    for w in case.words:
        assert w in msg, f"{case.id}: {w!r} is not in the message {msg!r}"
    name = {"headdim": "head dim"}.get(case.arg, case.arg)
    assert name in msg, f"{case.id}: the message does not name {name!r}: {msg!r}"


def test_table_covers_every_argument_of_every_public_function():
    """The table is meant to be the complete list: every argument of every public function that can be
    wrong has rows. A new argument fails here until the table has rows for it."""
    from test_fp8_attention_cpu import CASES as FP8_CASES  # the FP8 arguments' rows live with the FP8 tests

    unchecked = {"return_lse"}  # any value is fine (truthiness)
    seen = {(c.fn, c.arg) for c in CASES + FP8_CASES}
    missing = []
    for fn in PUBLIC:
        for arg in inspect.signature(getattr(cuflash, fn)).parameters:
            if arg not in unchecked and (fn, arg) not in seen:
                missing.append(f"{fn}({arg}=...)")
    assert not missing, f"no rows for {missing}: add them to CASES"
    assert set(PUBLIC) <= set(cuflash.__all__)
    public = {n for n in cuflash.__all__ if n.startswith("flash_attn")}
    public -= {"flash_attn_with_kvcache", "flash_attn_combine"}  # their table: tests/test_decode_cpu.py
    assert public <= set(PUBLIC), f"public functions missing from PUBLIC: {sorted(public - set(PUBLIC))}"
    assert set(DIRECTION) == set(POSITIONAL) == set(PUBLIC)
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate row ids"


def test_positional_arguments_match_the_signatures():
    """The rows call the public functions positionally from POSITIONAL: it must be the signature's order."""
    for fn in PUBLIC:
        params = inspect.signature(getattr(cuflash, fn)).parameters.values()
        positional = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        assert positional == POSITIONAL[fn], (fn, positional)


def test_cu_seqlens_values_checks_have_rows(spec_env):
    """Every refusal of _validate.check_cu_seqlens_values is produced by rows, for each of the two offset
    arrays, through both variable-length functions."""
    import re

    src = inspect.getsource(_validate.check_cu_seqlens_values)
    templates = re.findall(r'raise ValueError\(f"([^"]*)"', src)
    assert len(templates) == 4, templates
    messages = {fn: [] for fn in VARLEN}
    for c in CASES:
        if c.fn in VARLEN and c.mode == "spec" and not c.gap:
            spec_env["cc"] = c.cc
            try:
                c.call()
            except (ValueError, TypeError) as e:
                messages[c.fn].append(str(e))
    for name, maxname in (("cu_seqlens_q", "max_seqlen_q"), ("cu_seqlens_k", "max_seqlen_k")):
        for t in templates:
            t = t.replace("{name}", name).replace("{max_name}", maxname)
            pattern = ".+?".join(re.escape(part) for part in re.split(r"\{[^}]*\}", t))
            for fn in VARLEN:
                assert any(re.fullmatch(pattern, m) for m in messages[fn]), f"{fn}: no row says {t!r}"


# ----------------------------------------------------------------------------------------------------
# the control: the same calls without the problem pass every check
# ----------------------------------------------------------------------------------------------------

GOOD_CALLS = [
    ("forward-default", "flash_attn_func", arrays(), {}, "fa2.forward"),
    ("forward-fa1-causal-window", "flash_attn_func", arrays(), dict(impl="fa1", causal=True, window_size=(16, 3)),
     "fa1.forward"),
    ("forward-softcap-alibi-scale", "flash_attn_func", arrays(),
     dict(softcap=5.0, alibi_slopes=slopes(), softmax_scale=0.2, impl="fa2"), "fa2.forward"),
    ("forward-fp16-mqa-seqlen1", "flash_attn_func", arrays(dtype="float16", sq=1, sk=1, hkv=1), {}, "fa2.forward"),
    ("forward-packed-qkv-strides", "flash_attn_func",
     arrays(hkv=H, sk=SQ, q=spec((B, SQ, H, D), strides=(SQ * 3 * H * D, 3 * H * D, D, 1)),
            k=spec((B, SQ, H, D), strides=(SQ * 3 * H * D, 3 * H * D, D, 1), ptr=0x10000 + H * D * 2),
            v=spec((B, SQ, H, D), strides=(SQ * 3 * H * D, 3 * H * D, D, 1), ptr=0x10000 + 2 * H * D * 2)),
     {}, "fa2.forward"),
    ("forward-window-as-list", "flash_attn_func", arrays(), dict(window_size=[-1, 0]), "fa2.forward"),
    ("backward-default", "flash_attn_backward", arrays(), {}, "fa1.backward"),
    ("backward-causal-window-scale", "flash_attn_backward", arrays(),
     dict(causal=True, window_size=(8, -1), softmax_scale=0.1, impl="fa1"), "fa1.backward"),
    # the launch limits themselves pass
    ("forward-batch-65535", "flash_attn_func", arrays(b=65535), {}, "fa2.forward"),
    ("forward-heads-65535", "flash_attn_func", arrays(h=65535, hkv=5), {}, "fa2.forward"),
    ("forward-seqlens-2**30-1", "flash_attn_func", arrays(sq=2 ** 30 - 1, sk=2 ** 30 - 1), dict(causal=True),
     "fa2.forward"),
    ("backward-batch-heads-65535", "flash_attn_backward", arrays(b=65535, h=65535, hkv=65535), {}, "fa1.backward"),
    ("backward-seqlens-2**30-1", "flash_attn_backward", arrays(sq=2 ** 30 - 1, sk=2 ** 30 - 1), {}, "fa1.backward"),
    # variable length
    ("varlen-forward-default", "flash_attn_varlen_func", varlen_arrays(), {}, "fa2.forward"),
    ("varlen-forward-everything", "flash_attn_varlen_func", varlen_arrays(),
     dict(causal=True, window_size=(16, 3), softcap=5.0, alibi_slopes=slopes(), softmax_scale=0.2, dropout_p=0.1,
          dropout_seed=3, return_lse=True, impl="fa2"), "fa2.forward"),
    ("varlen-forward-fp16-mqa", "flash_attn_varlen_func", varlen_arrays(dtype="float16", hkv=1), {}, "fa2.forward"),
    ("varlen-forward-max-above-longest", "flash_attn_varlen_func", varlen_arrays(max_q=TQ, max_k=TK), {},
     "fa2.forward"),
    ("varlen-forward-numpy-int-max", "flash_attn_varlen_func",
     varlen_arrays(max_q=np.int64(MAXQ), max_k=np.int32(MAXK)), {}, "fa2.forward"),
    ("varlen-forward-batch-65535", "flash_attn_varlen_func",
     varlen_arrays(cu_q=(0,) * 65535 + (TQ,), cu_k=(0,) * 65535 + (TK,), max_q=TQ, max_k=TK), {}, "fa2.forward"),
    ("varlen-forward-max-2**30-1", "flash_attn_varlen_func", varlen_arrays(max_q=2 ** 30 - 1, max_k=2 ** 30 - 1), {},
     "fa2.forward"),
    ("varlen-backward-default", "flash_attn_varlen_backward", varlen_arrays(), {}, "fa2.backward"),
    ("varlen-backward-everything", "flash_attn_varlen_backward", varlen_arrays(),
     dict(causal=True, window_size=(8, -1), softcap=5.0, alibi_slopes=slopes(), softmax_scale=0.1, dropout_p=0.1,
          dropout_seed=3, dropout_offset=7, deterministic=True, impl="fa2"), "fa2.backward"),
    # validate=False skips only the host copy: offsets that validate=True refuses get through
    ("varlen-forward-unvalidated-offsets", "flash_attn_varlen_func",
     varlen_arrays(cu_q=(1, 20, 10, TQ + 5), max_q=1), dict(validate=False), "fa2.forward"),
    ("varlen-backward-unvalidated-offsets", "flash_attn_varlen_backward",
     varlen_arrays(cu_k=(3, 2, 1, TK + 5), max_k=1), dict(validate=False), "fa2.backward"),
]


for _name, _fam in FAMILIES.items():
    if _takes("flash_attn_backward", "deterministic") and "deterministic" in (_fam.BWD_FEATURES or ()):
        GOOD_CALLS.append((f"backward-{_name}-deterministic", "flash_attn_backward", arrays(),
                           dict(deterministic=True, impl=_name), f"{_name}.backward"))
    if (_takes("flash_attn_backward", "softcap") and _takes("flash_attn_backward", "alibi_slopes")
            and {"softcap", "alibi"} <= set(_fam.BWD_FEATURES or ())):
        GOOD_CALLS.append((f"backward-{_name}-softcap-alibi", "flash_attn_backward", arrays(),
                           dict(softcap=5.0, alibi_slopes=slopes(), causal=True, impl=_name), f"{_name}.backward"))


@pytest.mark.parametrize("what,fn,arrs,kwargs,reaches", GOOD_CALLS, ids=[g[0] for g in GOOD_CALLS])
def test_good_calls_reach_the_kernel(spec_env, what, fn, arrs, kwargs, reaches):
    with pytest.raises(_ReachedKernel) as info:
        _public(fn, arrs, kwargs)()
    family, direction = str(info.value).split(".")
    assert direction == DIRECTION[fn]
    if kwargs.get("impl", "auto") == "auto":
        assert family in FAMILIES  # auto's preference order is heuristics' business: don't pin it
    else:
        assert str(info.value) == reaches


def test_every_supported_headdim_passes(spec_env):
    for name, fam in FAMILIES.items():
        for d in fam.HEADDIMS:
            for fn in PUBLIC:
                feats = fam.FWD_FEATURES if DIRECTION[fn] == "forward" else fam.BWD_FEATURES
                if feats is None or (fn in VARLEN and "varlen" not in feats) or d not in api.headdims(fam, DIRECTION[fn]):
                    continue
                arrs = varlen_arrays(d=d) if fn in VARLEN else arrays(d=d)
                with pytest.raises(_ReachedKernel, match=name):
                    _public(fn, arrs, dict(impl=name))()


# ----------------------------------------------------------------------------------------------------
# api._supports: the reasons the implementation choice gives
# ----------------------------------------------------------------------------------------------------

SUPPORTS = [
    # (family, head dim, cc, direction, features, None or words of the reason)
    ("fa1", 64, (9, 0), "forward", {"gqa", "causal"}, None),
    ("fa1", 64, (8, 0), "backward", {"gqa", "window"}, None),
    ("fa1", 64, (7, 5), "forward", {"gqa"}, ["sm_80 or newer", "sm_75"]),
    ("fa1", 80, (9, 0), "forward", {"gqa"}, ["head dim 80 is not supported", "supported:"]),
    ("fa1", 64, (9, 0), "forward", {"gqa", "softcap"}, ["its forward does not support softcap"]),
    ("fa1", 64, (9, 0), "forward", {"gqa", "alibi", "softcap"}, ["its forward does not support alibi, softcap"]),
    ("fa2", 192, (9, 0), "forward", {"gqa", "softcap", "alibi", "causal", "window"}, None),
    ("fa2", 512, (9, 0), "forward", {"gqa"}, ["head dim 512 is not supported"]),
    ("fa3", 128, (9, 0), "backward", {"gqa", "causal", "window"}, None),
    ("fa3", 256, (9, 0), "backward", {"gqa", "causal", "window", "softcap"}, None),
    ("fa3", 80, (9, 0), "backward", {"gqa"}, ["head dim 80 is not supported", "supported: [64, 96, 128, 192, 256]"]),
    ("fa3", 64, (9, 0), "backward", {"gqa", "softcap"}, ["its backward does not support softcap"]),
    ("fa3", 64, (8, 0), "backward", {"gqa"}, ["sm_90 or newer", "sm_80"]),
]


@pytest.mark.parametrize("fam,d,cc,direction,features,words", SUPPORTS,
                         ids=[f"{s[0]}-{s[3]}-d{s[1]}-sm{s[2][0]}{s[2][1]}-{'_'.join(sorted(s[4]))}" for s in SUPPORTS])
def test_supports_reasons(fam, d, cc, direction, features, words):
    family = FAMILIES[fam]
    supported = family.FWD_FEATURES if direction == "forward" else family.BWD_FEATURES
    if supported is None:
        pytest.skip(f"{fam} has no {direction}")
    if (words is None or "does not support" in words[0]) and (features <= supported) != (words is None):
        pytest.skip(f"{fam}'s {direction} features changed since this row was written")
    reason = api._supports(family, d, cc, direction, set(features))
    if words is None:
        assert reason is None, reason
    else:
        assert reason is not None
        for w in words:
            assert w in reason, (w, reason)
