"""CPU tier: kernels_cu/common/fast_divmod.cuh (division by a run-time page size as multiply-high + shift),
built on the host (tests/cpp/fast_divmod_harness.cpp, g++), against Python's // and % for every divisor up
to 4096 and the large ones, over small numerators, random ones and the ends of [0, 2^31)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from host_harness import build

_i32p = ctypes.POINTER(ctypes.c_int32)


@pytest.fixture(scope="module")
def fast_divmod(tmp_path_factory):
    lib = build("fast_divmod_harness.cpp", "common", tmp_path_factory.mktemp("fast_divmod"))
    lib.fast_divmod.argtypes = [ctypes.c_int, _i32p, _i32p, _i32p, ctypes.c_longlong]
    lib.fast_divmod.restype = None

    def run(d: int, n: np.ndarray):
        n = np.ascontiguousarray(n, np.int32)
        q, r = np.full_like(n, -7), np.full_like(n, -7)
        lib.fast_divmod(d, n.ctypes.data_as(_i32p), q.ctypes.data_as(_i32p), r.ctypes.data_as(_i32p), n.size)
        return q, r

    return run


def _numerators(rng) -> np.ndarray:
    top = 2**31 - 1
    return np.concatenate([np.arange(0, 5000), rng.integers(0, top, 2000, endpoint=True),
                           np.arange(top - 2000, top + 1)]).astype(np.int64)


@pytest.mark.parametrize("divisors", [range(1, 1025), range(1025, 4097),
                                      [65535, 65536, 65537, 10**6, 2**30 - 1, 2**30, 2**30 + 1, 2**31 - 1]],
                         ids=["1-1024", "1025-4096", "large"])
def test_matches_python_divmod(fast_divmod, divisors):
    rng = np.random.default_rng(0)
    for d in divisors:
        n = _numerators(rng)
        q, r = fast_divmod(d, n)
        bad = np.flatnonzero((q != n // d) | (r != n % d))
        assert bad.size == 0, f"d={d}: n={n[bad[:5]].tolist()} gave q={q[bad[:5]].tolist()} r={r[bad[:5]].tolist()}"
