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
Row ids read "function-argument-problem".
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
FWD_ARRAYS = ("q", "k", "v")
BWD_ARRAYS = ("dout", "q", "k", "v", "out", "lse")
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

    @property
    def id(self):
        return f"{self.fn}-{self.arg}-{self.problem}"


def _public(fn_name, arrs, kwargs):
    names = FWD_ARRAYS if fn_name == "flash_attn_func" else BWD_ARRAYS
    fn = getattr(cuflash, fn_name)
    return lambda: fn(*(arrs[n] for n in names), **kwargs)


CASES: list[Case] = []


def add(fn, arg, problem, exc, words, *, arrs=None, mode="spec", call=None, cc=GOOD_CC, **kwargs):
    """One row; ``kwargs`` are the public function's keyword arguments."""
    if call is None:
        call = _public(fn, arrs if arrs is not None else arrays(), kwargs)
    CASES.append(Case(fn, arg, problem, mode, call, exc, tuple(words), cc))


def both(arg, problem, exc, words, **kw):
    """The same problem through both public functions (they share the q/k/v/scale/window/impl checks)."""
    for fn in ("flash_attn_func", "flash_attn_backward"):
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
both("k", "headdim_mismatch", ValueError, ["k and v must have q's head dim 64", "got 128"],
     arrs=arrays(k=spec((B, SK, HKV, 128)), v=spec((B, SK, HKV, 128))))
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

# --- head dim and implementation choice (both functions) ---------------------------------------------
for d in (8, 80, 512):
    both("headdim", f"{d}_unsupported", ValueError,
         ["no cuflash implementation can run this", f"head dim {d} is not supported", "supported: ["],
         arrs=arrays(d=d))
for direction, fn in (("forward", "flash_attn_func"), ("backward", "flash_attn_backward")):
    for name, fam in FAMILIES.items():
        if (fam.FWD_FEATURES if direction == "forward" else fam.BWD_FEATURES) is None:
            add(fn, "impl", f"{name}_has_no_{direction}", ValueError,
                [f"impl={name!r}", f"it has no {direction} kernel yet"], impl=name)
            continue
        for d in ALL_HEADDIMS:
            if d not in fam.HEADDIMS:
                add(fn, "impl", f"{name}_headdim_{d}", ValueError,
                    [f"impl={name!r}", f"head dim {d} is not supported", str(list(fam.HEADDIMS))],
                    arrs=arrays(d=d), impl=name)
        add(fn, "impl", f"{name}_gpu_too_old", ValueError,
            [f"impl={name!r}", f"sm_{fam.MIN_CC[0]}{fam.MIN_CC[1]} or newer", "sm_75"], impl=name, cc=(7, 5))
    for problem, bad in (("unknown_fa9", "fa9"), ("empty_string", ""), ("none", None), ("wrong_case_FA2", "FA2"),
                         ("int", 2)):
        add(fn, "impl", problem, ValueError, ["impl must be one of", repr(bad)], impl=bad)

# --- scalars: softmax_scale, window_size, causal (both functions) -------------------------------------
for bad in (0.0, -1.0, math.nan, math.inf, -math.inf):
    both("softmax_scale", f"value_{bad}", ValueError, ["softmax_scale must be a finite positive number", str(bad)],
         softmax_scale=bad)
for bad in ("0.1", True, [0.1], 1j):
    both("softmax_scale", f"type_{type(bad).__name__}", TypeError,
         ["softmax_scale must be a float or None", type(bad).__name__], softmax_scale=bad)
for bad in ((-2, 0), (0, -2), (-5, -5)):
    both("window_size", f"entry_below_-1_{bad[0]}_{bad[1]}", ValueError, ["window_size entries must be >= -1", str(bad)],
         window_size=bad)
for problem, bad in (("one_entry", (1,)), ("three_entries", (1, 2, 3)), ("float_entry", (1.5, 2)), ("string", "ab"),
                     ("none", None), ("bool_entry", (True, 0)), ("int", 4), ("string_entries", ("1", "2"))):
    both("window_size", problem, TypeError, ["window_size must be a pair of ints (left, right)", repr(bad)],
         window_size=bad)
for bad in (1, "yes", None):
    both("causal", f"type_{type(bad).__name__}", TypeError, ["causal must be a bool", type(bad).__name__],
         causal=bad)

# --- softcap, alibi_slopes (every public function that takes them: the forward today) ----------------
PUBLIC = ("flash_attn_func", "flash_attn_backward")
DIRECTION = {"flash_attn_func": "forward", "flash_attn_backward": "backward"}


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
        if _takes(fn, "softcap") and "softcap" not in feats:
            add(fn, "impl", f"{name}_with_softcap", ValueError,
                [f"impl={name!r}", f"its {DIRECTION[fn]} does not support softcap"], softcap=5.0, impl=name)
        if _takes(fn, "alibi_slopes") and "alibi" not in feats:
            add(fn, "impl", f"{name}_with_alibi_slopes", ValueError,
                [f"impl={name!r}", f"its {DIRECTION[fn]} does not support alibi"], alibi_slopes=slopes(), impl=name)
        optional = [("causal", dict(causal=True)), ("window", dict(window_size=(8, 8)))]
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


# --- host memory and non-arrays through the real Call (both functions, every array argument) ----------

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
    names = FWD_ARRAYS if fn == "flash_attn_func" else BWD_ARRAYS
    args = {n: _DeviceDLPack() for n in names}
    kwargs = {}
    if bad_arg in args:
        args[bad_arg] = bad
    else:
        kwargs[bad_arg] = bad
    f = getattr(cuflash, fn)
    return lambda: f(*(args[n] for n in names), **kwargs)


for fn, names in (("flash_attn_func", FWD_ARRAYS), ("flash_attn_backward", BWD_ARRAYS)):
    for arg in names + (("alibi_slopes",) if _takes(fn, "alibi_slopes") else ()):
        shape = (H,) if arg == "alibi_slopes" else (B, H, SQ) if arg == "lse" else (B, SQ, H, D)
        host = np.zeros(shape, np.float32 if arg in ("lse", "alibi_slopes") else np.float16)
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


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, request):
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
    unchecked = {"return_lse"}  # any value is fine (truthiness)
    seen = {(c.fn, c.arg) for c in CASES}
    missing = []
    for fn in PUBLIC:
        for arg in inspect.signature(getattr(cuflash, fn)).parameters:
            if arg not in unchecked and (fn, arg) not in seen:
                missing.append(f"{fn}({arg}=...)")
    assert not missing, f"no rows for {missing}: add them to CASES"
    assert set(PUBLIC) <= set(cuflash.__all__)
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate row ids"


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
            for fn, feats in (("flash_attn_func", fam.FWD_FEATURES), ("flash_attn_backward", fam.BWD_FEATURES)):
                if feats is None:
                    continue
                with pytest.raises(_ReachedKernel, match=name):
                    _public(fn, arrays(d=d), dict(impl=name))()


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
