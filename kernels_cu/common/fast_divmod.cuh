// Division by a run-time divisor that is the same for a whole kernel (a page size), as one multiply-high,
// an add and a shift instead of the ~30-instruction integer division ptxas emits for `/` and `%`.
//
// For a divisor d >= 1, with s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1, every n in
// [0, 2^31) has n / d = (umulhi(n, m) + n) >> s (Granlund & Montgomery, "Division by invariant integers
// using multiplication", 1994; the sum stays below 2^32 because umulhi(n, m) < n). The constructor
// does one 64-bit division, once per thread. tests/test_fast_divmod.py checks the host build of this
// header against Python's // and % over every divisor up to 4096 and the ends of the range.
#pragma once
#include "types.cuh"

struct FastDivmod {
    u32 divisor, multiplier, shift;

    FastDivmod() = default;
    __device__ __forceinline__ explicit FastDivmod(int d) : divisor(u32(d)) {
        shift = 0;
        while ((u32(1) << shift) < divisor) ++shift;
        multiplier = u32(((u64(1) << 32) * ((u64(1) << shift) - divisor)) / divisor + 1);
    }

    __device__ __forceinline__ int div(int n) const {
        return int((__umulhi(u32(n), multiplier) + u32(n)) >> shift);
    }

    // q = n / d, r = n % d, for 0 <= n < 2^31.
    __device__ __forceinline__ void divmod(int n, int& q, int& r) const {
        q = div(n);
        r = n - q * int(divisor);
    }
};
