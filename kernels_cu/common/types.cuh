// Element types without cuda_bf16.h / cuda_fp16.h (NVRTC ships no CUDA headers on a CPU machine).
// A 16-bit element is carried as its raw bits; each type tag knows how to convert and which mma
// instruction multiplies it.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

struct bf16_t {
    static constexpr const char* name = "bf16";
    // Two fp32 values -> packed bf16x2 (round to nearest even); lo lands in the low half.
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float to_float(u16 x) { return __uint_as_float(u32(x) << 16); }
    static __device__ __forceinline__ u16 from_float(float x) { return u16(pack2(x, 0.f) & 0xffffu); }
};

struct fp16_t {
    static constexpr const char* name = "fp16";
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float to_float(u16 x) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f;
    }
    static __device__ __forceinline__ u16 from_float(float x) { return u16(pack2(x, 0.f) & 0xffffu); }
};

// Compile-time element type chosen by the variant key (-DCUFLASH_DTYPE=0 bf16, 1 fp16).
#if defined(CUFLASH_DTYPE) && CUFLASH_DTYPE == 1
typedef fp16_t elem_t;
#else
typedef bf16_t elem_t;
#endif

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
