// Where a batch entry's rows live, for fixed-length and variable-length (packed) batches.
//
// Fixed length: q is (batch, seqlen_q, heads, d) and rows of entry b start at b * batch_stride.
// Variable length: q is (total_q, heads, d) packed, entry b owns rows [cu_q[b], cu_q[b + 1]); the
// launcher passes batch strides of 0 and the kernels add cu_q[b] rows. Per-row fp32 arrays (LSE, D,
// the dQ accumulator) are indexed by b * row_batch_stride + h * row_head_stride + (first row) + i:
// (batch, heads, seqlen_q) for fixed length, (heads, total_q) for variable length.
#pragma once
#include "types.cuh"

struct SeqInfo {
    int seqlen_q, seqlen_k;  // this entry's lengths
    int q_start, k_start;    // its first row in the packed layout (0 for fixed length)

    __device__ __forceinline__ SeqInfo(const int* cu_q, const int* cu_k, int b, int max_seqlen_q, int max_seqlen_k) {
        if (cu_q != nullptr) {
            q_start = cu_q[b];
            seqlen_q = cu_q[b + 1] - q_start;
            k_start = cu_k[b];
            seqlen_k = cu_k[b + 1] - k_start;
        } else {
            q_start = k_start = 0;
            seqlen_q = max_seqlen_q;
            seqlen_k = max_seqlen_k;
        }
    }
};
