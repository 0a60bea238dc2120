// The random signs of the Hadamard rotation of cuflash.fp8.quantize: channel i of a row is negated
// before the transform when hadamard_sign_bit(key, i) is 1. The key comes from the seed on the host
// (cuflash.fp8.sign_key); cuflash.fp8.hadamard_signs computes the same signs with NumPy, and
// tests/test_fp8_cpu.py builds this header on the host (g++) to check that the two agree.
// Self-contained (no other header) so that the host build needs nothing else.
#pragma once

// "lowbias32", a 32-bit integer mixer (Chris Wellons' hash prospector).
__device__ __forceinline__ unsigned mix32(unsigned x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// 1: channel i is negated (s_i = -1); 0: kept (s_i = +1). The same for every head dim: the signs of
// d = 64 are the first 64 of d = 256.
__device__ __forceinline__ unsigned hadamard_sign_bit(unsigned key, unsigned i) { return mix32(key ^ i) >> 31; }
