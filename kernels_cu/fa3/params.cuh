// Parameters of the FA3 forward besides its tensor maps (which carry q, k, v and their strides); the
// backward's are in fa3/bwd_params.cuh. cuflash/fa3.py mirrors each struct as a numpy structured dtype
// (align=True).
#pragma once
#include "../common/tile_scheduler.cuh"
#include "../common/types.cuh"

struct Fa3FwdParams {
    u16* o;
    float* lse;
    const int* cu_seqlens_q;  // CUFLASH_VARLEN: (batch + 1) row offsets of the packed sequences
    const int* cu_seqlens_k;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 row_batch_stride, row_head_stride;  // of the LSE: (batch, heads, seqlen_q), or (heads, total_q)
    int batch, heads, kv_heads, seqlen_q, seqlen_k;  // the longest lengths when CUFLASH_VARLEN
    int window_left, window_right;  // "unbounded" = seqlen_k (left), seqlen_q (right)
    float scale_log2;               // logit -> log2 units (cuflash/_params.logit_scales)
    float softcap_pre;              // scale / softcap (CUFLASH_SOFTCAP variants only)
    // CUFLASH_FP8 only: descale factors, contiguous fp32. Query row i of head h (batch b) uses
    // q_descale[(b heads + h) q_descale_blocks + i / q_descale_rows]; K/V tile n of KV head hk uses
    // k_descale / v_descale[(b kv_heads + hk) kv_descale_blocks + n / kv_descale_tiles].
    const float* q_descale;
    const float* k_descale;
    const float* v_descale;
    int q_descale_blocks, q_descale_rows, kv_descale_blocks, kv_descale_tiles;
    int sched_section, sched_serpentine;  // the persistent scheduler's order (cuflash/tile_order.py)
    TileOrderDivisors sched_div;          // its divisors (common/tile_scheduler.cuh; cuflash/fa3.py fill_schedule)
    int row_shift;  // query rows of the first query block before row 0 (fa3/fwd.cu; cuflash/fa3.py fill_schedule)
    // The stream-K tail (common/tile_scheduler.cuh TailSplit; tail_units 0: none): a piece that is not its
    // tile's last leaves O, the row maxima and sums in its slot of tail_partials (per slot and consumer
    // warpgroup 128 threads x (OD / 8 + 1) float4, fa3/fwd.cu save_partial) and sets the slot's flag to
    // tail_tag, which the merging block resets to 0 (so a captured graph replays with the same tag).
    int tail_start, tail_units, tail_k_blocks, tail_slots;
    float* tail_partials;
    u64* tail_flags;  // per slot and consumer warpgroup
    u64 tail_tag;     // this call's: a flag left over from another call never holds it
};
