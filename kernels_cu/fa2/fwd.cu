// FA2-style attention forward (FlashAttention-2's work split on mma.sync tensor cores).
//
// Grid: (Q blocks, heads, batch); heavy causal blocks (the last rows see the most keys) launch first.
// A block's WARPS warps each own MT consecutive 16-row m-tiles of the BLOCK_M query rows, so no
// reduction ever crosses warps. Per K/V tile:
//   - the next K (then V) tile streams into the other half of a two-stage shared-memory ring with
//     cp.async while this tile is computed; or (CUFLASH_KV_STAGES 1, wide head dims) K and V have one
//     buffer each, half the shared memory, so two blocks share an SM: V streams in during S = Q K^T and
//     the next K during the softmax and P V (FlashAttention-2's own schedule);
//   - S = Q K^T (mma.sync m16n8k16, fp32 accumulation), each K fragment feeding MT m-tiles;
//   - online softmax in base 2 with the scale folded into one FMA per score: p = 2^(s*c - m*c);
//     O is rescaled only when a row max moves, and divided by the row sum once, at the end;
//   - O += P V with P taken straight from the S registers as the A operand.
// Tiles are XOR-swizzled in shared memory (padded when the head dim is not a multiple of 64), so
// ldmatrix runs without bank conflicts. Masks: causal (bottom-right), sliding window; only tiles
// that cross a mask edge pay for per-element checks; tiles with nothing visible are never loaded.
//
// Compile-time constants (cuflash/fa2.py): CUFLASH_HEADDIM, CUFLASH_BLOCK_M, CUFLASH_BLOCK_N,
// CUFLASH_BLOCK_N_COMPUTE, CUFLASH_WARPS, CUFLASH_KV_STAGES (1/2, default 2),
// CUFLASH_DTYPE, CUFLASH_SOFTCAP (0/1), CUFLASH_ALIBI (0/1),
// CUFLASH_DROPOUT (0/1: P is dropped after the row sums, so the softmax normalisation is the
// undropped one, as in FlashAttention), CUFLASH_Q_REGS (0/1, default 0: Q fragments in registers).
#include "common/mask.cuh"
#include "common/philox.cuh"
#include "common/ptx.cuh"
#include "common/seqlen.cuh"
#include "common/tile.cuh"
#include "fa2/params.cuh"

#ifndef CUFLASH_Q_REGS
#define CUFLASH_Q_REGS 0
#endif
#ifndef CUFLASH_KV_STAGES
#define CUFLASH_KV_STAGES 2
#endif

constexpr int D = CUFLASH_HEADDIM;
constexpr int BM = CUFLASH_BLOCK_M;
constexpr int BN = CUFLASH_BLOCK_N;          // keys per K/V tile in shared memory (one load, one barrier pair)
constexpr int KN = CUFLASH_BLOCK_N_COMPUTE;  // keys per S/softmax/PV step (bounds the S registers)
constexpr int WARPS = CUFLASH_WARPS;
constexpr int MT = BM / (16 * WARPS);  // 16-row m-tiles per warp
constexpr int THREADS = WARPS * 32;
constexpr bool SOFTCAP = CUFLASH_SOFTCAP;
constexpr bool ALIBI = CUFLASH_ALIBI;
constexpr bool DROPOUT = CUFLASH_DROPOUT;
constexpr bool Q_REGS = CUFLASH_Q_REGS;  // Q's A fragments held in registers for the whole block (see QOperand)
static_assert(THREADS == CUFLASH_THREADS, "launcher and kernel disagree on the block size");
static_assert(MT * 16 * WARPS == BM && D % 16 == 0 && KN % 16 == 0 && BN % KN == 0,
              "tiles are made of 16x16 mma blocks");
constexpr int KV_STAGES = CUFLASH_KV_STAGES;  // K / V buffers each: 2 = a ring, 1 = refilled as freed
static_assert(KV_STAGES == 2 || (KV_STAGES == 1 && KN == BN), "one K/V buffer: the whole tile per step");

struct Smem {
    FastSmemTile<BM, D> q;
    FastSmemTile<BN, D> k[KV_STAGES];
    FastSmemTile<BN, D> v[KV_STAGES];
};

typedef float Frag[4];  // one m16n8 fp32 accumulator fragment

typedef LdsmAddr<BM, D, (D % 64 == 0)> QAddr;
typedef LdsmAddr<BN, D, (D % 64 == 0)> KVAddr;
constexpr u32 KV_STAGE_BYTES = sizeof(FastSmemTile<BN, D>);

// 16-byte cp.async to a shared address already in the shared window; src_bytes < 16 zero-fills the rest.
__device__ __forceinline__ void cp_async_16_at(u32 smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem), "r"(src_bytes));
}

// cp.async of a whole tile with a compile-time trip count. The common load_tile_async loop starts at
// threadIdx.x, so ptxas keeps it a run-time loop (plus a remainder loop) that pays ~25 integer
// instructions per 16-byte chunk: a signed division, a 64-bit multiply and the swizzle, for every chunk
// of every K and V tile (~220 per thread per 32-key tile at d = 128: more issue slots than the tile's
// MMAs leave free). Here each thread owns one 16-byte column chunk and walks rows STEP = THREADS / CHUNKS
// apart: one cp.async, one row test, two selects and one 64-bit pointer add per chunk. The swizzle
// depends on row % 8 only, so the destination of step `it` is that of step it % PERIOD plus a constant
// (an immediate offset). Same copy as bwd.cu's load_tile_unrolled, generalised to STEP < 8 (d = 256).
// Tiles whose chunk count does not divide the block (d = 96, 192) keep the common loop.
// One K / V buffer and two m-tiles per warp (d = 128 on sm_90, 128 x 64 tiles): the loop needs all 255
// registers, and ptxas spilled what the copies keep per thread across it (a 64-bit row offset per K and per
// V stride, a destination per tile). Then each thread's first element of a K and of a V tile (r0 row_stride
// + c) is read from shared memory at each copy (`lane_offset`), and the destinations share one offset.
constexpr bool LANE_OFFSETS_IN_SMEM = KV_STAGES == 1 && MT >= 2;

template <int ROWS, int COLS, bool SW>
__device__ __forceinline__ void load_tile(SmemTile<ROWS, COLS, SW>& tile, const u16* src, i64 row_stride,
                                          int rows_valid, const i64* lane_offset = nullptr) {
    constexpr int CHUNKS = COLS / 8;
    constexpr int STEP = THREADS / CHUNKS;  // rows between one thread's chunks (when CHUNKS divides THREADS)
    if constexpr (THREADS % CHUNKS != 0 || (SW && STEP % 8 != 0 && 8 % STEP != 0)) {
        load_tile_async<THREADS>(tile, src, row_stride, rows_valid);
    } else {
        constexpr int STEPS = (ROWS + STEP - 1) / STEP;
        constexpr int PERIOD = (!SW || STEP % 8 == 0) ? 1 : 8 / STEP;  // steps until the swizzle repeats
        constexpr u32 ROW_BYTES = SmemTile<ROWS, COLS, SW>::PITCH * 2;
        const int r0 = threadIdx.x / CHUNKS, c = (threadIdx.x % CHUNKS) * 8;
        u32 dst[PERIOD];
#pragma unroll
        for (int i = 0; i < PERIOD; ++i) {
            if constexpr (LANE_OFFSETS_IN_SMEM)  // (the tile's base plus an offset that every K / V tile shares)
                dst[i] = smem_addr(tile.data) +
                         u32(reinterpret_cast<char*>(tile.at(r0 + i * STEP, c)) - reinterpret_cast<char*>(tile.data));
            else
                dst[i] = smem_addr(tile.at(r0 + i * STEP, c));
        }
        const u16* s = src + (lane_offset ? *lane_offset : r0 * row_stride + c);
        const i64 step_stride = STEP * row_stride;
#pragma unroll
        for (int it = 0; it < STEPS; ++it) {
            const int r = r0 + it * STEP;
            if (ROWS % STEP != 0 && r >= ROWS) break;
            const bool in = r < rows_valid;  // rows past the end read nothing and become zeros
            cp_async_16_at(dst[it % PERIOD] + (it / PERIOD) * PERIOD * STEP * ROW_BYTES, in ? s : src, in ? 16 : 0);
            s += step_stride;
        }
    }
}

// The A operand of S = Q K^T (the warp's own MT x 16 rows of Q). Re-read from shared memory with ldmatrix
// for every K/V tile, or (IN_REGS) read once per block and kept in MT * D / 4 registers: that removes
// MT * D / 16 of the tile's ldmatrix.x4 (a fifth of them at d = 64, BLOCK_N = 64) where registers allow.
template <bool IN_REGS>
struct QOperand {
    QAddr addr;
    __device__ __forceinline__ QOperand(const QAddr& a) : addr(a) {}
    __device__ __forceinline__ void load() {}
    __device__ __forceinline__ void get(u32 (&a)[4], int mt, int kk) const { ldmatrix_x4_at(a, addr.at(mt * 16, kk)); }
};
template <>
struct QOperand<true> {
    u32 frag[MT][D / 16][4];
    QAddr addr;
    __device__ __forceinline__ QOperand(const QAddr& a) : addr(a) {}
    // After the Q tile has landed (cp.async wait + barrier).
    __device__ __forceinline__ void load() {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < D; kk += 16) ldmatrix_x4_at(frag[mt][kk / 16], addr.at(mt * 16, kk));
    }
    __device__ __forceinline__ void get(u32 (&a)[4], int mt, int kk) const {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = frag[mt][kk / 16][i];
    }
};

// S[mt] (16 x KN) = Q[rows of m-tile mt] K[keys n0 .. n0+KN)^T for the warp's MT m-tiles. `q` holds or
// addresses the warp's own rows; `k` the K tile of stage 0, `k_stage` the byte offset of this tile's stage.
__device__ __forceinline__ void qk_product(const QOperand<Q_REGS>& q, const KVAddr& k, u32 k_stage, int n0,
                                           Frag (&s)[MT][KN / 8]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < KN / 8; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) q.get(a[mt], mt, kk);
#pragma unroll
        for (int nn = 0; nn < KN; nn += 16) {
            u32 b[4];
            ldmatrix_x4_at(b, k.at(n0 + nn, kk) + k_stage);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816<elem_t>(s[mt][nn / 8], a[mt], {b[0], b[1]});
                mma_16816<elem_t>(s[mt][nn / 8 + 1], a[mt], {b[2], b[3]});
            }
        }
    }
}

// O[mt] (16 x D) += P[mt] V[keys n0 .. n0+KN). P stays in the fp32 S registers until each 16-key step
// packs it into a 16-bit A fragment (the C fragments of two adjacent 8-key tiles), so no second copy
// of P is live.
__device__ __forceinline__ void pv_product(const KVAddr& v, u32 v_stage, int n0, const Frag (&p)[MT][KN / 8],
                                           Frag (&o)[MT][D / 8]) {
#pragma unroll
    for (int kk = 0; kk < KN; kk += 16) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const float* c0 = p[mt][kk / 8];
            const float* c1 = p[mt][kk / 8 + 1];
            a[mt][0] = elem_t::pack2(c0[0], c0[1]);
            a[mt][1] = elem_t::pack2(c0[2], c0[3]);
            a[mt][2] = elem_t::pack2(c1[0], c1[1]);
            a[mt][3] = elem_t::pack2(c1[2], c1[3]);
        }
#pragma unroll
        for (int dd = 0; dd < D; dd += 16) {
            u32 b[4];
            ldmatrix_x4_trans_at(b, v.at(n0 + kk, dd) + v_stage);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816<elem_t>(o[mt][dd / 8], a[mt], {b[0], b[1]});
                mma_16816<elem_t>(o[mt][dd / 8 + 1], a[mt], {b[2], b[3]});
            }
        }
    }
}

// Fold one step of scores into the running softmax: apply softcap / ALiBi / mask to the raw scores,
// update each row's max and (per-thread partial) sum, turn S into P = 2^(s*c - m*c) in place, and
// rescale O where a row max moved. row_lo: this thread's first row (the other is row_lo + 8) of
// m-tile 0; col_lo: its first key column.
// MASKED is a template argument so that tiles inside the mask (most of them) carry no per-element test.
template <bool MASKED>
__device__ __forceinline__ void online_softmax(Frag (&s)[MT][KN / 8], Frag (&o)[MT][D / 8], float (&row_max)[MT][2],
                                               float (&row_sum)[MT][2], const Fa2FwdParams& p, const Mask& mask,
                                               int row_lo, int col_lo, float alibi) {
    float alpha[MT][2];  // per-row rescale of O, exactly 1 when the row max did not move
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < KN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row_lo + mt * 16 + (e / 2) * 8, col = col_lo + j * 8 + (e & 1);
                float x = s[mt][j][e];
                if constexpr (SOFTCAP) x = tanh_approx(x * p.softcap_pre);
                if constexpr (ALIBI) x -= alibi * fabsf(float(row + mask.diag() - col));
                if (MASKED && !mask.visible(row, col)) x = neg_inf();
                s[mt][j][e] = x;
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = row_max[mt][r];
#pragma unroll
            for (int j = 0; j < KN / 8; ++j) mx = fmaxf(mx, fmaxf(s[mt][j][2 * r], s[mt][j][2 * r + 1]));
            mx = quad_max(mx);
            // A row with nothing visible yet keeps max -inf: exponentiate against 0 then.
            const float base = mx == neg_inf() ? 0.f : mx * p.scale_log2;
            alpha[mt][r] = mx == row_max[mt][r] ? 1.f : fast_exp2(row_max[mt][r] * p.scale_log2 - base);
            row_max[mt][r] = mx;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < KN / 8; ++j) {
                s[mt][j][2 * r] = fast_exp2(s[mt][j][2 * r] * p.scale_log2 - base);
                s[mt][j][2 * r + 1] = fast_exp2(s[mt][j][2 * r + 1] * p.scale_log2 - base);
                sum += s[mt][j][2 * r] + s[mt][j][2 * r + 1];
            }
            row_sum[mt][r] = row_sum[mt][r] * alpha[mt][r] + sum;
        }
    }
    // Rescaling O costs d/2 multiplies per row; once the row maxima settle (after the first few
    // tiles) no row of the warp moves, and the whole warp skips it.
    bool moved = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) moved |= alpha[mt][0] != 1.f || alpha[mt][1] != 1.f;
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                o[mt][j][0] *= alpha[mt][0], o[mt][j][1] *= alpha[mt][0];
                o[mt][j][2] *= alpha[mt][1], o[mt][j][3] *= alpha[mt][1];
            }
    }
}

// Drop elements of P (kept ones scaled by 1 / (1 - p)); the mask of element (row, key) is a function of
// (seed, offset, batch * heads + head, row, key) only (common/philox.cuh). row_base, col_base: the
// (multiple-of-16) row of m-tile 0 and key of this step.
__device__ __forceinline__ void apply_dropout(Frag (&s)[MT][KN / 8], const Dropout& drop, int bh, int row_base,
                                              int col_base, int g, int t) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int jj = 0; jj < KN / 16; ++jj) {
            const u32 bits = drop.keep_bits(bh, row_base + mt * 16, col_base + jj * 16, g, t);
#pragma unroll
            for (int ch = 0; ch < 2; ++ch)
#pragma unroll
                for (int e = 0; e < 4; ++e)  // element e: row half e / 2, column parity e % 2
                    s[mt][2 * jj + ch][e] *= (bits >> (4 * ch + e)) & 1u ? drop.scale : 0.f;
        }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) fa2_fwd(const Fa2FwdParams p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

    const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest (last) Q blocks first
    const int head = blockIdx.y, batch = blockIdx.z;
    const SeqInfo seq(p.cu_seqlens_q, p.cu_seqlens_k, batch, p.seqlen_q, p.seqlen_k);
    const int row0 = m_block * BM;
    if (row0 >= seq.seqlen_q) return;  // variable length: this entry is shorter than the longest
    const int kv_head = head / (p.heads / p.kv_heads);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const Mask mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};

    const int warp_row0 = warp * MT * 16;  // first row of this warp within the block
    const u16* q = p.q + batch * p.q_batch_stride + head * p.q_head_stride + (i64(seq.q_start) + row0) * p.q_row_stride;
    const u16* k = p.k + batch * p.k_batch_stride + kv_head * p.k_head_stride + i64(seq.k_start) * p.k_row_stride;
    const u16* v = p.v + batch * p.v_batch_stride + kv_head * p.v_head_stride + i64(seq.k_start) * p.v_row_stride;
    float alibi = 0.f;  // ALiBi slope in raw-score units: logits get slope * -|i + diag - j|
    if constexpr (ALIBI) alibi = p.alibi_slopes[head] * 1.44269504088896341f / p.scale_log2;
    const Dropout drop{p.dropout_seed_lo, p.dropout_seed_hi, p.dropout_offset, p.dropout_threshold, p.dropout_scale};

    int n_lo, n_hi;
    mask.kv_block_range<BM, BN>(m_block, n_lo, n_hi);
    QOperand<Q_REGS> q_op(QAddr(sm.q, warp_row0 + (lane & 15), lane >> 4));  // A operand, this warp's rows
    const KVAddr k_addr = b_rows_addr(sm.k[0], lane);
    const KVAddr v_addr = b_trans_addr(sm.v[0], lane);

    Frag o[MT][D / 8] = {};
    float row_max[MT][2], row_sum[MT][2];  // row_sum: this thread's partial sums (quad-reduced at the end)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) row_max[mt][0] = row_max[mt][1] = neg_inf(), row_sum[mt][0] = row_sum[mt][1] = 0.f;

    if (n_lo < n_hi) {
        load_tile(sm.q, q, p.q_row_stride, seq.seqlen_q - row0);
        load_tile(sm.k[0], k + n_lo * BN * p.k_row_stride, p.k_row_stride, seq.seqlen_k - n_lo * BN);
        cp_async_commit();
        if constexpr (KV_STAGES == 2) {  // (one buffer: each V tile is loaded in its own iteration)
            load_tile(sm.v[0], v + n_lo * BN * p.v_row_stride, p.v_row_stride, seq.seqlen_k - n_lo * BN);
            cp_async_commit();
        }
        if constexpr (Q_REGS) {
            cp_async_wait<KV_STAGES - 1>();  // Q (and the first K tile) landed; the loop's first wait returns at once
            __syncthreads();
            q_op.load();
        }
    }

    // S -> P for keys key0 .. key0 + KN: the mask only where the tile crosses its edge, then dropout.
    auto scores_to_p = [&](Frag (&s)[MT][KN / 8], bool needs_mask, int key0) {
        if (needs_mask)
            online_softmax<true>(s, o, row_max, row_sum, p, mask, row0 + warp_row0 + g, key0 + 2 * t, alibi);
        else
            online_softmax<false>(s, o, row_max, row_sum, p, mask, row0 + warp_row0 + g, key0 + 2 * t, alibi);
        if constexpr (DROPOUT) apply_dropout(s, drop, batch * p.heads + head, row0 + warp_row0, key0, g, t);
    };

    // One K and one V buffer: two barriers per tile. The first (K_n landed) also says every warp is done
    // with P_{n-1} V_{n-1}, so V_n may overwrite it; the second (V_n landed) that every warp is done with
    // Q K_n^T, so K_{n+1} may overwrite K_n.
    if constexpr (KV_STAGES == 1) {
        const i64* k_offset = nullptr;  // (LANE_OFFSETS_IN_SMEM, above load_tile)
        const i64* v_offset = nullptr;
        if constexpr (LANE_OFFSETS_IN_SMEM) {
            __shared__ i64 lane_offset[2][THREADS];
            const int r0 = threadIdx.x / (D / 8), c = (threadIdx.x % (D / 8)) * 8;  // (load_tile's r0, c)
            lane_offset[0][threadIdx.x] = r0 * p.k_row_stride + c;
            lane_offset[1][threadIdx.x] = r0 * p.v_row_stride + c;
            k_offset = &lane_offset[0][threadIdx.x];
            v_offset = &lane_offset[1][threadIdx.x];
        }
        for (int n = n_lo; n < n_hi; ++n) {
            const int key0 = n * BN, next_key0 = key0 + BN;
            cp_async_wait<0>();
            __syncthreads();
            load_tile(sm.v[0], v + key0 * p.v_row_stride, p.v_row_stride, seq.seqlen_k - key0, v_offset);
            cp_async_commit();
            Frag s[MT][KN / 8];
            qk_product(q_op, k_addr, 0, 0, s);
            cp_async_wait<0>();
            __syncthreads();
            if (n + 1 < n_hi) {
                load_tile(sm.k[0], k + next_key0 * p.k_row_stride, p.k_row_stride, seq.seqlen_k - next_key0,
                          k_offset);
                cp_async_commit();
            }
            scores_to_p(s, !mask.tile_all_visible<BM, BN>(m_block, n), key0);
            pv_product(v_addr, 0, 0, s, o);
        }
    } else {
        for (int n = n_lo; n < n_hi; ++n) {
            const int stage = (n - n_lo) & 1;
            const int key0 = n * BN, next_key0 = key0 + BN;
            const bool has_next = n + 1 < n_hi;
            cp_async_wait<1>();  // this K tile has landed (this V tile may still be in flight)
            __syncthreads();     // ... for every thread; and everyone is done with the other stage
            if (has_next)
                load_tile(sm.k[stage ^ 1], k + next_key0 * p.k_row_stride, p.k_row_stride, seq.seqlen_k - next_key0);
            cp_async_commit();
            const bool needs_mask = !mask.tile_all_visible<BM, BN>(m_block, n);
            // Not unrolled: with two sub-steps unrolled ptxas kept both steps' values live and spilled 170-300
            // bytes (d = 64 BLOCK_N 128, d = 128 BLOCK_N 64); as a loop the sub-step offset costs a few adds.
#pragma unroll 1
            for (int sub = 0; sub < BN; sub += KN) {
                Frag s[MT][KN / 8];
                qk_product(q_op, k_addr, stage * KV_STAGE_BYTES, sub, s);
                scores_to_p(s, needs_mask, key0 + sub);
                if (sub == 0) {
                    cp_async_wait<1>();  // this V tile has landed (the next K tile may still be in flight)
                    __syncthreads();
                    if (has_next)
                        load_tile(sm.v[stage ^ 1], v + next_key0 * p.v_row_stride, p.v_row_stride,
                                  seq.seqlen_k - next_key0);
                    cp_async_commit();
                }
                pv_product(v_addr, stage * KV_STAGE_BYTES, sub, s, o);
            }
        }
    }
    cp_async_wait<0>();

    // Epilogue: O /= l, LSE = (m * c + log2 l) * ln 2. Each warp stages its own rows of O in its own
    // rows of the Q tile (no other warp reads them), then writes whole 16-byte chunks.
    float* lse = p.lse + batch * p.row_batch_stride + head * p.row_head_stride + seq.q_start;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(row_sum[mt][r]);
            const float inv = l > 0.f ? 1.f / l : 0.f;
            const int row_in_block = warp_row0 + mt * 16 + g + 8 * r;
#pragma unroll
            for (int j = 0; j < D / 8; ++j)
                *reinterpret_cast<u32*>(sm.q.at(row_in_block, j * 8 + 2 * t)) =
                    elem_t::pack2(o[mt][j][2 * r] * inv, o[mt][j][2 * r + 1] * inv);
            const int row = row0 + row_in_block;
            if (t == 0 && row < seq.seqlen_q)
                lse[row] = l > 0.f ? (row_max[mt][r] * p.scale_log2 + log2f(l)) * 0.69314718055994531f : neg_inf();
        }
    }
    __syncwarp();
    u16* out = p.o + batch * p.o_batch_stride + head * p.o_head_stride + i64(seq.q_start) * p.o_row_stride;
    constexpr int CHUNKS = D / 8;
    for (int i = lane; i < MT * 16 * CHUNKS; i += 32) {
        const int r = warp_row0 + i / CHUNKS, c = (i % CHUNKS) * 8;
        if (row0 + r < seq.seqlen_q)
            *reinterpret_cast<uint4*>(out + (row0 + r) * p.o_row_stride + c) = *reinterpret_cast<uint4*>(sm.q.at(r, c));
    }
}
