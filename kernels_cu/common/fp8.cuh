// FP8 (OCP e4m3, "float8_e4m3fn") conversions (sm_89 and newer), and the FP8 forward's P / V^T layout.
#pragma once
#include "fp8_layout.cuh"
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
