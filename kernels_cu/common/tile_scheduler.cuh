// Persistent tile scheduling: a grid of about one thread block per SM walks the (query block, head,
// batch) tiles in rounds of gridDim.x tiles, block b taking one tile per round: position b, or, with the
// serpentine, position b in even rounds and gridDim.x - 1 - b in odd ones. Tiles are ordered heaviest
// first, so with the serpentine the block that took the heaviest tile of one round takes the lightest of
// the next and the blocks' sums of work stay close (a plain round-robin gives block 0 the heaviest tile of
// every round); across several sections the costs are a sawtooth, which one deal or the other balances
// better. The host chooses the section and the deal per call with a model of the blocks' work
// (cuflash/tile_order.py). The next tile's loads overlap the current tile's last GEMMs and epilogue
// instead of waiting for a fresh block to launch.
//
// Stream-K tail (TailSplit, cuflash/fa3.py fill_tail; calls without a mask, where every tile sees the same
// k_blocks K tiles). Tiles of 64-row granularity on 132 SMs leave the last round part-empty at the benchmark
// shapes (2048 tiles: 15.5 rounds, 3 % of the blocks' time idle), so the rounds stop at tile `start` and the
// K tiles of the remaining tiles, in order, are cut into ranges of `units` per block: block b takes units
// [b units, (b + 1) units) of the (tail tile, K tile) sequence, at most the end of one tile and the start of
// the next (units <= k_blocks). Each piece of a tile but the last (highest keys) leaves its unnormalised O,
// row maxima and sums as a partial in one of the tile's `slots`; the block that holds the tile's last piece
// merges them before the epilogue. A block takes its later tile's piece first, so a merge waits only for
// pieces of lower-numbered blocks that each took first (none of which waits): no cycle, and none on a
// block that is not running provided blocks start in index order.
//
// Tile order. The (head, batch) pairs are cut into sections of `section` pairs whose K and V fit in L2
// together; a section's tiles run before the next section's. Within a section the last query blocks
// come first (with a causal mask they see the most keys: the round-robin hands out the heavy tiles first
// and the light ones fill in at the end), and the section's heads are the fastest index. So the blocks
// running at one time read the K/V of a few heads, each from L2 many times, instead of ~one block per
// head streaming its own K/V from device memory: with one block per (head, batch) at a time a d = 128
// tile does 128 FLOP per byte of K/V, which caps the kernel near 500 TFLOP/s at 4 TB/s.
#pragma once
#include "fast_divmod.cuh"
#include "types.cuh"

struct Tile {
    int m_block, head, batch;
};

// The stream-K tail's shape (units == 0: none; the rounds run to the last tile).
struct TailSplit {
    int start;     // the first tile of the tail: a whole number of rounds
    int units;     // K tiles per block in the tail
    int k_blocks;  // K tiles of every tile
    int slots;     // partial slots per tail tile (most pieces a tile has, less one)
};

// The divisions tile() makes, by divisors fixed for a call: tiles per section, pairs per section (and in the
// last, narrower section) and heads. As integer divisions they were three ~30-instruction sequences per tile
// in every warp (ncu, d = 64 N = 512: ~5 % of the kernel's instructions); the host computes them once per call
// (cuflash/fa3.py tile_order_divisors mirrors tile_order_divisors below) and the kernel reads them from its
// parameters.
struct TileOrderDivisors {
    FastDivmod section_tiles, section, last_section, heads;
};

__device__ __forceinline__ TileOrderDivisors tile_order_divisors(int m_blocks, int heads, int batch, int section) {
    const int pairs = heads * batch, last_first_pair = (pairs - 1) / section * section;
    return TileOrderDivisors{FastDivmod(min(section, pairs) * m_blocks), FastDivmod(section),
                             FastDivmod(pairs - last_first_pair), FastDivmod(heads)};
}

// A tail piece's part in its tile: `slot` >= 0: leave a partial there (an index into the call's partial
// slots); else merge the `merges` partials from slot `first` on (0: a whole tile, or the tile's only piece).
struct PieceRole {
    int slot, first, merges;
};

// Tile indices are ints: a tile has at least one query row of d >= 64 elements per head, so 2^31 tiles
// would be a Q of 2^37 elements, more than a GPU holds (and ints keep the persistent loop's state small:
// the FP8 d = 256 consumer has no register to spare).
struct TileScheduler {
    int m_blocks, heads, batch, section;
    int round_start;  // the first tile of the current round
    int index;        // this block's current tile (linear)
    bool serpentine;  // odd rounds run backwards
    TailSplit tail;
    int piece;        // -1 in the rounds; then 0, 1: this block's tail pieces (its later tile's first)

    __device__ __forceinline__ TileScheduler(int m_blocks_, int heads_, int batch_, int section_, bool serpentine_,
                                             TailSplit tail_ = TailSplit{0, 0, 1, 0})
        : m_blocks(m_blocks_), heads(heads_), batch(batch_), section(section_), round_start(0), index(blockIdx.x),
          serpentine(serpentine_), tail(tail_), piece(-1) {
        if (tail.units && index >= tail.start) enter_tail(0);
    }

    // Every round is a permutation of its gridDim.x tiles, so stopping at the first index past the end
    // covers each tile once (in a last, partial odd round the low blocks are the ones left out). In the
    // tail, index is the piece's tile (past the end: no piece left).
    __device__ __forceinline__ bool valid() const { return index < m_blocks * heads * batch; }
    __device__ __forceinline__ void advance() {
        if (piece >= 0) {
            enter_tail(piece + 1);
            return;
        }
        const bool backwards = serpentine && ((round_start / gridDim.x) & 1) == 0;  // the next round is odd
        round_start += gridDim.x;
        index = round_start + (backwards ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
        if (tail.units && index >= tail.start) enter_tail(0);
    }

    // This block's range of tail units (K tiles of the tail tiles in order), [lo, hi); empty past the end.
    __device__ __forceinline__ void tail_range(int& lo, int& hi) const {
        const int units = (m_blocks * heads * batch - tail.start) * tail.k_blocks;
        lo = min(int(blockIdx.x) * tail.units, units);
        hi = min(lo + tail.units, units);
    }
    // Piece k of this block's tail: k = 0 the tile its range ends in, k = 1 the one it starts in (if another).
    __device__ __forceinline__ void enter_tail(int k) {
        piece = k;
        int lo, hi;
        tail_range(lo, hi);
        const int first = lo / tail.k_blocks, last = (hi - 1) / tail.k_blocks;
        const bool exists = hi > lo && (k == 0 || (k == 1 && first < last));
        index = exists ? tail.start + (k == 0 ? last : first) : m_blocks * heads * batch;
    }
    // The K tiles [n_lo, n_hi) of the current tile this block computes: all of them in the rounds (as the
    // caller's mask gave them), this piece's in the tail.
    __device__ __forceinline__ void clip(int& n_lo, int& n_hi) const {
        if (piece < 0) return;
        int lo, hi;
        tail_range(lo, hi);
        const int base = (index - tail.start) * tail.k_blocks;
        n_lo = max(n_lo, lo - base);
        n_hi = min(n_hi, hi - base);
    }
    // What the current tile's piece does with its result (PieceRole).
    __device__ __forceinline__ PieceRole role() const {
        if (piece < 0) return PieceRole{-1, 0, 0};
        int lo, hi;
        tail_range(lo, hi);
        const int j = index - tail.start, end = (j + 1) * tail.k_blocks;
        const int first_block = j * tail.k_blocks / tail.units;  // the block holding the tile's first piece
        const int before = int(blockIdx.x) - first_block;      // pieces of this tile in lower blocks
        if (hi < end) return PieceRole{j * tail.slots + before, 0, 0};
        return PieceRole{-1, j * tail.slots, before};
    }

    // (div: tile_order_divisors(m_blocks, heads, batch, section) of this call.) FAST_DIV false: by `/` and `%`
    // instead, for kernels whose main loop has no uniform register to spare for the divisors (fa3/fwd.cu).
    template <bool FAST_DIV = true>
    __device__ __forceinline__ Tile tile(const TileOrderDivisors& div) const {
        if constexpr (FAST_DIV) {
            const int first_pair = div.section_tiles.div(index) * section;  // the section's first (head, batch) pair
            const bool narrow = first_pair + section > heads * batch;         // the last section may be narrower
            int step, column, batch_index, head;  // tile = step x width + column within the section
            (narrow ? div.last_section : div.section).divmod(index - first_pair * m_blocks, step, column);
            div.heads.divmod(first_pair + column, batch_index, head);
            return Tile{m_blocks - 1 - step, head, batch_index};
        } else {
            const int pairs = heads * batch, first_pair = index / (section * m_blocks) * section;
            const int width = min(section, pairs - first_pair), rest = index - first_pair * m_blocks;
            const int pair = first_pair + rest % width;
            return Tile{m_blocks - 1 - rest / width, pair % heads, pair / heads};
        }
    }
};
