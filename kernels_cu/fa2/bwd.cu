// FA2-style attention backward (FlashAttention-2's work split on mma.sync tensor cores).
//
// One thread block owns BLOCK_N keys of one (batch, KV head); dK and dV for them stay in registers.
// It walks every (query head of the GQA group, Q block) whose rows can see these keys, with the next
// Q / dO tiles streaming in by cp.async while the current ones are used, and per Q block i:
//     S  = Q_i K^T        dP = dO_i V^T                       (warps tile BLOCK_M x BLOCK_N)
//     P  = exp2(S c - lse_i log2 e),  dS = P o (dP - D_i)     (registers -> shared memory, 16-bit)
//     dV += P^T dO_i      dK += dS^T Q_i                      (warps tile BLOCK_N x d)
//     dQ_i += dS K                                            (warps tile BLOCK_M x d; fp32 atomics)
// Each product gets its own warp layout, so no warp recomputes another's S or dP; P and dS change
// layout through shared memory, and the transposed products read them with ldmatrix.trans.
// D = rowsum(dO o O) and the dQ conversion are common/bwd_aux.cu. Softcap multiplies dS by the
// derivative of tanh; ALiBi only shifts the logits. The deterministic mode orders the dQ additions of the
// K blocks that touch a Q block by a per-(head, Q block) counter, so the sums are bit-identical run to
// run (p.dq_semaphore non-null).
//
// Compile-time constants (cuflash/fa2.py): CUFLASH_HEADDIM, CUFLASH_BLOCK_M, CUFLASH_BLOCK_N,
// CUFLASH_WARPS, CUFLASH_QSTAGES (1/2), CUFLASH_WARPS_S_M (warp rows of the S/dP layout; the rest
// split the columns), CUFLASH_WARPS_KV_N (of the dK/dV layout), CUFLASH_WARPS_Q_M (of the dQ layout),
// CUFLASH_S_SPLIT / CUFLASH_Q_SPLIT (each warp computes its S/dP tile, its dQ tile, in that many column
// chunks: fewer live registers next to dK and dV, at the cost of re-reading the A operand),
// CUFLASH_DTYPE, CUFLASH_SOFTCAP, CUFLASH_ALIBI, CUFLASH_DROPOUT (the forward's mask, regenerated: dV
// uses the dropped P, dS = P o (dropped dP - D)). The deterministic mode is chosen at run time: a
// dq_semaphore array turns it on.
//
// Per Q block the main loop is shared-memory bound before it is tensor bound (bench/NOTES.md, "FA2
// backward: static analysis"): every ldmatrix feeds a warp tile, so the tiles are as large as the
// registers allow, and the loop carries as little else as possible: the Q/dO copies are unrolled at
// compile time, LSE and D arrive by cp.async with Q/dO (no global-load latency after the barrier), the
// per-element mask test exists only in the copy of the P/dS code that edge tiles run, the dQ atomics
// are 8-byte vector reductions on sm_90, and every ldmatrix address is a precomputed base plus an
// immediate (warp_mma_at: computed per call, the swizzle cost as many issue slots as the ldmatrix).
#include "common/mask.cuh"
#include "common/philox.cuh"
#include "common/ptx.cuh"
#include "common/seqlen.cuh"
#include "common/tile.cuh"
#include "common/warp_mma.cuh"
#include "fa2/params.cuh"

constexpr int D = CUFLASH_HEADDIM;
constexpr int BM = CUFLASH_BLOCK_M;
constexpr int BN = CUFLASH_BLOCK_N;
constexpr int WARPS = CUFLASH_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int QSTAGES = CUFLASH_QSTAGES;
constexpr bool SOFTCAP = CUFLASH_SOFTCAP;
constexpr bool ALIBI = CUFLASH_ALIBI;
constexpr bool DROPOUT = CUFLASH_DROPOUT;
static_assert(THREADS == CUFLASH_THREADS, "launcher and kernel disagree on the block size");

// Warp layouts: (rows x columns) of warps over each product's output, and each warp's fragments.
constexpr int WS_M = CUFLASH_WARPS_S_M, WS_N = WARPS / WS_M;       // S, dP: BM x BN
constexpr int WKV_N = CUFLASH_WARPS_KV_N, WKV_D = WARPS / WKV_N;   // dK, dV: BN x D
constexpr int WQ_M = CUFLASH_WARPS_Q_M, WQ_D = WARPS / WQ_M;       // dQ: BM x D
constexpr int S_SPLIT = CUFLASH_S_SPLIT, Q_SPLIT = CUFLASH_Q_SPLIT;
constexpr int S_ROWS = BM / WS_M, S_COLS = BN / WS_N / S_SPLIT;  // one chunk of a warp's S / dP tile
constexpr int KV_ROWS = BN / WKV_N, KV_COLS = D / WKV_D;
constexpr int Q_ROWS = BM / WQ_M, Q_COLS = D / WQ_D / Q_SPLIT;   // one chunk of a warp's dQ tile
static_assert(S_ROWS % 16 == 0 && S_COLS % 16 == 0 && KV_ROWS % 16 == 0 && KV_COLS % 16 == 0 &&
                  Q_ROWS % 16 == 0 && Q_COLS % 16 == 0,
              "every warp tile is made of whole 16x16 blocks");

struct Smem {
    FastSmemTile<BN, D> k;
    FastSmemTile<BN, D> v;
    FastSmemTile<BM, D> q[QSTAGES];
    FastSmemTile<BM, D> dout[QSTAGES];
    FastSmemTile<BM, BN> p;   // P (rows = queries)
    FastSmemTile<BM, BN> ds;  // dS (rows = queries)
    float lse[QSTAGES][BM];   // the Q block's LSE and D rows, copied with its Q / dO (past the end: zeros,
    float dsum[QSTAGES][BM];  // replaced by +inf / 0 when read)
};

template <bool B>
struct BoolConst {
    static constexpr bool value = B;
};

// cp.async of a whole tile with a compile-time trip count. The common load_tile_async loop starts at
// threadIdx.x, so ptxas keeps it as a run-time loop plus a remainder loop (~130 instructions per tile);
// here each thread owns one 16-byte column chunk and walks rows THREADS / CHUNKS apart, so the loop
// unrolls into one cp.async, one row test and one pointer add per step (no row test with ALL_ROWS: the
// caller knows the whole tile is in range). Tiles whose chunk count does not divide the block (d = 96,
// 192) keep the common loop.
template <bool ALL_ROWS, int ROWS, int COLS, bool SW>
__device__ __forceinline__ void load_tile_unrolled(SmemTile<ROWS, COLS, SW>& tile, const u16* src, i64 row_stride,
                                                   int rows_valid) {
    constexpr int CHUNKS = COLS / 8;
    if constexpr (THREADS % CHUNKS != 0) {
        load_tile_async<THREADS>(tile, src, row_stride, rows_valid);
    } else {
        constexpr int STEP = THREADS / CHUNKS;  // rows apart between one thread's chunks
        constexpr int STEPS = (ROWS + STEP - 1) / STEP;
        // The swizzle depends on row % 8 only, so with STEP % 8 == 0 every step is the first plus a constant.
        constexpr bool AFFINE = !SW || STEP % 8 == 0;
        const int r0 = threadIdx.x / CHUNKS, c = (threadIdx.x % CHUNKS) * 8;
        const u16* s = src + r0 * row_stride + c;
        u16* d0 = tile.at(r0, c);
#pragma unroll
        for (int it = 0; it < STEPS; ++it) {
            const int r = r0 + it * STEP;
            if (ROWS % STEP != 0 && r >= ROWS) break;
            const bool in = ALL_ROWS || r < rows_valid;
            u16* d = AFFINE ? d0 + it * STEP * SmemTile<ROWS, COLS, SW>::PITCH : tile.at(r, c);
            cp_async_16(d, in ? s : src, in ? 16 : 0);
            s += STEP * row_stride;
        }
    }
}

// 4-byte cp.async (for the fp32 LSE / D rows, whose start is only 4-byte aligned with packed sequences);
// src_bytes = 0 writes a zero.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}

// dst[0..1] += (a, b) in global memory, relaxed, device scope (what atomicAdd does). sm_90 has an 8-byte
// vector reduction: half the instructions and half the L2 atomic requests of two scalar atomicAdds.
__device__ __forceinline__ void red_add2(float* dst, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) fa2_bwd(const Fa2BwdParams p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

    const int n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
    const SeqInfo seq(p.cu_seqlens_q, p.cu_seqlens_k, batch, p.seqlen_q, p.seqlen_k);
    const int key0 = n_block * BN;
    if (key0 >= seq.seqlen_k) return;  // variable length: this entry is shorter than the longest
    const int group = p.heads / p.kv_heads;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const Mask mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};
    // Packed (variable-length) inputs: this entry's rows start at q_start / k_start.
    const u16* q_base = p.q + batch * p.q_batch_stride + i64(seq.q_start) * p.q_row_stride;
    const u16* do_base = p.dout + batch * p.do_batch_stride + i64(seq.q_start) * p.do_row_stride;
    const Dropout drop{p.dropout_seed_lo, p.dropout_seed_hi, p.dropout_offset, p.dropout_threshold, p.dropout_scale};

    // This warp's place in each layout.
    const int s_row0 = (warp / WS_N) * S_ROWS, s_col_base = (warp % WS_N) * S_COLS * S_SPLIT;
    const int kv_row0 = (warp / WKV_D) * KV_ROWS, kv_col0 = (warp % WKV_D) * KV_COLS;
    const int q_row0 = (warp / WQ_D) * Q_ROWS, q_col_base = (warp % WQ_D) * Q_COLS * Q_SPLIT;

    // ldmatrix addresses of each product's operands, with this warp's origin folded in (warp_mma_at): the
    // dO, V and dS tiles are laid out like Q, K and P, so one address set serves both of a pair, plus a
    // byte offset (the Q / dO stage on top). Built where they are used: kept live across the loop, the
    // six sets would cost 24 registers.
    auto offset = [&](const void* to, const void* from) {
        return u32(reinterpret_cast<const char*>(to) - reinterpret_cast<const char*>(from));
    };
    const u32 dout_off = offset(&sm.dout[0], &sm.q[0]), v_off = offset(&sm.v, &sm.k), ds_off = offset(&sm.ds, &sm.p);

    int m_lo, m_hi;
    mask.q_block_range<BM, BN>(n_block, m_lo, m_hi);
    const int m_count = m_hi - m_lo, items = group * m_count;  // (query head, Q block) pairs, head-major
    const int q_blocks = (p.seqlen_q + BM - 1) / BM;  // per (batch, head) semaphores: sized by the maximum

    float dk[KV_ROWS / 16][KV_COLS / 8][4], dv[KV_ROWS / 16][KV_COLS / 8][4];
    zero(dk);
    zero(dv);

    // (query head, Q block) pairs run head-major; each item's successor is found without a division.
    struct Item {
        int head, m;
    };
    auto next_item = [&](Item it) { return it.m + 1 < m_hi ? Item{it.head, it.m + 1} : Item{it.head + 1, m_lo}; };
    auto load_item = [&](Item it, int stage) {
        const int row0 = it.m * BM;
        const u16* q_src = q_base + it.head * p.q_head_stride + row0 * p.q_row_stride;
        const u16* do_src = do_base + it.head * p.do_head_stride + row0 * p.do_row_stride;
        const int rows_valid = seq.seqlen_q - row0;
        if (rows_valid >= BM) {  // most blocks: no per-row test
            load_tile_unrolled<true>(sm.q[stage], q_src, p.q_row_stride, rows_valid);
            load_tile_unrolled<true>(sm.dout[stage], do_src, p.do_row_stride, rows_valid);
        } else {
            load_tile_unrolled<false>(sm.q[stage], q_src, p.q_row_stride, rows_valid);
            load_tile_unrolled<false>(sm.dout[stage], do_src, p.do_row_stride, rows_valid);
        }
        // LSE and D of the block's rows (threads [0, BM) and [BM, 2 BM)); rows past the end become zeros.
        const i64 rows = batch * p.row_batch_stride + it.head * p.row_head_stride + seq.q_start + row0;
#pragma unroll
        for (int i0 = 0; i0 < 2 * BM; i0 += THREADS) {
            const int i = i0 + threadIdx.x, r = i % BM;
            if (2 * BM % THREADS != 0 && i >= 2 * BM) break;
            const bool in = r < rows_valid;
            const float* src = (i < BM ? p.lse : p.dsum) + (in ? rows + r : 0);
            cp_async_4(i < BM ? &sm.lse[stage][r] : &sm.dsum[stage][r], src, in ? 4 : 0);
        }
    };
    if (items > 0) {
        load_tile_unrolled<false>(sm.k, p.k + batch * p.k_batch_stride + kv_head * p.k_head_stride +
                                            (i64(seq.k_start) + key0) * p.k_row_stride,
                                  p.k_row_stride, seq.seqlen_k - key0);
        load_tile_unrolled<false>(sm.v, p.v + batch * p.v_batch_stride + kv_head * p.v_head_stride +
                                            (i64(seq.k_start) + key0) * p.v_row_stride,
                                  p.v_row_stride, seq.seqlen_k - key0);
        if constexpr (QSTAGES == 2) load_item(Item{kv_head * group, m_lo}, 0);
        cp_async_commit();
    }

    Item cur{kv_head * group, m_lo};
    for (int item = 0; item < items; ++item, cur = next_item(cur)) {
        const int stage = QSTAGES == 2 ? item & 1 : 0;
        const u32 stage_off = stage * u32(sizeof(FastSmemTile<BM, D>));  // Q / dO stage 1 follows stage 0
        const int hq = cur.head, m = cur.m, row0 = m * BM;
        const i64 row_base = batch * p.row_batch_stride + hq * p.row_head_stride + seq.q_start;  // dq_accum rows
        float alibi = 0.f;
        if constexpr (ALIBI) alibi = p.alibi_slopes[hq] * 1.44269504088896341f / p.scale_log2;

        if constexpr (QSTAGES == 1) {
            __syncthreads();  // every warp is done with the previous Q block's tiles
            load_item(cur, 0);
            cp_async_commit();
        }
        cp_async_wait<0>();  // K, V and this Q block's Q / dO / LSE / D have landed
        __syncthreads();     // ... for every thread; and P / dS of the previous block are consumed
        if constexpr (QSTAGES == 2) {
            if (item + 1 < items) load_item(next_item(cur), stage ^ 1);
            cp_async_commit();
        }

        // This thread's rows of the S layout: lse (in log2 units) and D; +inf / 0 past the end (and lse
        // +inf for a row that saw no key) so that P = 0 there.
        float lse2[S_ROWS / 16][2], dsum[S_ROWS / 16][2];
#pragma unroll
        for (int mi = 0; mi < S_ROWS / 16; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int r_in = s_row0 + mi * 16 + g + 8 * r;
                const bool in = row0 + r_in < seq.seqlen_q;
                const float l = sm.lse[stage][r_in];
                lse2[mi][r] = !in || l == neg_inf() ? -neg_inf() : l * 1.44269504088896341f;
                dsum[mi][r] = in ? sm.dsum[stage][r_in] : 0.f;
            }

        // P and dS of one warp chunk to shared memory. MASKED: the tile crosses a mask edge (or the end of
        // the keys / rows) and each element is tested; the other instance, which most tiles run, has no
        // per-element test at all (a test costs ~4 issue slots per element even when its branch is not taken).
        auto store_p_ds = [&](auto masked, const float(&s)[S_ROWS / 16][S_COLS / 8][4],
                              const float(&dp)[S_ROWS / 16][S_COLS / 8][4], int s_col0) {
            constexpr bool MASKED = decltype(masked)::value;
#pragma unroll
            for (int mi = 0; mi < S_ROWS / 16; ++mi) {
                u32 keep = ~0u;  // dropout keep bits of the current 16 x 16 block (common/philox.cuh)
#pragma unroll
                for (int ni = 0; ni < S_COLS / 8; ++ni) {
                    if constexpr (DROPOUT)
                        if (ni % 2 == 0)
                            keep = drop.keep_bits(batch * p.heads + hq, row0 + s_row0 + mi * 16,
                                                  key0 + s_col0 + (ni / 2) * 16, g, t);
#pragma unroll
                    for (int half = 0; half < 2; ++half) {  // elements {0,1} (row g) and {2,3} (row g + 8)
                        const int r_in = s_row0 + mi * 16 + g + 8 * half, c_in = s_col0 + ni * 8 + 2 * t;
                        float pv[2], dsv[2];
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int row = row0 + r_in, col = key0 + c_in + e;
                            float x = s[mi][ni][2 * half + e], dtanh = 1.f;
                            if constexpr (SOFTCAP) {
                                x = tanh_approx(x * p.softcap_pre);
                                dtanh = 1.f - x * x;
                            }
                            if constexpr (ALIBI) x -= alibi * fabsf(float(row + mask.diag() - col));
                            float prob = fast_exp2(x * p.scale_log2 - lse2[mi][half]);
                            if constexpr (MASKED) prob = mask.visible(row, col) ? prob : 0.f;
                            float dpv = dp[mi][ni][2 * half + e];
                            pv[e] = prob;
                            if constexpr (DROPOUT) {
                                const float k = (keep >> (4 * (ni & 1) + 2 * half + e)) & 1u ? drop.scale : 0.f;
                                pv[e] = prob * k;  // what the forward multiplied V by
                                dpv *= k;
                            }
                            dsv[e] = prob * (dpv - dsum[mi][half]) * dtanh;
                        }
                        *reinterpret_cast<u32*>(sm.p.at(r_in, c_in)) = elem_t::pack2(pv[0], pv[1]);
                        *reinterpret_cast<u32*>(sm.ds.at(r_in, c_in)) = elem_t::pack2(dsv[0], dsv[1]);
                    }
                }
            }
        };

        const bool needs_mask = !mask.tile_all_visible<BM, BN>(m, n_block);
        const auto q_rows = a_addr(sm.q[0], lane, s_row0);        // Q, dO as A of S, dP
        const auto k_rows = b_rows_addr(sm.k, lane, s_col_base);  // K, V as B of S, dP
#pragma unroll
        for (int chunk = 0; chunk < S_SPLIT; ++chunk) {
            const int s_col0 = s_col_base + chunk * S_COLS;
            float s[S_ROWS / 16][S_COLS / 8][4], dp[S_ROWS / 16][S_COLS / 8][4];
            zero(s);
            zero(dp);
            warp_mma_at<S_ROWS / 16, S_COLS / 8, D, false, false, elem_t>(s, q_rows, stage_off, 0, 0, k_rows, 0,
                                                                         chunk * S_COLS, 0);
            warp_mma_at<S_ROWS / 16, S_COLS / 8, D, false, false, elem_t>(dp, q_rows, stage_off + dout_off, 0, 0, k_rows,
                                                                         v_off, chunk * S_COLS, 0);
            if (needs_mask) store_p_ds(BoolConst<true>{}, s, dp, s_col0);
            else store_p_ds(BoolConst<false>{}, s, dp, s_col0);
        }
        __syncthreads();  // P and dS complete

        // dV += P^T dO, dK += dS^T Q: A operands are the k-major (query-row) P / dS tiles.
        const auto p_cols = b_rows_addr(sm.p, lane, 0, kv_row0);      // P, dS as (k-major) A of dV, dK
        const auto q_cols = b_trans_addr(sm.q[0], lane, 0, kv_col0);  // dO, Q as (k-major) B of dV, dK
        warp_mma_at<KV_ROWS / 16, KV_COLS / 8, BM, true, true, elem_t>(dv, p_cols, 0, 0, 0, q_cols, stage_off + dout_off,
                                                                      0, 0);
        warp_mma_at<KV_ROWS / 16, KV_COLS / 8, BM, true, true, elem_t>(dk, p_cols, ds_off, 0, 0, q_cols, stage_off, 0, 0);

        int* semaphore = nullptr;
        int turn = 0;
        const bool deterministic = p.dq_semaphore != nullptr;
        if (deterministic) {
            // The K blocks that touch Q block m are [lo, hi); block n adds its share (n - lo)-th.
            int lo, hi;
            mask.kv_block_range<BM, BN>(m, lo, hi);
            turn = n_block - lo;
            semaphore = p.dq_semaphore + (i64(batch) * p.heads + hq) * q_blocks + m;
            if (threadIdx.x == 0)
                while (ld_acquire(semaphore) != turn) {
                }
            __syncthreads();
        }
        // dQ_i += dS K (K stored [key][d] is k-major for this product), one column chunk at a time. A lane
        // holds two adjacent columns of each row: one 8-byte reduction.
        const auto ds_rows = a_addr(sm.ds, lane, q_row0);             // dS as A of dQ
        const auto k_cols = b_trans_addr(sm.k, lane, 0, q_col_base);  // K as (k-major) B of dQ
#pragma unroll
        for (int chunk = 0; chunk < Q_SPLIT; ++chunk) {
            const int q_col0 = q_col_base + chunk * Q_COLS;
            float dq[Q_ROWS / 16][Q_COLS / 8][4];
            zero(dq);
            warp_mma_at<Q_ROWS / 16, Q_COLS / 8, BN, false, true, elem_t>(dq, ds_rows, 0, 0, 0, k_cols, 0, chunk * Q_COLS, 0);
#pragma unroll
            for (int mi = 0; mi < Q_ROWS / 16; ++mi)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = row0 + q_row0 + mi * 16 + g + 8 * r;
                    if (row >= seq.seqlen_q) continue;
                    float* dst = p.dq_accum + (row_base + row) * D + q_col0 + 2 * t;
#pragma unroll
                    for (int ni = 0; ni < Q_COLS / 8; ++ni) red_add2(dst + ni * 8, dq[mi][ni][2 * r], dq[mi][ni][2 * r + 1]);
                }
        }
        if (deterministic) {
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) st_release(semaphore, turn + 1);
        }
    }

    // dK carries the softmax scale (dQ gets it on conversion); keys past the end are not written.
#pragma unroll
    for (int mi = 0; mi < KV_ROWS / 16; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + kv_row0 + mi * 16 + g + 8 * r;
            if (key >= seq.seqlen_k) continue;
            const i64 krow = i64(seq.k_start) + key;
            u16* dk_row = p.dk + batch * p.dk_batch_stride + kv_head * p.dk_head_stride + krow * p.dk_row_stride + kv_col0 + 2 * t;
            u16* dv_row = p.dv + batch * p.dv_batch_stride + kv_head * p.dv_head_stride + krow * p.dv_row_stride + kv_col0 + 2 * t;
#pragma unroll
            for (int ni = 0; ni < KV_COLS / 8; ++ni) {
                *reinterpret_cast<u32*>(dk_row + ni * 8) =
                    elem_t::pack2(dk[mi][ni][2 * r] * p.scale, dk[mi][ni][2 * r + 1] * p.scale);
                *reinterpret_cast<u32*>(dv_row + ni * 8) = elem_t::pack2(dv[mi][ni][2 * r], dv[mi][ni][2 * r + 1]);
            }
        }
}
