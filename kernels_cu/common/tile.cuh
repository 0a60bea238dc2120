// Shared-memory tiles of 16-bit elements and the cooperative copies that fill them.
//
// Every access of these tiles is a 16-byte chunk (8 elements) whose column is a multiple of 8: an
// ldmatrix row address or a vector copy. The 8 row addresses of an ldmatrix phase must fall in
// different banks. Two layouts achieve that:
//   padded   (SWIZZLE = false): each row is padded by 8 elements (16 bytes), so consecutive rows
//            start 4 banks apart. Costs 16 bytes per row. Works for any COLS.
//   swizzled (SWIZZLE = true):  rows are packed; chunk c of row r is stored at chunk c ^ (r % 8),
//            so the same logical chunk of 8 consecutive rows lands in 8 different 16-byte bank
//            groups of a 128-byte line. Needs COLS to be a multiple of 64 (8 chunks).
#pragma once
#include "ptx.cuh"
#include "types.cuh"

template <int ROWS, int COLS, bool SWIZZLE = false>
struct SmemTile {
    static_assert(!SWIZZLE || COLS % 64 == 0, "the XOR swizzle permutes groups of 8 chunks");
    static constexpr int PITCH = SWIZZLE ? COLS : COLS + 8;
    u16 data[ROWS][PITCH];
    __device__ __forceinline__ u16* at(int r, int c) {
        if constexpr (SWIZZLE) return &data[r][(((c >> 3) ^ (r & 7)) << 3) | (c & 7)];
        else return &data[r][c];
    }
};

// Padded when the head dim is not a multiple of 64 (32, 96), swizzled otherwise.
template <int ROWS, int COLS>
using FastSmemTile = SmemTile<ROWS, COLS, COLS % 64 == 0>;

// Copy rows [0, rows_valid) of a (ROWS x COLS) global tile with row stride `row_stride` (elements)
// into `tile`; rows past rows_valid become zeros, so out-of-range keys and values can never inject
// NaN or Inf from whatever memory lies beyond the array. Every thread of the block takes part.
template <int THREADS, int ROWS, int COLS, bool SW>
__device__ __forceinline__ void load_tile_sync(SmemTile<ROWS, COLS, SW>& tile, const u16* src, i64 row_stride,
                                               int rows_valid) {
    constexpr int CHUNKS = COLS / 8;  // 16-byte chunks per row
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
        int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < rows_valid) v = *reinterpret_cast<const uint4*>(src + r * row_stride + c);
        *reinterpret_cast<uint4*>(tile.at(r, c)) = v;
    }
}

// The same copy issued as cp.async (16 bytes per instruction, completion tracked by commit groups):
// the copy runs in the background while the block computes on the previous tile. Rows past
// rows_valid are zero-filled by the hardware (source size 0), reading nothing.
template <int THREADS, int ROWS, int COLS, bool SW>
__device__ __forceinline__ void load_tile_async(SmemTile<ROWS, COLS, SW>& tile, const u16* src, i64 row_stride,
                                                int rows_valid) {
    constexpr int CHUNKS = COLS / 8;
#pragma unroll
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
        int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        const bool in = r < rows_valid;
        cp_async_16(tile.at(r, c), in ? src + r * row_stride + c : src, in ? 16 : 0);
    }
}

// ldmatrix address helpers for a 16x16 block at (r0, c0) of a tile. Matrix i of an ldmatrix.x4 comes
// from lanes 8i..8i+7 (see ptx.cuh).
//   a_operand: the four matrices in A-fragment order (rows r0/r0+8 x cols c0/c0+8, row-major).
//   b_operand_from_rows: a tile stored [n][k] (k contiguous): registers {0,1} are the B fragment of
//     n-tile r0..r0+7, registers {2,3} that of n-tile r0+8..r0+15, both over k = c0..c0+15.
//   b_operand_trans: a tile stored [k][n] (n contiguous), for ldmatrix.trans: registers {0,1} are
//     the B fragment of n-tile c0..c0+7, {2,3} that of c0+8..c0+15, over k = r0..r0+15.
template <int ROWS, int COLS, bool SW>
__device__ __forceinline__ u16* a_operand(SmemTile<ROWS, COLS, SW>& t, int r0, int c0, int lane) {
    return t.at(r0 + (lane & 15), c0 + (lane >> 4) * 8);
}
template <int ROWS, int COLS, bool SW>
__device__ __forceinline__ u16* b_operand_from_rows(SmemTile<ROWS, COLS, SW>& t, int r0, int c0, int lane) {
    return t.at(r0 + (lane & 7) + (lane >> 4) * 8, c0 + ((lane >> 3) & 1) * 8);
}
template <int ROWS, int COLS, bool SW>
__device__ __forceinline__ u16* b_operand_trans(SmemTile<ROWS, COLS, SW>& t, int r0, int c0, int lane) {
    return t.at(r0 + (lane & 7) + ((lane >> 3) & 1) * 8, c0 + (lane >> 4) * 8);
}

// Register-light ldmatrix addressing. A lane's ldmatrix row address inside a 16x16 block at (r0, c0)
// is (r0 + lane_row, c0 + 8 * lane_chunk); only lane_row and lane_chunk depend on the lane. For a
// swizzled tile, with r0 a multiple of 8 and c0 a multiple of 16, the stored chunk is
//     (c0/8 + lane_chunk) ^ (lane_row % 8) = 8 * (c0/64) + ((c0/8 % 8) ^ (lane_chunk ^ lane_row % 8)),
// so four per-lane bases (one per value of c0/16 % 4) plus a compile-time offset give every address:
// the unrolled loops then use [register + immediate] instead of one live register per address.
// A warp whose tile starts at a run-time origin (row0 a multiple of 8, col0 a multiple of 16) folds it
// into the bases: base j serves the 16 columns at col0 + 16 j (+ 64 per group of four), so at() still
// takes compile-time offsets relative to the origin and costs no instruction beyond the ldmatrix.
// lane_row / lane_chunk of the three operand kinds (see a_operand & co. above):
//   A:          lane & 15,                          lane >> 4
//   B rows:     (lane & 7) + (lane >> 4) * 8,       (lane >> 3) & 1
//   B trans:    (lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4
template <int ROWS, int COLS, bool SW>
struct LdsmAddr {
    static constexpr int PITCH_BYTES = SmemTile<ROWS, COLS, SW>::PITCH * 2;
    u32 base[SW ? 4 : 1];

    __device__ __forceinline__ LdsmAddr(SmemTile<ROWS, COLS, SW>& t, int lane_row, int lane_chunk, int row0 = 0,
                                        int col0 = 0) {
        const u32 row = smem_addr(&t.data[row0 + lane_row][0]);
        if constexpr (SW) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int unit = col0 / 16 + j;  // 16-column unit: chunk 2 unit + lane_chunk, group unit / 4
                base[j] = row + (unit / 4) * 128 + (((2 * (unit % 4)) ^ lane_chunk ^ (lane_row & 7)) << 4);
            }
        } else {
            base[0] = row + (col0 + lane_chunk * 8) * 2;
        }
    }
    // Shared address of this lane's row for the 16x16 block at (row0 + r0, col0 + c0); r0 % 8 == 0,
    // c0 % 16 == 0, both known at compile time after unrolling.
    __device__ __forceinline__ u32 at(int r0, int c0) const {
        if constexpr (SW) return base[(c0 >> 4) & 3] + r0 * PITCH_BYTES + (c0 >> 6) * 128;
        else return base[0] + r0 * PITCH_BYTES + c0 * 2;
    }
};

template <int ROWS, int COLS, bool SW>
__device__ __forceinline__ LdsmAddr<ROWS, COLS, SW> a_addr(SmemTile<ROWS, COLS, SW>& t, int lane, int row0 = 0,
                                                        int col0 = 0) {
    return LdsmAddr<ROWS, COLS, SW>(t, lane & 15, lane >> 4, row0, col0);
}
template <int ROWS, int COLS, bool SW>
__device__ __forceinline__ LdsmAddr<ROWS, COLS, SW> b_rows_addr(SmemTile<ROWS, COLS, SW>& t, int lane, int row0 = 0,
                                                             int col0 = 0) {
    return LdsmAddr<ROWS, COLS, SW>(t, (lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1, row0, col0);
}
template <int ROWS, int COLS, bool SW>
__device__ __forceinline__ LdsmAddr<ROWS, COLS, SW> b_trans_addr(SmemTile<ROWS, COLS, SW>& t, int lane, int row0 = 0,
                                                              int col0 = 0) {
    return LdsmAddr<ROWS, COLS, SW>(t, (lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4, row0, col0);
}
