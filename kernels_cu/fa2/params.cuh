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
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    int batch, heads, kv_heads, seqlen_q, seqlen_k;
    int window_left, window_right;  // "unbounded" = seqlen_q + seqlen_k
    // Logits are scale * s, or softcap * tanh(scale * s / softcap) with softcap. The kernel keeps
    // raw scores r (s, or tanh(softcap_pre * s)) and exponentiates r * scale_log2 in base 2:
    float scale_log2;   // scale * log2(e), or softcap * log2(e) with softcap
    float softcap_pre;  // scale / softcap (used only by softcap variants)
};
