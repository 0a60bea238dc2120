// Kernel parameter struct of the fp8 family (cuflash.fp8.quantize), passed by value.
// cuflash/fp8.py mirrors it field by field as a numpy structured dtype (align=True): keep the order and
// types in step. Strides are in elements and 64-bit.
#pragma once
#include "../common/types.cuh"

typedef unsigned char u8;

constexpr int FP8_TILE_ROWS = 128;  // rows of one (batch, head) per CTA tile (cuflash/fp8.py: TILE_ROWS)

// What one launch of fp8_quantize does (see the top comment of fp8/quantize.cu).
enum Fp8Pass : int {
    FP8_PASS_FUSED = 0,    // every CTA tile holds whole groups: amax, scale and conversion in one launch
    FP8_PASS_AMAX = 1,     // groups span several tiles: each tile merges its amax into Fp8QuantParams::amax
    FP8_PASS_CONVERT = 2,  // ... then each tile converts with its group's finished amax
};

struct Fp8QuantParams {
    const u16* x;    // (batch, seqlen, heads, d) bf16/fp16, last dim contiguous, other strides free
    u8* data;        // (batch, seqlen, heads, d) e4m3 bytes, contiguous
    float* descale;  // (batch, heads, num_blocks) contiguous
    u32* amax;       // (batch, heads, num_blocks) zeroed scratch: the float bits of each group's amax (split
                     // passes only; null in the fused pass)
    i64 x_batch_stride, x_row_stride, x_head_stride;
    int batch, seqlen, heads;
    int block;        // rows per group (the host clamps it to seqlen)
    int num_blocks;   // groups per (batch, head) = ceil(seqlen / block)
    int tile_groups;  // fused pass: whole groups per CTA tile (tile_groups * block <= FP8_TILE_ROWS); split: 1
    int chunks;       // split passes: CTA tiles per group = ceil(block / FP8_TILE_ROWS); 1 when fused
    int pass;         // an Fp8Pass
    u32 sign_key;     // the Hadamard signs' key, derived from the seed by cuflash.fp8.sign_key
    float descale_per_amax;  // fp32(1 / (448 sqrt(d))) with the rotation, fp32(1 / 448) without
};
