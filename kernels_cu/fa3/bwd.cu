// FA3-style attention backward for Hopper (sm_90a), version 1: wgmma for all five products, TMA loads
// through an mbarrier ring, warp specialisation.
//
// A thread block owns BN = 128 keys of one (batch, KV head) and walks the query heads of its group and
// the query blocks of BM rows (80 or 96, or 64: below) that see those keys. Three warpgroups:
//   producer  (warpgroup 0): gives registers back; one thread TMA-loads K and V once, then streams the
//             (Q, dO) blocks through a 2-stage ring ("full" / "empty" mbarriers); one thread per consumer
//             (warps 1 and 2) adds that consumer's dQ tiles to the accumulator (below);
//   consumers (warpgroups 1 and 2): each owns 64 of the keys and, per query block, computes
//       S^T  = K Q^T,  dP^T = V dO^T            (64 keys x 64 queries; both operands in shared memory)
//       P^T  = 2^(S^T c - lse log2 e),  dS^T = P^T o (dP^T - D)        (registers; D = rowsum(dO o O))
//       (softcap: logits t = tanh(S^T softcap_pre), P^T = 2^(t c - lse log2 e) and dS^T carries the
//       derivative of the cap, o (1 - t^2); c = softcap log2 e, cuflash/_params.logit_scales)
//       dV  += P^T dO,  dK += dS^T Q           (P^T, dS^T fed from registers; dO, Q read MN-major)
//     and writes dS^T to shared memory; then, over all BN keys (both consumers' dS^T),
//       dQ   = dS K, one 64-column atom per consumer (both operands MN-major),
//     added to the fp32 dQ accumulator (common/bwd_aux.cu zeroes it first, converts it last) through
//     shared memory, one TMA reduce-add per 32-column box (2.4x faster than atomics on the H200). Each
//     dQ element is added once per block and step (version 0 added two 64-key halves: twice the traffic).
//     The consumer stages its dQ tile in one of two buffers and goes on; the producer warpgroup's dQ
//     writer for that consumer issues the reduce-add and frees the buffer once TMA has read it.
//     Order within a step (FlashAttention-3's): dV goes to the tensor cores as soon as P^T exists, under
//     dS^T's arithmetic, and dK after dQ, so dQ's staging runs under dK (softcap: dV, dK after dS^T).
//   The LSE and D rows of each (Q, dO) block arrive with it through the ring (flat row tensor maps), not by
//   loads from the consumers that the S^T GEMM could not hide.
//   At the end dK (times the softmax scale) and dV are stored from registers.
//   Deterministic mode (p.dq_semaphore set): the K blocks that touch a Q block add their dQ shares in
//   descending block order, each waiting on a per-(Q block, dQ atom) counter, so dQ is bit-identical run
//   to run. Descending because a K block walks its Q blocks upwards from the first that sees it: under a
//   causal mask or a window, K block n + 1 reaches Q block m before K block n does, so in this order no
//   block waits for one that is behind it. Blocks are launched highest first in this mode, so a block only
//   ever waits for one launched before it (no deadlock when a head's blocks outnumber the SMs). Without a
//   mask every K block would start at Q block 0 and wait for the chain above it: there, when a head's K
//   blocks all fit on the GPU, they walk their Q blocks rotated instead (p.rotate_q_blocks,
//   common/dq_order.cuh). The waiting, the add and the wait for its completion are the dQ writer's; the
//   consumers do not stall while a staging buffer is free.
//   Variable length (CUFLASH_VARLEN): packed (total, heads, d) inputs, each block finds its sequence through
//   cu_seqlens (common/seqlen.cuh) and works in that sequence's rows; the padded LSE / D rows of a
//   sequence start at lse_row0 (cuflash/fa3.py builds them).
// Not yet: dropout, a persistent schedule, overlap between the consumers (bench/NOTES.md).
//
// Compile-time constants (cuflash/fa3.py): CUFLASH_HEADDIM (64, 96, 128; 192 and 256: fa3/bwd_wide.cu),
// CUFLASH_DTYPE, CUFLASH_SOFTCAP (0/1), CUFLASH_VARLEN (0/1), CUFLASH_BLOCK_M (64/80/96), CUFLASH_DQ_STAGES,
// CUFLASH_SMEM_BYTES.
#include "fa3/bwd_roles.cuh"

constexpr int D = CUFLASH_HEADDIM;
constexpr bool SOFTCAP = CUFLASH_SOFTCAP;
constexpr bool VARLEN = CUFLASH_VARLEN;
// Query rows per step (heuristics.FA3_BWD_BLOCK_M): 80 at d = 96 / 128 (FlashAttention-3's tile at d = 128)
// and 96 at d = 64 -- more work per step over the same barriers, LSE reads and dQ hand-offs than 64: +4-12 %
// on the H200 -- or 64 with a softcap (registers). Other than 64, dQ is computed transposed, dQ^T = K^T
// dS^T (the head dim as the wgmma's M, which must be 64), and staged for its writer from the transposed
// registers.
constexpr int BM = CUFLASH_BLOCK_M;
constexpr bool DQ_TRANSPOSED = BM != 64;
constexpr int BN = 128;  // keys per thread block: two consumer warpgroups x 64
constexpr int STAGES = 2;
// Tiles hold whole 64-column atoms: d = 96 is stored as 128 columns whose last 32 TMA fills with zeros, and
// every product runs at DP = 128 (only d columns of dK, dV and dQ are stored): S^T and dP^T over the 96
// real columns only made ptxas spill at d = 96.
constexpr int DP = (D + 63) / 64 * 64;
constexpr int ATOMS = DP / 64;
constexpr int THREADS = 384;
constexpr int CONSUMER_WARPS = 8;
// setmaxnreg: the consumers can only take what the producer warpgroup gives back. Launched with 384
// threads a block starts at 168 registers per thread (65536 / 384 rounded down to 8); asking for more than
// that in total made the consumers' setmaxnreg wait forever (a hang, not an error).
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
// dQ tiles per consumer in flight to its writer: two where the shared memory holds them (cuflash/fa3.py)
constexpr int DQ_STAGES = CUFLASH_DQ_STAGES;
constexpr int DQ_TILE_SLOTS = 2 * DQ_STAGES;  // their DqTile records (written a step ahead of the tile)
// dS^T is stored [key][query] in atoms of 64 queries (128-byte rows); at 80 / 96 rows the second atom holds
// 16 / 32.
constexpr int DS_ATOMS = (BM + 63) / 64;
constexpr int KV_BYTES = BN * DP * 2, QB_BYTES = BM * DP * 2, DS_BYTES = DS_ATOMS * BN * 128;
constexpr int DQ_BOX_BYTES = BM * 32 * 4;  // BM rows x 32 fp32 columns: one 128-byte-swizzled box
constexpr int ROWS_PITCH = (BM + 31) / 32 * 32;  // a stage's LSE / D rows: TMA writes to 128-byte aligned addresses
static_assert(THREADS == CUFLASH_THREADS, "launcher and kernel disagree on the block size");
static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= 65536 / THREADS / 8 * 8 * THREADS,
              "the register split must fit in what the block starts with");
static_assert(DP == 64 || DP == 128, "head dims up to 128 (registers: dK and dV are 2 x DP / 2 per thread)");
static_assert(BM % 16 == 0 && BM <= 128 && (BM == 64 || !SOFTCAP), "steps of other than 64 rows: no softcap");

struct Smem {
    alignas(1024) unsigned char k[KV_BYTES];          // ATOMS atoms of [BN][64]
    alignas(1024) unsigned char v[KV_BYTES];
    alignas(1024) unsigned char q[STAGES][QB_BYTES];  // ATOMS atoms of [BM][64]
    alignas(1024) unsigned char dout[STAGES][QB_BYTES];
    alignas(1024) unsigned char ds[DS_BYTES];         // dS^T [BN keys][BM queries] as DS_ATOMS atoms of 64 queries,
                                                      // 128-byte swizzle; consumer c writes keys 64 c .. (dQ reads all)
    alignas(1024) unsigned char dq[2][DQ_STAGES][2 * DQ_BOX_BYTES];  // per consumer: dQ atoms as two boxes
    alignas(128) float lse[STAGES][ROWS_PITCH];   // the (Q, dO) block's rows of the LSE and of D, loaded with it
    alignas(128) float dsum[STAGES][ROWS_PITCH];
    u64 kv_full, qd_full[STAGES], qd_empty[STAGES];
    u64 dq_full[2][DQ_STAGES], dq_empty[2][DQ_STAGES];  // per consumer: its staged dQ tiles, to and from its writer
    DqTile dq_tile[2][DQ_TILE_SLOTS];                   // where each staged tile goes
};
static_assert(sizeof(Smem) + 1023 <= CUFLASH_SMEM_BYTES, "cuflash/fa3.py asks for too little shared memory");

// Named barriers: both consumers (256 threads) around the shared dS^T, and per consumer (128) for its dQ tile.
constexpr int DS_FREE_BAR = 1, DS_READY_BAR = 2, DQ_BAR = 3;  // DQ_BAR + consumer

// The epilogue (bwd_roles.cuh: CUFLASH_STORE_DKV_TMA): each consumer stages its 64 keys of dK and of dV
// (ATOMS atoms of [64][64] each) in the (Q, dO) ring.
constexpr bool STORE_DKV_TMA = CUFLASH_STORE_DKV_TMA;
constexpr int DKV_BYTES = 2 * ATOMS * 64 * 128;
static_assert(2 * DKV_BYTES <= 2 * STAGES * QB_BYTES, "both consumers' dK and dV fit in the (Q, dO) ring");
// (sm.dout follows sm.q with no gap: both 1024-aligned, and the ring's stages are whole multiples of 1024)
static_assert(QB_BYTES % 1024 == 0, "the (Q, dO) ring is one run of bytes");

// X^T Y^T for this consumer's 64 rows of X (K or V, [BN][D]) and the BM rows of Y (Q or dO, [BM][D]):
// a 64 x BM accumulator, both operands K-major. Asynchronous: one commit group.
// `onto_acc`: added to acc's values.
__device__ __forceinline__ void issue_xyt(float (&acc)[BM / 2], const unsigned char* x_rows, const unsigned char* y,
                                          bool onto_acc = false) {
    wgmma_abt_kmajor<BM, DP / 16>(acc, x_rows, BN * 128, y, BM * 128, onto_acc);
}

// acc (64 keys x D) += A (64 keys x BM queries, registers) Y (BM x D, read MN-major from [BM][D] atoms).
__device__ __forceinline__ void issue_acc_ay(float (&acc)[DP / 2], const u32 (&a)[BM / 16][4], const unsigned char* y) {
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<DP, 1>(acc, a[kk], wgmma_desc_mn(y + kk * 16 * 128, BM * 128), 1);
}

// The dQ atom consumer c computes at step i (the i-th (head, Q block) of this K block), or -1 for none: at
// d = 128 each consumer takes one atom, (c + i) % 2; at d = 64 the consumers take turns.
__device__ __forceinline__ int dq_atom(int c, int i) {
    if constexpr (ATOMS == 2) return (c + i) & 1;  // (not % 2: the compiler then knows a >= 0)
    return i % 2 == c ? 0 : -1;
}
// How many dQ tiles a consumer staged before step i (it owns one at every step at d = 128, every other at
// d = 64): which buffer step i's tile takes and the phase of that buffer's barriers.
__device__ __forceinline__ int dq_tile_index(int i) { return ATOMS == 2 ? i : i / 2; }

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    fa3_bwd(const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_k,
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
    // The sequence, its mask and the Q blocks this K block sees, [m_lo, m_hi): each role finds them after its
    // setmaxnreg (ptxas spilled them when they lived across it).
    int m_lo, m_hi;

    if (threadIdx.x == 0) init_bwd_barriers<STAGES, DQ_STAGES, CONSUMER_WARPS>(sm);
    __syncthreads();

    if (warpgroup == 0) {  // ---------------------------------------------------------------- producer
        regs_decrease<PRODUCER_REGS>();
        const SeqInfo seq = bwd_sequence<VARLEN>(p, batch);
        const Mask mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};
        const int shift = row_shift_of<VARLEN>(p);
        mask.q_block_range<BM, BN>(n_block, m_lo, m_hi, shift);
        const int warp = threadIdx.x / 32;
        if (threadIdx.x % 32 != 0 || warp > 2 || m_lo == m_hi) return;
        if (warp == 0) {
            load_kv_and_q_blocks<ATOMS, BM, BN, STAGES, VARLEN>(sm, &map_q, &map_k, &map_v, &map_do, &map_lse,
                                                                &map_dsum, p, seq, batch, kv_head, group, n_block,
                                                                m_lo, m_hi, shift);
        } else {  // the dQ writer of consumer warp - 1: its tiles (dq_atom)
            const int c = warp - 1, steps = group * (m_hi - m_lo);
            write_dq_tiles<D, 2, DQ_BOX_BYTES, DQ_STAGES, DQ_TILE_SLOTS>(sm, &map_dq, p, c,
                                                                         ATOMS == 2 ? steps : (steps + 1 - c) / 2);
        }
        return;
    }

    // ------------------------------------------------------------------------------------- consumers
    regs_increase<CONSUMER_REGS>();
    const SeqInfo seq = bwd_sequence<VARLEN>(p, batch);
    const Mask mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};
    const int shift = row_shift_of<VARLEN>(p);  // Q block m: rows from m BM - shift (bwd_roles.cuh)
    mask.q_block_range<BM, BN>(n_block, m_lo, m_hi, shift);
    const int c = warpgroup - 1;  // which 64 keys of the block
    const int t = threadIdx.x % 128, lane = t % 32;
    const Lane ln{t / 32, lane / 4, lane % 4};
    const int key_lo = n_block * BN + c * 64 + 16 * ln.w + ln.g;  // this thread's keys: key_lo, key_lo + 8

    float dk[DP / 2], dv[DP / 2];
#pragma unroll
    for (int j = 0; j < DP / 2; ++j) dk[j] = dv[j] = 0.f;

    if (m_lo < m_hi) {
        const unsigned char* k_rows = sm.k + c * 64 * 128;  // this consumer's 64 rows of every K / V atom
        const unsigned char* v_rows = sm.v + c * 64 * 128;
        unsigned char* ds = sm.ds + c * 64 * 128;  // this consumer's 64 key rows of each dS^T atom
        mbar_wait(&sm.kv_full, 0);
        // Step i: Q block m of the group's (i / (m_hi - m_lo))-th query head (the consumers need only m; two
        // nested loops kept a head counter live, which ptxas spilled). The step's place within the head, qi,
        // and the head, h_i, are counted along (uniform registers) instead of divided out at every step.
        const int m_count = m_hi - m_lo, steps = group * m_count;
        const float inv_scale_log2 = 1.f / p.scale_log2;  // (FOLD_COLUMNS)
        int qi = 0, h_i = 0;
        for (int i = 0; i < steps; ++i, qi = qi + 1 == m_count ? 0 : qi + 1, h_i += qi == 0) {
            const int m = step_q_block(p, qi, n_block, m_lo, m_hi), s = i % STAGES;
            // Where this step's dQ tile goes, for the writer, while few registers are live (at the end of
            // the step it made ptxas spill). Slot tile % DQ_TILE_SLOTS: this consumer staged the tile two
            // before this one only once the writer had read that one's slot.
            if (t == 0 && dq_atom(c, i) >= 0) {
                const int h = kv_head * group + h_i, a = dq_atom(c, i);
                DqTile& tile = sm.dq_tile[c][dq_tile_index(i) % DQ_TILE_SLOTS];
                tile.col = a * 64;
                tile.row = seq.q_start + m * BM;  // (dq_accum holds the shift's padding rows before row 0)
                tile.head = VARLEN ? h : batch * p.heads + h;
                if (p.dq_semaphore) dq_turn<BM, BN>(tile, p, mask, n_block, batch, h, m, a, ATOMS, shift);
            }
            mbar_wait(&sm.qd_full[s], (i / STAGES) & 1);
            // The block's LSE and D columns are read before S^T and dP^T are issued: the wgmma waits order
            // every later load after them, and the first exponent waited on these reads (ncu: ~10 % of the
            // d = 64 consumers' stall samples at the LDS and the FFMA behind it). Above 64 rows the GEMMs start
            // from them instead, S^T from -lse / (scale log2 e) and dP^T from -D, so that neither is live
            // beside the accumulators (ptxas serialised the wgmmas there: too few registers); each starting
            // value in a register of its own (own_register: shared ones, copied beside the in-flight S^T
            // wgmma, made ptxas wait for it, C7517).
            constexpr bool FOLD_COLUMNS = BM != 64;
            float lse2[BM / 8][2], dsum[BM / 8][2];
            float st[BM / 2], dpt[BM / 2];
            if constexpr (!SOFTCAP) {
                column_values<BM, BM>(lse2, sm.lse[s], -neg_inf(), m, 0, ln, seq, shift);
                column_values<BM, BM>(dsum, sm.dsum[s], 0.f, m, 0, ln, seq, shift);
                if constexpr (FOLD_COLUMNS) {
#pragma unroll
                    for (int j = 0; j < BM / 2; ++j) {
                        // (a finite start for rows without probability, LSE +inf: -inf in the accumulator
                        // is not something to rely on)
                        st[j] = own_register(-fminf(lse2[j / 4][j % 2], 1e30f) * inv_scale_log2);
                        dpt[j] = own_register(-dsum[j / 4][j % 2]);
                    }
#pragma unroll
                    for (int j = 0; j < BM / 8; ++j) lse2[j][0] = lse2[j][1] = 0.f;
                }
            }
            issue_xyt(st, k_rows, sm.q[s], FOLD_COLUMNS);
            issue_xyt(dpt, v_rows, sm.dout[s], FOLD_COLUMNS);

            // P^T, then dV += P^T dO on the tensor cores while dS^T is formed, and dK += dS^T Q after dQ so
            // that dQ's staging runs under it (FlashAttention-3's order). With a softcap P^T needs dP^T first
            // (probabilities_and_ds) and both follow dS^T at once, dK before dQ (the other order spills
            // there: 200-270 bytes at d = 96 / 128).
            u32 pa[BM / 16][4], dsa[BM / 16][4];
            auto issue_dk = [&]() {
                wgmma_fence();
                issue_acc_ay(dk, dsa, sm.q[s]);
                wgmma_commit();
            };
            auto release_slot = [&]() {
                wgmma_wait<0>();  // dV, dK: P^T and dS^T leave the registers
                wgmma_fence_regs(dk);
                wgmma_fence_regs(dv);
                if (lane == 0) mbar_arrive(&sm.qd_empty[s]);  // Q and dO of this slot are no longer read
            };
            if constexpr (SOFTCAP) {
                probabilities_and_ds<BM, BN, SOFTCAP, BM>(st, dpt, sm.lse[s], sm.dsum[s], m, n_block, 0, key_lo, ln,
                                                          seq, mask, p, shift);
                acc_to_a_frags<BM>(st, pa);
                acc_to_a_frags<BM>(dpt, dsa);
                wgmma_fence();
                issue_acc_ay(dv, pa, sm.dout[s]);
                issue_acc_ay(dk, dsa, sm.q[s]);
                wgmma_commit();
            } else {
                wgmma_wait<1>();  // S^T
                wgmma_fence_regs(st);
                probabilities<BM, BN, SOFTCAP, BM>(st, lse2, m, n_block, 0, key_lo, ln, mask, p, shift);
                acc_to_a_frags<BM>(st, pa);
                wgmma_fence();
                issue_acc_ay(dv, pa, sm.dout[s]);
                wgmma_commit();
                wgmma_wait<1>();  // dP^T (dV stays in flight)
                wgmma_fence_regs(dpt);
                if constexpr (!FOLD_COLUMNS) subtract_dsum<SOFTCAP, BM>(dpt, st, dsum);
#pragma unroll
                for (int j = 0; j < BM / 2; ++j) dpt[j] *= st[j];
                acc_to_a_frags<BM>(dpt, dsa);
            }

            // dS^T to shared memory for dQ: both consumers' dQ GEMMs of the last step, which read both
            // halves of sm.ds, are done (each waited for its own before arriving here).
            named_sync(DS_FREE_BAR, 256);
#pragma unroll
            for (int j = 0; j < BM / 8; ++j)  // (16-byte chunk j of the key's row: 8 queries)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int key = 16 * ln.w + ln.g + 8 * hh;
                    *reinterpret_cast<u32*>(ds + (j / 8) * BN * 128 + key * 128 + (((j % 8) ^ (key % 8)) * 16) +
                                            4 * ln.q4) = dsa[j / 2][2 * (j % 2) + hh];
                }
            fence_async_smem();
            named_sync(DS_READY_BAR, 256);  // dS^T of all BN keys is in sm.ds
            if constexpr (SOFTCAP) release_slot();  // before dQ's accumulators are live (registers)

            // dQ (BM x D) = dS (BM x BN keys) K (BN keys x D), one 64-column atom of dQ per consumer over
            // all BN keys, so the block adds each dQ element once (per-consumer halves over 64 keys each
            // added twice the bytes); dq_atom says which. A = dS^T read MN-major from both halves of
            // sm.ds, B = K MN-major (above 64 rows: the transpose, A = K^T and B = dS^T, both MN-major too); the
            // descriptors advance from one base each (hoisting all 16 cost ptxas registers: spills). Then
            // (without a softcap) dK, whose wgmmas run while dQ is staged.
            const int a = dq_atom(c, i);
            if (a >= 0) {
                const int tile = dq_tile_index(i), buf = tile % DQ_STAGES;
                mbar_wait(&sm.dq_empty[c][buf], ((tile / DQ_STAGES) & 1) ^ 1);  // the writer is done with it
                const u64 desc_ds = wgmma_desc_mn(sm.ds, DQ_TRANSPOSED ? BN * 128 : 64 * 128);
                const u64 desc_k = wgmma_desc_mn(sm.k + a * BN * 128, BN * 128);
                float dq[BM / 2];
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk) {
                    const u64 ds_kk = wgmma_desc_advance(desc_ds, kk * 16 * 128);
                    const u64 k_kk = wgmma_desc_advance(desc_k, kk * 16 * 128);
                    // dQ^T (64 columns x BM rows) = K^T dS^T, or dQ (64 rows x 64 columns) = dS K
                    wgmma_ss_mn<BM>(dq, DQ_TRANSPOSED ? k_kk : ds_kk, DQ_TRANSPOSED ? ds_kk : k_kk, kk > 0);
                }
                wgmma_commit();
                if constexpr (!SOFTCAP) issue_dk();
                unsigned char* dq_tile = sm.dq[c][buf];
                wgmma_wait<SOFTCAP ? 0 : 1>();  // dQ (and dV; without a softcap dK stays in flight)
                wgmma_fence_regs(dq);
                // Two boxes of the dQ tensor map (BM rows x 32 fp32, 128-byte swizzle: 16-byte chunk c of
                // row r at c ^ (r % 8)).
                if constexpr (DQ_TRANSPOSED) {
                    // This thread holds dQ^T at columns col, col + 8 and rows 8 j + 2 q4 + e: one fp32 store
                    // each (a warp's 32 land in 8 distinct chunks of 4 rows: no bank conflicts).
#pragma unroll
                    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
                        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const int col = 16 * ln.w + ln.g + 8 * hh, r = 8 * j + 2 * ln.q4 + e;
                                const int chunk = ((col % 32) / 4) ^ (r % 8);
                                *reinterpret_cast<float*>(dq_tile + (col / 32) * DQ_BOX_BYTES + r * 128 + chunk * 16 +
                                                          4 * (col % 4)) = dq[4 * j + 2 * hh + e];
                            }
                } else {
                    stage_dq_rows<DQ_BOX_BYTES>(dq_tile, dq, ln);
                }
                fence_async_smem();
                named_sync(DQ_BAR + c, 128);
                if (t == 0) mbar_arrive(&sm.dq_full[c][buf]);  // to this consumer's dQ writer
            } else if constexpr (!SOFTCAP) {  // (dK in each branch: issued once after a dQ under a condition,
                issue_dk();                      // it made ptxas serialise every wgmma, C7514)
            }
            if constexpr (!SOFTCAP) release_slot();
        }
    }

    if constexpr (STORE_DKV_TMA) {
        named_sync(DS_FREE_BAR, 256);  // both consumers are past their last GEMM on the ring
        store_dkv_tma<DP>(sm.q[0] + c * DKV_BYTES, &map_dk, &map_dv, dk, dv, p.scale, t, ln, DQ_BAR + c,
                          /*col0=*/0, /*col_end=*/D, n_block * BN + c * 64, kv_head, batch);
        return;
    }
    // dK = scale * sum dS^T Q and dV for this thread's two keys; keys past the end are not stored. (The
    // sequence is looked up again: kept through the loop, its start made ptxas spill.)
    const SeqInfo kv_seq = bwd_sequence<VARLEN>(p, batch);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key_lo + 8 * r;
        if (key >= kv_seq.seqlen_k) continue;
        const i64 row = i64(kv_seq.k_start) + key;
        u16* dk_row = p.dk + batch * p.dk_batch_stride + kv_head * p.dk_head_stride + row * p.dk_row_stride;
        u16* dv_row = p.dv + batch * p.dv_batch_stride + kv_head * p.dv_head_stride + row * p.dv_row_stride;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const int col = 8 * j + 2 * ln.q4;
            *reinterpret_cast<u32*>(dk_row + col) = elem_t::pack2(dk[4 * j + 2 * r] * p.scale, dk[4 * j + 2 * r + 1] * p.scale);
            *reinterpret_cast<u32*>(dv_row + col) = elem_t::pack2(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
        }
    }
}
