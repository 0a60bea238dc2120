"""Special values and run-to-run determinism in every kernel family (GPU tier; issue 8 point 5).

* NaN and +-inf in the inputs never hang or crash a kernel, and leave every row that does not meet them
  exactly as it is without them: q rows 0, 1, 2 of every (batch, head) get NaN, +inf and -inf, and the
  other rows of out and lse (and of dq, in the deterministic backward modes) are compared bit for bit with
  a call on the same data without the special values. (A query row's output depends on its own q row and
  on K/V only; in the backward so does its dq row.)
* NaN and inf in K / V (which every row may meet): the calls return, and the next call on clean data is
  right (nothing was left broken).
* The forward is bit-identical run to run (FA3, its FP8 kernel, the decode kernel split and unsplit; FA1
  and FA2 have their own test), as are the deterministic backward modes (tests/test_fa2_gpu.py,
  tests/test_fa3_gpu.py).

Rows with every key masked (O = 0, LSE = -inf) are checked where the masks are: tests/gpu_checks.py and
the families' tests. This file runs among gpu_check.sh's risky files (a hang here is what it looks
for)."""
import importlib

import numpy as np
import pytest

import cuflash
from gpu_checks import check_forward, inputs

pytestmark = pytest.mark.gpu

SPECIAL_ROWS = 3  # q rows 0, 1, 2: NaN, +inf, -inf


@pytest.fixture(autouse=True)
def _needs_gpu():
    if not cuflash.available_impls():
        pytest.skip("no cuflash implementation runs on this GPU")


def _set(x, index, value):
    """A copy of the 16-bit float array x with x[index] = value (set in float32: the round trip through
    float32 is exact, and CuPy assigns scalars to bfloat16 arrays through it)."""
    import cupy

    x32 = x.astype(cupy.float32)
    x32[index] = value
    return x32.astype(x.dtype)


def _with_special_rows(q, values=(np.nan, np.inf, -np.inf)):
    """A copy of q (batch, seqlen, heads, d) whose rows 0 .. len(values) - 1 hold one special value each
    (in one element, every head)."""
    for row, value in enumerate(values):
        q = _set(q, (slice(None), row, slice(None), row % q.shape[-1]), value)
    return q


def _same_bits(name, got, want):
    """got == want bit for bit (16- or 32-bit floats, compared as integers so NaN patterns count too)."""
    view = "uint16" if got.dtype.itemsize == 2 else "uint32"
    same = got.view(view) == want.view(view)
    assert bool(same.all()), f"{name}: {int((~same).sum())} of {same.size} elements differ"


def _impls(direction):
    return [impl for impl in ("fa1", "fa2", "fa3") if impl in cuflash.available_impls(direction)]


def _healthy(impl):
    """A clean call after the special values is still right (no sticky error, nothing left broken)."""
    import cupy

    q, k, v = inputs(np.random.default_rng(1), 1, 65, 97, 2, 2, 64, "bfloat16")
    check_forward(impl, q, k, v, causal=True)
    cupy.cuda.Device().synchronize()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("impl", _impls("forward") or ["none"])
def test_forward_rows_without_special_values_are_untouched(poison_allocations, impl, causal):
    q, k, v = inputs(np.random.default_rng(), 2, 77, 133, 4, 2, 64, "bfloat16")
    out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, impl=impl)
    bad_out, bad_lse = cuflash.flash_attn_func(_with_special_rows(q), k, v, causal=causal, return_lse=True,
                                               impl=impl)
    _same_bits("out", bad_out[:, SPECIAL_ROWS:], out[:, SPECIAL_ROWS:])
    _same_bits("lse", bad_lse[:, :, SPECIAL_ROWS:], lse[:, :, SPECIAL_ROWS:])
    _healthy(impl)


@pytest.mark.parametrize("impl", _impls("backward") or ["none"])
def test_backward_rows_without_special_values_are_untouched(poison_allocations, impl):
    """Deterministic mode where the family has one (its dq is then a fixed function of the inputs); FA1's
    dq rows are compared to within one bf16 rounding (its fp32 atomics add in any order)."""
    import cupy

    features = importlib.import_module(f"cuflash.{impl}").BWD_FEATURES
    det = {"deterministic": True} if "deterministic" in features else {}
    q, k, v = inputs(np.random.default_rng(), 2, 77, 133, 4, 2, 64, "bfloat16")
    dout = cupy.asarray(np.random.default_rng(2).standard_normal(q.shape, dtype=np.float32)).astype(q.dtype)
    grads = {}
    for name, qq in (("clean", q), ("special", _with_special_rows(q))):
        out, lse = cuflash.flash_attn_func(qq, k, v, causal=True, return_lse=True, impl=impl)
        grads[name] = cuflash.flash_attn_backward(dout, qq, k, v, out, lse, causal=True, impl=impl, **det)
    cupy.cuda.Device().synchronize()
    got, want = grads["special"][0][:, SPECIAL_ROWS:], grads["clean"][0][:, SPECIAL_ROWS:]
    if det:
        _same_bits("dq", got, want)
    else:
        err = float(cupy.abs(got.astype(cupy.float32) - want.astype(cupy.float32)).max())
        scale = float(cupy.abs(want.astype(cupy.float32)).max())
        assert err <= 2.0**-7 * scale, f"dq rows without special values moved by {err} (max |dq| {scale})"
    _healthy(impl)


@pytest.mark.parametrize("impl", _impls("backward") or ["none"])
def test_special_values_in_k_and_v_return(poison_allocations, impl):
    import cupy

    q, k, v = inputs(np.random.default_rng(), 2, 77, 133, 4, 2, 64, "bfloat16")
    k = _set(_set(k, (slice(None), 5, slice(None), 0), np.nan), (slice(None), 6, slice(None), 1), np.inf)
    v = _set(_set(v, (slice(None), 9, slice(None), 2), -np.inf), (slice(None), 10, slice(None), 3), np.nan)
    out, lse = cuflash.flash_attn_func(q, k, v, causal=False, return_lse=True, impl=impl)
    cuflash.flash_attn_backward(out, q, k, v, out, lse, impl=impl)
    cupy.cuda.Device().synchronize()
    _healthy(impl)


def _kvcache_inputs(rng, b=3, d=128):
    import cupy

    def rand(*shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype("bfloat16")

    lens = cupy.asarray(np.array([700, 1, 333][:b], np.int32))
    return rand(b, 1, 32, d), rand(b, 800, 8, d), rand(b, 800, 8, d), lens


@pytest.mark.parametrize("num_splits", [1, 4])
def test_kvcache_special_values(poison_allocations, num_splits):
    """Decode: NaN / inf in one batch entry's query leave the other entries' bits alone (split and not);
    special values in the cache return; the forward is bit-identical run to run."""
    import cupy

    if "fa2" not in cuflash.available_impls("forward"):
        pytest.skip("the decode kernels need sm_80 or newer")
    q, kc, vc, lens = _kvcache_inputs(np.random.default_rng())
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=num_splits,
                                               return_softmax_lse=True)
    again, again_lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=num_splits,
                                                       return_softmax_lse=True)
    _same_bits("out run to run", again, out)
    _same_bits("lse run to run", again_lse, lse)
    bad_q = q
    for head, value in enumerate((np.nan, np.inf, -np.inf)):
        bad_q = _set(bad_q, (0, 0, head, 0), value)
    bad_out, bad_lse = cuflash.flash_attn_with_kvcache(bad_q, kc, vc, cache_seqlens=lens, num_splits=num_splits,
                                                       return_softmax_lse=True)
    _same_bits("out of the other entries", bad_out[1:], out[1:])
    _same_bits("lse of the other entries", bad_lse[1:], lse[1:])
    kc, vc = _set(kc, (1, 0, 0, 0), np.nan), _set(vc, (2, 5, 3, 7), np.inf)
    cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=num_splits)
    cupy.cuda.Device().synchronize()
    _healthy("fa2")


def _fa3_only():
    from cuflash import api, fa3
    from cuflash._device import compute_capability

    why = api._supports_arch(fa3, compute_capability())
    if why is not None:
        pytest.skip(f"FA3 / FP8 attention: {why}")


@pytest.mark.parametrize("causal", [False, True])
def test_fa3_forward_is_bit_identical_run_to_run(poison_allocations, causal):
    _fa3_only()
    for d in (64, 128, 256):
        q, k, v = inputs(np.random.default_rng(), 2, 333, 517, 4, 2, d, "bfloat16")
        a, lse_a = cuflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, impl="fa3")
        b, lse_b = cuflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, impl="fa3")
        _same_bits(f"d={d} out", b, a)
        _same_bits(f"d={d} lse", lse_b, lse_a)


def test_fp8_special_values_and_run_to_run(poison_allocations):
    """FP8: a NaN row of q is left out of its block's scale (cuflash.fp8.quantize), so the other rows
    quantise, and attend, exactly as without it; +inf in K makes its block's scale infinite -- garbage for
    that block, but the call returns; two calls on the same bytes give the same bits."""
    import cupy

    from cuflash import fp8

    _fa3_only()
    q, k, v = inputs(np.random.default_rng(), 2, 200, 300, 4, 2, 128, "bfloat16")

    def run(qq, kk):
        (qd, qs), (kd, ks), (vd, vs) = (fp8.quantize(x, block=128, hadamard=h, seed=7)
                                        for x, h in ((qq, True), (kk, True), (v, False)))
        return cuflash.flash_attn_func(qd, kd, vd, q_descale=qs, k_descale=ks, v_descale=vs, fp8_format="e4m3",
                                       descale_block=(128, 128), return_lse=True)

    out, lse = run(q, k)
    again, again_lse = run(q, k)
    _same_bits("out run to run", again, out)
    _same_bits("lse run to run", again_lse, lse)
    # The baseline for the NaN row is row 0 zeroed, not q itself: the original row 0 may hold its block's
    # largest value (it did in about one run in twenty), and without it the block's scale is another.
    base_out, base_lse = run(_set(q, (slice(None), 0), 0.0), k)
    bad_out, bad_lse = run(_with_special_rows(q, (np.nan,)), k)
    _same_bits("out", bad_out[:, 1:], base_out[:, 1:])
    _same_bits("lse", bad_lse[:, :, 1:], base_lse[:, :, 1:])
    run(q, _set(k, (slice(None), 7, slice(None), 0), np.inf))
    cupy.cuda.Device().synchronize()
    _healthy("fa3")
