// Host build of kernels_cu/common/tile_scheduler.cuh, so the CPU tier checks the very code the FA3
// forward runs (tests/test_tile_scheduler.py builds this into a shared library and calls it through ctypes).
//
//   g++ -std=c++17 -O1 -fwrapv -shared -fPIC -I kernels_cu/common tests/cpp/scheduler_harness.cpp -o libsched.so
//
// The CUDA qualifiers are defined away, blockIdx / gridDim are host globals the entry point sets, and the
// few device intrinsics of types.cuh get host stand-ins (never called here).
#include <algorithm>
#include <cstdint>
#include <cstring>

#define __device__
#define __forceinline__ inline
using std::max;
using std::min;

struct HostDim3 {
    unsigned x = 0, y = 1, z = 1;
};
static HostDim3 blockIdx, gridDim;
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }

#include "tile_scheduler.cuh"

// Walks every block's tiles in the order the kernel does: out[k] = (block, m_block, head, batch) of the
// k-th tile visited, blocks in order. Returns how many were written, or -1 if more than `capacity`.
template <bool FAST_DIV>
long long walk(int m_blocks, int heads, int batch, int section, int serpentine, int grid, int32_t* out,
               long long capacity) {
    long long count = 0;
    gridDim.x = unsigned(grid);
    const TileOrderDivisors div = tile_order_divisors(m_blocks, heads, batch, section);
    for (int b = 0; b < grid; ++b) {
        blockIdx.x = unsigned(b);
        for (TileScheduler sched(m_blocks, heads, batch, section, serpentine != 0); sched.valid(); sched.advance()) {
            if (count >= capacity) return -1;
            const Tile t = sched.tile<FAST_DIV>(div);
            int32_t* row = out + 4 * count++;
            row[0] = b, row[1] = t.m_block, row[2] = t.head, row[3] = t.batch;
        }
    }
    return count;
}

extern "C" {

// The kernel's walk with the host-built divisors (FAST_DIV) and with plain division (the FP8 forward's).
long long scheduler_walk(int m_blocks, int heads, int batch, int section, int serpentine, int grid, int32_t* out,
                         long long capacity) {
    return walk<true>(m_blocks, heads, batch, section, serpentine, grid, out, capacity);
}
long long scheduler_walk_plain_div(int m_blocks, int heads, int batch, int section, int serpentine, int grid,
                                   int32_t* out, long long capacity) {
    return walk<false>(m_blocks, heads, batch, section, serpentine, grid, out, capacity);
}

// The same walk with a stream-K tail (TailSplit{start, units, k_blocks, slots}): out[k] = (block, m_block, head,
// batch, n_lo, n_hi, slot, first, merges) of the k-th tile or piece visited, [n_lo, n_hi) the K tiles
// TileScheduler::clip leaves of [0, k_blocks), the rest its PieceRole. Returns the count, or -1.
long long scheduler_walk_tail(int m_blocks, int heads, int batch, int section, int serpentine, int grid, int start,
                              int units, int k_blocks, int slots, int32_t* out, long long capacity) {
    long long count = 0;
    gridDim.x = unsigned(grid);
    const TileOrderDivisors div = tile_order_divisors(m_blocks, heads, batch, section);
    for (int b = 0; b < grid; ++b) {
        blockIdx.x = unsigned(b);
        for (TileScheduler sched(m_blocks, heads, batch, section, serpentine != 0,
                                 TailSplit{start, units, k_blocks, slots});
             sched.valid(); sched.advance()) {
            if (count >= capacity) return -1;
            const Tile t = sched.tile(div);
            int n_lo = 0, n_hi = k_blocks;
            sched.clip(n_lo, n_hi);
            const PieceRole role = sched.role();
            int32_t* row = out + 9 * count++;
            row[0] = b, row[1] = t.m_block, row[2] = t.head, row[3] = t.batch, row[4] = n_lo, row[5] = n_hi;
            row[6] = role.slot, row[7] = role.first, row[8] = role.merges;
        }
    }
    return count;
}

// tile_order_divisors(m_blocks, heads, batch, section) as 12 words (divisor, multiplier, shift of each), for
// cuflash/fa3.py's mirror.
void scheduler_divisors(int m_blocks, int heads, int batch, int section, uint32_t* out) {
    const TileOrderDivisors d = tile_order_divisors(m_blocks, heads, batch, section);
    const FastDivmod all[4] = {d.section_tiles, d.section, d.last_section, d.heads};
    for (int i = 0; i < 4; ++i) out[3 * i] = all[i].divisor, out[3 * i + 1] = all[i].multiplier, out[3 * i + 2] = all[i].shift;
}

}  // extern "C"
