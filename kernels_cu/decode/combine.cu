// Merge of split attention results by their log-sum-exp: Flash-Decoding's second pass, and
// cuflash.flash_attn_combine. One warp per output row (batch entry, query, head):
//   lse = log sum_s exp(lse_s),   out = sum_s exp(lse_s - lse) * out_s
// in a pass over the row's split LSEs for the maximum, one for the sum of exponentials, and one over
// the partial rows (lanes over consecutive columns: each split's row is read in 128-byte pieces, eight
// splits' loads in flight at once). A
// split with lse -inf has weight 0 and its partial row is never read (it may hold anything); a row with
// every split at -inf gives out 0 and lse -inf.
// After decode/fwd.cu on sm_90+ this kernel is launched as the split kernel's programmatic dependent
// (cuflash.decode.forward): its blocks may be resident before the partials are written, and wait for
// them in grid_dependency_wait(), which returns at once when it was launched normally
// (cuflash.flash_attn_combine).
// Compile-time constant: CUFLASH_OUT_DTYPE (0 bf16, 1 fp16, 2 fp32). Head dim and split count are
// run-time values (any).
#include "common/ptx.cuh"
#include "common/types.cuh"

struct CombineParams {
    const float* o_partial;    // (num_splits, batch, seqlen, heads, headdim), headdim contiguous
    const float* lse_partial;  // (num_splits, batch, heads, seqlen)
    void* o;                   // (batch, seqlen, heads, headdim) in the output dtype
    float* lse;                // (batch, heads, seqlen), contiguous
    i64 op_split_stride, op_batch_stride, op_row_stride, op_head_stride;
    i64 lp_split_stride, lp_batch_stride, lp_head_stride, lp_row_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    int num_splits, batch, seqlen, heads, headdim;
};

constexpr int WARPS = CUFLASH_THREADS / 32;
constexpr int COLS = 4;    // columns per lane per pass over the splits: 128 columns per pass
constexpr int SPLITS = 8;  // splits whose partial rows are loaded at once
constexpr float LOG2E = 1.44269504088896341f;

__device__ __forceinline__ void store(void* o, i64 idx, float x) {
#if CUFLASH_OUT_DTYPE == 2
    static_cast<float*>(o)[idx] = x;
#elif CUFLASH_OUT_DTYPE == 1
    static_cast<u16*>(o)[idx] = fp16_t::from_float(x);
#else
    static_cast<u16*>(o)[idx] = bf16_t::from_float(x);
#endif
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

extern "C" __global__ void __launch_bounds__(CUFLASH_THREADS) attn_combine(const CombineParams p) {
    const i64 row = i64(blockIdx.x) * WARPS + threadIdx.x / 32;  // (b, i, h) flattened
    const int lane = threadIdx.x % 32;
    if (row >= i64(p.batch) * p.seqlen * p.heads) return;
    const int h = int(row % p.heads), i = int((row / p.heads) % p.seqlen);
    const int b = int(row / (i64(p.heads) * p.seqlen));
    const float* lse_s = p.lse_partial + b * p.lp_batch_stride + h * p.lp_head_stride + i * p.lp_row_stride;
    const float* o_s = p.o_partial + b * p.op_batch_stride + i * p.op_row_stride + h * p.op_head_stride;
    grid_dependency_wait();  // the split kernel has completed: its partials are written and visible

    float mx = neg_inf();
    for (int s = lane; s < p.num_splits; s += 32) mx = fmaxf(mx, lse_s[s * p.lp_split_stride]);
    mx = warp_max(mx);
    const float base = mx == neg_inf() ? 0.f : mx;  // every split empty: weights are all 0
    float total = 0.f;
    for (int s = lane; s < p.num_splits; s += 32) {
        const float x = lse_s[s * p.lp_split_stride];
        total += x == neg_inf() ? 0.f : exp2f((x - base) * LOG2E);
    }
    total = warp_sum(total);
    const float inv = total > 0.f ? 1.f / total : 0.f;

    // The partial rows, SPLITS splits per pass: their LSEs, then their values, are loaded together so a
    // pass waits for two round trips to L2 instead of two per split (one warp per row: the row's latency
    // is the kernel's, e.g. 33 splits at batch 1).
    const i64 out_row = b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
    for (int c0 = 0; c0 < p.headdim; c0 += 32 * COLS) {
        float acc[COLS] = {};
        for (int s0 = 0; s0 < p.num_splits; s0 += SPLITS) {
            float w[SPLITS], x[SPLITS][COLS];
#pragma unroll
            for (int u = 0; u < SPLITS; ++u) {  // the same address in every lane: broadcast loads
                const float l = s0 + u < p.num_splits ? lse_s[(s0 + u) * p.lp_split_stride] : neg_inf();
                w[u] = l == neg_inf() ? 0.f : exp2f((l - base) * LOG2E) * inv;
            }
#pragma unroll
            for (int u = 0; u < SPLITS; ++u) {
                const float* src = o_s + (s0 + u) * p.op_split_stride;
#pragma unroll
                for (int e = 0; e < COLS; ++e) {
                    const int c = c0 + lane + 32 * e;
                    x[u][e] = w[u] != 0.f && c < p.headdim ? src[c] : 0.f;  // a -inf split is never read
                }
            }
#pragma unroll
            for (int u = 0; u < SPLITS; ++u)
#pragma unroll
                for (int e = 0; e < COLS; ++e) acc[e] += w[u] * x[u][e];
        }
#pragma unroll
        for (int e = 0; e < COLS; ++e) {
            const int c = c0 + lane + 32 * e;
            if (c < p.headdim) store(p.o, out_row + c, acc[e]);
        }
    }
    if (lane == 0) p.lse[(i64(b) * p.heads + h) * p.seqlen + i] = total > 0.f ? base + logf(total) : neg_inf();
}
