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
// Tile order. The (head, batch) pairs are cut into sections of `section` pairs whose K and V fit in L2
// together; a section's tiles run before the next section's. Within a section the last query blocks
// come first (with a causal mask they see the most keys: the round-robin hands out the heavy tiles first
// and the light ones fill in at the end), and the section's heads are the fastest index. So the blocks
// running at one time read the K/V of a few heads, each from L2 many times, instead of ~one block per
// head streaming its own K/V from device memory: with one block per (head, batch) at a time a d = 128
// tile does 128 FLOP per byte of K/V, which caps the kernel near 500 TFLOP/s at 4 TB/s.
#pragma once
#include "types.cuh"

struct Tile {
    int m_block, head, batch;
};

// Tile indices are ints: a tile has at least one query row of d >= 64 elements per head, so 2^31 tiles
// would be a Q of 2^37 elements, more than a GPU holds (and ints keep the persistent loop's state small:
// the FP8 d = 256 consumer has no register to spare).
struct TileScheduler {
    int m_blocks, heads, batch, section;
    int round_start;  // the first tile of the current round
    int index;        // this block's current tile (linear)
    bool serpentine;  // odd rounds run backwards

    __device__ __forceinline__ TileScheduler(int m_blocks_, int heads_, int batch_, int section_, bool serpentine_)
        : m_blocks(m_blocks_), heads(heads_), batch(batch_), section(section_), round_start(0), index(blockIdx.x),
          serpentine(serpentine_) {}

    // Every round is a permutation of its gridDim.x tiles, so stopping at the first index past the end
    // covers each tile once (in a last, partial odd round the low blocks are the ones left out).
    __device__ __forceinline__ bool valid() const { return index < m_blocks * heads * batch; }
    __device__ __forceinline__ void advance() {
        const bool backwards = serpentine && ((round_start / gridDim.x) & 1) == 0;  // the next round is odd
        round_start += gridDim.x;
        index = round_start + (backwards ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
    }

    __device__ __forceinline__ Tile tile() const {
        const int pairs = heads * batch, per_section = section * m_blocks;
        const int first_pair = index / per_section * section;  // the section's first (head, batch) pair
        const int width = min(section, pairs - first_pair);  // the last section may be narrower
        const int rest = index - first_pair * m_blocks;  // tile within the section
        const int pair = first_pair + rest % width;
        return Tile{m_blocks - 1 - rest / width, pair % heads, pair / heads};
    }
};
