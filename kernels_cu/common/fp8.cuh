// FP8 (OCP e4m3, "float8_e4m3fn") conversions and the key order of the FP8 forward's V^T tiles.
// The conversions need sm_89 or newer.
#pragma once
#include "types.cuh"

// Two fp32 values -> two e4m3 bytes, lo in the low byte: round to nearest even, finite values beyond
// +-448 saturate to +-448, NaN stays NaN. (PTX: the first source goes to the upper byte.)
__device__ __forceinline__ u16 to_e4m3x2(float lo, float hi) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// Four fp32 values -> four e4m3 bytes, a in the lowest.
__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d) {
    return u32(to_e4m3x2(a, b)) | u32(to_e4m3x2(c, d)) << 16;
}

// Position p (0..15) of each 16-key group of a V^T row holds key fp8_v_key_order(p) of the group: the
// order in which acc_to_a_frags_fp8 (common/hopper.cuh) packs P, so P's fragments need no shuffles.
__host__ __device__ constexpr int fp8_v_key_order(int p) { return 2 * (p >> 2) + (p & 1) + 8 * ((p >> 1) & 1); }
