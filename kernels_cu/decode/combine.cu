// Merge of split attention results by their log-sum-exp: Flash-Decoding's second pass, and
// cuflash.flash_attn_combine. One warp per output row (batch entry, query, head):
//   lse = log sum_s exp(lse_s),   out = sum_s exp(lse_s - lse) * out_s
// The first SPLITS splits' partial rows (lanes over consecutive columns) are loaded together with the
// split LSEs (one per lane; max and sum of exponentials in one online pass), so at up to 16 splits and
// d <= 128 the merge waits for one round trip to L2 (on the H200 the kernel's time is its launch and
// dependency wait either way: 4.4 us alone at 16 splits, as with the three round trips it had before).
// A split with lse -inf has weight 0: its partial row may be read but is never multiplied (it may hold
// anything, NaN included); a row with every split at -inf gives out 0 and lse -inf.
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
constexpr int COLS = 4;     // columns per lane per pass over the splits: 128 columns per pass
constexpr int SPLITS = 16;  // splits whose partial rows are loaded at once
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

// exp2((x - base) log2 e), 0 for x = -inf (also when base is -inf: no NaN)
__device__ __forceinline__ float weight(float x, float base) {
    return x == neg_inf() ? 0.f : exp2f((x - base) * LOG2E);
}

// The partial rows of splits s0 .. s0 + SPLITS - 1, columns c0 + lane + 32 e (0 past the splits or columns).
__device__ __forceinline__ void load_splits(float (&x)[SPLITS][COLS], const float* o_s, i64 split_stride,
                                            int num_splits, int headdim, int s0, int c0, int lane) {
#pragma unroll
    for (int u = 0; u < SPLITS; ++u)
#pragma unroll
        for (int e = 0; e < COLS; ++e) {
            const int c = c0 + lane + 32 * e;
            x[u][e] = s0 + u < num_splits && c < headdim ? o_s[(s0 + u) * split_stride + c] : 0.f;
        }
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

    // The first pass's partial rows, in flight while the LSEs below are read.
    float x[SPLITS][COLS];
    load_splits(x, o_s, p.op_split_stride, p.num_splits, p.headdim, 0, 0, lane);

    // Max and sum of exponentials of the split LSEs, lane-strided and online; lane s keeps split s's LSE
    // (the weights of the first 32 splits then come by shuffle, the rest are read again).
    const float own = lane < p.num_splits ? lse_s[lane * p.lp_split_stride] : neg_inf();
    float mx = own, total = own == neg_inf() ? 0.f : 1.f;
    for (int s = lane + 32; s < p.num_splits; s += 32) {
        const float l = lse_s[s * p.lp_split_stride];
        if (l > mx) total = total * weight(mx, l) + 1.f, mx = l;
        else total += weight(l, mx);
    }
    const float base = warp_max(mx);  // -inf when every split is empty: every weight is 0 then
    total = warp_sum(total * weight(mx, base));
    const float inv = total > 0.f ? 1.f / total : 0.f;

    const i64 out_row = b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
    for (int c0 = 0; c0 < p.headdim; c0 += 32 * COLS) {
        float acc[COLS] = {};
        for (int s0 = 0; s0 < p.num_splits; s0 += SPLITS) {
            if (c0 > 0 || s0 > 0) load_splits(x, o_s, p.op_split_stride, p.num_splits, p.headdim, s0, c0, lane);
#pragma unroll
            for (int u = 0; u < SPLITS; ++u) {
                const int s = s0 + u;  // the same in every lane
                if (s >= p.num_splits) break;
                const float l = s < 32 ? __shfl_sync(0xffffffffu, own, s) : lse_s[s * p.lp_split_stride];
                const float w = weight(l, base) * inv;
#pragma unroll
                for (int e = 0; e < COLS; ++e) acc[e] += w != 0.f ? w * x[u][e] : 0.f;  // select: x may be NaN
            }
        }
#pragma unroll
        for (int e = 0; e < COLS; ++e) {
            const int c = c0 + lane + 32 * e;
            if (c < p.headdim) store(p.o, out_row + c, acc[e]);
        }
    }
    if (lane == 0) p.lse[(i64(b) * p.heads + h) * p.seqlen + i] = total > 0.f ? base + logf(total) : neg_inf();
}
