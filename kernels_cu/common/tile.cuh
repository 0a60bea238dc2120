// Shared-memory tiles of 16-bit elements and the cooperative copies that fill them.
//
// A tile is ROWS x COLS elements with each row padded by 8 elements (16 bytes): consecutive rows then
// start 4 banks apart, so the 8 row addresses of an ldmatrix phase fall in different banks, and every
// row stays 16-byte aligned as ldmatrix and 16-byte vector loads require.
#pragma once
#include "types.cuh"

template <int ROWS, int COLS>
struct SmemTile {
    static constexpr int PITCH = COLS + 8;
    u16 data[ROWS][PITCH];
    __device__ __forceinline__ u16* at(int r, int c) { return &data[r][c]; }
};

// Copy rows [0, rows_valid) of a (ROWS x COLS) global tile with row stride `row_stride` (elements)
// into `tile`; rows past rows_valid become zeros, so out-of-range keys and values can never inject
// NaN or Inf from whatever memory lies beyond the array. Every thread of the block takes part.
template <int THREADS, int ROWS, int COLS>
__device__ __forceinline__ void load_tile_sync(SmemTile<ROWS, COLS>& tile, const u16* src, i64 row_stride,
                                               int rows_valid) {
    constexpr int CHUNKS = COLS / 8;  // 16-byte chunks per row
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
        int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < rows_valid) v = *reinterpret_cast<const uint4*>(src + r * row_stride + c);
        *reinterpret_cast<uint4*>(tile.at(r, c)) = v;
    }
}

// ldmatrix address helpers for a 16x16 block at (r0, c0) of a tile. Matrix i of an ldmatrix.x4 comes
// from lanes 8i..8i+7 (see ptx.cuh).
//   a_operand: the four matrices in A-fragment order (rows r0/r0+8 x cols c0/c0+8, row-major).
//   b_operand_from_rows: a tile stored [n][k] (k contiguous): registers {0,1} are the B fragment of
//     n-tile r0..r0+7, registers {2,3} that of n-tile r0+8..r0+15, both over k = c0..c0+15.
//   b_operand_trans: a tile stored [k][n] (n contiguous), for ldmatrix.trans: registers {0,1} are
//     the B fragment of n-tile c0..c0+7, {2,3} that of c0+8..c0+15, over k = r0..r0+15.
template <int ROWS, int COLS>
__device__ __forceinline__ u16* a_operand(SmemTile<ROWS, COLS>& t, int r0, int c0, int lane) {
    return t.at(r0 + (lane & 15), c0 + (lane >> 4) * 8);
}
template <int ROWS, int COLS>
__device__ __forceinline__ u16* b_operand_from_rows(SmemTile<ROWS, COLS>& t, int r0, int c0, int lane) {
    return t.at(r0 + (lane & 7) + (lane >> 4) * 8, c0 + ((lane >> 3) & 1) * 8);
}
template <int ROWS, int COLS>
__device__ __forceinline__ u16* b_operand_trans(SmemTile<ROWS, COLS>& t, int r0, int c0, int lane) {
    return t.at(r0 + (lane & 7) + ((lane >> 3) & 1) * 8, c0 + (lane >> 4) * 8);
}
