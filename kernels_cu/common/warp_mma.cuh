// A warp's tile of a matrix product on mma.sync, operands read from shared-memory tiles.
//
// acc[mi][ni] are m16n8 fp32 fragments covering rows [m0, m0 + 16*MI) and columns [n0, n0 + 8*NI) of
// C += A B, summed over K_DEPTH values of the inner index starting at k0 (A's) and bk0 (B's).
// Storage of each operand is either "by rows" (A stored [m][k], B stored [n][k]: the inner index is
// contiguous) or "k-major" (A stored [k][m], B stored [k][n]); k-major operands are read with
// ldmatrix.trans, so a transposed product (P^T dO, dS^T Q) needs no transposed copy.
//
// The operands are read through precomputed ldmatrix addresses (LdsmAddr, tile.cuh): computing each
// swizzled address at the call cost about as many issue slots as the ldmatrix it fed (the FA2 backward
// before session 12, bench/NOTES.md). `a` and `b` carry the warp's origin in their tiles; m0, k0, n0,
// bk0 are compile-time offsets from it and a_off / b_off a byte offset added to every address (another
// tile of the same shape: a pipeline stage, a second operand laid out alike). The lane mappings the
// addresses must be built with:
//   A by rows: a_addr, origin (m, k)       A k-major: b_rows_addr, origin (k, m)
//   B by rows: b_rows_addr, origin (n, k)  B k-major: b_trans_addr, origin (k, n)
#pragma once
#include "ptx.cuh"
#include "tile.cuh"

template <int MI, int NI, int K_DEPTH, bool A_KMAJOR, bool B_KMAJOR, typename T, class AddrA, class AddrB>
__device__ __forceinline__ void warp_mma_at(float (&acc)[MI][NI][4], const AddrA& a, u32 a_off, int m0, int k0,
                                            const AddrB& b, u32 b_off, int n0, int bk0) {
    static_assert(NI % 2 == 0 && K_DEPTH % 16 == 0, "B is loaded 16 columns x 16 deep at a time");
#pragma unroll
    for (int kk = 0; kk < K_DEPTH; kk += 16) {
        u32 fa[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
            if constexpr (A_KMAJOR) ldmatrix_x4_trans_at(fa[mi], a.at(k0 + kk, m0 + 16 * mi) + a_off);
            else ldmatrix_x4_at(fa[mi], a.at(m0 + 16 * mi, k0 + kk) + a_off);
        }
#pragma unroll
        for (int ni = 0; ni < NI; ni += 2) {
            u32 fb[4];
            if constexpr (B_KMAJOR) ldmatrix_x4_trans_at(fb, b.at(bk0 + kk, n0 + 8 * ni) + b_off);
            else ldmatrix_x4_at(fb, b.at(n0 + 8 * ni, bk0 + kk) + b_off);
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                mma_16816<T>(acc[mi][ni], fa[mi], {fb[0], fb[1]});
                mma_16816<T>(acc[mi][ni + 1], fa[mi], {fb[2], fb[3]});
            }
        }
    }
}

template <int MI, int NI>
__device__ __forceinline__ void zero(float (&acc)[MI][NI][4]) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) acc[mi][ni][0] = acc[mi][ni][1] = acc[mi][ni][2] = acc[mi][ni][3] = 0.f;
}
