// Dropout masks from Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"):
// a counter-based generator, so the backward regenerates exactly the forward's mask from the same
// (seed, offset) without storing it, whatever the thread layout of either kernel.
//
// Element (row i, key j) of (batch b, head h) reads 16 bits of the Philox block with
//     counter = (j / 16, i / 16, b * heads + h, 32 * offset + (i % 8) * 4 + (j % 8) / 2),  key = seed,
// word ((j % 16) / 8) * 2 + (i % 16) / 8 of the four outputs, the low half for even j, the high half
// for odd j. So one Philox call serves the 8 elements a lane holds in a 16 x 16 block of mma C fragments
// (rows g, g + 8; columns 2t, 2t + 1, 8 + 2t, 9 + 2t). The element is kept when those 16 bits are
// >= threshold = round(p * 65536). cuflash/reference.py (dropout_mask) implements the same map.
#pragma once
#include "types.cuh"

__device__ __forceinline__ void philox4x32_10(u32 (&c)[4], u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const u32 hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        const u32 hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        const u32 n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

struct Dropout {
    u32 seed_lo, seed_hi, offset, threshold;  // threshold: 16-bit keep bound (drop when bits < threshold)
    float scale;                              // 1 / (1 - p)

    // Keep bits of the 8 elements a lane holds in the 16 x 16 block whose top-left is (i0, j0) (both
    // multiples of 16) for lane (g, t): bit (2 * col_half + row_half) * 2 + e, i.e. index
    // [col_half][row_half][e] with column 8 * col_half + 2t + e and row g + 8 * row_half.
    __device__ __forceinline__ u32 keep_bits(int bh, int i0, int j0, int g, int t) const {
        u32 c[4] = {u32(j0) >> 4, u32(i0) >> 4, u32(bh), offset * 32u + u32(g * 4 + t)};
        philox4x32_10(c, seed_lo, seed_hi);
        u32 bits = 0;
#pragma unroll
        for (int w = 0; w < 4; ++w) {  // word w = 2 * col_half + row_half
            bits |= u32((c[w] & 0xffffu) >= threshold) << (2 * w);
            bits |= u32((c[w] >> 16) >= threshold) << (2 * w + 1);
        }
        return bits;
    }
};
