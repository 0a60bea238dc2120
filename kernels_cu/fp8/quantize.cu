// FP8 quantisation of attention inputs (cuflash.fp8.quantize); sm_89 and newer (cvt ... e4m3x2).
//
//   x (batch, seqlen, heads, d) bf16/fp16  ->  data (batch, seqlen, heads, d) e4m3 bytes (OCP float8_e4m3fn)
//                                              descale (batch, heads, num_blocks) fp32
// A group is the `block` consecutive rows of one (batch entry, head) that share one scale. With the
// rotation (CUFLASH_HADAMARD=1) every row is first mapped to x diag(s) H_d / sqrt(d), H_d the Sylvester
// Hadamard matrix and s_i = +-1 a hash of (seed, i) (fp8/signs.cuh; cuflash.fp8.hadamard_signs computes
// the same signs on the host).
//
// Numerics. The rotation is a fast Walsh-Hadamard transform in fp32 of the un-normalised rows
// y = x diag(s) H_d (adds and subtractions only, strides 1, 2, ..., d/2 in that order), and the 1/sqrt(d)
// is folded into the scale. With a = max |y| over the group (NaN ignored):
//     data = e4m3_rn_satfinite(y * fp32(448 / a)),    descale = a * fp32(1 / (448 sqrt(d)))
// i.e. data = x_rot / descale with descale = max |x_rot| / 448 in exact arithmetic, one rounding less than
// normalising first at d = 128 (sqrt(128) is irrational). Without the rotation y = x and the factor is
// 1/448. A group of zeros (a == 0) gets descale 1 and data 0; a is raised to 2^-100 at least so that
// 448 / a stays finite in fp32 (only bf16 inputs can be that small).
//
// Work split. A CTA (8 warps) takes a tile of at most FP8_TILE_ROWS = 128 consecutive rows of one
// (batch, head); a warp takes whole rows, lane l holding elements E*l .. E*l + E - 1 (E = d / 32) in
// registers, so a row is one vector load per lane and the transform needs no shared memory.
//   * block <= 128 (the default 128, per-token block = 1, ...): pass FUSED, one launch. The tile is
//     tile_groups whole groups. Sweep 1 rotates every row and reduces |y| into a per-group amax in shared
//     memory (atomicMax on the bits: non-negative floats order like their bit patterns); then the tile
//     knows its scales, writes descale, and sweep 2 reads its rows again, rotates them again and converts.
//   * block > 128 (up to the whole sequence): a group spans several tiles, so two launches: pass AMAX runs
//     sweep 1 and merges the tile's amax into amax[group] in global memory (zeroed by the host), then pass
//     CONVERT reads the finished amax and runs sweep 2 (the group's first tile writes descale).
// Why sweep 2 recomputes the rotation instead of keeping it: a tile is at most 64 KB of input, still in L2
// when it is read again; keeping it would take 128 KB of fp32 per tile in shared memory or registers. The
// recomputation costs 5E shuffles per row (the cross-lane butterflies) and keeps every group size on one
// code path with E floats of row per lane.
//
// Compile-time constants: CUFLASH_HEADDIM (64, 128, 256), CUFLASH_DTYPE (0 bf16, 1 fp16),
// CUFLASH_HADAMARD (0 or 1). The pass, the block and the seed are run-time values.
#include "common/fp8.cuh"
#include "common/types.cuh"
#include "fp8/params.cuh"
#include "fp8/signs.cuh"

constexpr int D = CUFLASH_HEADDIM;
constexpr int E = D / 32;  // elements of a row per lane
constexpr int WARPS = CUFLASH_THREADS / 32;
constexpr int UNROLL = 4;            // rows a warp loads before it processes the first of them
constexpr float FP8_MAX = 448.f;     // the largest finite e4m3 value
constexpr float AMAX_FLOOR = 0x1p-100f;  // the least amax a group is scaled by (cuflash/fp8.py: AMAX_FLOOR)
static_assert(D == 64 || D == 128 || D == 256, "head dims 64, 128, 256");

// A lane's E input elements (2E bytes) move as one vector.
template <int BYTES> struct VecOf;
template <> struct VecOf<4> { typedef u32 type; };
template <> struct VecOf<8> { typedef uint2 type; };
template <> struct VecOf<16> { typedef uint4 type; };
typedef VecOf<2 * E>::type RowVec;

__device__ __forceinline__ void to_words(u32 v, u32 (&w)[1]) { w[0] = v; }
__device__ __forceinline__ void to_words(uint2 v, u32 (&w)[2]) { w[0] = v.x; w[1] = v.y; }
__device__ __forceinline__ void to_words(uint4 v, u32 (&w)[4]) { w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w; }

// The lane's E e4m3 bytes, as E/2 byte pairs (the first element in the low byte), stored as one vector.
__device__ __forceinline__ void store_fp8(u8* dst, const u16 (&h)[1]) { *reinterpret_cast<u16*>(dst) = h[0]; }
__device__ __forceinline__ void store_fp8(u8* dst, const u16 (&h)[2]) {
    *reinterpret_cast<u32*>(dst) = u32(h[0]) | u32(h[1]) << 16;
}
__device__ __forceinline__ void store_fp8(u8* dst, const u16 (&h)[4]) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(u32(h[0]) | u32(h[1]) << 16, u32(h[2]) | u32(h[3]) << 16);
}

// Bit e set: element E * lane + e is negated before the transform (fp8/signs.cuh).
__device__ __forceinline__ u32 lane_sign_bits(u32 key, int lane) {
    u32 bits = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) bits |= hadamard_sign_bit(key, u32(E * lane + e)) << e;
    return bits;
}

// v <- H_d v for the row the warp holds. Stage h (h = 1, 2, ..., d/2 in this order) maps each pair
// (i, i + h), bit h of i clear, to (v_i + v_{i+h}, v_i - v_{i+h}). Strides below E pair elements of one
// lane; stride h >= E pairs lane l with lane l ^ (h / E), the lower index being the lane with that bit clear.
__device__ __forceinline__ void fwht(float (&v)[E], int lane) {
#pragma unroll
    for (int h = 1; h < E; h *= 2) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            if (e & h) continue;
            const float lo = v[e], hi = v[e + h];
            v[e] = lo + hi;
            v[e + h] = lo - hi;
        }
    }
#pragma unroll
    for (int m = 1; m < 32; m *= 2) {
        const bool upper = lane & m;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float other = __shfl_xor_sync(0xffffffffu, v[e], m);
            v[e] = upper ? other - v[e] : v[e] + other;
        }
    }
}

// The lane's E values of y: the raw elements in fp32, sign-flipped and transformed with the rotation.
__device__ __forceinline__ void to_rotated(RowVec raw, u32 signs, int lane, float (&v)[E]) {
    u32 w[E / 2];
    to_words(raw, w);
#pragma unroll
    for (int i = 0; i < E / 2; ++i) {
        v[2 * i] = elem_t::to_float(u16(w[i] & 0xffffu));
        v[2 * i + 1] = elem_t::to_float(u16(w[i] >> 16));
    }
#if CUFLASH_HADAMARD
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = __uint_as_float(__float_as_uint(v[e]) ^ (((signs >> e) & 1u) << 31));
    fwht(v, lane);
#endif
}

// f(r, v) for the warp's rows r = row_begin + warp, + WARPS, ... < row_end in increasing order, v the lane's
// values of row r's y. UNROLL rows are loaded before the first is processed (loads in flight per warp).
// Every condition is warp-uniform, so the shuffles inside run on full warps.
template <class F>
__device__ __forceinline__ void for_each_row(const u16* x, i64 row_stride, int row_begin, int row_end, int warp,
                                             int lane, u32 signs, F&& f) {
    for (int r0 = row_begin + warp; r0 < row_end; r0 += WARPS * UNROLL) {
        RowVec raw[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int r = r0 + u * WARPS;
            if (r < row_end) raw[u] = *reinterpret_cast<const RowVec*>(x + r * row_stride);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int r = r0 + u * WARPS;
            if (r < row_end) {
                float v[E];
                to_rotated(raw[u], signs, lane, v);
                f(r, v);
            }
        }
    }
}

// 448 / a and the descale of a group whose max |y| is `amax` (see the top comment).
__device__ __forceinline__ void group_scale(float amax, float descale_per_amax, float& inv, float& descale) {
    if (amax == 0.f) {  // all zeros (or zeros and NaN): data 0 (NaN stays NaN), descale 1
        inv = 1.f;
        descale = 1.f;
        return;
    }
    const float a = fmaxf(amax, AMAX_FLOOR);  // +inf stays: inv 0, descale inf
    inv = __fdiv_rn(FP8_MAX, a);
    descale = __fmul_rn(a, descale_per_amax);
}

extern "C" __global__ void __launch_bounds__(CUFLASH_THREADS) fp8_quantize(const Fp8QuantParams p) {
    __shared__ u32 group_amax[FP8_TILE_ROWS];  // per group of the tile: the bits of max |y| (non-negative)
    __shared__ float group_inv[FP8_TILE_ROWS];  // ... and 448 / amax

    const int b = blockIdx.z, h = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const bool fused = p.pass == FP8_PASS_FUSED;

    // The tile: rows [row_begin, row_end) of (b, h), holding groups first_group .. first_group + groups - 1.
    int first_group, groups, row_begin, row_end, chunk = 0;
    if (fused) {
        first_group = blockIdx.x * p.tile_groups;
        groups = min(p.tile_groups, p.num_blocks - first_group);
        row_begin = first_group * p.block;
        row_end = min(p.seqlen, row_begin + groups * p.block);
    } else {
        first_group = blockIdx.x / p.chunks;
        chunk = blockIdx.x % p.chunks;
        groups = 1;
        row_begin = first_group * p.block + chunk * FP8_TILE_ROWS;
        row_end = min(min(p.seqlen, (first_group + 1) * p.block), row_begin + FP8_TILE_ROWS);
    }
    if (row_begin >= row_end) return;  // a chunk past the end of a short last group (before any barrier)

    const i64 group_index = (i64(b) * p.heads + h) * p.num_blocks + first_group;  // into descale and amax
    const u16* x = p.x + b * p.x_batch_stride + h * p.x_head_stride + E * lane;
    u8* data = p.data + (i64(b) * p.seqlen * p.heads + h) * D + E * lane;
    const i64 data_row_stride = i64(p.heads) * D;
    const u32 signs = CUFLASH_HADAMARD ? lane_sign_bits(p.sign_key, lane) : 0u;

    if (p.pass != FP8_PASS_CONVERT) {  // sweep 1: the amax of every group of the tile
        for (int t = threadIdx.x; t < groups; t += CUFLASH_THREADS) group_amax[t] = 0u;
        __syncthreads();
        // Each lane keeps the max of its elements over the warp's rows of the current group; the warp merges
        // it into shared memory when the group changes (the rows come in increasing order) and at the end.
        int current = -1;
        float lane_max = 0.f;
        auto merge = [&]() {
            float m = lane_max;
#pragma unroll
            for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            if (lane == 0) atomicMax(&group_amax[current], __float_as_uint(m));
        };
        for_each_row(x, p.x_row_stride, row_begin, row_end, warp, lane, signs, [&](int r, const float (&v)[E]) {
            const int g = p.tile_groups > 1 ? (r - row_begin) / p.block : 0;  // one group: no division
            if (g != current) {
                if (current >= 0) merge();
                current = g;
                lane_max = 0.f;
            }
#pragma unroll
            for (int e = 0; e < E; ++e) lane_max = fmaxf(lane_max, fabsf(v[e]));  // fmaxf drops NaN
        });
        if (current >= 0) merge();
        __syncthreads();
        if (p.pass == FP8_PASS_AMAX) {
            if (threadIdx.x == 0) atomicMax(p.amax + group_index, group_amax[0]);
            return;
        }
    }

    // The tile's scales: from shared memory (fused), or from the amax the AMAX pass finished (convert).
    for (int t = threadIdx.x; t < groups; t += CUFLASH_THREADS) {
        const float amax = __uint_as_float(fused ? group_amax[t] : p.amax[group_index]);
        float inv, descale;
        group_scale(amax, p.descale_per_amax, inv, descale);
        group_inv[t] = inv;
        if (chunk == 0) p.descale[group_index + t] = descale;
    }
    __syncthreads();

    // Sweep 2: the rows again, rotated again (the same arithmetic, so the same values), scaled and converted.
    for_each_row(x, p.x_row_stride, row_begin, row_end, warp, lane, signs, [&](int r, const float (&v)[E]) {
        const float inv = group_inv[p.tile_groups > 1 ? (r - row_begin) / p.block : 0];
        u16 pairs[E / 2];
#pragma unroll
        for (int i = 0; i < E / 2; ++i) pairs[i] = to_e4m3x2(__fmul_rn(v[2 * i], inv), __fmul_rn(v[2 * i + 1], inv));
        store_fp8(data + r * data_row_stride, pairs);
    });
}
