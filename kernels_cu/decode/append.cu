// Before the decode attention: the new tokens into the cache, and rotary position embeddings.
//   kv_append: one warp per new (entry b, token j, KV head): k (rotated when the call has rotary) and v
//              written in place at cache position cache_seqlens[b] + j (contiguous or paged cache);
//   q_rotary:  one warp per (entry, query, head): q rotated into a scratch copy (q is the caller's).
// Lane l handles elements 8l .. 8l + 7 (one 16-byte load and store; head dims up to 256). The rotation
// is done in fp32 with separately rounded products (__fmul_rn: no FMA contraction), so the stored
// values are exactly cuflash.reference.rotary_ref's rounded to the element type.
// Compile-time constant: CUFLASH_DTYPE. Head dim, rotary dim, paging and convention are run-time values.
#include "common/types.cuh"
#include "decode/params.cuh"

constexpr int WARPS = CUFLASH_THREADS / 32;

__device__ __forceinline__ void unpack8(uint4 raw, float (&x)[8]) {
    const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        x[2 * i] = elem_t::to_float(u16(w[i] & 0xffffu));
        x[2 * i + 1] = elem_t::to_float(u16(w[i] >> 16));
    }
}

__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
    return make_uint4(elem_t::pack2(x[0], x[1]), elem_t::pack2(x[2], x[3]), elem_t::pack2(x[4], x[5]),
                      elem_t::pack2(x[6], x[7]));
}

// a * c - b * s and a * c + b * s with each product rounded on its own (as NumPy computes them).
__device__ __forceinline__ float rot_minus(float a, float c, float b, float s) {
    return __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
}
__device__ __forceinline__ float rot_plus(float a, float c, float b, float s) {
    return __fadd_rn(__fmul_rn(a, c), __fmul_rn(b, s));
}

// Elements 8 * chunk .. + 7 of the row at `src`, rotated to position `pos` when they lie in the first
// rotary_dim channels. Pairs: interleaved (2i, 2i + 1) with angle i; else (i, i + rotary_dim / 2) with
// angle i. rotary_dim is a multiple of 16, so a chunk is wholly in one half and its partner is one chunk.
__device__ __forceinline__ uint4 rotate_chunk(const AppendParams& p, const u16* src, int chunk, int pos) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src + 8 * chunk);
    if (p.rotary_cos == nullptr || 8 * chunk >= p.rotary_dim) return raw;
    const u16* cos_row = p.rotary_cos + pos * p.rotary_stride;
    const u16* sin_row = p.rotary_sin + pos * p.rotary_stride;
    float x[8], y[8];
    unpack8(raw, x);
    if (p.interleaved) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int angle = 4 * chunk + e;
            const float c = elem_t::to_float(cos_row[angle]), s = elem_t::to_float(sin_row[angle]);
            y[2 * e] = rot_minus(x[2 * e], c, x[2 * e + 1], s);
            y[2 * e + 1] = rot_plus(x[2 * e + 1], c, x[2 * e], s);
        }
    } else {
        const int half = p.rotary_dim / 2;
        const bool first = 8 * chunk < half;
        float partner[8];
        unpack8(*reinterpret_cast<const uint4*>(src + 8 * chunk + (first ? half : -half)), partner);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int angle = 8 * chunk + e - (first ? 0 : half);
            const float c = elem_t::to_float(cos_row[angle]), s = elem_t::to_float(sin_row[angle]);
            y[e] = first ? rot_minus(x[e], c, partner[e], s) : rot_plus(x[e], c, partner[e], s);
        }
    }
    return pack8(y);
}

extern "C" __global__ void __launch_bounds__(CUFLASH_THREADS) kv_append(const AppendParams p) {
    const i64 row = i64(blockIdx.x) * WARPS + threadIdx.x / 32;  // (b, j, kv_head) flattened
    const int lane = threadIdx.x % 32;
    if (row >= i64(p.batch) * p.seqlen_new * p.kv_heads || 8 * lane >= p.headdim) return;
    const int h = int(row % p.kv_heads), j = int((row / p.kv_heads) % p.seqlen_new);
    const int b = int(row / (i64(p.kv_heads) * p.seqlen_new));
    const int pos = p.cache_seqlens[b] + j;
    const i64 kc = cache_row_offset(p.page_table, p.page_table_stride, p.cache_batch_idx, p.page_size, b, pos,
                                    p.kc_batch_stride, p.kc_row_stride) + h * p.kc_head_stride;
    const i64 vc = cache_row_offset(p.page_table, p.page_table_stride, p.cache_batch_idx, p.page_size, b, pos,
                                    p.vc_batch_stride, p.vc_row_stride) + h * p.vc_head_stride;
    const u16* k_src = p.k_new + b * p.kn_batch_stride + j * p.kn_row_stride + h * p.kn_head_stride;
    const u16* v_src = p.v_new + b * p.vn_batch_stride + j * p.vn_row_stride + h * p.vn_head_stride;
    *reinterpret_cast<uint4*>(p.k_cache + kc + 8 * lane) = rotate_chunk(p, k_src, lane, pos);
    *reinterpret_cast<uint4*>(p.v_cache + vc + 8 * lane) = *reinterpret_cast<const uint4*>(v_src + 8 * lane);
}

extern "C" __global__ void __launch_bounds__(CUFLASH_THREADS) q_rotary(const AppendParams p) {
    const i64 row = i64(blockIdx.x) * WARPS + threadIdx.x / 32;  // (b, i, head) flattened
    const int lane = threadIdx.x % 32;
    if (row >= i64(p.batch) * p.seqlen_q * p.heads || 8 * lane >= p.headdim) return;
    const int h = int(row % p.heads), i = int((row / p.heads) % p.seqlen_q);
    const int b = int(row / (i64(p.heads) * p.seqlen_q));
    const int pos = p.cache_seqlens[b] + p.q_position_step * i;
    const u16* src = p.q + b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride;
    u16* dst = p.q_rot + b * p.qr_batch_stride + i * p.qr_row_stride + h * p.qr_head_stride;
    *reinterpret_cast<uint4*>(dst + 8 * lane) = rotate_chunk(p, src, lane, pos);
}
