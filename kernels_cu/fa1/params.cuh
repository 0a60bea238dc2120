// Kernel parameter structs of the FA1 family, passed by value. cuflash/fa1.py mirrors them field by
// field as numpy structured dtypes (align=True), so keep the order and types in step.
// Strides are in elements and 64-bit: batch * seqlen * heads * headdim can pass 2^31.
#pragma once
#include "../common/types.cuh"

struct Fa1FwdParams {
    const u16* q;
    const u16* k;
    const u16* v;
    u16* o;
    float* lse;  // (batch, heads, seqlen_q), contiguous
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    int batch, heads, kv_heads, seqlen_q, seqlen_k;
    int window_left, window_right;  // "unbounded" = seqlen_k (left), seqlen_q (right)
    float scale;                    // softmax scale
};

// The passes before and after the main backward kernel (D = rowsum(dO o O), dQ conversion) are
// common/bwd_aux.cu.
struct Fa1BwdParams {
    const u16* q;
    const u16* k;
    const u16* v;
    const u16* dout;
    float* dq_accum;  // (batch, heads, seqlen_q, headdim) fp32, summed by atomics, scaled on conversion
    u16* dk;
    u16* dv;
    const float* lse;   // (batch, heads, seqlen_q)
    const float* dsum;  // D = rowsum(dO * O), (batch, heads, seqlen_q)
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 do_batch_stride, do_row_stride, do_head_stride;
    i64 dk_batch_stride, dk_row_stride, dk_head_stride;
    i64 dv_batch_stride, dv_row_stride, dv_head_stride;
    int batch, heads, kv_heads, seqlen_q, seqlen_k;
    int window_left, window_right;
    float scale;
};
