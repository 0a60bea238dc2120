"""CPU tier: kernels_cu/common/poly_exp2.cuh (2^x on the FMA pipe, which the FA3 forward's softmax uses for
some of its exponentials), built on the host (tests/cpp/poly_exp2_harness.cpp, g++), against 2^x in fp64:
relative error, the exact values the softmax relies on (2^0 = 1, masked scores -inf -> +0, NaN -> +0), no
negative or non-finite result anywhere in the softmax's range, and monotonicity."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from host_harness import build

_f32p = ctypes.POINTER(ctypes.c_float)
MAX_REL_ERROR = 1.1e-4  # the cubic's 1.0e-4 on [-0.5, 0.5], plus fp32 rounding


@pytest.fixture(scope="module")
def poly_exp2(tmp_path_factory):
    lib = build("poly_exp2_harness.cpp", "common", tmp_path_factory.mktemp("poly_exp2"))
    lib.poly_exp2_many.argtypes = [_f32p, _f32p, ctypes.c_longlong]
    lib.poly_exp2_many.restype = None

    def run(x) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        y = np.full_like(x, np.float32(-7))
        lib.poly_exp2_many(x.ctypes.data_as(_f32p), y.ctypes.data_as(_f32p), x.size)
        return y

    return run


def test_relative_error_over_the_normal_range(poly_exp2):
    x = np.concatenate([np.linspace(-126, 0, 2_000_001, dtype=np.float32),
                        -np.abs(np.random.default_rng(0).standard_normal(100_000).astype(np.float32)) * 20])
    want = np.exp2(x.astype(np.float64))
    rel = np.abs(poly_exp2(x) / want - 1)
    assert rel.max() <= MAX_REL_ERROR, f"max relative error {rel.max():.3e} at x = {x[rel.argmax()]}"
    assert rel.max() > 5e-5, "the cubic's error should show: is poly_exp2 still the polynomial?"


def test_exact_values(poly_exp2):
    x = np.array([0.0, -1.0, -2.0, -10.0, -126.0, -np.inf, np.nan], np.float32)
    y = poly_exp2(x)
    np.testing.assert_array_equal(y[:5], np.exp2(x[:5]))  # f = 0: the cubic is exactly 1
    assert y[5] == 0 and not np.signbit(y[5]), "a masked score (-inf) must weigh exactly +0"
    assert y[6] == 0 and not np.signbit(y[6])


def test_never_negative_nan_or_above_one_near_the_bottom(poly_exp2):
    """Below 2^-126 the result is a subnormal or 0 (ex2.approx.ftz gives 0): tiny and non-negative, never
    a wrapped exponent (a negative number, inf or NaN); and nothing <= 0 exceeds 1 by more than the error."""
    x = np.concatenate([np.linspace(-200, -120, 400_001, dtype=np.float32), np.float32([-1e30, -3.4e38])])
    y = poly_exp2(x)
    assert np.all(np.isfinite(y)) and not np.any(np.signbit(y))
    assert y.max() <= np.exp2(-120.0) * (1 + MAX_REL_ERROR)
    assert np.all(y[x < -127] == 0)
    top = poly_exp2(np.linspace(-1e-3, 0, 10_001, dtype=np.float32))
    assert top.max() <= 1 + MAX_REL_ERROR


def test_monotone(poly_exp2):
    """The softmax's order of weights survives: non-decreasing over a fine grid across integer boundaries
    (where the cubic's two ends meet)."""
    x = np.concatenate([np.linspace(k - 0.51, k - 0.49, 20_001, dtype=np.float32) for k in range(-20, 1)]
                       + [np.linspace(-8, 0, 1_000_001, dtype=np.float32)])
    x = np.sort(x)
    y = poly_exp2(x)
    worst = np.min(np.diff(y.astype(np.float64)) / y[1:])
    assert worst >= -2e-7, f"decreases by {-worst:.2e} (relative)"
