// The FA3 backward's producer-warpgroup roles, apart from fa3/bwd.cu (head dims up to 128, the consumers
// split the keys) so that a kernel with another work split (head dims 192 and 256, the consumers splitting
// the head dim) can share them. Such a kernel has a producer
// warpgroup whose thread 0 loads K and V once and streams the (Q, dO, LSE, D) blocks through a ring, and
// whose warps 1 and 2 are the dQ writers of consumers 0 and 1: they add the dQ tiles the consumers stage
// in shared memory to the fp32 accumulator by TMA reduce-add, in deterministic mode in their turn.
//
// The functions take the kernel's shared-memory struct as a template parameter and use these members of
// it: k, v (BN rows x ATOMS atoms), q[STAGES], dout[STAGES] (BM rows x ATOMS atoms), lse[STAGES][BM],
// dsum[STAGES][BM], the barriers kv_full, qd_full[STAGES], qd_empty[STAGES], dq_full[2][DQ_STAGES],
// dq_empty[2][DQ_STAGES], and per consumer the staged tiles dq[2][DQ_STAGES][...] (boxes of 64 rows x 32
// fp32 columns) with their records dq_tile[2][DQ_TILE_SLOTS].
#pragma once
#include "common/dq_order.cuh"
#include "common/hopper.cuh"
#include "common/mask.cuh"
#include "common/padded_rows.cuh"
#include "common/ptx.cuh"
#include "common/seqlen.cuh"
#include "fa3/bwd_params.cuh"

// The kernels' epilogue: dK and dV through shared memory and TMA stores (coalesced, and the block need not
// wait for them; store_dkv_tma), or (packed batches, where the rows past a sequence are the next one's)
// from registers. 0 is a timing probe's setting (scripts/ab_probe.py bwd-dkv).
#ifndef CUFLASH_STORE_DKV_TMA
#define CUFLASH_STORE_DKV_TMA (!CUFLASH_VARLEN)
#endif
static_assert(!(CUFLASH_STORE_DKV_TMA && CUFLASH_VARLEN), "packed batches store dK / dV from registers");

#ifndef CUFLASH_PROBE_NO_DQ_ADD  // a timing probe only (write_dq_tiles)
#define CUFLASH_PROBE_NO_DQ_ADD 0
#endif

// Timing probes only (scripts/ab_probe.py bwd-det-cost; with either, deterministic dQ is not ordered):
// CUFLASH_PROBE_LAUNCH_ORDER 0 / 1 launches the lowest / highest K block first whatever p says (-1: as p
// says); CUFLASH_PROBE_DET_NO_TURN 1 makes a deterministic writer add without waiting for its turn (it still
// waits for each add to land and passes the turn on); CUFLASH_PROBE_DET_NO_WAIT_ALL 1 makes it pass the turn
// on without waiting for its add to land.
#ifndef CUFLASH_PROBE_DET_NO_WAIT_ALL
#define CUFLASH_PROBE_DET_NO_WAIT_ALL 0
#endif
#ifndef CUFLASH_PROBE_LAUNCH_ORDER
#define CUFLASH_PROBE_LAUNCH_ORDER -1
#endif
#ifndef CUFLASH_PROBE_DET_NO_TURN
#define CUFLASH_PROBE_DET_NO_TURN 0
#endif

// This block's K block: deterministic mode launches the highest first (fa3/bwd.cu), the default the lowest.
__device__ __forceinline__ int launched_n_block(const Fa3BwdParams& p) {
    const bool highest_first = CUFLASH_PROBE_LAUNCH_ORDER < 0 ? p.highest_first != 0 : CUFLASH_PROBE_LAUNCH_ORDER == 1;
    return highest_first ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
}

// Where a staged dQ tile goes, written by its consumer for the writer (which has too few registers to work
// it out): the tile's first column and row and its head coordinate in the dQ tensor map; deterministic
// mode: its counter (an index into p.dq_semaphore) and the value that makes it this block's turn.
struct DqTile {
    int col, row, head, flag, turn;
};

// Deterministic mode: the counter of Q block m's dQ part `part` (of `parts` per block; head h) and the value
// that makes it K block n_block's turn: the K blocks that touch the Q block add in descending block order,
// or in the rotated order (common/dq_order.cuh; every K block of the sequence touches every Q block then).
// With 2^p.dq_plane_shift dQ accumulator planes (cuflash/fa3.py bwd_dq_accumulators: few heads in the grid)
// block n adds into plane n mod 2^shift and waits only for the blocks above it in that plane: a chain of
// hand-offs 2^shift times shorter per Q block, the planes summed in order by the conversion. The tile's
// head coordinate moves to its plane too. shift: Q block m holds rows from m BM - shift (row_shift_of).
template <int BM, int BN>
__device__ __forceinline__ void dq_turn(DqTile& tile, const Fa3BwdParams& p, const Mask& mask, int n_block, int batch,
                                        int h, int m, int part, int parts, int shift) {
    const int q_blocks = (p.seqlen_q + shift + BM - 1) / BM;
    int n_first, n_end;
    mask.kv_block_range_rows<BN>(max(m * BM - shift, 0), min(m * BM + BM - shift, mask.seqlen_q) - 1, n_first, n_end);
    const int plane = n_block & ((1 << p.dq_plane_shift) - 1);
    // (the launcher checks that the counters of every plane fit an int)
    tile.flag = ((batch * p.heads + h) * q_blocks + m) * parts + part + plane * p.dq_plane_flags;
    tile.turn = p.rotate_q_blocks
                    ? dq_order_rotated_turn(n_block, m, n_end, (mask.seqlen_q + shift + BM - 1) / BM)
                    : (n_end - 1 - n_block) >> p.dq_plane_shift;
    tile.head += plane * p.dq_plane_heads;
}

// Query rows before row 0 in the first Q block (cuflash/fa3.py, tile_order.bwd_row_shift: under a causal
// mask every K block's last step is partly empty, the first steps of only a few would be): Q block m holds
// rows [m BM - shift, (m + 1) BM - shift). The LSE / D rows and the dQ accumulator keep `shift` rows of
// padding before row 0 (LSE +inf and D 0, so no probability flows there; dQ's never read), so a block's rows
// there start at m BM as they do without a shift; the Q / dO rows before 0 come zero-filled by TMA. 0 for
// packed batches.
template <bool VARLEN>
__device__ __forceinline__ int row_shift_of(const Fa3BwdParams& p) {
    return VARLEN ? 0 : p.row_shift;
}

// The Q block K block n_block visits at step i of its walk over [m_lo, m_hi) (rotated or upwards).
__device__ __forceinline__ int step_q_block(const Fa3BwdParams& p, int i, int n_block, int m_lo, int m_hi) {
    return m_lo + dq_order_q_block(i, n_block, m_hi - m_lo, p.rotate_q_blocks);
}

// This block's sequence: its lengths and, in a packed batch, its first rows.
template <bool VARLEN>
__device__ __forceinline__ SeqInfo bwd_sequence(const Fa3BwdParams& p, int batch) {
    return VARLEN ? SeqInfo(p.cu_seqlens_q, p.cu_seqlens_k, batch, p.seqlen_q, p.seqlen_k)
                  : SeqInfo(nullptr, nullptr, batch, p.seqlen_q, p.seqlen_k);
}

// The first of head h's LSE / D rows for this sequence, in the padded layout cuflash/fa3.py builds:
// (batch, heads, pitch) for fixed length; for packed batches (heads, pitch) with sequence b's rows from
// padded_seq_start (common/padded_rows.cuh), so every block of BM rows starts 16-byte aligned for TMA.
template <bool VARLEN>
__device__ __forceinline__ int lse_row0(const Fa3BwdParams& p, const SeqInfo& seq, int batch, int h) {
    if constexpr (VARLEN) return int(i64(h) * p.row_head_stride) + padded_seq_start(seq.q_start, batch);
    return int(i64(batch) * p.row_batch_stride + i64(h) * p.row_head_stride);
}

// Thread 0: the barriers of the (Q, dO) ring (a consumer warp's arrival each frees a slot) and of each
// consumer's staged dQ tiles; the caller syncs the block after.
template <int STAGES, int DQ_STAGES, int CONSUMER_WARPS, class Smem>
__device__ __forceinline__ void init_bwd_barriers(Smem& sm) {
    mbar_init(&sm.kv_full, 1);
    for (int s = 0; s < STAGES; ++s) {
        mbar_init(&sm.qd_full[s], 1);
        mbar_init(&sm.qd_empty[s], CONSUMER_WARPS);  // one arrival per consumer warp
    }
    for (int c = 0; c < 2; ++c)
        for (int s = 0; s < DQ_STAGES; ++s) {
            mbar_init(&sm.dq_full[c][s], 1);
            mbar_init(&sm.dq_empty[c][s], 1);
        }
    fence_barrier_init();
}

// Producer thread 0: K and V of this block once, then for each query head h of the group and each Q block
// m in [m_lo, m_hi) (in step_q_block's order) the block's Q and dO tiles and its LSE and D rows into ring
// slot i % STAGES.
template <int ATOMS, int BM, int BN, int STAGES, bool VARLEN, class Smem>
__device__ __forceinline__ void load_kv_and_q_blocks(Smem& sm, const TensorMap* map_q, const TensorMap* map_k,
                                                     const TensorMap* map_v, const TensorMap* map_do,
                                                     const TensorMap* map_lse, const TensorMap* map_dsum,
                                                     const Fa3BwdParams& p, const SeqInfo& seq, int batch,
                                                     int kv_head, int group, int n_block, int m_lo, int m_hi,
                                                     int shift) {
    constexpr int KV_BYTES = BN * ATOMS * 128, QB_BYTES = BM * ATOMS * 128;
    const int tma_batch = VARLEN ? 0 : batch;  // a packed batch is one entry of total rows
    mbar_arrive_expect_tx(&sm.kv_full, 2 * KV_BYTES);
    tma_load_atoms<ATOMS>(sm.k, BN, map_k, &sm.kv_full, seq.k_start + n_block * BN, kv_head, tma_batch);
    tma_load_atoms<ATOMS>(sm.v, BN, map_v, &sm.kv_full, seq.k_start + n_block * BN, kv_head, tma_batch);
    int i = 0;
    for (int h = kv_head * group; h < (kv_head + 1) * group; ++h) {
#pragma unroll 1  // (unrolled, the loop needs more than the producer's registers)
        for (int step = 0; step < m_hi - m_lo; ++step, ++i) {
            const int m = step_q_block(p, step, n_block, m_lo, m_hi), s = i % STAGES;
            mbar_wait(&sm.qd_empty[s], ((i / STAGES) & 1) ^ 1);
            mbar_arrive_expect_tx(&sm.qd_full[s], 2 * QB_BYTES + 2 * BM * 4);
            const int q_row = seq.q_start + m * BM - shift;  // (rows before 0: zero-filled)
            tma_load_atoms<ATOMS>(sm.q[s], BM, map_q, &sm.qd_full[s], q_row, h, tma_batch);
            tma_load_atoms<ATOMS>(sm.dout[s], BM, map_do, &sm.qd_full[s], q_row, h, tma_batch);
            // LSE and D rows of the block from the padded rows (one flat row each; with a shift they hold
            // its padding before row 0). A last block's rows past the sequence read padding or the next
            // rows (or zeros past the end): the consumers never use them. (Packed Q / dO rows past the
            // sequence are the next sequence's: masked.)
            const int row0 = lse_row0<VARLEN>(p, seq, batch, h) + m * BM;
            tma_load_2d(sm.lse[s], map_lse, &sm.qd_full[s], row0, 0);
            tma_load_2d(sm.dsum[s], map_dsum, &sm.qd_full[s], row0, 0);
        }
    }
}

// The dQ writer of consumer c (one thread): its `tiles` staged tiles in order, each BOXES boxes of 64 rows
// x 32 fp32 columns (BOX_BYTES apart), where the tile's record says, boxes at or past column D (padding)
// left out. Deterministic mode: waits for the tile's turn, and after the add has landed passes the turn on.
template <int D, int BOXES, int BOX_BYTES, int DQ_STAGES, int DQ_TILE_SLOTS, class Smem>
__device__ __forceinline__ void write_dq_tiles(Smem& sm, const TensorMap* map_dq, const Fa3BwdParams& p, int c,
                                               int tiles) {
#pragma unroll 1
    for (int k = 0; k < tiles; ++k) {
        const int s = k % DQ_STAGES;
        mbar_wait(&sm.dq_full[c][s], (k / DQ_STAGES) & 1);
        const DqTile& tile = sm.dq_tile[c][k % DQ_TILE_SLOTS];
        int* flag = nullptr;
        int turn = 0;
        if (p.dq_semaphore) {  // deterministic: this K block's turn among those touching the Q block
            flag = p.dq_semaphore + tile.flag;
            turn = tile.turn;
            while (!CUFLASH_PROBE_DET_NO_TURN && ld_acquire(flag) != turn) {
            }
            fence_async_global();  // the reduce below comes after the acquire
        }
        // One reduce-add per box into dq_accum viewed as (D, seqlen_q, batch x heads): rows past seqlen_q
        // fall out of bounds instead of into the next head. Packed batches: (D, total_q, heads); rows past
        // the sequence are the next sequence's and get exact zeros (P is 0 for them), which leave those
        // sums as they are.
#pragma unroll
        for (int box = 0; box < BOXES; ++box)
            // (padded head dims: the padding's boxes are not added. CUFLASH_PROBE_NO_DQ_ADD: a timing probe,
            // scripts/ab_probe.py, that leaves the adds out to measure what they cost; dQ is then wrong)
            if (tile.col + box * 32 < D && !CUFLASH_PROBE_NO_DQ_ADD)
                tma_reduce_add_3d(map_dq, sm.dq[c][s] + box * BOX_BYTES, tile.col + box * 32, tile.row, tile.head);
        tma_store_commit();
        tma_store_wait_read();  // TMA has read the tile: the buffer is free
        mbar_arrive(&sm.dq_empty[c][s]);
        if (p.dq_semaphore) {
            if (!CUFLASH_PROBE_DET_NO_WAIT_ALL) tma_store_wait_all();  // the adds are in global memory ...
            fence_async_global();
            st_release(flag, turn + 1);  // ... before the next K block may add
        }
    }
}

// Rows of this thread in a 64 x N accumulator: 16 w + g and + 8; columns 8 j + 2 q4 and + 1.
struct Lane {
    int w, g, q4;
};

// A 64-row dQ accumulator (2 N fp32 columns; this thread's rows 16 w + g and + 8, columns 8 j + 2 q4 and + 1)
// into its staging `tile`: boxes of the dQ tensor map of 32 columns each, BOX_BYTES apart, in the 128-byte
// swizzle (16-byte chunk ch of row r at ch ^ (r % 8)); float2 stores, two wavefronts per warp.
template <int BOX_BYTES, int N>
__device__ __forceinline__ void stage_dq_rows(unsigned char* tile, const float (&dq)[N], const Lane& ln) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = 16 * ln.w + ln.g + 8 * hh, box = j / 4;
            const int chunk = (2 * (j % 4) + ln.q4 / 2) ^ (r % 8);
            *reinterpret_cast<float2*>(tile + box * BOX_BYTES + r * 128 + chunk * 16 + 8 * (ln.q4 % 2)) =
                make_float2(dq[4 * j + 2 * hh], dq[4 * j + 2 * hh + 1]);
        }
}

// A consumer's dK (times the softmax scale) and dV accumulators, 64 keys x COLS columns, to `stage` (dK's
// COLS / 64 atoms of [64][64], then dV's) in the 128-byte swizzle of the tensor maps (16-byte chunk j of
// row r at j ^ (r % 8): a warp's stores hit 32 banks); then, after the consumer's named barrier `bar`, its
// thread 0 stores the boxes at keys key0.. and columns col0.. that start before col_end (keys and columns
// past the tensor's end are clipped by TMA) and waits until they have been read. The caller makes sure no
// GEMM still reads `stage`.
template <int COLS>
__device__ __forceinline__ void store_dkv_tma(unsigned char* stage, const TensorMap* map_dk, const TensorMap* map_dv,
                                              const float (&dk)[COLS / 2], const float (&dv)[COLS / 2], float scale,
                                              int t, const Lane& ln, int bar, int col0, int col_end, int key0,
                                              int kv_head, int batch) {
    constexpr int ATOMS = COLS / 64;
    unsigned char* dk_smem = stage;
    unsigned char* dv_smem = stage + ATOMS * 64 * 128;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = 16 * ln.w + ln.g + 8 * r;
#pragma unroll
        for (int j = 0; j < COLS / 8; ++j) {
            const int at = (j / 8) * 64 * 128 + row * 128 + (((j % 8) ^ (row % 8)) * 16) + 4 * ln.q4;
            *reinterpret_cast<u32*>(dk_smem + at) =
                elem_t::pack2(dk[4 * j + 2 * r] * scale, dk[4 * j + 2 * r + 1] * scale);
            *reinterpret_cast<u32*>(dv_smem + at) = elem_t::pack2(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
        }
    }
    fence_async_smem();
    named_sync(bar, 128);
    if (t == 0) {
#pragma unroll
        for (int a = 0; a < ATOMS; ++a) {
            if (col0 + a * 64 >= col_end) break;
            tma_store_4d(map_dk, dk_smem + a * 64 * 128, col0 + a * 64, key0, kv_head, batch);
            tma_store_4d(map_dv, dv_smem + a * 64 * 128, col0 + a * 64, key0, kv_head, batch);
        }
        tma_store_commit();
        tma_store_wait_read();
    }
}

// The per-query-column values a thread needs from a block's rows (LSE or D), for the N query rows q0 .. q0 +
// N - 1 of Q block m: v[j][e] = rows[q0 + 8 j + 2 q4 + e], `outside` for rows past the sequence (rows
// before it, shift: the padding holds what `outside` would be). A whole block (most) reads them as they
// are; only the last block of a sequence tests rows.
template <int BM, int N>
__device__ __forceinline__ void column_values(float (&v)[N / 8][2], const float* rows, float outside, int m, int q0,
                                              const Lane& ln, const SeqInfo& seq, int shift) {
    const int end = seq.seqlen_q + shift;  // (in the block's padded rows)
    if ((m + 1) * BM <= end) {
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) v[j][e] = rows[q0 + 8 * j + 2 * ln.q4 + e];
    } else {
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int r = q0 + 8 * j + 2 * ln.q4 + e;
                v[j][e] = m * BM + r < end ? rows[r] : outside;
            }
    }
}

// st (64 keys x N queries: S^T, or with a softcap the capped logits t) into P^T = 2^(st c - lse2) for this
// thread's keys key_lo, key_lo + 8 of K block n_block and the N query rows q0 .. of Q block m; lse2 per
// query column (column_values of the block's LSE rows, log2 units, +inf where no probability flows: rows
// that saw no key, as the preprocess wrote them, and rows past the end). Masked pairs get P = 0.
template <int BM, int BN, bool SOFTCAP, int N>
__device__ __forceinline__ void probabilities(float (&st)[N / 2], const float (&lse2)[N / 8][2], int m, int n_block,
                                              int q0, int key_lo, const Lane& ln, const Mask& mask,
                                              const Fa3BwdParams& p, int shift) {
    const bool edge = !mask.tile_all_visible<BM, BN>(m, n_block, shift);  // a tile with masked pairs
    const int row0 = m * BM - shift + q0;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float& x = st[4 * j + e];
            x = fast_exp2(x * p.scale_log2 - lse2[j][e % 2]);
            const int key = key_lo + 8 * (e / 2), row = row0 + 8 * j + 2 * ln.q4 + e % 2;
            if (SOFTCAP && edge && !mask.visible(row, key)) x = 0.f;
        }
    // Without a cap, the mask in a pass of its own once lse2 is dead (folded into the exponentials, its
    // predicated compares kept everything live at once: ptxas spilled).
    if (!SOFTCAP && edge) {
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key_lo + 8 * (e / 2), row = row0 + 8 * j + 2 * ln.q4 + e % 2;
                if (!mask.visible(row, key)) st[4 * j + e] = 0.f;
            }
    }
}

// dpt (dP^T) minus D per query column (column_values of the block's D rows; 0 past the sequence); with a
// softcap times the cap's derivative 1 - t^2 (st still holds t). The caller multiplies by P^T after.
template <bool SOFTCAP, int N>
__device__ __forceinline__ void subtract_dsum(float (&dpt)[N / 2], const float (&st)[N / 2],
                                              const float (&dsum)[N / 8][2]) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float& ds = dpt[4 * j + e];
            ds -= dsum[j][e % 2];
            if constexpr (SOFTCAP) ds *= 1.f - st[4 * j + e] * st[4 * j + e];
        }
}

// A consumer's step after it issued S^T = K Q^T and then dP^T = V dO^T (two commit groups) for 64 keys
// and N query rows: waits for each and turns st into P^T and dpt into dS^T = P^T o (dP^T - D). With a
// softcap the logits are t = tanh(S^T softcap_pre) and P^T is formed after dP^T arrives so that t need not
// share the registers with P^T.
template <int BM, int BN, bool SOFTCAP, int N>
__device__ __forceinline__ void probabilities_and_ds(float (&st)[N / 2], float (&dpt)[N / 2], const float* lse_rows,
                                                     const float* dsum_rows, int m, int n_block, int q0, int key_lo,
                                                     const Lane& ln, const SeqInfo& seq, const Mask& mask,
                                                     const Fa3BwdParams& p, int shift) {
    float lse2[N / 8][2], dsum[N / 8][2];  // read before the waits, which order every load after them
    column_values<BM, N>(lse2, lse_rows, -neg_inf(), m, q0, ln, seq, shift);
    column_values<BM, N>(dsum, dsum_rows, 0.f, m, q0, ln, seq, shift);
    wgmma_wait<1>();  // S^T
    wgmma_fence_regs(st);
    if constexpr (SOFTCAP) {
#pragma unroll
        for (int j = 0; j < N / 2; ++j) st[j] = tanh_approx(st[j] * p.softcap_pre);
    } else {
        probabilities<BM, BN, SOFTCAP, N>(st, lse2, m, n_block, q0, key_lo, ln, mask, p, shift);
    }
    wgmma_wait<0>();  // dP^T
    wgmma_fence_regs(dpt);
    subtract_dsum<SOFTCAP, N>(dpt, st, dsum);
    if constexpr (SOFTCAP) probabilities<BM, BN, SOFTCAP, N>(st, lse2, m, n_block, q0, key_lo, ln, mask, p, shift);
#pragma unroll
    for (int j = 0; j < N / 2; ++j) dpt[j] *= st[j];
}
