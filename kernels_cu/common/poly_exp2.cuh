// 2^x on the FMA pipe, for x <= 0 (a softmax's exponent): the special-function unit does 16 exponentials
// per clock per SM, an eighth of what the FP32 pipes issue, so a softmax that computes some of them here
// keeps both busy (FlashAttention-4's trick). No inline PTX: tests/cpp/poly_exp2_harness.cpp builds this
// header on the host and checks it against 2^x.
//
// x = n + f with n = round(x) and f in [-0.5, 0.5]: adding 1.5 * 2^23 leaves round(x) in the sum's low
// mantissa bits; 2^f by a cubic (relative error 1.0e-4, exactly 1 at f = 0), times 2^n by adding n to its
// exponent field (the sum's bits shifted left by 23 are n modulo 2^9 there). x is clamped to -127 first,
// so -inf (a masked score) and NaN give exactly +0 (n = -127, f = 0: the exponent field becomes 0), and
// no result wraps into the sign bit (n = -127 only with f >= 0, where 2^f's exponent field is 127; below
// 2^-126 the result is a small subnormal instead of ex2.approx.ftz's 0).
#pragma once

__device__ __forceinline__ float poly_exp2(float x) {
    x = fmaxf(x, -127.f);
    const float shifted = x + 12582912.f;  // 1.5 * 2^23
    const float f = x - (shifted - 12582912.f);
    const float p = fmaf(fmaf(fmaf(5.500871316e-02f, f, 2.422106862e-01f), f, 6.932829022e-01f), f, 1.f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(shifted) << 23));
}
