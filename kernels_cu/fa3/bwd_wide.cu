// FA3-style attention backward for Hopper (sm_90a), head dims 192 and 256: fa3/bwd.cu's pipeline with the
// work split the other way. At d = 256 a consumer warpgroup cannot hold dK and dV for 64 keys over the whole
// head dim (2 x 128 fp32 registers per thread), so here the two consumers share the block's 64 keys and
// split the head dim: consumer c owns columns [128 c, 128 c + 128) of dK, dV and dQ.
//
// A thread block owns BN = 64 keys of one (batch, KV head) and walks the query heads of its group and the
// 64-row query blocks that see those keys. Per query block:
//   consumer 0 computes S^T = K Q^T and P^T, consumer 1 dP^T = V dO^T and dS^T = P^T o (dP^T - D), each
//     over all 64 keys and 64 queries (operands in shared memory, K-major; P^T goes to consumer 1 through
//     shared memory in fp32), and store them as bf16/fp16 into the block's [64 keys][64 queries] tiles of
//     P^T and dS^T. Each wgmma's smem operands then feed 64 columns, not 32: K or V (32 KB) is read once
//     per step instead of by both consumers. (With a softcap, dS^T needs the capped logits too: there
//     consumer c computes both for its 32 queries, rows 32 c .. 32 c + 31 of the block, as
//     fa3/bwd_roles.cuh's probabilities_and_ds.) Once the tiles are in (a named barrier), over its 128
//     columns consumer c computes:
//       dV += P^T dO,  dK += dS^T Q                     (A from shared memory, B MN-major)
//       dQ  = dS K                                      (both MN-major), staged for its dQ writer
//   The producer warpgroup is fa3/bwd.cu's: thread 0 loads K, V once and streams (Q, dO, LSE, D) through a
//   one-slot ring (two do not fit next to the dQ staging: 32 KB per slot), warps 1 and 2 are the dQ
//   writers (bwd_roles.cuh: write_dq_tiles), deterministic mode as in fa3/bwd.cu (descending K-block
//   order, highest block launched first).
// d = 192 runs as 256: the tiles' last 64 columns are zeros written once at the start (TMA loads only the
// three atoms that exist) and only d columns are stored.
//
// Compile-time constants (cuflash/fa3.py): CUFLASH_HEADDIM (192, 256), CUFLASH_DTYPE, CUFLASH_SOFTCAP (0/1),
// CUFLASH_VARLEN (0/1), CUFLASH_SMEM_BYTES.
#include "fa3/bwd_roles.cuh"

constexpr int D = CUFLASH_HEADDIM;
constexpr bool SOFTCAP = CUFLASH_SOFTCAP;
constexpr bool VARLEN = CUFLASH_VARLEN;
constexpr int DP = 256;                // every product runs over 256 columns (d = 192: 64 of TMA's zeros)
constexpr int ATOMS = DP / 64;         // 64-column atoms of 128-byte rows
constexpr int LOADED_ATOMS = (D + 63) / 64;  // the atoms TMA fills; the rest (d = 192: one) stay zero
constexpr int HALF = DP / 2;           // head-dim columns per consumer
constexpr int BM = 64;                 // query rows per step
constexpr int QH = BM / 2;             // query rows per consumer for S^T and dP^T
constexpr int BN = 64;                 // keys per thread block
constexpr int STAGES = 1;
// Consumer 0 forms P^T and consumer 1 dS^T, each over the whole block (above); 0: each consumer both, for
// its 32 queries (what a softcap needs; a timing probe's setting otherwise, scripts/ab_probe.py).
#ifndef CUFLASH_SPLIT_SDP
#define CUFLASH_SPLIT_SDP 1
#endif
constexpr bool SPLIT_SDP = CUFLASH_SPLIT_SDP && !SOFTCAP;
constexpr int THREADS = 384;
constexpr int CONSUMER_WARPS = 8;
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;  // (fa3/bwd.cu: the split must fit the block's 168)
constexpr int DQ_STAGES = 1;
constexpr int DQ_TILE_SLOTS = 2 * DQ_STAGES;
constexpr int KV_BYTES = BN * DP * 2, QB_BYTES = BM * DP * 2, PDS_BYTES = BN * BM * 2;
constexpr int DQ_BOX_BYTES = BM * 32 * 4;  // 64 rows x 32 fp32 columns: one 128-byte-swizzled box
constexpr int DQ_BOXES = HALF / 32;
// SPLIT_SDP: P^T in fp32 from consumer 0 to consumer 1, as float4 [BN * BM / 4 / 128][128 threads]: thread t
// of either consumer holds the same keys and queries of a 64 x 64 accumulator, and a warp's float4 at
// consecutive threads is conflict-free.
constexpr int P_SLOTS = SPLIT_SDP ? BN * BM / 4 / 128 : 1;
static_assert(THREADS == CUFLASH_THREADS, "launcher and kernel disagree on the block size");
static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= 65536 / THREADS / 8 * 8 * THREADS,
              "the register split must fit in what the block starts with");
static_assert(D > 128 && D <= DP, "head dims 192 and 256 (fa3/bwd.cu has the others)");
static_assert(BM == 64 && BN == 64, "the padding atoms are zeroed as 64 rows of 128 bytes");

struct Smem {
    alignas(1024) unsigned char k[KV_BYTES];          // ATOMS atoms of [BN][64]
    alignas(1024) unsigned char v[KV_BYTES];
    alignas(1024) unsigned char q[STAGES][QB_BYTES];  // ATOMS atoms of [BM][64]
    alignas(1024) unsigned char dout[STAGES][QB_BYTES];
    alignas(1024) unsigned char pt[PDS_BYTES];        // P^T [BN keys][BM queries], 128-byte swizzle
    alignas(1024) unsigned char dst[PDS_BYTES];       // dS^T, the same
    alignas(1024) unsigned char dq[2][DQ_STAGES][DQ_BOXES * DQ_BOX_BYTES];  // per consumer: its dQ columns
    float4 p_f32[P_SLOTS][128];                       // SPLIT_SDP: P^T, consumer 0 to consumer 1
    alignas(128) float lse[STAGES][BM];   // the (Q, dO) block's rows of the LSE and of D, loaded with it
    alignas(128) float dsum[STAGES][BM];
    u64 kv_full, qd_full[STAGES], qd_empty[STAGES];
    u64 dq_full[2][DQ_STAGES], dq_empty[2][DQ_STAGES];
    DqTile dq_tile[2][DQ_TILE_SLOTS];
};
static_assert(sizeof(Smem) + 1023 <= CUFLASH_SMEM_BYTES, "cuflash/fa3.py asks for too little shared memory");

// Named barriers over both consumers (256 threads) around the shared P^T / dS^T tiles and P^T in fp32, and
// per consumer (128) for its dQ tile.
constexpr int PDS_FREE_BAR = 1, PDS_READY_BAR = 2, P_READY_BAR = 5, DQ_BAR = 3;  // DQ_BAR + consumer

// The epilogue as fa3/bwd.cu's (bwd_roles.cuh: CUFLASH_STORE_DKV_TMA): each consumer stages its HALF columns
// of dK and dV for the block's keys in the (Q, dO) slot.
constexpr bool STORE_DKV_TMA = CUFLASH_STORE_DKV_TMA;
constexpr int DKV_BYTES = 2 * HALF * 64 * 2;  // a consumer's dK and dV for 64 keys
static_assert(2 * DKV_BYTES <= 2 * STAGES * QB_BYTES && QB_BYTES % 1024 == 0,
              "both consumers' dK and dV fit in the (Q, dO) slot, one run of bytes");

// acc (64 keys x HALF) += A (64 keys x BM queries, a [key][query] tile in shared memory, K-major) Y (BM x
// HALF: this consumer's two atoms of a [BM][D] tile, read MN-major).
__device__ __forceinline__ void issue_acc_tile_y(float (&acc)[HALF / 2], const unsigned char* a_tile,
                                                 const unsigned char* y_half) {
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
        wgmma_ss<HALF, 1>(acc, wgmma_desc_advance(wgmma_desc(a_tile), 32 * kk),
                          wgmma_desc_mn(y_half + kk * 16 * 128, BM * 128), 1);
}

// A 64 x N accumulator (P^T or dS^T of N queries from query chunk0 * 8 on) into the block's [key][query]
// tile as 16-bit pairs: row key at key * 128 bytes, 16-byte chunk (8 queries) ch at (ch ^ key % 8) * 16.
template <int N>
__device__ __forceinline__ void store_tile_columns(unsigned char* tile, const float (&acc)[N / 2], int chunk0,
                                                   const Lane& ln) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int key = 16 * ln.w + ln.g + 8 * hh, chunk = chunk0 + j;
            *reinterpret_cast<u32*>(tile + key * 128 + ((chunk ^ (key % 8)) * 16) + 4 * ln.q4) =
                elem_t::pack2(acc[4 * j + 2 * hh], acc[4 * j + 2 * hh + 1]);
        }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    fa3_bwd_wide(const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_k,
                 const __grid_constant__ TensorMap map_v, const __grid_constant__ TensorMap map_do,
                 const __grid_constant__ TensorMap map_dq, const __grid_constant__ TensorMap map_lse,
                 const __grid_constant__ TensorMap map_dsum, const __grid_constant__ TensorMap map_dk,
                 const __grid_constant__ TensorMap map_dv, const Fa3BwdParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    Smem& sm = aligned_smem<Smem>(smem_raw);

    const int n_block = launched_n_block(p);
    const int kv_head = blockIdx.y, batch = blockIdx.z;
    const int group = p.heads / p.kv_heads;
    const int warpgroup = warpgroup_index();
    int m_lo, m_hi;  // the Q blocks that see this K block (each role finds them after its setmaxnreg)

    if (threadIdx.x == 0) init_bwd_barriers<STAGES, DQ_STAGES, CONSUMER_WARPS>(sm);
    if constexpr (LOADED_ATOMS < ATOMS) {
        // d = 192: the last atom of every K, V, Q and dO tile is zeros, written once here (TMA never loads
        // it) and made visible to the tensor cores' reads before anyone goes on.
        for (int a = LOADED_ATOMS; a < ATOMS; ++a)
            for (int i = threadIdx.x; i < 64 * 128 / 16; i += THREADS) {
                const uint4 zero = make_uint4(0, 0, 0, 0);
                reinterpret_cast<uint4*>(sm.k + a * BN * 128)[i] = zero;
                reinterpret_cast<uint4*>(sm.v + a * BN * 128)[i] = zero;
                for (int s = 0; s < STAGES; ++s) {
                    reinterpret_cast<uint4*>(sm.q[s] + a * BM * 128)[i] = zero;
                    reinterpret_cast<uint4*>(sm.dout[s] + a * BM * 128)[i] = zero;
                }
            }
        fence_async_smem();
    }
    __syncthreads();

    if (warpgroup == 0) {  // ---------------------------------------------------------------- producer
        regs_decrease<PRODUCER_REGS>();
        const SeqInfo seq = bwd_sequence<VARLEN>(p, batch);
        const Mask mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};
        mask.q_block_range<BM, BN>(n_block, m_lo, m_hi);
        const int warp = threadIdx.x / 32;
        if (threadIdx.x % 32 != 0 || warp > 2 || m_lo == m_hi) return;
        if (warp == 0)
            load_kv_and_q_blocks<LOADED_ATOMS, BM, BN, STAGES, VARLEN>(sm, &map_q, &map_k, &map_v, &map_do,
                                                                       &map_lse, &map_dsum, p, seq, batch, kv_head,
                                                                       group, n_block, m_lo, m_hi, /*shift=*/0);
        else  // the dQ writer of consumer warp - 1: a tile at every step
            write_dq_tiles<D, DQ_BOXES, DQ_BOX_BYTES, DQ_STAGES, DQ_TILE_SLOTS>(sm, &map_dq, p, warp - 1,
                                                                                group * (m_hi - m_lo));
        return;
    }

    // ------------------------------------------------------------------------------------- consumers
    regs_increase<CONSUMER_REGS>();
    const SeqInfo seq = bwd_sequence<VARLEN>(p, batch);
    const Mask mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};
    mask.q_block_range<BM, BN>(n_block, m_lo, m_hi);
    const int c = warpgroup - 1;  // which 32 queries of a block (S^T, dP^T), which 128 head-dim columns
    const int t = threadIdx.x % 128, lane = t % 32;
    const Lane ln{t / 32, lane / 4, lane % 4};
    const int key_lo = n_block * BN + 16 * ln.w + ln.g;  // this thread's keys: key_lo, key_lo + 8

    float dk[HALF / 2], dv[HALF / 2];
#pragma unroll
    for (int j = 0; j < HALF / 2; ++j) dk[j] = dv[j] = 0.f;

    if (m_lo < m_hi) {
        mbar_wait(&sm.kv_full, 0);
        // Step i: Q block m of the group's h_i-th head, qi-th of its range (counted, not divided: fa3/bwd.cu).
        const int m_count = m_hi - m_lo, steps = group * m_count;
        int qi = 0, h_i = 0;
        for (int i = 0; i < steps; ++i, qi = qi + 1 == m_count ? 0 : qi + 1, h_i += qi == 0) {
            const int m = step_q_block(p, qi, n_block, m_lo, m_hi), s = i % STAGES;
            if (t == 0) {  // where this step's dQ tile goes, for the writer (fa3/bwd.cu: DQ_TILE_SLOTS)
                const int h = kv_head * group + h_i;
                DqTile& tile = sm.dq_tile[c][i % DQ_TILE_SLOTS];
                tile.col = c * HALF;
                tile.row = seq.q_start + m * BM;
                tile.head = VARLEN ? h : batch * p.heads + h;
                if (p.dq_semaphore) dq_turn<BM, BN>(tile, p, mask, n_block, batch, h, m, c, 2, /*shift=*/0);
            }
            mbar_wait(&sm.qd_full[s], (i / STAGES) & 1);
            if constexpr (SPLIT_SDP) {
                // consumer 0: S^T = K Q^T into P^T; consumer 1: dP^T = V dO^T into dS^T (one wgmma stream,
                // its operands chosen by address: no wgmma under a branch)
                float acc[BM / 2];
                wgmma_abt_kmajor<BM, DP / 16>(acc, c == 0 ? sm.k : sm.v, BN * 128, c == 0 ? sm.q[s] : sm.dout[s],
                                              BM * 128);
                float rows[BM / 8][2];  // the LSE (consumer 0) or D (consumer 1) of each query column
                column_values<BM, BM>(rows, c == 0 ? sm.lse[s] : sm.dsum[s], c == 0 ? -neg_inf() : 0.f, m, 0, ln,
                                      seq, /*shift=*/0);
                wgmma_wait<0>();
                wgmma_fence_regs(acc);
                if (c == 0)
                    probabilities<BM, BN, false, BM>(acc, rows, m, n_block, 0, key_lo, ln, mask, p, /*shift=*/0);
                else
#pragma unroll
                    for (int j = 0; j < BM / 2; ++j) acc[j] -= rows[j / 4][j % 2];
                // The last step's GEMMs, which read both tiles, are done (each consumer waited for its own),
                // and consumer 1 read the last P^T before it arrived here. (One barrier instruction for
                // both consumers: compute-sanitizer's synccheck takes one reached from two places for
                // divergence.)
                named_sync(PDS_FREE_BAR, 256);
                float4* p_mine = &sm.p_f32[0][t];
                if (c == 0) {
#pragma unroll
                    for (int k = 0; k < P_SLOTS; ++k)
                        p_mine[k * 128] = make_float4(acc[4 * k], acc[4 * k + 1], acc[4 * k + 2], acc[4 * k + 3]);
                    named_arrive(P_READY_BAR, 256);
                    store_tile_columns<BM>(sm.pt, acc, 0, ln);
                } else {
                    named_sync(P_READY_BAR, 256);
#pragma unroll
                    for (int k = 0; k < P_SLOTS; ++k) {
                        const float4 pk = p_mine[k * 128];
                        acc[4 * k] *= pk.x, acc[4 * k + 1] *= pk.y, acc[4 * k + 2] *= pk.z, acc[4 * k + 3] *= pk.w;
                    }
                    store_tile_columns<BM>(sm.dst, acc, 0, ln);
                }
            } else {
                float st[QH / 2], dpt[QH / 2];
                wgmma_abt_kmajor<QH, DP / 16>(st, sm.k, BN * 128, sm.q[s] + c * QH * 128, BM * 128);
                wgmma_abt_kmajor<QH, DP / 16>(dpt, sm.v, BN * 128, sm.dout[s] + c * QH * 128, BM * 128);
                probabilities_and_ds<BM, BN, SOFTCAP, QH>(st, dpt, sm.lse[s], sm.dsum[s], m, n_block, c * QH, key_lo,
                                                          ln, seq, mask, p, /*shift=*/0);
                // P^T and dS^T into the shared tiles: both consumers' GEMMs of the last step, which read both
                // halves, are done (each waited for its own before arriving here).
                named_sync(PDS_FREE_BAR, 256);
                store_tile_columns<QH>(sm.pt, st, (QH / 8) * c, ln);
                store_tile_columns<QH>(sm.dst, dpt, (QH / 8) * c, ln);
            }
            fence_async_smem();
            named_sync(PDS_READY_BAR, 256);  // all 64 queries of P^T and dS^T are in

            // This consumer's columns: dV += P^T dO, dK += dS^T Q; then dQ = dS K (A = dS^T read MN-major,
            // B = K MN-major), into a buffer the writer has freed.
            const unsigned char* dout_half = sm.dout[s] + c * 2 * BM * 128;
            const unsigned char* q_half = sm.q[s] + c * 2 * BM * 128;
            wgmma_fence();
            issue_acc_tile_y(dv, sm.pt, dout_half);
            issue_acc_tile_y(dk, sm.dst, q_half);
            wgmma_commit();
            mbar_wait(&sm.dq_empty[c][i % DQ_STAGES], ((i / DQ_STAGES) & 1) ^ 1);
            float dq[HALF / 2];
            const u64 desc_ds = wgmma_desc_mn(sm.dst, BN * 128);
            const u64 desc_k = wgmma_desc_mn(sm.k + c * 2 * BN * 128, BN * 128);
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                wgmma_ss_mn<HALF>(dq, wgmma_desc_advance(desc_ds, kk * 16 * 128),
                                  wgmma_desc_advance(desc_k, kk * 16 * 128), kk > 0);
            wgmma_commit();
            wgmma_wait<1>();  // dV, dK (dQ reads K and dS^T only): the producer may refill the one slot now
            wgmma_fence_regs(dk);
            wgmma_fence_regs(dv);
            if (lane == 0) mbar_arrive(&sm.qd_empty[s]);  // Q and dO of this slot are no longer read
            wgmma_wait<0>();  // dQ
            wgmma_fence_regs(dq);

            // dQ into the staging buffer as DQ_BOXES boxes of the dQ tensor map (64 rows x 32 fp32)
            unsigned char* dq_tile = sm.dq[c][i % DQ_STAGES];
            stage_dq_rows<DQ_BOX_BYTES>(dq_tile, dq, ln);
            fence_async_smem();
            named_sync(DQ_BAR + c, 128);
            if (t == 0) mbar_arrive(&sm.dq_full[c][i % DQ_STAGES]);  // to this consumer's dQ writer
        }
    }

    if constexpr (STORE_DKV_TMA) {
        named_sync(PDS_FREE_BAR, 256);  // both consumers are past their last GEMM on the slot
        store_dkv_tma<HALF>(sm.q[0] + c * DKV_BYTES, &map_dk, &map_dv, dk, dv, p.scale, t, ln, DQ_BAR + c,
                            /*col0=*/c * HALF, /*col_end=*/D, n_block * BN, kv_head, batch);
        return;
    }
    // dK = scale * sum dS^T Q and dV, this consumer's columns for this thread's two keys; keys past the end
    // and the padding's columns are not stored.
    const SeqInfo kv_seq = bwd_sequence<VARLEN>(p, batch);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key_lo + 8 * r;
        if (key >= kv_seq.seqlen_k) continue;
        const i64 row = i64(kv_seq.k_start) + key;
        u16* dk_row = p.dk + batch * p.dk_batch_stride + kv_head * p.dk_head_stride + row * p.dk_row_stride;
        u16* dv_row = p.dv + batch * p.dv_batch_stride + kv_head * p.dv_head_stride + row * p.dv_row_stride;
#pragma unroll
        for (int j = 0; j < HALF / 8; ++j) {
            const int col = c * HALF + 8 * j + 2 * ln.q4;
            if (col >= D) continue;
            *reinterpret_cast<u32*>(dk_row + col) =
                elem_t::pack2(dk[4 * j + 2 * r] * p.scale, dk[4 * j + 2 * r + 1] * p.scale);
            *reinterpret_cast<u32*>(dv_row + col) = elem_t::pack2(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
        }
    }
}
