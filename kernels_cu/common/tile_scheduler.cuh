// Persistent tile scheduling: a grid of about one thread block per SM walks the (query block, head,
// batch) tiles, block b taking tiles b, b + gridDim.x, b + 2 gridDim.x, ... The next tile's loads then
// overlap the current tile's last GEMMs and epilogue instead of waiting for a fresh block to launch.
//
// Tile order: the last query blocks first (with a causal mask they see the most keys), then head, then
// batch, so the round-robin hands out the heavy tiles first and the light ones fill in at the end.
#pragma once
#include "types.cuh"

struct Tile {
    int m_block, head, batch;
};

struct TileScheduler {
    int m_blocks, heads, batch;
    i64 index;  // this block's current tile (linear)

    __device__ __forceinline__ TileScheduler(int m_blocks_, int heads_, int batch_)
        : m_blocks(m_blocks_), heads(heads_), batch(batch_), index(blockIdx.x) {}

    __device__ __forceinline__ bool valid() const { return index < i64(m_blocks) * heads * batch; }
    __device__ __forceinline__ void advance() { index += gridDim.x; }

    __device__ __forceinline__ Tile tile() const {
        const i64 per_m = i64(heads) * batch;
        const int rest = int(index % per_m);
        return Tile{m_blocks - 1 - int(index / per_m), rest % heads, rest / heads};
    }
};
