"""CPU tier of FP8 attention (``flash_attn_func`` on e4m3 inputs, cuflash/fp8_attention.py).

* The e4m3 decode table of the reference (``reference.e4m3_table``, from the format's definition) against
  ml_dtypes and known values; ``reference.round_e4m3`` (the rounding of P the reference can model) against
  ml_dtypes' conversion, ties included.
* ``reference.attention_fp8_ref`` on tiny shapes against a direct loop over rows and keys, with per-block,
  per-tensor and mixed descales, causal masks with seqlen_q < and > seqlen_k, GQA; its ``round_p`` model;
  and the reference quantiser feeding it gives attention close to that of the unquantised inputs.
* A bad-input table, as tests/test_bad_input_table.py: "spec" rows call ``cuflash.flash_attn_func`` on
  ``Spec`` records (stand-in ``Call``, a fake GPU, a stand-in cupy, ``fa3.forward_fp8`` replaced by a
  sentinel); "host" rows go through the real ``Call``. Every row's message names the argument. Good calls
  show what reaches the kernel: the blocks, the descales' shapes, the output's dtype, the window.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import types

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _device, api, fa3, fp8_attention
from cuflash import reference as ref
from test_bad_input_table import Case, _ReachedKernel, _SpecCall, check_refused, slopes, spec  # the same stand-ins

B, SQ, SK, H, HKV, D = 2, 300, 520, 8, 2, 128
GOOD_CC = (9, 0)


# ----------------------------------------------------------------------------------------------------
# e4m3: the decode table and the rounding
# ----------------------------------------------------------------------------------------------------

def test_e4m3_table_is_ml_dtypes_float8_e4m3fn():
    table = ref.e4m3_table()
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert table.shape == (256,) and table.dtype == np.float64
    np.testing.assert_array_equal(table, want)  # NaN where NaN
    np.testing.assert_array_equal(np.signbit(table), np.signbit(want))  # -0 at 0x80


def test_e4m3_table_known_values():
    table = ref.e4m3_table()
    known = {0x00: 0.0, 0x01: 2.0 ** -9, 0x07: 7 * 2.0 ** -9, 0x08: 2.0 ** -6, 0x30: 0.5, 0x38: 1.0, 0x39: 1.125,
             0x40: 2.0, 0x77: 240.0, 0x7E: 448.0, 0xB8: -1.0, 0xFE: -448.0, 0x81: -(2.0 ** -9)}
    for bits, value in known.items():
        assert table[bits] == value, hex(bits)
    assert np.signbit(table[0x80]) and table[0x80] == 0
    assert np.isnan(table[[0x7F, 0xFF]]).all() and np.isnan(table).sum() == 2  # NaN only there
    assert np.isfinite(table[~np.isnan(table)]).all()  # no infinities
    finite = np.sort(np.unique(np.abs(table[~np.isnan(table)])))
    assert len(finite) == 127 and finite[-1] == 448.0  # 0 and 126 positive magnitudes


def test_e4m3_values_uses_the_table():
    bits = np.arange(256, dtype=np.uint8)
    values = ref.e4m3_values(bits)
    assert values.dtype == np.float32
    np.testing.assert_array_equal(values, ref.e4m3_table().astype(np.float32))


def test_round_e4m3_matches_ml_dtypes():
    """Random values over the whole range (subnormals, normals, past 448), and every midpoint between two
    neighbouring e4m3 values (ties go to the even mantissa)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-14, 10, 200_000))).astype(np.float32)
    table = ref.e4m3_table()
    positive = np.sort(table[(table >= 0) & np.isfinite(table)])
    midpoints = ((positive[1:] + positive[:-1]) / 2).astype(np.float32)  # exact in float32
    x = np.concatenate([x, midpoints, -midpoints, positive.astype(np.float32), [0.0, -0.0, 460.0, 1e30, -1e30]])
    want = ref.e4m3_values(ref.e4m3_bits(x))
    for dtype in (np.float32, np.float64):
        got = ref.round_e4m3(x.astype(dtype))
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want.astype(dtype))
    assert np.isnan(ref.round_e4m3(np.array([np.nan]))).all()


# ----------------------------------------------------------------------------------------------------
# the reference
# ----------------------------------------------------------------------------------------------------

def fp8_inputs(rng, b, sq, sk, h, hkv, d, nq, nk):
    """Random e4m3 bytes (NaN patterns left out) and positive descales of n entries per (batch, head)."""
    def data(*shape):
        bits = rng.integers(0, 256, shape, dtype=np.uint8)
        return np.where((bits & 0x7F) == 0x7F, bits ^ 0x01, bits).astype(np.uint8)

    def descale(hh, n):
        return rng.uniform(0.002, 0.02, (b, hh, n)).astype(np.float32)

    return (data(b, sq, h, d), data(b, sk, hkv, d), data(b, sk, hkv, d),
            descale(h, nq), descale(hkv, nk), descale(hkv, nk))


def direct_fp8_attention(qd, kd, vd, qs, ks, vs, q_block, kv_block, causal, scale, round_p=False):
    """Row by row, key by key: dequantise with the descale of the row's / key's block (n == 1: the one
    scale), mask bottom-right, softmax; ``round_p``: exp(s - max) rounded to e4m3 through ml_dtypes before
    the product with V, divided by the sum of the unrounded values."""
    b, sq, h, d = qd.shape
    sk, hkv = kd.shape[1], kd.shape[2]
    value = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    out = np.zeros((b, sq, h, d))
    lse = np.full((b, h, sq), -np.inf)
    for bi in range(b):
        for hi in range(h):
            hk = hi // (h // hkv)
            keys = [j for j in range(sk)]
            kx = np.array([value[kd[bi, j, hk]] * ks[bi, hk, 0 if ks.shape[2] == 1 else j // kv_block] for j in keys])
            vx = np.array([value[vd[bi, j, hk]] * vs[bi, hk, 0 if vs.shape[2] == 1 else j // kv_block] for j in keys])
            for i in range(sq):
                qx = value[qd[bi, i, hi]] * qs[bi, hi, 0 if qs.shape[2] == 1 else i // q_block]
                visible = [j for j in keys if not causal or j <= i + sk - sq]
                if not visible:
                    continue
                s = np.array([scale * float(qx @ kx[j]) for j in visible])
                m = s.max()
                p = np.exp(s - m)
                p_used = ref.e4m3_values(ref.e4m3_bits(p.astype(np.float32))).astype(np.float64) if round_p else p
                out[bi, i, hi] = (p_used[:, None] * vx[visible]).sum(axis=0) / p.sum()
                lse[bi, hi, i] = m + math.log(p.sum())
    return out, lse


REF_CASES = [
    # (b, sq, sk, h, hkv, d, nq, nk, q_block, kv_block, causal)
    (1, 5, 7, 2, 2, 16, 1, 1, 128, 128, False),
    (2, 7, 5, 4, 2, 16, 3, 2, 3, 4, True),    # seqlen_q > seqlen_k: the first rows see nothing
    (1, 3, 9, 4, 1, 8, 3, 3, 1, 3, True),     # MQA, one q scale per row
    (2, 6, 6, 2, 1, 32, 2, 1, 4, 128, False),  # q per block, k/v per tensor
    (1, 1, 11, 3, 3, 8, 1, 6, 128, 2, True),
]


REF_IDS = [f"b{c[0]}-sq{c[1]}-sk{c[2]}-h{c[3]}-hkv{c[4]}-d{c[5]}-nq{c[6]}-nk{c[7]}-{'causal' if c[10] else 'full'}"
           for c in REF_CASES]


@pytest.mark.parametrize("case", REF_CASES, ids=REF_IDS)
@pytest.mark.parametrize("round_p", [False, True])
def test_reference_equals_a_direct_computation(case, round_p):
    b, sq, sk, h, hkv, d, nq, nk, q_block, kv_block, causal = case
    rng = np.random.default_rng(sum(case[:6]))
    inputs = fp8_inputs(rng, b, sq, sk, h, hkv, d, nq, nk)
    out, lse = ref.attention_fp8_ref(*inputs, descale_block=(q_block, kv_block), causal=causal, round_p=round_p)
    want_out, want_lse = direct_fp8_attention(*inputs, q_block, kv_block, causal, 1 / math.sqrt(d), round_p)
    assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq) and out.dtype == np.float64
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


def test_rounding_p_changes_out_by_at_most_an_e4m3_step():
    """e4m3 keeps 3 mantissa bits: each rounded p is within 2^-4 of itself relatively (the normal range),
    or 2^-10 absolutely (subnormals), so |out_rounded - out| <= (2^-4 + 2^-10 * keys) * max|v| per row."""
    rng = np.random.default_rng(1)
    inputs = fp8_inputs(rng, 1, 16, 64, 2, 2, 32, 1, 1)
    exact, lse = ref.attention_fp8_ref(*inputs)
    rounded, lse_r = ref.attention_fp8_ref(*inputs, round_p=True)
    v_max = np.abs(ref.e4m3_values(inputs[2]) * inputs[5].max()).max()
    diff = np.abs(rounded - exact).max()
    assert 0 < diff <= (2.0 ** -4 + 2.0 ** -10 * 64) * v_max
    np.testing.assert_array_equal(lse, lse_r)


def test_reference_takes_the_quantiser_s_output():
    """Quantised by reference.fp8_quantize (q and k rotated with one seed, v not), the FP8 reference is close
    to attention of the unquantised inputs: the descale layout and the rotation agree between the two."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, n, hh, 64)).astype(np.float32) for n, hh in ((40, 4), (70, 2), (70, 2)))
    qd, qs = ref.fp8_quantize(q, 16, True, seed=9)
    kd, ks = ref.fp8_quantize(k, 32, True, seed=9)
    vd, vs = ref.fp8_quantize(v, 32, False)
    for causal in (False, True):
        out, lse = ref.attention_fp8_ref(qd, kd, vd, qs, ks, vs, descale_block=(16, 32), causal=causal)
        want, want_lse = ref.attention_ref(q, k, v, causal=causal, compute_dtype="float64")
        err = np.sqrt(np.mean((out - want) ** 2))
        assert err < 0.03, err
        np.testing.assert_allclose(lse, want_lse, atol=0.05)


@pytest.mark.parametrize("case", REF_CASES, ids=REF_IDS)
def test_score_error_bound_is_the_largest_absolute_product_sum(case):
    """fp8_score_error_bound = scale * max over (head, query, key of the head's group) of
    (d / 32 + 1) sum_i |q_i k_i| + (d / 4) |sum_i q_i k_i| (the second term only with aligned=True), times
    2^-14: computed directly here, query head by query head (GQA groups adjacent)."""
    b, sq, sk, h, hkv, d, nq, nk, q_block, kv_block, _ = case
    rng = np.random.default_rng(sum(case[:6]) + 1)
    qd, kd, _, qs, ks, _ = fp8_inputs(rng, b, sq, sk, h, hkv, d, nq, nk)
    value = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    largest = {True: 0.0, False: 0.0}
    for bi in range(b):
        for hi in range(h):
            hk = hi // (h // hkv)
            for i in range(sq):
                qx = value[qd[bi, i, hi]] * qs[bi, hi, 0 if qs.shape[2] == 1 else i // q_block]
                for j in range(sk):
                    kx = value[kd[bi, j, hk]] * ks[bi, hk, 0 if ks.shape[2] == 1 else j // kv_block]
                    random_part = (d / 32 + 1) * float(np.abs(qx) @ np.abs(kx))
                    largest[False] = max(largest[False], random_part)
                    largest[True] = max(largest[True], random_part + (d / 4) * abs(float(qx @ kx)))
    for scale in (None, 0.7):
        for aligned in (True, False):
            want = (1 / math.sqrt(d) if scale is None else scale) * largest[aligned] * 2.0 ** -14
            got = ref.fp8_score_error_bound(qd, kd, qs, ks, descale_block=(q_block, kv_block), softmax_scale=scale,
                                            aligned=aligned)
            assert got == pytest.approx(want, rel=1e-12)


def test_reference_refuses_a_descale_of_the_wrong_shape():
    rng = np.random.default_rng(3)
    qd, kd, vd, qs, ks, vs = fp8_inputs(rng, 1, 10, 10, 2, 2, 8, 2, 1)
    with pytest.raises(ValueError, match="descale must be"):
        ref.attention_fp8_ref(qd, kd, vd, qs, ks, vs, descale_block=(3, 128))  # 10 rows / 3 = 4 blocks, not 2


# ----------------------------------------------------------------------------------------------------
# bad input through flash_attn_func
# ----------------------------------------------------------------------------------------------------

def fp8_arrays(b=B, sq=SQ, sk=SK, h=H, hkv=HKV, d=D, dtype="uint8", **over) -> dict:
    out = {"q": spec((b, sq, h, d), dtype), "k": spec((b, sk, hkv, d), dtype), "v": spec((b, sk, hkv, d), dtype)}
    out.update(over)
    return out


def scales(heads, n, dtype="float32", device=0, b=B, strides=None):
    return spec((b, heads, n), dtype, strides=strides, device=device)


def call(arrs=None, **kwargs):
    """flash_attn_func on ``arrs`` (default: good uint8 Specs) with fp8_format="e4m3" and descale_block=(128,
    128) unless given (the tables below count blocks of 128; the default block has its own tests)."""
    arrs = fp8_arrays() if arrs is None else arrs
    kwargs.setdefault("fp8_format", "e4m3")
    kwargs.setdefault("descale_block", (128, 128))
    return lambda: cuflash.flash_attn_func(arrs["q"], arrs["k"], arrs["v"], **kwargs)


CASES: list[Case] = []


def bad(arg, problem, exc, words, *, mode="spec", cc=GOOD_CC, arrs=None, fn=None, **kwargs):
    CASES.append(Case("flash_attn_func", arg, problem, mode, fn or call(arrs, **kwargs), exc, tuple(words), cc))


NQ, NK = -(-SQ // 128), -(-SK // 128)  # 3 and 5 blocks with call()'s descale_block

# --- the descales: shape, dtype, device ---------------------------------------------------------------
for arg, heads, n, other_heads, other_n in (("q_descale", H, NQ, HKV, NK), ("k_descale", HKV, NK, H, NQ),
                                           ("v_descale", HKV, NK, H, NQ)):
    heads_name = "heads" if arg == "q_descale" else "kv_heads"
    want = [f"{arg} must have shape (batch, {heads_name}, 1) = ({B}, {heads}, 1)", f"= ({B}, {heads}, {n})",
            "descale_block=(128, 128)"]
    for problem, shape in (("n_between", (B, heads, 2)), ("n_plus_1", (B, heads, n + 1)),
                           ("other_heads", (B, other_heads, 1)), ("batch", (B + 1, heads, 1)),
                           ("rank2", (B, heads)), ("rank4", (B, heads, 1, 1)), ("heads_last", (B, n, heads)),
                           ("blocks_of_the_other_sequence", (B, heads, other_n))):
        bad(arg, f"shape_{problem}", ValueError, want + ["got (" + ", ".join(map(str, shape))],
            **{arg: spec(shape, "float32")})
    for dt in ("float16", "bfloat16", "float64", "int32"):
        bad(arg, f"dtype_{dt}", TypeError, [f"{arg} must be float32", f"got {dt}"], **{arg: scales(heads, 1, dt)})
    bad(arg, "other_device", ValueError, [f"{arg} is on CUDA device 1 but q is on device 0"],
        **{arg: scales(heads, n, device=1)})
    # descales with inputs that are not FP8
    for dt in ("bfloat16", "float16"):
        bad(arg, f"with_{dt}_inputs", ValueError, [f"{arg} is given but q, k and v are {dt}", "FP8 inputs only"],
            arrs=fp8_arrays(dtype=dt), fp8_format=None, **{arg: scales(heads, 1)})
    bad(arg, "numpy_host_array", TypeError, [f"{arg} must live in CUDA device memory", "numpy.ndarray"], mode="host",
        fn=lambda arg=arg, heads=heads: _host_call(**{arg: np.ones((B, heads, 1), np.float32)}))
    bad(arg, "python_list", TypeError, [f"{arg} must be a GPU array", "builtins.list"], mode="host",
        fn=lambda arg=arg: _host_call(**{arg: [[[1.0]]]}))

# --- fp8_format ----------------------------------------------------------------------------------------
for value in ("e5m2", "E4M3", "float8_e4m3fn", "fp8", 3, b"e4m3"):
    bad("fp8_format", f"value_{value!r}", ValueError, ["fp8_format must be one of ('e4m3',)", repr(value)],
        fp8_format=value)
for dt in ("bfloat16", "float16"):
    bad("fp8_format", f"with_{dt}_inputs", TypeError, ["fp8_format='e4m3' says q, k and v hold FP8 bytes",
                                                      f"q is {dt}"], arrs=fp8_arrays(dtype=dt))
bad("fp8_format", "missing_with_uint8_inputs", TypeError, ["q, k and v are uint8: pass fp8_format='e4m3'"],
    fp8_format=None)
bad("fp8_format", "missing_with_uint8_inputs_and_descales", TypeError, ["pass fp8_format='e4m3'"],
    fp8_format=None, q_descale=scales(H, NQ))

# --- descale_block -------------------------------------------------------------------------------------
for problem, value in (("one_entry", (128,)), ("three_entries", (128, 128, 1)), ("int", 128), ("float", (1.5, 128)),
                       ("bool", (True, 128)), ("string", "ab"), ("none", None), ("numpy_float", (np.float32(64), 128))):
    bad("descale_block", problem, TypeError, ["descale_block must be a pair of ints (q_block, kv_block)",
                                              repr(value)], descale_block=value)
for value in ((0, 128), (128, 0), (-1, 128)):
    bad("descale_block", f"value_{value[0]}_{value[1]}", ValueError, ["descale_block entries must be >= 1",
                                                                      str(value)], descale_block=value)
for arg in ("k_descale", "v_descale"):
    for kv_block in (100, 64, 130):
        n = -(-SK // kv_block)
        bad("descale_block", f"kv_block_{kv_block}_with_per_block_{arg}", ValueError,
            [f"descale_block=(128, {kv_block}): kv_block must be a multiple of 128", f"when {arg} has one scale per"],
            descale_block=(128, kv_block), **{arg: scales(HKV, n)})
bad("descale_block", "with_bfloat16_inputs", ValueError, ["descale_block is given but q, k and v are bfloat16"],
    arrs=fp8_arrays(dtype="bfloat16"), fp8_format=None, descale_block=(64, 128))

# --- q, k, v: FP8 all three, layout, head dim ---------------------------------------------------------
for arg, dt in (("k", "bfloat16"), ("v", "float16"), ("q", "bfloat16"), ("k", "int8"), ("v", "float32")):
    bad(arg, f"{dt}_next_to_fp8", TypeError, [f"{arg} is {dt} but", "is FP8", "q, k and v must all be FP8"],
        arrs=fp8_arrays(**{arg: spec(fp8_arrays()[arg].shape, dt)}))
for dt in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    bad("q", f"torch_{dt}", TypeError, ["q is a torch tensor of dtype", dt, "e4m3 only"], arrs=None,
        fn=lambda dt=dt: _torch_call(dt))
bad("k", "ml_dtypes_float8_e4m3fn", TypeError, ["k has dtype float8_e4m3fn", "uint8", "fp8_format='e4m3'"],
    arrs=fp8_arrays(k=np.zeros((B, SK, HKV, D), ml_dtypes.float8_e4m3fn)))
bad("q", "rank3", ValueError, ["q must have 4 dimensions"], arrs=fp8_arrays(q=spec((B, SQ, H * D), "uint8")))
bad("k", "seqlen_stride_unaligned", ValueError, ["k's seqlen stride must be a multiple of 16 bytes (16 elements)"],
    arrs=fp8_arrays(k=spec((B, SK, HKV, D), "uint8", strides=(SK * 264, 264, 132, 1))))
bad("v", "pointer_unaligned", ValueError, ["v's data must start at a 16-byte aligned address"],
    arrs=fp8_arrays(v=dataclasses.replace(fp8_arrays()["v"], ptr=0x10008)))
bad("k", "heads_not_divisible", ValueError, ["query heads (8)", "KV heads in k/v (3)"], arrs=fp8_arrays(hkv=3))
bad("v", "other_device", ValueError, ["v is on CUDA device 1 but q is on device 0"],
    arrs=fp8_arrays(v=dataclasses.replace(fp8_arrays()["v"], device=1)))
for d in (32, 80, 96, 192, 512):
    bad("headdim", f"{d}_unsupported", ValueError, [f"head dim {d} is not supported with FP8 inputs",
                                                    "supported: [64, 128, 256]"], arrs=fp8_arrays(d=d))

# --- options the FP8 kernel does not have, and the usual checks of the others ---------------------------
for window in ((8, 8), (-1, 0), (0, -1), [128, 16]):
    bad("window_size", f"{window[0]}_{window[1]}", ValueError,
        [f"window_size={tuple(window)} is not supported with FP8 inputs"], window_size=window)
bad("window_size", "not_a_pair", TypeError, ["window_size must be a pair of ints"], window_size=(1,))
bad("softcap", "5", ValueError, ["softcap=5.0 is not supported with FP8 inputs"], softcap=5.0)
bad("softcap", "string", TypeError, ["softcap must be a float"], softcap="5")
bad("alibi_slopes", "given", ValueError, ["alibi_slopes is not supported with FP8 inputs"], alibi_slopes=slopes())
bad("dropout_p", "0.1", ValueError, ["dropout_p=0.1 is not supported with FP8 inputs"], dropout_p=0.1,
    dropout_seed=1)
bad("dropout_p", "out_of_range", ValueError, ["dropout_p must be in [0, 1)"], dropout_p=1.5)
bad("dropout_seed", "missing", TypeError, ["dropout_seed must be an int"], dropout_p=0.1)
bad("dropout_offset", "negative", ValueError, ["dropout_offset must be an int in [0, 2**32)"], dropout_p=0.1,
    dropout_seed=1, dropout_offset=-1)
bad("softmax_scale", "zero", ValueError, ["softmax_scale must be a finite positive number"], softmax_scale=0.0)
bad("causal", "int", TypeError, ["causal must be a bool"], causal=1)
for impl in ("fa1", "fa2", "fa9", None, "FA3"):
    bad("impl", f"{impl}", ValueError, ["impl must be one of ('auto', 'fa3') with FP8 inputs", repr(impl)], impl=impl)

# --- the GPU -----------------------------------------------------------------------------------------------
for cc in ((7, 5), (8, 0), (8, 9)):
    bad("q", f"gpu_sm{cc[0]}{cc[1]}", ValueError,
        ["FP8 attention runs on FA3's Hopper kernel, which cannot run on q's device 0", "sm_90 or newer",
         f"this GPU is sm_{cc[0]}{cc[1]}"], cc=cc)
bad("q", "gpu_sm100", ValueError, ["cannot run on q's device 0", "built for sm_90a only", "sm_100"], cc=(10, 0))

# --- host memory through the real Call ------------------------------------------------------------------


class _DeviceDLPack:
    """Claims to live on CUDA device 0; the check must refuse the bad argument before converting any."""

    def __dlpack__(self, stream=None):
        raise AssertionError("converted before every argument was checked")

    def __dlpack_device__(self):
        return (2, 0)


def _host_call(**kwargs):
    return cuflash.flash_attn_func(_DeviceDLPack(), _DeviceDLPack(), _DeviceDLPack(), fp8_format="e4m3", **kwargs)


bad("q", "torch_float8_e4m3fn_on_the_cpu", TypeError, ["q must live in CUDA device memory", "torch.Tensor"],
    mode="host", fn=lambda: _torch_call("float8_e4m3fn", real=True))


def _torch_call(dtype, real=False):
    """q a torch tensor of ``dtype`` (float8 formats): a real CPU tensor (``real``), else a stand-in that has the
    dtype and whose uint8 view is never taken."""
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype, None)
    if dt is None:
        pytest.skip(f"this torch has no {dtype}")
    q = torch.zeros((B, SQ, H, D), dtype=dt) if real else _TorchFp8(fp8_arrays()["q"], dt)
    k, v = (torch.zeros((B, SK, HKV, D), dtype=torch.uint8) for _ in range(2))
    return cuflash.flash_attn_func(q, k if real else _DeviceDLPack(), v if real else _DeviceDLPack())


@dataclasses.dataclass
class _TorchFp8:
    """Stands for a torch float8 tensor on the GPU: its dtype, and ``.view(torch.uint8)`` gives its bytes' Spec."""

    data: object
    dtype: object

    def view(self, dtype):
        import torch

        assert dtype is torch.uint8
        return self.data


# ----------------------------------------------------------------------------------------------------
# the environment of "spec" rows
# ----------------------------------------------------------------------------------------------------

@pytest.fixture
def spec_env(monkeypatch):
    """flash_attn_func on Specs: fake Call (in api and fp8_attention), a fake sm_90 GPU (or the row's cc), a
    stand-in cupy whose arrays are tuples saying how they were made, and fa3.forward_fp8 recording its
    arguments in ``state["launches"]`` before raising _ReachedKernel."""
    state = {"cc": GOOD_CC, "launches": []}
    monkeypatch.setattr(api, "Call", _SpecCall)
    monkeypatch.setattr(fp8_attention, "Call", _SpecCall)
    monkeypatch.setattr(_device, "compute_capability", lambda device=0: state["cc"])
    fake_cupy = types.SimpleNamespace(
        float32="float32",
        ones=lambda shape, dtype: ("ones", tuple(shape), dtype),
        empty=lambda shape, dtype: ("empty", tuple(shape), str(dtype)),
        broadcast_to=lambda a, shape: ("descale", a.name, a.shape, tuple(shape)),
        ascontiguousarray=lambda a: a,
    )
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)

    def forward_fp8(*args):
        state["launches"].append(args)
        raise _ReachedKernel("fa3.forward_fp8")

    monkeypatch.setattr(fa3, "forward_fp8", forward_fp8, raising=False)
    return state


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, request):
    check_refused(case, request)


def test_table_covers_every_fp8_argument():
    fp8_args = ("q_descale", "k_descale", "v_descale", "fp8_format", "descale_block")
    params = inspect.signature(cuflash.flash_attn_func).parameters
    assert all(a in params for a in fp8_args)
    seen = {c.arg for c in CASES}
    missing = [a for a in fp8_args if a not in seen]
    assert not missing, f"no rows for {missing}"
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate row ids"


# ----------------------------------------------------------------------------------------------------
# which calls are FP8 calls, and what reaches the kernel
# ----------------------------------------------------------------------------------------------------

BF16 = spec((1, 4, 2, 64))
U8 = spec((1, 4, 2, 64), "uint8")


@pytest.mark.parametrize("args,kwargs,want", [
    ((BF16, BF16, BF16), {}, False),
    ((BF16, BF16, BF16), {"descale_block": list(fp8_attention.DEFAULT_DESCALE_BLOCK)}, False),
    ((U8, U8, U8), {}, True),
    ((BF16, U8, BF16), {}, True),
    ((BF16, BF16, BF16), {"fp8_format": "e4m3"}, True),
    ((BF16, BF16, BF16), {"v_descale": scales(2, 1)}, True),
    ((BF16, BF16, BF16), {"descale_block": (64, 128)}, True),
    ((np.zeros(4, ml_dtypes.float8_e4m3fn), BF16, BF16), {}, True),
    ((object(), object(), object()), {}, False),
], ids=["bf16", "bf16-default-block-as-list", "uint8", "one-uint8", "fp8_format", "descale", "descale_block",
        "float8-dtype", "no-dtype"])
def test_is_fp8_call(args, kwargs, want):
    options = dict(q_descale=None, k_descale=None, v_descale=None, fp8_format=None,
                   descale_block=fp8_attention.DEFAULT_DESCALE_BLOCK)
    options.update(kwargs)
    assert fp8_attention.is_fp8_call(*args, **options) is want


# a per-tensor K/V descale: the kernel gets a block covering the keys that every FP8 key tile divides
KV_WHOLE = fa3.fp8_whole_sequence_kv_block(SK)
GOOD = [
    # (id, arrays, keyword arguments, (q_block, kv_block) the kernel gets, descales the kernel gets)
    ("no-descales", fp8_arrays(), {}, (SQ, KV_WHOLE),
     [("ones", (B, H, 1), "float32"), ("ones", (B, HKV, 1), "float32"), ("ones", (B, HKV, 1), "float32")]),
    ("per-block", fp8_arrays(), dict(q_descale=scales(H, NQ), k_descale=scales(HKV, NK), v_descale=scales(HKV, NK)),
     (128, 128), [("descale", "q_descale", (B, H, NQ), (B, H, NQ)),
                  ("descale", "k_descale", (B, HKV, NK), (B, HKV, NK)),
                  ("descale", "v_descale", (B, HKV, NK), (B, HKV, NK))]),
    ("per-tensor", fp8_arrays(), dict(q_descale=scales(H, 1), k_descale=scales(HKV, 1), v_descale=scales(HKV, 1)),
     (SQ, KV_WHOLE), [("descale", "q_descale", (B, H, 1), (B, H, 1)), ("descale", "k_descale", (B, HKV, 1), (B, HKV, 1)),
                 ("descale", "v_descale", (B, HKV, 1), (B, HKV, 1))]),
    ("q64-kv256", fp8_arrays(), dict(descale_block=(64, 256), q_descale=scales(H, 5), k_descale=scales(HKV, 3),
                                     v_descale=scales(HKV, 3)),
     (64, 256), [("descale", "q_descale", (B, H, 5), (B, H, 5)), ("descale", "k_descale", (B, HKV, 3), (B, HKV, 3)),
                 ("descale", "v_descale", (B, HKV, 3), (B, HKV, 3))]),
    # k per block, v per tensor: v's scale is broadcast to k's blocks (the kernel reads one block count)
    ("k-per-block-v-per-tensor", fp8_arrays(), dict(k_descale=scales(HKV, NK), v_descale=scales(HKV, 1)), (SQ, 128),
     [("ones", (B, H, 1), "float32"), ("descale", "k_descale", (B, HKV, NK), (B, HKV, NK)),
      ("descale", "v_descale", (B, HKV, 1), (B, HKV, NK))]),
    ("v-per-block-only", fp8_arrays(), dict(v_descale=scales(HKV, NK)), (SQ, 128),
     [("ones", (B, H, 1), "float32"), ("ones", (B, HKV, NK), "float32"),
      ("descale", "v_descale", (B, HKV, NK), (B, HKV, NK))]),
    ("one-q-scale-per-row", fp8_arrays(), dict(descale_block=[1, 128], q_descale=scales(H, SQ)), (1, KV_WHOLE),
     [("descale", "q_descale", (B, H, SQ), (B, H, SQ)), ("ones", (B, HKV, 1), "float32"),
      ("ones", (B, HKV, 1), "float32")]),
    # per-tensor k/v: kv_block need not be a multiple of 128, the kernel gets one that covers the keys
    ("per-tensor-kv-block-100", fp8_arrays(), dict(descale_block=(128, 100), k_descale=scales(HKV, 1)), (SQ, KV_WHOLE),
     [("ones", (B, H, 1), "float32"), ("descale", "k_descale", (B, HKV, 1), (B, HKV, 1)),
      ("ones", (B, HKV, 1), "float32")]),
    ("block-longer-than-the-keys", fp8_arrays(), dict(descale_block=(10 ** 12, 1024), k_descale=scales(HKV, 1)),
     (SQ, KV_WHOLE), None),
    ("mqa-causal-d64", fp8_arrays(hkv=1, d=64), dict(causal=True, impl="fa3"), (SQ, KV_WHOLE), None),
    ("d256-gqa-seqlen1", fp8_arrays(sq=1, sk=1, d=256), dict(return_lse=True), (1, fa3.fp8_whole_sequence_kv_block(1)), None),
    ("packed-qkv-strides", dict(
        q=spec((B, SQ, H, D), "uint8", strides=(SQ * 3 * H * D, 3 * H * D, D, 1)),
        k=spec((B, SQ, H, D), "uint8", strides=(SQ * 3 * H * D, 3 * H * D, D, 1), ptr=0x10000 + H * D),
        v=spec((B, SQ, H, D), "uint8", strides=(SQ * 3 * H * D, 3 * H * D, D, 1), ptr=0x10000 + 2 * H * D)),
     dict(softmax_scale=0.5), (SQ, fa3.fp8_whole_sequence_kv_block(SQ)), None),
]


@pytest.mark.parametrize("what,arrs,kwargs,blocks,descales", GOOD, ids=[g[0] for g in GOOD])
def test_good_calls_reach_the_kernel(spec_env, what, arrs, kwargs, blocks, descales):
    with pytest.raises(_ReachedKernel):
        call(arrs, **kwargs)()
    (args,) = spec_env["launches"]
    q, k, v, out, lse, q_scale, k_scale, v_scale, q_block, kv_block, dims, window, scale, stream = args
    assert (q.name, k.name, v.name) == ("q", "k", "v") and q.dtype == "uint8"
    b, sq, h, d = q.shape
    sk = k.shape[1]
    assert out == ("empty", (b, sq, h, d), "bfloat16") and lse == ("empty", (b, h, sq), "float32")
    assert dims == dataclasses.replace(dims, batch=b, seqlen_q=sq, seqlen_k=sk, heads=h, kv_heads=k.shape[2],
                                       headdim=d, dtype="bfloat16")
    assert (q_block, kv_block) == blocks and kv_block % fa3.FP8_BLOCK_N == 0
    if descales is not None:
        assert [q_scale, k_scale, v_scale] == descales
    assert window == ((sk, 0) if kwargs.get("causal") else (sk, sq))  # api._plan's window for these options
    assert scale == kwargs.get("softmax_scale", 1 / math.sqrt(d))


def test_torch_float8_e4m3fn_is_viewed_as_uint8_without_fp8_format(spec_env):
    torch = pytest.importorskip("torch")
    q, k, v = (_TorchFp8(fp8_arrays()[n], torch.float8_e4m3fn) for n in "qkv")
    with pytest.raises(_ReachedKernel):
        cuflash.flash_attn_func(q, k, v, causal=True)
    (args,) = spec_env["launches"]
    assert [a.name for a in args[:3]] == ["q", "k", "v"] and args[10].dtype == "bfloat16"
    with pytest.raises(_ReachedKernel):  # mixed with uint8 bytes and an explicit format
        cuflash.flash_attn_func(q, fp8_arrays()["k"], v, fp8_format="e4m3")
    with pytest.raises(ValueError, match="fp8_format must be one of"):
        cuflash.flash_attn_func(q, k, v, fp8_format="e5m2")


def test_float_calls_do_not_take_the_fp8_path(spec_env, monkeypatch):
    """bf16 inputs with the FP8 arguments at their defaults go to the usual families."""
    def pick_impl(*args, **kwargs):
        raise _ReachedKernel("pick")

    monkeypatch.setattr(api, "_pick_impl", pick_impl)
    a = fp8_arrays(dtype="bfloat16")
    with pytest.raises(_ReachedKernel, match="pick"):
        cuflash.flash_attn_func(a["q"], a["k"], a["v"], descale_block=fp8_attention.DEFAULT_DESCALE_BLOCK)
    assert spec_env["launches"] == []


def test_long_rows_take_the_long_row_tiles():
    """FP8 calls with at least FA3_FP8_LONG_MIN_SEQLEN query rows take FA3_FP8_TILES_WIDE where it has the head
    dim and its key tile divides the K/V descale block (d = 64, 128: 256 keys; d = 256: 128, P through shared
    memory) -- its P_SMEM tiles only up to FA3_FP8_P_SMEM_MAX_SEQLEN_K keys -- else FA3_FP8_TILES_LONG where it
    has the head dim (d = 128: no pingpong), the rest FA3_FP8_TILES; each choice is its own compiled variant."""
    from cuflash import heuristics

    compiled = {v.name for v in fa3.all_variants()}  # (what the CPU tier's compile check compiles)
    for d in fa3.FP8_HEADDIMS:
        short = fa3.fwd_tiles(d, fp8=True)
        assert short == heuristics.FA3_FP8_TILES[d]
        long = heuristics.FA3_FP8_TILES_LONG.get(d, short)
        wide = heuristics.FA3_FP8_TILES_WIDE.get(d, long)
        for kv_block in (None, 128, 256, 384, 512, 1024):
            for many_keys in (False, True):
                fits = (kv_block is None or kv_block % wide.block_n == 0) and not (wide.p_smem and many_keys)
                got = fa3.fwd_tiles(d, fp8=True, long_rows=True, kv_block=kv_block, many_keys=many_keys)
                assert got == (wide if fits else long), (d, kv_block, many_keys)
                assert fa3.fwd_variant(d, "bfloat16", fp8=True, long_rows=True, kv_block=kv_block,
                                       many_keys=many_keys).name in compiled
        assert fa3.fwd_variant(d, "bfloat16", fp8=True).name in compiled
    assert not heuristics.FA3_FP8_TILES_LONG[128].pingpong and heuristics.FA3_FP8_TILES[128].pingpong
    assert heuristics.FA3_FP8_TILES_WIDE[128].block_n == 256 and not heuristics.FA3_FP8_TILES_WIDE[128].intra_wg_overlap
    wide_256 = heuristics.FA3_FP8_TILES_WIDE[256]
    assert wide_256.p_smem and wide_256.intra_wg_overlap and not heuristics.FA3_FP8_TILES[256].p_smem


def test_fp8_calls_take_the_p_smem_tiles_up_to_the_key_limit():
    """fa3.forward_fp8's tiles (fp8_call_kind): d = 256 calls with long rows and FA3_FP8_P_SMEM_MAX_SEQLEN_K keys
    take the P_SMEM tiles, one key more (O's decay) or short rows the fresh-accumulator ones."""
    from cuflash import _validate, heuristics

    limit = heuristics.FA3_FP8_P_SMEM_MAX_SEQLEN_K
    long = heuristics.FA3_FP8_LONG_MIN_SEQLEN
    for sq, sk, p_smem in ((long, limit, True), (long, limit + 1, False), (long - 1, limit, False), (long, 1, True)):
        dims = _validate.Dims(1, sq, sk, 2, 2, 256, "bfloat16")
        kind = fa3.fp8_call_kind(dims, 256)
        assert fa3.fwd_tiles(256, fp8=True, **kind).p_smem == p_smem, (sq, sk)
        assert ("p_smem=1" in fa3.fwd_variant(256, "bfloat16", fp8=True, **kind).name) == p_smem


def test_a_per_tensor_kv_descale_block_suits_every_fp8_tile():
    for sk in (1, 127, 128, 129, 255, 256, 300, 8192):
        block = fa3.fp8_whole_sequence_kv_block(sk)
        assert block >= sk and block % fa3.FP8_BLOCK_N == 0
        assert block % fa3.fwd_tiles(128, fp8=True, long_rows=True).block_n == 0
