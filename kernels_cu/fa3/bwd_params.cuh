// Parameters of the FA3 backward besides its tensor maps (fa3/params.cuh has the forward's); cuflash/fa3.py
// mirrors the struct as a numpy structured dtype (align=True). (A file of its own: a change here does not
// touch the forward's kernels.)
#pragma once
#include "../common/types.cuh"

struct Fa3BwdParams {
    // LSE, D and dQ reach the kernel through tensor maps (cuflash/fa3.py: backward)
    const int* cu_seqlens_q;  // CUFLASH_VARLEN: (batch + 1) row offsets of the packed sequences
    const int* cu_seqlens_k;
    u16* dk;
    u16* dv;
    i64 dk_batch_stride, dk_row_stride, dk_head_stride;
    i64 dv_batch_stride, dv_row_stride, dv_head_stride;
    i64 row_batch_stride, row_head_stride;  // of the padded LSE / D rows (bwd.cu: lse_row0)
    int batch, heads, kv_heads, seqlen_q, seqlen_k;  // the longest lengths when CUFLASH_VARLEN
    int window_left, window_right;  // "unbounded" = seqlen_k (left), seqlen_q (right)
    float scale_log2;               // logit -> log2 units (cuflash/_params.logit_scales)
    float softcap_pre;              // scale / softcap (CUFLASH_SOFTCAP variants only)
    float scale;                    // softmax scale (dK = scale * dS^T Q)
    // Deterministic mode: (batch, heads, q_blocks, dQ atoms) zeroed counters; each K block adds its dQ share
    // of a Q block when the counter says it is its turn (null: adds in any order).
    int* dq_semaphore;
    // Deterministic mode: K block n adds into dQ accumulator plane n mod 2^dq_plane_shift (bwd_roles.cuh
    // dq_turn), each plane in descending K-block order with counters of its own (dq_plane_flags counters
    // apart); a plane is dq_plane_heads entries further along the dQ map's third coordinate. Shift 0: one plane.
    int dq_plane_shift, dq_plane_flags, dq_plane_heads;
    int highest_first;  // launch the K blocks highest first (deterministic mode must; cuflash/heuristics.py)
    // Deterministic mode without a mask bounding the rows, every K block of a head resident at once: the
    // rotated dQ order (common/dq_order.cuh), set by cuflash/fa3.py.
    int rotate_q_blocks;
    // Query rows of the first Q block before row 0 (fa3/bwd_roles.cuh row_shift_of; fa3/bwd.cu only, 0 for
    // fa3/bwd_wide.cu and packed batches; cuflash/fa3.py backward).
    int row_shift;
};
