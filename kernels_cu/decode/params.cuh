// Kernel parameter structs of the decode family (flash_attn_with_kvcache), passed by value.
// cuflash/decode.py mirrors them field by field as numpy structured dtypes (align=True): keep the order
// and types in step. Strides are in elements and 64-bit.
#pragma once
#include "../common/types.cuh"

// Where logical key j of batch entry b lives in a cache (k_cache or v_cache):
//   contiguous: row j of cache entry cb = cache_batch_idx ? cache_batch_idx[b] : b
//               -> cb * batch_stride + j * row_stride
//   paged:      row j % page_size of page page_table[b * page_table_stride + j / page_size]
//               -> page * batch_stride + (j % page_size) * row_stride    (batch_stride = page stride)
// plus kv_head * head_stride. Per-entry key count: cache_seqlens[b] + seqlen_new (the new tokens were
// appended by kv_append before the attention kernel runs).

struct DecodeParams {
    const u16* q;  // (batch, seqlen_q, heads, d), already rotated when the call has rotary
    const u16* k;  // k_cache
    const u16* v;  // v_cache
    u16* o;        // (batch, seqlen_q, heads, d): written when num_splits == 1
    float* lse;    // (batch, heads, seqlen_q) contiguous: written when num_splits == 1
    float* o_partial;    // (num_splits, batch, seqlen_q, heads, d) fp32 contiguous: num_splits > 1
    float* lse_partial;  // (num_splits, batch, heads, seqlen_q) fp32 contiguous: num_splits > 1
    const int* cache_seqlens;    // (batch,)
    const int* page_table;       // (batch, max_pages) for paged variants
    const int* cache_batch_idx;  // (batch,) or null (contiguous variants)
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;  // batch stride = page stride when paged
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 page_table_stride;  // elements between page_table rows
    int batch, heads, kv_heads, seqlen_q, seqlen_new;
    int page_size;             // paged: rows per page (any value >= 1)
    int num_splits, m_blocks;  // grid.x = num_splits * m_blocks
    int window_left, window_right;  // "unbounded" = the cache capacity (left), seqlen_q (right)
    // As in the FA2 forward: raw scores r (s, or tanh(softcap_pre * s) with softcap) are exponentiated
    // as 2^(r * scale_log2 - max).
    float scale_log2;   // scale * log2(e), or softcap * log2(e) with softcap
    float softcap_pre;  // scale / softcap; 0 = no softcap (a run-time switch: decode is memory-bound)
};

struct AppendParams {
    const u16* k_new;  // (batch, seqlen_new, kv_heads, d)
    const u16* v_new;
    u16* k_cache;
    u16* v_cache;
    const u16* q;      // (batch, seqlen_q, heads, d)
    u16* q_rot;        // like q: q rotated (null when the call has no rotary)
    const u16* rotary_cos;  // (seqlen_ro, rotary_dim / 2), rows rotary_stride apart; null = no rotary
    const u16* rotary_sin;
    const int* cache_seqlens;
    const int* page_table;       // null for a contiguous cache
    const int* cache_batch_idx;  // null = identity
    i64 kn_batch_stride, kn_row_stride, kn_head_stride;
    i64 vn_batch_stride, vn_row_stride, vn_head_stride;
    i64 kc_batch_stride, kc_row_stride, kc_head_stride;
    i64 vc_batch_stride, vc_row_stride, vc_head_stride;
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 qr_batch_stride, qr_row_stride, qr_head_stride;
    i64 page_table_stride, rotary_stride;
    int batch, seqlen_new, seqlen_q, heads, kv_heads, headdim, rotary_dim, page_size;
    int q_position_step;  // q token i is rotated at cache_seqlens[b] + q_position_step * i
    int interleaved;      // 1: GPT-J pairs (2i, 2i+1); 0: GPT-NeoX pairs (i, i + rotary_dim / 2)
};

// Element offset of logical key j of entry b in a cache with the given strides (see the top comment).
__device__ __forceinline__ i64 cache_row_offset(const int* page_table, i64 page_table_stride, const int* cache_batch_idx,
                                                int page_size, int b, int j, i64 batch_stride, i64 row_stride) {
    if (page_table != nullptr) {
        const i64 page = page_table[b * page_table_stride + j / page_size];
        return page * batch_stride + i64(j % page_size) * row_stride;
    }
    const i64 cb = cache_batch_idx != nullptr ? cache_batch_idx[b] : b;
    return cb * batch_stride + i64(j) * row_stride;
}
