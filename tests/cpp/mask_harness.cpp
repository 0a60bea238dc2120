// Host build of kernels_cu/common/mask.cuh, so the CPU test tier checks the very code the kernels run
// (tests/test_mask_arith.py builds this into a shared library and calls it through ctypes).
//
//   g++ -std=c++17 -O1 -fwrapv -shared -fPIC -I kernels_cu/common tests/cpp/mask_harness.cpp -o libmask.so
//
// -fwrapv: a 32-bit overflow in the mask arithmetic then shows up as a wrong answer the tests catch
// (GPU integer arithmetic wraps too) instead of undefined behaviour the optimiser may exploit.
//
// The CUDA qualifiers are defined away and min/max are the std ones (device code gets them from CUDA's
// headers). The tile sizes are template parameters, so a handful are instantiated and picked at run
// time; every entry point returns -1 for a (BM, BN) pair that is not in the list.
#include <algorithm>
#include <cstdint>

#define __device__
#define __forceinline__ inline
using std::max;
using std::min;

#include "dq_order.cuh"
#include "mask.cuh"

namespace {

// (BM, BN) pairs: small and square ones plus the ones the kernels use today (fa1 fwd 64x64 / 64x32,
// fa1 bwd 64x64 / 32x32, fa2 fwd 128x64 / 128x32 / 64x32, fa2 bwd 64x128 / 64x64 / 64x32).
#define CUFLASH_TILES(X) \
    X(16, 16) X(16, 64) X(32, 32) X(64, 32) X(64, 64) X(64, 128) X(128, 32) X(128, 64) X(128, 128)

template <int BM, int BN>
void kv_ranges(const Mask& mk, int first, int count, int32_t* lo, int32_t* hi) {
    for (int i = 0; i < count; ++i) mk.kv_block_range<BM, BN>(first + i, lo[i], hi[i]);
}

template <int BM, int BN>
void q_ranges(const Mask& mk, int first, int count, int32_t* lo, int32_t* hi) {
    for (int i = 0; i < count; ++i) mk.q_block_range<BM, BN>(first + i, lo[i], hi[i]);
}

template <int BM, int BN>
void all_visible(const Mask& mk, int m0, int n_m, int n0, int n_n, uint8_t* out) {
    for (int i = 0; i < n_m; ++i)
        for (int j = 0; j < n_n; ++j) out[int64_t(i) * n_n + j] = mk.tile_all_visible<BM, BN>(m0 + i, n0 + j) ? 1 : 0;
}

}  // namespace

extern "C" {

// 1 when (bm, bn) is instantiated here.
int mask_has_tile(int bm, int bn) {
#define X(A, B) if (bm == A && bn == B) return 1;
    CUFLASH_TILES(X)
#undef X
    return 0;
}

// out[r * cols + c] = visible(r, c) for r in [0, rows), c in [0, cols); rows/cols may run past sq/sk
// (the kernels call visible() on the padding of the last tiles too).
void mask_visible_matrix(int sq, int sk, int left, int right, int rows, int cols, uint8_t* out) {
    const Mask mk{sq, sk, left, right};
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) out[int64_t(r) * cols + c] = mk.visible(r, c) ? 1 : 0;
}

int mask_visible(int sq, int sk, int left, int right, int row, int col) {
    const Mask mk{sq, sk, left, right};
    return mk.visible(row, col) ? 1 : 0;
}

// lo[i], hi[i] = kv_block_range<bm, bn>(first + i) for i in [0, count).
int mask_kv_block_ranges(int bm, int bn, int sq, int sk, int left, int right, int first, int count, int32_t* lo,
                         int32_t* hi) {
    const Mask mk{sq, sk, left, right};
#define X(A, B) if (bm == A && bn == B) { kv_ranges<A, B>(mk, first, count, lo, hi); return 0; }
    CUFLASH_TILES(X)
#undef X
    return -1;
}

// lo[i], hi[i] = q_block_range<bm, bn>(first + i) for i in [0, count).
int mask_q_block_ranges(int bm, int bn, int sq, int sk, int left, int right, int first, int count, int32_t* lo,
                        int32_t* hi) {
    const Mask mk{sq, sk, left, right};
#define X(A, B) if (bm == A && bn == B) { q_ranges<A, B>(mk, first, count, lo, hi); return 0; }
    CUFLASH_TILES(X)
#undef X
    return -1;
}

// out[i * n_n + j] = tile_all_visible<bm, bn>(m0 + i, n0 + j) for i in [0, n_m), j in [0, n_n).
int mask_tile_all_visible(int bm, int bn, int sq, int sk, int left, int right, int m0, int n_m, int n0, int n_n,
                          uint8_t* out) {
    const Mask mk{sq, sk, left, right};
#define X(A, B) if (bm == A && bn == B) { all_visible<A, B>(mk, m0, n_m, n0, n_n, out); return 0; }
    CUFLASH_TILES(X)
#undef X
    return -1;
}

// common/dq_order.cuh: the deterministic FA3 backward's walk over Q blocks and its rotated turn order.
int dq_q_block(int i, int n, int m_count, int rotated) { return dq_order_q_block(i, n, m_count, rotated != 0); }
int dq_rotated_turn(int n, int m, int n_count, int m_count) { return dq_order_rotated_turn(n, m, n_count, m_count); }

}  // extern "C"
