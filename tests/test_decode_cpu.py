"""CPU tier of the decode family (flash_attn_with_kvcache, flash_attn_combine).

* A bad-input table: every argument x every class of bad input is refused with a ValueError/TypeError
  naming the argument before any kernel runs. As in tests/test_bad_input_table.py, "spec" rows run the
  public functions on ``Spec`` records (a stand-in ``Call``, a fake GPU, launches replaced by a sentinel);
  the Specs of cache_seqlens / page_table / cache_batch_idx carry their values, so the ``check=True``
  checks of the values run too. "host" rows go through the real ``Call`` with host arrays and non-arrays.
* The NumPy model of split-KV + combine (cuflash.reference.decode_split_model) against the exact
  reference, on random inputs with odd sizes and splits that get no keys.
* The rotary reference against a hand-written loop; the combine reference against brute force.
* The split heuristic (the parameter structs' layouts: tests/test_param_structs.py).
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import NamedTuple
from unittest import mock

import numpy as np
import pytest

import cuflash
from cuflash import _device, api, decode, heuristics
from cuflash import reference as ref
from cuflash._interop import Spec
from test_bad_input_table import Case, _ReachedKernel, _SpecCall, check_refused, spec  # the same stand-ins

B, SQ, H, HKV, D = 2, 1, 8, 2, 128
CACHE = 100  # contiguous cache rows per entry
NEW = 3  # new tokens
PAGES, PAGE = 20, 16  # paged cache: 20 pages of 16 rows
MAXP = 8  # page_table columns: capacity 128 keys per entry
LENS = (5, 60)
TABLE = ((3, 1, 4, 19, -1, -1, -1, -1), (0, 2, 5, 6, 7, 8, -1, -1))  # -1: unused (beyond the keys)
RO = 70  # rotary table rows
GOOD_CC = (9, 0)


@dataclasses.dataclass(frozen=True)
class ValSpec(Spec):
    """A Spec that also holds its values: ``.get()`` is the host copy ``check=True`` reads."""

    values: tuple = ()

    def get(self):
        return np.asarray(self.values, dtype=np.int64)


def vals(values, dtype="int32", shape=None, strides=None, device=0) -> ValSpec:
    arr = np.asarray(values)
    base = spec(arr.shape if shape is None else shape, dtype, strides=strides, device=device)
    return ValSpec(**{f.name: getattr(base, f.name) for f in dataclasses.fields(Spec)}, values=arr.tolist())


def kv_args(b=B, sq=SQ, h=H, hkv=HKV, d=D, dtype="bfloat16", paged=False, new=NEW, rotary=False, **over) -> dict:
    """Good arguments of flash_attn_with_kvcache (positional ones and keywords), then ``over`` replaces some;
    a value of ``None`` in ``over`` drops the argument."""
    rows = (PAGES, PAGE) if paged else (b, CACHE)
    args = {"q": spec((b, sq, h, d), dtype), "k_cache": spec(rows + (hkv, d), dtype),
            "v_cache": spec(rows + (hkv, d), dtype), "cache_seqlens": vals(LENS[:b] + (0,) * max(0, b - 2))}
    if new:
        args["k"] = spec((b, new, hkv, d), dtype)
        args["v"] = spec((b, new, hkv, d), dtype)
    if paged:
        args["page_table"] = vals([list(r) for r in TABLE[:b]] + [[0] * MAXP] * max(0, b - 2))
    if rotary:
        args["rotary_cos"] = spec((RO, 32), dtype)
        args["rotary_sin"] = spec((RO, 32), dtype)
    args.update(over)
    return {k: v for k, v in args.items() if v is not None}


def combine_args(ns=3, b=B, s=2, h=H, d=D, **over) -> dict:
    args = {"out_partial": spec((ns, b, s, h, d), "float32"), "lse_partial": spec((ns, b, h, s), "float32")}
    args.update(over)
    return args


KV_POSITIONAL = ("q", "k_cache", "v_cache", "k", "v")
COMBINE_POSITIONAL = ("out_partial", "lse_partial")


def _call(fn_name: str, args: dict):
    fn = getattr(cuflash, fn_name)
    positional = KV_POSITIONAL if fn_name == "flash_attn_with_kvcache" else COMBINE_POSITIONAL
    pos = [args.get(n) for n in positional]
    while pos and pos[-1] is None and len(pos) > 3:
        pos.pop()
    kw = {n: a for n, a in args.items() if n not in positional}
    return lambda: fn(*pos, **kw)


CASES: list[Case] = []
KV, CB = "flash_attn_with_kvcache", "flash_attn_combine"


def kv(arg, problem, exc, words, cc=GOOD_CC, **kw):
    CASES.append(Case(KV, arg, problem, "spec", _call(KV, kv_args(**kw)), exc, tuple(words), cc))


def cb(arg, problem, exc, words, **kw):
    CASES.append(Case(CB, arg, problem, "spec", _call(CB, combine_args(**kw)), exc, tuple(words)))


# --- q --------------------------------------------------------------------------------------------------
kv("q", "rank3", ValueError, ["q must have 4 dimensions"], q=spec((B, SQ, H * D)))
kv("q", "dtype_float32", TypeError, ["q must be float16 or bfloat16", "float32"], q=spec((B, SQ, H, D), "float32"))
kv("q", "headdim_not_contiguous", ValueError, ["q's last dimension (headdim) must be contiguous"],
   q=spec((B, SQ, H, D), strides=(2 * SQ * H * D, 2 * H * D, 2 * D, 2)))
kv("q", "pointer_unaligned", ValueError, ["q's data must start at a 16-byte aligned address"],
   q=spec((B, SQ, H, D), ptr=0x10002))
kv("q", "empty_seqlen", ValueError, ["seqlen_q must be at least 1", "q of shape (2, 0, 8, 128)"], q=spec((B, 0, H, D)))
kv("q", "zero_heads", ValueError, ["q must have at least one batch entry and one head"], q=spec((B, SQ, 0, D)),
   k=None, v=None)
# --- k_cache / v_cache --------------------------------------------------------------------------------
kv("k_cache", "dtype_differs_from_q", TypeError, ["k_cache must have the dtype of q (bfloat16)", "float16"],
   k_cache=spec((B, CACHE, HKV, D), "float16"))
kv("v_cache", "dtype_int8", TypeError, ["v_cache must be float16 or bfloat16", "int8"],
   v_cache=spec((B, CACHE, HKV, D), "int8"))
kv("k_cache", "rank3", ValueError, ["k_cache must have 4 dimensions"], k_cache=spec((B, CACHE, HKV * D)))
kv("v_cache", "shape_differs_from_k_cache", ValueError, ["k_cache and v_cache must have the same shape"],
   v_cache=spec((B, CACHE + 1, HKV, D)))
kv("k_cache", "headdim_mismatch", ValueError, ["k_cache and v_cache must have q's head dim 128", "got 64"],
   k_cache=spec((B, CACHE, HKV, 64)), v_cache=spec((B, CACHE, HKV, 64)))
kv("k_cache", "heads_not_divisible", ValueError, ["query heads (8)", "KV heads in k_cache/v_cache (3)"],
   k_cache=spec((B, CACHE, 3, D)), v_cache=spec((B, CACHE, 3, D)), k=None, v=None)
kv("k_cache", "batch_mismatch", ValueError, ["k_cache must have q's batch size 2", "cache_batch_idx"],
   k_cache=spec((3, CACHE, HKV, D)), v_cache=spec((3, CACHE, HKV, D)))
kv("k_cache", "no_rows", ValueError, ["k_cache must hold at least one"], k_cache=spec((B, 0, HKV, D)),
   v_cache=spec((B, 0, HKV, D)), k=None, v=None, cache_seqlens=0)
kv("k_cache", "row_stride_unaligned", ValueError, ["k_cache's seqlen stride must be a multiple of 16 bytes"],
   k_cache=spec((B, CACHE, HKV, D), strides=(CACHE * 260, 260, 130, 1)))
kv("v_cache", "other_device", ValueError, ["v_cache is on CUDA device 1 but q is on device 0"],
   v_cache=spec((B, CACHE, HKV, D), device=1))
kv("k_cache", "paged_headdim_mismatch", ValueError, ["(num_pages, page_size, kv_heads, headdim)"], paged=True,
   k_cache=spec((PAGES, PAGE, HKV, 64)), v_cache=spec((PAGES, PAGE, HKV, 64)))
# --- k / v (new tokens) ---------------------------------------------------------------------------------
kv("v", "missing_with_k", ValueError, ["k and v (the new tokens) must both be given", "v=None"], v=None)
kv("k", "missing_with_v", ValueError, ["k and v (the new tokens) must both be given", "k=None"], k=None)
kv("k", "dtype_differs_from_q", TypeError, ["k must have the dtype of q"], k=spec((B, NEW, HKV, D), "float16"))
kv("v", "shape_differs_from_k", ValueError, ["k and v must have the same shape"], v=spec((B, NEW + 1, HKV, D)))
kv("k", "heads_differ_from_cache", ValueError, ["k and v must have shape (batch, seqlen_new, kv_heads, headdim)"],
   k=spec((B, NEW, 4, D)), v=spec((B, NEW, 4, D)))
kv("k", "batch_differs", ValueError, ["k and v must have shape (batch, seqlen_new, kv_heads, headdim) = (2,"],
   k=spec((3, NEW, HKV, D)), v=spec((3, NEW, HKV, D)))
kv("k", "more_tokens_than_the_cache", ValueError, ["k has seqlen_new = 101 new tokens", "at most 100 keys"],
   k=spec((B, CACHE + 1, HKV, D)), v=spec((B, CACHE + 1, HKV, D)))
kv("k", "rank3", ValueError, ["k must have 4 dimensions"], k=spec((B, NEW, HKV * D)))
# --- cache_seqlens --------------------------------------------------------------------------------------
kv("cache_seqlens", "dtype_int64", TypeError, ["cache_seqlens must be int32", "int64"], cache_seqlens=vals(LENS, "int64"))
kv("cache_seqlens", "shape", ValueError, ["cache_seqlens must have shape (batch,) = (2,)", "got (3)"],
   cache_seqlens=vals((1, 2, 3)))
kv("cache_seqlens", "not_contiguous", ValueError, ["cache_seqlens must be contiguous"],
   cache_seqlens=vals(LENS, strides=(2,)))
kv("cache_seqlens", "other_device", ValueError, ["cache_seqlens is on CUDA device 1"], cache_seqlens=vals(LENS, device=1))
kv("cache_seqlens", "value_negative", ValueError, ["cache_seqlens[1] = -1 is out of range", "0 <= cache_seqlens <= 97"],
   cache_seqlens=vals((5, -1)))
kv("cache_seqlens", "value_leaves_no_room", ValueError, ["cache_seqlens[0] = 98 is out of range", "3 new tokens"],
   cache_seqlens=vals((98, 0)))
kv("cache_seqlens", "paged_value_beyond_capacity", ValueError, ["cache_seqlens[1] = 127", "128 keys per entry"],
   paged=True, cache_seqlens=vals((1, 127)))
kv("cache_seqlens", "int_beyond_capacity", ValueError, ["cache_seqlens = 98 is out of range", "<= 97"],
   cache_seqlens=98)
kv("cache_seqlens", "int_negative", ValueError, ["cache_seqlens = -1 is out of range"], cache_seqlens=-1)
# --- page_table -----------------------------------------------------------------------------------------
kv("page_table", "dtype_int64", TypeError, ["page_table must be int32", "int64"], paged=True,
   page_table=vals([list(r) for r in TABLE], "int64"))
kv("page_table", "rank1", ValueError, ["page_table must have shape (batch, max_pages)"], paged=True,
   page_table=vals(TABLE[0]))
kv("page_table", "batch_mismatch", ValueError, ["page_table must have shape (batch, max_pages) = (2,", "(3, 8)"],
   paged=True, page_table=vals([list(TABLE[0])] * 3))
kv("page_table", "rows_not_contiguous", ValueError, ["page_table's rows must be contiguous"], paged=True,
   page_table=vals([list(r) for r in TABLE], strides=(16, 2)))
kv("page_table", "with_cache_batch_idx", ValueError, ["cache_batch_idx cannot be used with a paged cache",
                                                      "page_table"], paged=True, cache_batch_idx=vals((0, 1)))
kv("page_table", "value_beyond_pages", ValueError, ["page_table[1, 3] = 20 is out of range [0, 20)", "20 pages",
                                                    "first 4 pages"],
   paged=True, page_table=vals([list(TABLE[0]), [0, 2, 5, 20, -1, -1, -1, -1]]))
kv("page_table", "value_negative_in_use", ValueError, ["page_table[0, 0] = -1 is out of range"], paged=True,
   page_table=vals([[-1, 3, 4, 5, 6, 7, 8, 9], list(TABLE[1])]))
kv("page_table", "other_device", ValueError, ["page_table is on CUDA device 1"], paged=True,
   page_table=vals([list(r) for r in TABLE], device=1))
# --- cache_batch_idx ------------------------------------------------------------------------------------
kv("cache_batch_idx", "dtype_int64", TypeError, ["cache_batch_idx must be int32"], cache_batch_idx=vals((0, 1), "int64"))
kv("cache_batch_idx", "shape", ValueError, ["cache_batch_idx must have shape (batch,)"], cache_batch_idx=vals((0,)))
kv("cache_batch_idx", "value_beyond_cache", ValueError, ["cache_batch_idx[1] = 4 is out of range [0, 4)"],
   k_cache=spec((4, CACHE, HKV, D)), v_cache=spec((4, CACHE, HKV, D)), cache_batch_idx=vals((3, 4)))
kv("cache_batch_idx", "value_negative", ValueError, ["cache_batch_idx[0] = -2 is out of range"],
   cache_batch_idx=vals((-2, 1)))
# --- rotary ---------------------------------------------------------------------------------------------
kv("rotary_sin", "missing", ValueError, ["rotary_cos and rotary_sin must both be given"], rotary=True, rotary_sin=None)
kv("rotary_cos", "missing", ValueError, ["rotary_cos and rotary_sin must both be given"], rotary=True, rotary_cos=None)
kv("rotary_cos", "dtype_float32", TypeError, ["rotary_cos must have the dtype of q (bfloat16)", "float32"],
   rotary=True, rotary_cos=spec((RO, 32), "float32"))
kv("rotary_sin", "dtype_float16", TypeError, ["rotary_sin must have the dtype of q"], rotary=True,
   rotary_sin=spec((RO, 32), "float16"))
kv("rotary_cos", "rank1", ValueError, ["rotary_cos must have shape (seqlen_ro, rotary_dim / 2)"], rotary=True,
   rotary_cos=spec((RO,)), rotary_sin=spec((RO,)))
kv("rotary_sin", "shape_differs", ValueError, ["rotary_cos and rotary_sin must have the same shape"], rotary=True,
   rotary_sin=spec((RO, 16)))
kv("rotary_cos", "rotary_dim_not_multiple_of_16", ValueError, ["rotary_dim a multiple of 16", "rotary_dim = 24"],
   rotary=True, rotary_cos=spec((RO, 12)), rotary_sin=spec((RO, 12)))
kv("rotary_cos", "rotary_dim_above_headdim", ValueError, ["at most the head dim 128", "rotary_dim = 160"],
   rotary=True, rotary_cos=spec((RO, 80)), rotary_sin=spec((RO, 80)))
kv("rotary_cos", "rows_not_contiguous", ValueError, ["rotary_cos's rows must be contiguous"], rotary=True,
   rotary_cos=spec((RO, 32), strides=(64, 2)))
kv("rotary_cos", "too_few_positions", ValueError, ["rotary_cos has 62 positions but position 62 is rotated"],
   rotary=True, rotary_cos=spec((62, 32)), rotary_sin=spec((62, 32)))
kv("rotary_interleaved", "type_str", TypeError, ["rotary_interleaved must be a bool", "str"], rotary=True,
   rotary_interleaved="yes")
# --- scalars ----------------------------------------------------------------------------------------------
kv("softmax_scale", "zero", ValueError, ["softmax_scale must be a finite positive number"], softmax_scale=0.0)
kv("softmax_scale", "type_str", TypeError, ["softmax_scale must be a float or None"], softmax_scale="0.1")
kv("causal", "type_int", TypeError, ["causal must be a bool", "int"], causal=1)
kv("window_size", "entry_below_-1", ValueError, ["window_size entries must be >= -1"], window_size=(-2, 0))
kv("window_size", "one_entry", TypeError, ["window_size must be a pair of ints"], window_size=(4,))
kv("softcap", "negative", ValueError, ["softcap must be a finite number >= 0"], softcap=-1.0)
kv("softcap", "type_str", TypeError, ["softcap must be a float"], softcap="1")
kv("num_splits", "negative", ValueError, ["num_splits must be in [0, 128]", "-1"], num_splits=-1)
kv("num_splits", "above_max", ValueError, ["num_splits must be in [0, 128]", "129"], num_splits=129)
kv("num_splits", "type_float", TypeError, ["num_splits must be an int", "float"], num_splits=2.0)
kv("num_splits", "type_bool", TypeError, ["num_splits must be an int", "bool"], num_splits=True)
kv("check", "type_int", TypeError, ["check must be a bool", "int"], check=1)
# --- out / workspace (caller-provided buffers: a captured graph replays without allocating) -------------
OUT_PTR, WS_PTR = 0x20000, 0x40000
kv("out", "shape_differs_from_q", ValueError, ["out must have the shape of q (2, 1, 8, 128)", "(2, 1, 8, 64)"],
   out=spec((B, SQ, H, 64), ptr=OUT_PTR))
kv("out", "dtype_differs_from_q", TypeError, ["out must have the dtype of q (bfloat16)", "float16"],
   out=spec((B, SQ, H, D), "float16", ptr=OUT_PTR))
kv("out", "float32", TypeError, ["out must be float16 or bfloat16", "float32"], out=spec((B, SQ, H, D), "float32",
                                                                                      ptr=OUT_PTR))
kv("out", "headdim_not_contiguous", ValueError, ["out's last dimension (headdim) must be contiguous"],
   out=spec((B, SQ, H, D), strides=(2 * SQ * H * D, 2 * H * D, 2 * D, 2), ptr=OUT_PTR))
kv("out", "other_device", ValueError, ["out is on CUDA device 1 but q is on device 0"],
   out=spec((B, SQ, H, D), device=1, ptr=OUT_PTR))
kv("out", "is_q", ValueError, ["out must not be q itself"], out=spec((B, SQ, H, D)))
kv("workspace", "too_small", ValueError, ["workspace holds 100 bytes but this call needs 256", "the fp32 LSE",
                                          "kvcache_workspace_bytes"], workspace=spec((100,), "uint8", ptr=WS_PTR))
kv("workspace", "too_small_for_splits", ValueError, ["needs 33280", "partial results of 4 KV splits"], num_splits=4,
   workspace=spec((33279,), "uint8", ptr=WS_PTR))
kv("workspace", "too_small_for_rotary_and_int_seqlens", ValueError,
   ["the rotated q", "cache_seqlens as an int32 vector"], rotary=True, cache_seqlens=7, num_splits=1,
   workspace=spec((64, 2), "float32", ptr=WS_PTR))
kv("workspace", "not_contiguous", ValueError, ["workspace must be contiguous", "strides (2,)"],
   workspace=spec((4096,), "uint8", strides=(2,), ptr=WS_PTR))
kv("workspace", "unaligned", ValueError, ["workspace must start at a 16-byte aligned address", "0x40008"],
   workspace=spec((4096,), "uint8", ptr=WS_PTR + 8))
kv("workspace", "other_device", ValueError, ["workspace is on CUDA device 1 but q is on device 0"],
   workspace=spec((4096,), "uint8", device=1, ptr=WS_PTR))
# --- sizes and the GPU ----------------------------------------------------------------------------------
kv("headdim", "96_unsupported", ValueError, ["flash_attn_with_kvcache cannot run this call", "head dim 96"],
   d=96)
kv("GPU", "too_old", ValueError, ["flash_attn_with_kvcache cannot run this call", "sm_80 or newer", "sm_75"],
   cc=(7, 5))
kv("batch", "over_grid_limit", ValueError, ["batch must be at most 65535", "65536"], b=65536, new=0,
   cache_seqlens=0)
kv("kv_heads", "over_grid_limit", ValueError, ["kv_heads must be at most 65535", "65536"], h=65536, hkv=65536, new=0,
   cache_seqlens=0)
# --- flash_attn_combine -----------------------------------------------------------------------------------
cb("out_partial", "dtype_bfloat16", TypeError, ["out_partial must be float32", "bfloat16"],
   out_partial=spec((3, B, 2, H, D), "bfloat16"))
cb("out_partial", "rank4", ValueError, ["out_partial must have 5 dimensions"], out_partial=spec((3, B, 2, H * D), "float32"))
cb("out_partial", "empty_splits", ValueError, ["out_partial must have no empty dimension"],
   out_partial=spec((0, B, 2, H, D), "float32"), lse_partial=spec((0, B, H, 2), "float32"))
cb("out_partial", "headdim_not_contiguous", ValueError, ["out_partial's last dimension (headdim) must be contiguous"],
   out_partial=spec((3, B, 2, H, D), "float32", strides=(2 * B * 2 * H * D, 2 * 2 * H * D, 2 * H * D, 2 * D, 2)))
cb("lse_partial", "dtype_float16", TypeError, ["lse_partial must be float32"], lse_partial=spec((3, B, H, 2), "float16"))
cb("lse_partial", "shape_seqlen_heads_swapped", ValueError,
   ["lse_partial must have shape (num_splits, batch, heads, seqlen) = (3, 2, 8, 2)", "(3, 2, 2, 8)"],
   lse_partial=spec((3, B, 2, H), "float32"))
cb("lse_partial", "other_device", ValueError, ["lse_partial is on CUDA device 1"],
   lse_partial=spec((3, B, H, 2), "float32", device=1))
for bad in ("int8", "float64", "half"):
    CASES.append(Case(CB, "out_dtype", bad, "spec", _call(CB, dict(combine_args(), out_dtype=bad)), ValueError,
                      ("out_dtype must be None, 'float32', 'float16' or 'bfloat16'", repr(bad))))


# --- host memory and non-arrays through the real Call ----------------------------------------------------

class _DeviceDLPack:
    """Claims to live on CUDA device 0; the bad argument must be refused before any is converted."""

    def __dlpack__(self, stream=None):
        raise AssertionError("converted before every argument was checked")

    def __dlpack_device__(self):
        return (2, 0)


def _host_call(fn_name, bad_arg, bad):
    if fn_name == KV:
        args = {n: _DeviceDLPack() for n in ("q", "k_cache", "v_cache")}
        args["cache_seqlens"] = _DeviceDLPack()
    else:
        args = {n: _DeviceDLPack() for n in COMBINE_POSITIONAL}
    args[bad_arg] = bad
    return _call(fn_name, args)


for arg in ("q", "k_cache", "v_cache", "k", "cache_seqlens", "page_table", "rotary_cos", "out", "workspace"):
    host = np.zeros((B, 4), np.int32 if arg in ("cache_seqlens", "page_table") else np.float16)
    CASES.append(Case(KV, arg, "numpy_host_array", "host", _host_call(KV, arg, host), TypeError,
                      (f"{arg} must live in CUDA device memory", "numpy.ndarray")))
for arg, bad in (("cache_seqlens", None), ("cache_seqlens", 3.0), ("cache_seqlens", True), ("cache_seqlens", [1, 2]),
                 ("cache_batch_idx", [0, 1]), ("rotary_sin", "x"), ("v", (1, 2))):
    CASES.append(Case(KV, arg, f"not_an_array_{type(bad).__name__}", "host", _host_call(KV, arg, bad), TypeError,
                      (f"{arg} must be a GPU array", type(bad).__name__)))
for arg in COMBINE_POSITIONAL:
    CASES.append(Case(CB, arg, "numpy_host_array", "host", _host_call(CB, arg, np.zeros((2, 2), np.float32)), TypeError,
                      (f"{arg} must live in CUDA device memory",)))
    CASES.append(Case(CB, arg, "none", "host", _host_call(CB, arg, None), TypeError, (f"{arg} must be a GPU array",)))


# ----------------------------------------------------------------------------------------------------
# the environment of "spec" rows
# ----------------------------------------------------------------------------------------------------

@pytest.fixture
def spec_env(monkeypatch):
    """Public functions on Specs: fake Call, a fake 132-SM sm_90 GPU (or the row's cc); launches record
    their arguments in ``state["launches"]`` and decode.forward raises _ReachedKernel."""
    state = {"cc": GOOD_CC, "launches": []}
    monkeypatch.setattr(api, "Call", _SpecCall)
    monkeypatch.setattr(_device, "compute_capability", lambda device=0: state["cc"])
    monkeypatch.setattr(_device, "device_properties", lambda device=0: {"multiProcessorCount": 132, "sharedMemPerBlockOptin": 232448})
    monkeypatch.setitem(sys.modules, "cupy", mock.MagicMock(name="cupy"))

    def record(name, reach):
        def launch(*args, **kwargs):
            state["launches"].append((name, args, kwargs))
            if reach:
                raise _ReachedKernel(name)
        return launch

    monkeypatch.setattr(decode, "append", record("append", False))
    monkeypatch.setattr(decode, "forward", record("forward", True))
    monkeypatch.setattr(decode, "combine", record("combine", True))

    def carve(ws, layout, q_dtype):  # stand-ins for the views into the workspace
        state["carved"] = layout
        return {name: Carved(name, offset, shape, dt, ws.ptr + offset) for name, offset, shape, dt in layout}

    monkeypatch.setattr(decode, "carve", carve)
    return state


class Carved(NamedTuple):
    name: str
    offset: int
    shape: tuple
    dtype: str
    ptr: int

    def fill(self, value):
        pass


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, request):
    check_refused(case, request)


def test_table_covers_every_argument():
    unchecked = {"return_softmax_lse"}  # any value is fine (truthiness)
    # entry 1 of the default paged table uses its first 4 pages (60 + 3 keys of 16): the rows above put their
    # bad values there; values past the pages in use are never read and pass (see GOOD)
    seen = {(c.fn, c.arg) for c in CASES}
    missing = [f"{fn}({a}=...)" for fn in (KV, CB) for a in inspect.signature(getattr(cuflash, fn)).parameters
               if a not in unchecked and (fn, a) not in seen]
    assert not missing, f"no rows for {missing}"
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate row ids"
    assert {KV, CB} <= set(cuflash.__all__)


GOOD = [
    # (id, function, arguments, expected num_splits or None)
    ("decode-contiguous-append", KV, kv_args(), None),
    ("decode-contiguous-no-new", KV, kv_args(new=0), None),
    ("decode-paged", KV, kv_args(paged=True), None),
    ("decode-paged-page-size-1", KV, kv_args(paged=True, k_cache=spec((300, 1, HKV, D)), v_cache=spec((300, 1, HKV, D)),
                                             page_table=vals([list(range(100)), list(range(100, 200))])), None),
    ("decode-rotary-causal-sq4", KV, kv_args(sq=4, rotary=True, causal=True, rotary_interleaved=True), None),
    ("decode-int-cache-seqlens", KV, kv_args(cache_seqlens=97), None),
    ("decode-cache-batch-idx", KV, kv_args(k_cache=spec((5, CACHE, HKV, D)), v_cache=spec((5, CACHE, HKV, D)),
                                           cache_batch_idx=vals((4, 0))), None),
    ("decode-fp16-mqa-d64-window-softcap", KV, kv_args(dtype="float16", hkv=1, d=64, window_size=(16, 0), softcap=30.0),
     None),
    ("decode-forced-splits", KV, kv_args(num_splits=7), 7),
    ("decode-no-split", KV, kv_args(num_splits=1), 1),
    # check=False: values that check=True refuses get through (the CUDA-graph path)
    ("decode-unchecked-values", KV, kv_args(paged=True, check=False, cache_seqlens=vals((500, -3)),
                                            page_table=vals([[99] * MAXP, [-5] * MAXP])), None),
    # caller-provided out and workspace (a captured graph then replays without allocating)
    ("decode-out-and-workspace", KV, kv_args(out=spec((B, SQ, H, D), ptr=OUT_PTR),
                                             workspace=spec((256,), "uint8", ptr=WS_PTR)), 1),
    ("decode-out-strided", KV, kv_args(out=spec((B, SQ, H, D), strides=(SQ * H * 2 * D, H * 2 * D, 2 * D, 1),
                                                ptr=OUT_PTR)), None),
    ("decode-workspace-splits-rotary-int-seqlens", KV,
     kv_args(rotary=True, num_splits=4, cache_seqlens=7, workspace=spec((1 << 20,), "float32", ptr=WS_PTR)), 4),
    ("combine-default", CB, combine_args(), None),
    ("combine-bf16-one-split", CB, dict(combine_args(ns=1), out_dtype="bfloat16"), None),
]


@pytest.mark.parametrize("what,fn,args,splits", GOOD, ids=[g[0] for g in GOOD])
def test_good_calls_reach_the_kernel(spec_env, what, fn, args, splits):
    with pytest.raises(_ReachedKernel):
        _call(fn, args)()
    names = [n for n, _, _ in spec_env["launches"]]
    if fn == CB:
        assert names == ["combine"]
        return
    want_append = "k" in args or "rotary_cos" in args
    assert names == (["append", "forward"] if want_append else ["forward"])
    _, fwd_args, fwd_kwargs = spec_env["launches"][-1]
    num_splits = fwd_args[12]
    if splits is not None:
        assert num_splits == splits
    assert (fwd_kwargs["o_partial"] is None) == (num_splits == 1)


def test_out_and_workspace_reach_the_kernels(spec_env):
    """out= is the array the kernels write; the scratch comes from the workspace at 256-byte aligned offsets."""
    out = spec((B, SQ, H, D), ptr=OUT_PTR)
    args = kv_args(paged=True, rotary=True, num_splits=3, out=out, workspace=spec((1 << 16,), "uint8", ptr=WS_PTR))
    with pytest.raises(_ReachedKernel):
        _call(KV, args)()
    (_, app_args, _), (_, fwd_args, fwd_kwargs) = spec_env["launches"]
    layout = {name: (offset, shape, dt) for name, offset, shape, dt in spec_env["carved"]}
    assert list(layout) == ["lse", "o_partial", "lse_partial", "q_rot"]
    assert layout["lse"] == (0, (B, H, SQ), "float32")
    assert layout["o_partial"] == (256, (3, B, SQ, H, D), "float32")
    assert layout["lse_partial"] == (256 + 3 * B * SQ * H * D * 4, (3, B, H, SQ), "float32")
    assert layout["q_rot"][1:] == ((B, SQ, H, D), "bfloat16") and layout["q_rot"][0] % 256 == 0
    assert fwd_args[3].name == "out" and fwd_args[3].ptr == OUT_PTR  # the caller's out, not a new array
    assert fwd_args[4].name == "lse" and fwd_args[0].name == "q_rot" and app_args[5].name == "q_rot"
    assert fwd_kwargs["o_partial"].name == "o_partial" and fwd_kwargs["lse_partial"].name == "lse_partial"
    assert all(c.ptr % 16 == 0 for c in (fwd_args[4], fwd_kwargs["o_partial"], fwd_kwargs["lse_partial"]))


def test_out_is_returned_as_given(spec_env, monkeypatch):
    """Without a workspace the call still writes into (and returns) the caller's out."""
    monkeypatch.setattr(decode, "forward", lambda *a, **k: spec_env["launches"].append(("forward", a, k)))
    out = spec((B, SQ, H, D), ptr=OUT_PTR)
    res, lse = _call(KV, kv_args(new=0, num_splits=1, out=out, return_softmax_lse=True))()
    assert res.ptr == OUT_PTR and res.shape == out.shape
    assert spec_env["launches"][-1][1][3].ptr == OUT_PTR


class _NoHostCopy(ValSpec):
    def get(self):
        raise AssertionError("check=False read a device value on the host")


def _no_host(v: ValSpec) -> _NoHostCopy:
    return _NoHostCopy(**{f.name: getattr(v, f.name) for f in dataclasses.fields(ValSpec)})


@pytest.mark.parametrize("paged", [False, True])
def test_unchecked_call_reads_nothing_on_the_host(spec_env, paged):
    """check=False (the CUDA-graph path) never copies a device value to the host (cupy.asnumpy, .get(), int()
    of a device scalar): num_splits=0 comes from the shapes, with the capacity as the longest entry."""
    import cupy  # the fixture's MagicMock

    args = kv_args(paged=paged, check=False, new=0, cache_batch_idx=None if paged else _no_host(vals((1, 0))))
    args["cache_seqlens"] = _no_host(args["cache_seqlens"])
    if paged:
        args["page_table"] = _no_host(args["page_table"])
    with pytest.raises(_ReachedKernel):
        _call(KV, args)()
    assert not cupy.asnumpy.called and not cupy.ndarray.get.called
    capacity = MAXP * PAGE if paged else CACHE
    tiles = heuristics.DECODE_TILES[D]
    want = heuristics.decode_num_splits(B, HKV, 1, capacity, tiles.block_n, 132, paged=paged and tiles.paged_rule,
                                        page_size=PAGE if paged else None)
    assert spec_env["launches"][-1][1][12] == want


def test_kvcache_num_splits_is_the_call_s_choice_and_bounds_it(spec_env):
    """kvcache_num_splits gives what num_splits=0 picks; at the capacity it bounds every check=True choice
    (the heuristic never splits more for fewer keys), so a workspace sized with it always fits."""
    for b, h, hkv, sq, keys in ((1, 32, 8, 1, 32768), (16, 32, 8, 1, 8192), (128, 32, 8, 1, 2048), (2, 8, 2, 5, 100)):
        got = api.kvcache_num_splits(b, h, hkv, sq, D, keys, device=0)
        mb = -(-(h // hkv) * sq // heuristics.DECODE_BLOCK_M)
        assert got == heuristics.decode_num_splits(b, hkv, mb, keys, heuristics.DECODE_TILES[D].block_n, 132)
        assert all(api.kvcache_num_splits(b, h, hkv, sq, D, k, device=0) <= got for k in range(0, keys + 1, 97))
    assert api.kvcache_num_splits(1, 32, 8, 1, 128, 32768, device=0) > 1  # batch 1 at 32k splits
    with pytest.raises(ValueError, match="head dim 96"):
        api.kvcache_num_splits(1, 8, 2, 1, 96, 100, device=0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        api.kvcache_num_splits(1, 8, 3, 1, 128, 100, device=0)
    for size in (1, 16, 256):  # the page size the call passes on; the paged count without one bounds them
        got = api.kvcache_num_splits(1, 32, 8, 1, D, 32768, paged=True, page_size=size, device=0)
        tiles = heuristics.DECODE_TILES[D]
        assert got == heuristics.decode_num_splits(1, 8, 1, 32768, tiles.block_n, 132, paged=tiles.paged_rule,
                                                   page_size=size)
        assert got <= api.kvcache_num_splits(1, 32, 8, 1, D, 32768, paged=True, device=0)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="page_size"):
            api.kvcache_num_splits(1, 8, 2, 1, 128, 100, paged=True, page_size=bad, device=0)


def test_kvcache_workspace_bytes():
    lse = B * H * SQ * 4
    assert api.kvcache_workspace_bytes(B, H, SQ, D, 1) == 256  # lse alone, rounded up to 256 bytes
    split = -(-4 * B * SQ * H * D * 4 // 256) * 256 + 256
    assert api.kvcache_workspace_bytes(B, H, SQ, D, 4) == 256 + split
    q_rot = B * SQ * H * D * 2
    assert api.kvcache_workspace_bytes(B, H, SQ, D, 1, rotary=True, int_cache_seqlens=True) == 256 + q_rot + 256
    assert api.kvcache_workspace_bytes(B, H, SQ, D, 1, dtype="float16", rotary=True) == 256 + q_rot
    big = api.kvcache_workspace_bytes(128, 32, 1, 128, 8)
    assert big >= 8 * 128 * 32 * 128 * 4 + 8 * 128 * 32 * 4 + lse  # larger calls need more
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="split count"):
            api.kvcache_workspace_bytes(B, H, SQ, D, bad)
    layout, total = decode.workspace_layout(3, 2, 5, 64, 7, "bfloat16", rotary=True, seqlens_vector=True)
    ends = [off + int(np.prod(shape)) * (2 if dt == "bfloat16" else 4) for _, off, shape, dt in layout]
    assert all(off % decode.WORKSPACE_ALIGN == 0 for _, off, _, _ in layout)
    assert all(end <= nxt for end, (_, nxt, _, _) in zip(ends, layout[1:])) and ends[-1] <= total


def test_auto_splits_use_the_heuristic(spec_env):
    """num_splits=0 with check=True: the heuristic sees the longest entry's keys (60 + 3 new)."""
    with pytest.raises(_ReachedKernel):
        _call(KV, kv_args())()
    num_splits = spec_env["launches"][-1][1][12]
    blocks_n = heuristics.DECODE_TILES[D].block_n
    assert num_splits == heuristics.decode_num_splits(B, HKV, 1, 63, blocks_n, 132) == 1  # 63 keys: one tile


# ----------------------------------------------------------------------------------------------------
# references and the split model
# ----------------------------------------------------------------------------------------------------

def _bf16(x):
    import ml_dtypes

    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def test_rotary_reference_matches_a_hand_written_loop():
    rng = np.random.default_rng(1)
    b, s, h, d, rd, ro = 2, 3, 2, 32, 16, 10
    x = rng.standard_normal((b, s, h, d)).astype(np.float32)
    cos, sin = rng.standard_normal((ro, rd // 2)).astype(np.float32), rng.standard_normal((ro, rd // 2)).astype(np.float32)
    pos = rng.integers(0, ro, (b, s))
    for interleaved in (False, True):
        got = ref.rotary_ref(x, cos, sin, pos, interleaved=interleaved)
        want = x.copy()
        for bi in range(b):
            for si in range(s):
                p = pos[bi, si]
                for hi in range(h):
                    for i in range(rd // 2):
                        a, c = (2 * i, 2 * i + 1) if interleaved else (i, i + rd // 2)
                        x1, x2 = x[bi, si, hi, a], x[bi, si, hi, c]
                        want[bi, si, hi, a] = x1 * cos[p, i] - x2 * sin[p, i]
                        want[bi, si, hi, c] = x2 * cos[p, i] + x1 * sin[p, i]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert np.array_equal(got[..., rd:], x[..., rd:])  # channels past rotary_dim pass through
    # a rotation: norms of the rotated pairs are kept when cos^2 + sin^2 = 1
    ang = rng.uniform(0, 6.3, (ro, rd // 2))
    got = ref.rotary_ref(x, np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32), pos)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_combine_reference_against_brute_force():
    rng = np.random.default_rng(2)
    ns, b, s, h, d = 5, 2, 3, 4, 8
    o = rng.standard_normal((ns, b, s, h, d))
    lse = rng.standard_normal((ns, b, h, s)) * 3
    lse[1] = -np.inf  # a split with no keys anywhere: its out is garbage and must not be read
    o[1] = np.nan
    lse[:, 0, 0, 0] = -np.inf  # one row with no keys at all
    out, l = ref.combine_ref(o, lse)
    for bi in range(b):
        for si in range(s):
            for hi in range(h):
                ls = lse[:, bi, hi, si]
                if np.all(ls == -np.inf):
                    assert l[bi, hi, si] == -np.inf and np.all(out[bi, si, hi] == 0)
                    continue
                keep = ls > -np.inf
                want_l = np.log(np.exp(ls[keep]).sum())
                want_o = (np.exp(ls[keep] - want_l)[:, None] * o[keep, bi, si, hi]).sum(axis=0)
                assert abs(l[bi, hi, si] - want_l) < 1e-12
                np.testing.assert_allclose(out[bi, si, hi], want_o, rtol=1e-12, atol=1e-12)


def _random_case(rng, *, paged, b, sq, h, hkv, d, lens, new, page_size=7, rotary=False):
    q = _bf16(rng.standard_normal((b, sq, h, d)))
    need = max(lens) + new
    if paged:
        max_pages = -(-need // page_size) + 1
        pages = b * max_pages + 3
        kc = _bf16(rng.standard_normal((pages, page_size, hkv, d)))
        vc = _bf16(rng.standard_normal((pages, page_size, hkv, d)))
        pt = rng.permutation(pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    else:
        kc = _bf16(rng.standard_normal((b, need + 5, hkv, d)))
        vc = _bf16(rng.standard_normal((b, need + 5, hkv, d)))
        pt = None
    k = _bf16(rng.standard_normal((b, new, hkv, d))) if new else None
    v = _bf16(rng.standard_normal((b, new, hkv, d))) if new else None
    extra = {}
    if rotary:
        ang = rng.uniform(0, 6.3, (need + sq + 1, d // 4))
        extra = dict(rotary_cos=_bf16(np.cos(ang)), rotary_sin=_bf16(np.sin(ang)))
    return dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=np.asarray(lens, np.int32), page_table=pt, **extra)


SPLIT_CASES = [
    # (id, paged, b, sq, h, hkv, d, lens, new, options, num_splits, block_n)
    ("decode-contig-ragged", False, 3, 1, 4, 2, 16, (0, 1, 37), 0, {}, 3, 8),
    ("decode-paged-append", True, 2, 1, 6, 2, 16, (5, 20), 1, {}, 4, 4),
    ("sq3-causal-more-splits-than-tiles", True, 2, 3, 4, 1, 16, (0, 9), 2, dict(causal=True), 9, 4),
    ("sq5-causal-empty-rows", False, 2, 5, 2, 2, 8, (0, 2), 1, dict(causal=True), 2, 2),
    ("window-softcap", False, 2, 2, 4, 2, 16, (13, 30), 2, dict(window_size=(5, 1), softcap=2.0), 3, 4),
    ("gqa-17-rows-two-m-blocks", True, 1, 1, 17, 1, 8, (23,), 0, dict(causal=True), 2, 8),
    ("sq4-group8-window-left", False, 1, 4, 8, 1, 8, (40,), 4, dict(window_size=(6, -1), causal=True), 5, 8),
    ("rotary-neox-causal", True, 2, 2, 4, 2, 16, (3, 11), 2, dict(causal=True, rotary=True), 3, 4),
    ("rotary-interleaved", False, 2, 2, 4, 2, 16, (3, 11), 2, dict(rotary=True, rotary_interleaved=True), 2, 4),
]


@pytest.mark.parametrize("what,paged,b,sq,h,hkv,d,lens,new,options,num_splits,block_n", SPLIT_CASES,
                         ids=[c[0] for c in SPLIT_CASES])
def test_split_model_matches_the_exact_reference(what, paged, b, sq, h, hkv, d, lens, new, options, num_splits, block_n):
    rng = np.random.default_rng(abs(hash(what)) % 2 ** 32)
    options = dict(options)
    case = _random_case(rng, paged=paged, b=b, sq=sq, h=h, hkv=hkv, d=d, lens=lens, new=new,
                        rotary=options.pop("rotary", False))
    interleaved = options.pop("rotary_interleaved", False)
    out, lse, kc, vc = ref.kvcache_attention_ref(**case, rotary_interleaved=interleaved, compute_dtype="float64",
                                                 **options)
    q_used, kc2, vc2, seqlens_k = ref.kvcache_update_ref(
        case["q"], case["k_cache"], case["v_cache"], case["k"], case["v"], cache_seqlens=case["cache_seqlens"],
        page_table=case["page_table"], rotary_cos=case.get("rotary_cos"), rotary_sin=case.get("rotary_sin"),
        rotary_interleaved=interleaved, causal=options.get("causal", False),
        window_size=options.get("window_size", (-1, -1)))
    assert np.array_equal(kc.astype(np.float32), kc2.astype(np.float32))
    o_part, lse_part = ref.decode_split_model(q_used, kc2, vc2, seqlens_k=seqlens_k, page_table=case["page_table"],
                                              num_splits=num_splits, block_n=block_n, **options)
    empty_splits = np.all(lse_part == -np.inf, axis=(1, 2, 3))
    o, l = ref.combine_ref(o_part, lse_part)
    np.testing.assert_allclose(o, out, atol=1e-10, rtol=1e-10)
    assert np.array_equal(l == -np.inf, lse == -np.inf)
    fin = np.isfinite(lse)
    np.testing.assert_allclose(l[fin], lse[fin], atol=1e-10, rtol=1e-10)
    if what.endswith("more-splits-than-tiles"):
        assert empty_splits.any()  # trailing splits got no tile and wrote 0 / -inf
    if "empty-rows" in what:
        assert (lse == -np.inf).any()


def test_split_tiles_cover_the_range_once():
    for first, last, bn in ((0, 0, 4), (3, 200, 16), (17, 17, 8), (5, 4, 4), (0, 63, 64), (64, 64, 64)):
        for ns in (1, 2, 3, 7, 40):
            tiles = []
            for s in range(ns):
                lo, hi = ref.decode_split_tiles(s, ns, first, last, bn)
                tiles += list(range(lo, hi))
            want = [] if last < first else list(range(first // bn, last // bn + 1))
            assert tiles == want, (first, last, bn, ns)


def test_append_with_cache_batch_idx_writes_the_named_rows():
    rng = np.random.default_rng(3)
    q = _bf16(rng.standard_normal((2, 1, 2, 8)))
    kc = _bf16(rng.standard_normal((4, 10, 1, 8)))
    k = _bf16(rng.standard_normal((2, 2, 1, 8)))
    _, kc2, _, n = ref.kvcache_update_ref(q, kc, kc, k, k, cache_seqlens=np.array([3, 0], np.int32),
                                          cache_batch_idx=np.array([2, 0], np.int32))
    assert list(n) == [5, 2]
    assert np.array_equal(kc2[2, 3:5], k[0]) and np.array_equal(kc2[0, 0:2], k[1])
    untouched = np.ones(kc.shape[:2], bool)
    untouched[2, 3:5] = untouched[0, 0:2] = False
    assert np.array_equal(kc2[untouched].astype(np.float32), kc[untouched].astype(np.float32))


# ----------------------------------------------------------------------------------------------------
# heuristic
# ----------------------------------------------------------------------------------------------------

def test_split_heuristic():
    f = heuristics.decode_num_splits
    assert f(64, 8, 1, 8192, 64, 132) == 1  # 512 blocks fill 132 SMs
    assert f(1, 8, 1, 32768, 64, 132) == 16  # contiguous: 8 blocks -> 128, one per SM, no second wave
    assert f(5, 8, 1, 32768, 64, 132) == 3  # 40 blocks -> 120 (4 splits would be 160: 28 SMs with two)
    assert f(1, 1, 1, 1 << 20, 64, 132) == heuristics.DECODE_MAX_SPLITS  # 132 wanted (one per SM): capped
    assert f(1, 1, 1, 1 << 20, 64, 100) == 100  # one per SM of a smaller GPU
    assert f(1, 8, 1, 200, 64, 132) == 1  # 4 tiles: not worth a split
    assert f(1, 8, 1, 64 * 8, 64, 132) == 2  # 8 tiles: at least 4 per split
    # Paged caches: a grid of about one block per SM gets a second split (the page-table loads of one block
    # are not hidden); contiguous caches and grids past one wave stay unsplit.
    assert f(16, 8, 1, 8192, 64, 132, paged=True) == 2 and f(16, 8, 1, 8192, 64, 132) == 1  # 128 blocks
    assert f(32, 8, 1, 8192, 64, 132, paged=True) == 1  # 256 blocks: two waves' worth already
    assert f(16, 8, 1, 7 * 64, 64, 132, paged=True) == 1  # 7 tiles: no split of fewer than 4
    assert f(1, 8, 1, 32768, 64, 132, paged=True) == 33  # small grids: about two blocks per SM
    # ... for small pages: from DECODE_SMALL_PAGE_BELOW a paged cache splits like a contiguous one
    small = heuristics.DECODE_SMALL_PAGE_BELOW
    assert f(1, 8, 1, 32768, 64, 132, paged=True, page_size=small - 1) == 33
    assert f(1, 8, 1, 32768, 64, 132, paged=True, page_size=small) == f(1, 8, 1, 32768, 64, 132) == 16
    assert f(16, 8, 1, 8192, 64, 132, paged=True, page_size=256) == 1
    assert f(16, 8, 1, 8192, 64, 132, paged=True, page_size=1) == 2
    for batch in (1, 4, 16, 100):  # the paged rule bounds every page size's count (workspaces are sized by it)
        for size in (1, 16, 64, 256):
            assert f(batch, 8, 1, 32768, 64, 132, paged=True, page_size=size) <= f(batch, 8, 1, 32768, 64, 132,
                                                                                   paged=True)
    for paged in (False, True):
        for batch in (1, 2, 4, 16, 30, 33, 100):
            previous = None
            for keys in (1, 63, 64, 1000, 5000, 100000):
                n = f(batch, 4, 1, keys, 64, 132, paged=paged)
                assert 1 <= n <= heuristics.DECODE_MAX_SPLITS
                assert n == 1 or -(-keys // 64) // n >= heuristics.DECODE_MIN_TILES_PER_SPLIT
                assert previous is None or n >= previous, "more keys must never mean fewer splits"
                previous = n


# ----------------------------------------------------------------------------------------------------
# machine code (tests/test_compile.py checks every family for compile errors and spills)
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_decode_kernels_use_tensor_cores_and_cp_async(arch):
    """decode_fwd runs on mma.sync (HMMA) fed by cp.async (LDGSTS) and ldmatrix (LDSM), with no spills;
    the registered family is 2 dtypes x (3 head dims x {contiguous, paged} + d = 128's deeper paged ring for
    one-wave grids) + 4 append/rotary + 3 combine."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "cuflash", "compile", "--arch", arch, "--family", "decode", "--json"],
                          capture_output=True, text=True)
    rows = json.loads(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    assert len(rows) == 21
    fwd = [r for r in rows if r["kernel"] == "decode_fwd"]
    assert len(fwd) == 14
    for r in fwd:
        ops = r["opcodes"]
        assert ops and ops["HMMA"] > 0 and ops["LDGSTS"] > 0 and ops["LDSM"] > 0, r["name"]
        assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0, r["name"]


@pytest.mark.parametrize("stages", [2, 3, 4, 6])
@pytest.mark.parametrize("tiles", [1, 2, 3, 5, 17])
def test_page_ring_schedule(stages, tiles):
    """decode/fwd.cu's page-table entry ring, replayed in Python: tile t's entries go to slot t % (2 stages)
    in the commit group of tile t - (stages - 1) (the first stages - 1 tiles' before the prologue, waited
    for at once); the copy of tile t reads them after the wait for tile t - (stages - 1)'s group and a
    barrier. Checks that every read finds its tile's entries landed, and that no slot is rewritten before
    the barrier that follows its last read."""
    ring = 2 * stages
    slot = {}           # slot -> (tile, group that writes it)
    last_read = {}      # slot -> the barrier count at which it was last read
    groups_done = -1    # groups landed (for this thread: cp.async.wait_group); the prologue's entries: group -1
    barriers = 0

    def write(t, group):
        s = t % ring
        if s in last_read:  # the write is issued after every thread passed a barrier since the last read
            assert barriers > last_read[s], (t, s)
        slot[s] = (t, group)

    def read(t):
        s = t % ring
        assert slot[s][0] == t and slot[s][1] <= groups_done, (t, slot[s], groups_done)
        last_read[s] = barriers

    for t in range(min(stages - 1, tiles)):  # the prologue's own group, waited for, then a barrier
        write(t, -1)
    barriers += 1
    for s in range(stages - 1):  # prologue groups 0 .. stages - 2: tile s's data, tile s + stages - 1's entries
        if s < tiles:
            read(s)
        if s + stages - 1 < tiles:
            write(s + stages - 1, s)
    for n in range(tiles):  # loop iteration n: group n + stages - 1
        groups_done = n  # cp_async_wait<stages - 2>: the group of tile n (= group n) has landed
        barriers += 1
        nxt = n + stages - 1
        if nxt < tiles:
            read(nxt)
        if nxt + stages - 1 < tiles:
            write(nxt + stages - 1, nxt)
