// Kernel parameter structs of the FA2 family, passed by value. cuflash/fa2.py mirrors them field by
// field as numpy structured dtypes (align=True): keep the order and types in step.
// Strides are in elements and 64-bit.
#pragma once
#include "../common/types.cuh"

struct Fa2FwdParams {
    const u16* q;
    const u16* k;
    const u16* v;
    u16* o;
    float* lse;                 // (batch, heads, seqlen_q), contiguous
    const float* alibi_slopes;  // (heads,) when the variant has ALiBi
    const int* cu_seqlens_q;    // (batch + 1,) for variable-length batches, else null (common/seqlen.cuh)
    const int* cu_seqlens_k;
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 row_batch_stride, row_head_stride;  // of the per-row fp32 arrays (LSE)
    int batch, heads, kv_heads, seqlen_q, seqlen_k;  // seqlens: the maxima for variable length
    int window_left, window_right;  // "unbounded" = seqlen_k (left), seqlen_q (right)
    // Logits are scale * s, or softcap * tanh(scale * s / softcap) with softcap. The kernel keeps
    // raw scores r (s, or tanh(softcap_pre * s)) and exponentiates r * scale_log2 in base 2:
    float scale_log2;   // scale * log2(e), or softcap * log2(e) with softcap
    float softcap_pre;  // scale / softcap (used only by softcap variants)
    u32 dropout_seed_lo, dropout_seed_hi, dropout_offset, dropout_threshold;  // common/philox.cuh
    float dropout_scale;                                                     // 1 / (1 - p)
};

// The passes before and after the main backward kernel (D = rowsum(dO o O), dQ conversion) are
// common/bwd_aux.cu.
struct Fa2BwdParams {
    const u16* q;
    const u16* k;
    const u16* v;
    const u16* dout;
    float* dq_accum;  // (batch, heads, seqlen_q, headdim) fp32, zeroed by bwd_preprocess
    u16* dk;
    u16* dv;
    const float* lse;           // (batch, heads, seqlen_q), natural log
    const float* dsum;          // D = rowsum(dO * O), (batch, heads, seqlen_q)
    const float* alibi_slopes;  // (heads,) when the variant has ALiBi
    int* dq_semaphore;          // (batch, heads, Q blocks), zeroed, for the deterministic variant
    const int* cu_seqlens_q;    // (batch + 1,) for variable-length batches, else null (common/seqlen.cuh)
    const int* cu_seqlens_k;
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 do_batch_stride, do_row_stride, do_head_stride;
    i64 dk_batch_stride, dk_row_stride, dk_head_stride;
    i64 dv_batch_stride, dv_row_stride, dv_head_stride;
    i64 row_batch_stride, row_head_stride;  // of the per-row fp32 arrays (LSE, D, dQ accumulator rows)
    int batch, heads, kv_heads, seqlen_q, seqlen_k;  // seqlens: the maxima for variable length
    int window_left, window_right;
    float scale_log2;   // as in the forward
    float softcap_pre;  // as in the forward
    float scale;        // softmax scale: dK = scale * dS^T Q (dQ gets it on conversion)
    u32 dropout_seed_lo, dropout_seed_hi, dropout_offset, dropout_threshold;  // as in the forward
    float dropout_scale;
};
