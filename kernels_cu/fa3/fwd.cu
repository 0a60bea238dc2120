// FA3-style attention forward for Hopper (sm_90a): TMA, an mbarrier ring, warp specialisation, wgmma.
//
// A persistent grid (about one thread block per SM, common/tile_scheduler.cuh) walks the tiles of
// BLOCK_M = 64 x CONSUMERS query rows of one (batch, head); each thread block runs 1 + CONSUMERS warpgroups:
//   producer  (warpgroup 0): gives registers back (setmaxnreg.dec); one thread TMA-loads the Q tile once
//             and streams the K and V tiles the rows can see through a STAGES-deep shared-memory ring,
//             each tile completing a "full" mbarrier, each K or V slot waiting on its own "empty"
//             mbarrier first (a K slot frees as soon as S is computed, well before its V);
//   consumers (warpgroups 1 .. CONSUMERS, 64 rows each): take registers (setmaxnreg.inc) and run the online
//             softmax over the K/V tiles with two overlaps:
//     - within a warpgroup, iteration n issues S_n = Q K_n^T and O += P_{n-1} V_{n-1} together (both
//       asynchronous wgmma), then computes the softmax of S_n while the tensor cores finish P_{n-1} V_{n-1};
//     - between the consumer warpgroups ("pingpong"), a named barrier per consumer makes them take turns
//       issuing their GEMMs (0, 1, .., 0, ...), so one warpgroup's softmax runs while another's GEMMs occupy
//       the tensor cores. Two consumers (240 registers each) is the rule; three (160 each: d = 64, where
//       the softmax of a tile outlasts its GEMMs) keep two softmaxes going beside one warpgroup's GEMMs.
// Tiles in shared memory are atoms of 128-byte rows with the 128-byte swizzle that TMA writes and wgmma
// reads (common/hopper.cuh). The epilogue stores O through shared memory with TMA where it can (STORE_O_TMA).
//
// FP8 variants (CUFLASH_FP8, issue 9): Q, K and V are e4m3 bytes and both GEMMs run on FP8 wgmma (k = 32,
// twice the bf16 rate). FP8 wgmma reads shared-memory operands K-major only, so V arrives transposed, as
// V^T [d][keys] tiles written by a pre-pass (fa3/fp8_transpose_v.cu) in the key order that lets P go from
// the S accumulator to 8-bit A fragments without shuffles (acc_to_a_frags_fp8). Descale factors: a query
// row's (per Q block) and a K tile's (per K block) multiply S into logits (one factor per row and tile);
// V's (per V block) is kept out of the accumulation by holding O in units of the current tile's V descale
// (O *= alpha vs_{n-1} / vs_n at each rescale) and applying the last one with 1 / l. O is bf16. FP8 wgmma
// keeps only about 14 bits of its accumulator when it adds products to it (the DeepSeek-V3 report measured
// this on Hopper), so O carried through thousands of P V GEMMs decays: a key holding most of a row's weight
// early in 4M keys lost three quarters of it. Each tile's P V therefore goes into a fresh accumulator that
// is added to O in fp32 (O = O alpha + P V, one FFMA an element, which is the rescale O needed anyway; at
// d = 256, without the overlap, O is rescaled and the parts of P V added). Long rows at d = 128 take
// 256-key tiles without the overlap (S 128 + O 64 + P 32 registers; P V through S's): a consumer's softmax
// runs alone on its sub-partitions under the pingpong, and its fixed costs (the row maxima's chains and
// shuffles, the GEMM waits, O's FFMA) spread over twice the keys. A tile has one K and one V descale: K / V
// descale blocks are whole tiles (cuflash/fa3.py picks 128-key tiles for blocks that 256 does not divide).
// Long rows at d = 256 with at most heuristics.FA3_FP8_P_SMEM_MAX_SEQLEN_K keys take the overlap instead,
// with P through shared memory and O in the wgmma's accumulator (P_SMEM below): faster, at the cost of the
// decay over many keys.
//
// Compile-time constants (cuflash/fa3.py): CUFLASH_HEADDIM (64, 96, 128, 192, 256), CUFLASH_HEADDIM_V (of V
// and O when it differs: fa3.FWD_HEADDIM_V), CUFLASH_BLOCK_N, CUFLASH_CONSUMERS (2, 3),
// CUFLASH_STAGES, CUFLASH_DTYPE (of O; of Q, K, V too unless FP8), CUFLASH_SOFTCAP (0/1), CUFLASH_VARLEN
// (0/1), CUFLASH_STORE_O_TMA (0/1), CUFLASH_PACK_GQA (0/1), CUFLASH_FP8 (0/1), CUFLASH_INTRA_WG_OVERLAP (0/1),
// CUFLASH_TAIL_SPLIT (0/1: the stream-K tail of calls without a mask),
// CUFLASH_PINGPONG (0/1), CUFLASH_P_SMEM (0/1), CUFLASH_EXP2_EMU (0: every exponential on the SFU; k: one
// column group in k on the FMA pipe), CUFLASH_MAX_CHAINS (row maxima in this many FMNMX chains; 1 unless a
// probe asks), CUFLASH_FAST_TILE_DIV (0/1: the tile order by FastDivmods; 1 unless FP8 or the tiles say 0),
// CUFLASH_Q_STAGES (1/2: Q buffers; 1 unless the tiles say 2).
#include "common/hopper.cuh"
#include "common/mask.cuh"
#include "common/poly_exp2.cuh"
#include "common/ptx.cuh"
#include "common/seqlen.cuh"
#include "common/tile_scheduler.cuh"
#include "fa3/params.cuh"

constexpr int D = CUFLASH_HEADDIM;  // of Q and K
#ifndef CUFLASH_HEADDIM_V
#define CUFLASH_HEADDIM_V CUFLASH_HEADDIM
#endif
#ifndef CUFLASH_EXP2_EMU
#define CUFLASH_EXP2_EMU 0
#endif
// The softmax computes the exponentials of one group of 8 key columns in EXP2_EMU on the FMA pipe
// (poly_exp2), the rest on the special-function unit; 0: all on the SFU. Where the softmax, not the GEMMs,
// bounds a tile (d = 64, FP8), the SFU's 16 exponentials per clock are its narrowest unit.
constexpr int EXP2_EMU = CUFLASH_EXP2_EMU;
#ifndef CUFLASH_MAX_CHAINS
#define CUFLASH_MAX_CHAINS 1
#endif
// A row's maximum over its 2 BN / 8 scores in this many independent chains of FMNMX, joined at the end: one
// chain is 2 BN / 8 dependent instructions (17 at BN = 128), which a lone softmax warp waits out (ncu, FP8
// d = 128: FMNMX 13 % of the stall samples). A tuning switch (scripts/ab_probe.py); 1 = one chain.
constexpr int MAX_CHAINS = CUFLASH_MAX_CHAINS;
#ifndef CUFLASH_SPECULATIVE_MAX
#define CUFLASH_SPECULATIVE_MAX 0
#endif
// In tiles every row of a warpgroup sees whole, the exponentials of S_n start from the running max of the
// tiles before instead of waiting for S_n's own max (OnlineSoftmax::speculate): the max chain and its quad
// shuffles leave the softmax's critical path. heuristics.FA3_TILES takes it where it measured faster (bf16
// d = 128, most at N = 2k); FP8's 256-key tiles lost 2-4 % with it (their two consumers' softmaxes share the
// SFU, which one's max phase was not leaving idle). With the intra-warpgroup overlap the rare recompute of S
// also waits for the P V in flight (which reads P_{n-1} and O, not S).
constexpr bool SPECULATIVE_MAX = CUFLASH_SPECULATIVE_MAX;
// A row whose max rose by at most SPEC_HEADROOM (log2 units) keeps the old max: its P is at most 2^8, which
// e4m3 (448) and bf16 hold; beyond that S is recomputed.
constexpr float SPEC_HEADROOM = 8.f;
constexpr int DV = CUFLASH_HEADDIM_V;  // of V and O (d_v; d_qk unless the launcher asks otherwise)
static_assert(DV % 16 == 0, "O is stored two 8-column groups at a time");
constexpr bool FP8 = CUFLASH_FP8;
constexpr int ELEM_BYTES = FP8 ? 1 : 2;         // of Q, K, V
constexpr int ATOM_COLS = 128 / ELEM_BYTES;     // elements per 128-byte atom row
// Tiles hold whole atoms: d = 96 (bf16) is stored as 128 columns whose last 32 TMA fills with zeros (the
// tensor map's row is 96 wide), d = 64 (FP8) as 128. S = Q K^T runs over the d real columns only; in
// bf16, O += P V runs at N = DVP (d_v padded the same way) and the extra output columns (zeros) are not
// stored.
constexpr int DP = (D + ATOM_COLS - 1) / ATOM_COLS * ATOM_COLS;
constexpr int DVP = (DV + ATOM_COLS - 1) / ATOM_COLS * ATOM_COLS;
constexpr int OD = FP8 ? D : DVP;               // columns of the O accumulator (FP8: N = d of V^T's rows)
constexpr int CONSUMERS = CUFLASH_CONSUMERS;  // consumer warpgroups, 64 query rows each
constexpr int BM = 64 * CONSUMERS;
constexpr int BN = CUFLASH_BLOCK_N;
constexpr int STAGES = CUFLASH_STAGES;
constexpr bool SOFTCAP = CUFLASH_SOFTCAP;
constexpr bool VARLEN = CUFLASH_VARLEN;  // packed (total, heads, d) inputs, sequences found by cu_seqlens
// The epilogue stages O in shared memory and stores it with TMA (whole 128-byte rows, asynchronous: the
// warpgroup moves on to its next tile) where shared memory allows (cuflash/fa3.py decides: not at
// d = 256) and rows past a sequence's end fall out of bounds (not in packed batches, where they are the
// next sequence's rows); otherwise each thread stores its registers.
constexpr bool STORE_O_TMA = CUFLASH_STORE_O_TMA;
static_assert(!(STORE_O_TMA && VARLEN), "packed batches store O from registers");
// GQA packing (few query rows, several query heads per KV head): a tile's BM rows are (query, head) pairs
// of one KV head's group, row r = query r / group of head r % group, so the group shares each K/V tile
// and short sequences still fill the tile. Q arrives through a (d, heads, seqlen, batch) tensor map whose
// box is (64, group, BM / group); O is stored from registers.
constexpr bool PACK_GQA = CUFLASH_PACK_GQA;
static_assert(!(PACK_GQA && (VARLEN || STORE_O_TMA)), "GQA packing: fixed-length batches, O from registers");
static_assert(!(FP8 && (SOFTCAP || VARLEN || PACK_GQA)), "FP8: fixed-length batches, no softcap");
// The stream-K tail (common/tile_scheduler.cuh TailSplit): compiled into the variants that calls without a
// mask take (cuflash/fa3.py fill_tail sets tail_units for those calls only).
constexpr bool TAIL_SPLIT = CUFLASH_TAIL_SPLIT;
static_assert(!(TAIL_SPLIT && (FP8 || VARLEN || PACK_GQA)), "the tail: fixed-length bf16 / fp16 batches, unpacked");
// FP8: a V^T tile is VT_ATOMS atoms of [D rows][128 keys] (a 128-byte swizzle atom holds 128 keys of a row)
static_assert(!FP8 || BN % 128 == 0, "FP8: V^T tile rows are whole 128-byte atoms of keys");
constexpr int VT_ATOMS = FP8 ? BN / 128 : 1;
static_assert(!FP8 || DV == D, "FP8: V has the head dim of Q and K");
constexpr int ATOMS = DP / ATOM_COLS;  // atoms per row of a Q or K tile
constexpr int V_ATOMS = DVP / ATOM_COLS;  // of a V tile (bf16 / fp16)
constexpr int O_ATOMS = OD / 64;       // 64-column atoms of the 16-bit O staged for the TMA store
constexpr int THREADS = 128 * (1 + CONSUMERS);
constexpr int CONSUMER_WARPS = 4 * CONSUMERS;
// setmaxnreg: the producer keeps 24 registers per thread, the consumers share the rest of the 64K
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = CONSUMERS == 2 ? 240 : 160;
static_assert(CONSUMERS == 2 || CONSUMERS == 3, "two or three consumer warpgroups");
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= 65536, "the register split fits the SM");
#ifndef CUFLASH_Q_STAGES
#define CUFLASH_Q_STAGES 1
#endif
// Q buffers. With one, the producer loads tile j + 1's Q, and behind it tile j + 1's K / V, only once tile j's
// last S GEMM has read Q: a tile's first loads start under its predecessor's last P V and epilogue. With two
// (heuristics.Fa3Tiles.q_stages) they start as soon as tile j's K / V are issued and the ring has room, a
// whole tile earlier, which counts where tiles are a few K tiles long (short causal rows).
constexpr int Q_STAGES = CUFLASH_Q_STAGES;
static_assert(Q_STAGES == 1 || Q_STAGES == 2, "one or two Q buffers");
constexpr int Q_BYTES = BM * DP * ELEM_BYTES, K_BYTES = BN * DP * ELEM_BYTES;
constexpr int V_BYTES = FP8 ? D * BN : BN * DVP * ELEM_BYTES;  // FP8: a V^T tile, d rows of BN keys
constexpr int O_BYTES = BM * OD * 2;
constexpr int QK_STEPS = D * ELEM_BYTES / 32;    // 32-byte k-steps of S = Q K^T
// Within a warpgroup, S_n = Q K_n^T runs while P_{n-1} V_{n-1} does, which keeps S, P_{n-1} and O in
// registers at once. Without it (CUFLASH_INTRA_WG_OVERLAP 0; FP8 at d = 256, whose O 128 + S 64 + P 16
// registers per thread do not fit a consumer's 240 together) P V completes before S is issued and only the
// pingpong overlaps the softmax with GEMMs.
constexpr bool INTRA_WG_OVERLAP = CUFLASH_INTRA_WG_OVERLAP;
constexpr int PV_STEPS = BN * ELEM_BYTES / 32;   // k-steps of O += P V (16 or 32 keys each)
// FP8: the fresh per-tile P V accumulator (see the top comment) has all of O's columns with the overlap
// (S, P, O and P V fit: 64 + 16 + 64 + 64 registers at d = 128); without it it is S's registers, idle then,
// taking PV_N of O's columns at a time (d = 256: BN = 128 of its 256; d = 128 with 256-key tiles: all 128).
constexpr int PV_N = BN < OD ? BN : OD;
#ifndef CUFLASH_P_SMEM
#define CUFLASH_P_SMEM 0
#endif
// FP8 with the overlap, P_SMEM: P_{n-1} goes to shared memory (its A fragments, by stmatrix) and O += P V
// reads it there into O itself, as bf16 accumulates: no P registers and no fresh accumulator live through
// the softmax of S_n, only S and O (d = 256 on 128 keys: 64 + 128 registers, where P and the fresh
// accumulator beside them did not fit; d = 128 on 256 keys: 128 + 64, measured level with its no-overlap
// tiles). The price is the long-row decay the fresh accumulator avoids (top comment): O passes through the
// tensor cores' ~14-bit accumulation every tile, so cuflash/fa3.py takes these tiles for rows of at most
// heuristics.FA3_FP8_P_SMEM_MAX_SEQLEN_K keys.
constexpr bool P_SMEM = CUFLASH_P_SMEM;
static_assert(!P_SMEM || (FP8 && INTRA_WG_OVERLAP), "P through shared memory: FP8 with the overlap");
constexpr bool FRESH_PV = FP8 && !P_SMEM;  // FP8: each tile's P V in a fresh accumulator, added to O in fp32
static_assert(!FP8 || INTRA_WG_OVERLAP || OD % PV_N == 0, "FP8 without the overlap: P V in parts of PV_N columns");
static_assert(THREADS == CUFLASH_THREADS, "launcher and kernel disagree on the block size");
static_assert(D % 32 == 0 && BN % 16 == 0 && BN <= 256, "d is whole 32-byte k-steps; BN is a wgmma N");

struct Smem {
    alignas(1024) unsigned char q[Q_STAGES][Q_BYTES];  // ATOMS atoms of [BM][128 bytes]
    alignas(1024) unsigned char k[STAGES][K_BYTES];    // ATOMS atoms of [BN][128 bytes]
    alignas(1024) unsigned char v[STAGES][V_BYTES];    // as k; FP8: [D][BN keys]
    // per consumer: O_ATOMS atoms of [64][64]; without the TMA store a 16-byte placeholder
    alignas(STORE_O_TMA ? 1024 : 16) unsigned char o[STORE_O_TMA ? O_BYTES : 16];
    // P_SMEM: per consumer, P_{n-1} as BN / 128 atoms of [64 rows][128 bytes] (K-major, 128-byte swizzle)
    alignas(P_SMEM ? 1024 : 16) unsigned char p[P_SMEM ? CONSUMERS * 64 * BN : 16];
    u64 q_full[Q_STAGES], q_empty[Q_STAGES], k_full[STAGES], v_full[STAGES], k_empty[STAGES], v_empty[STAGES];
};
// The launcher's dynamic shared memory must hold Smem after aligning the base to 1024 bytes.
static_assert(sizeof(Smem) + 1023 <= CUFLASH_SMEM_BYTES, "cuflash/fa3.py asks for too little shared memory");

// Pingpong: consumer c waits on named barrier PINGPONG_BAR + c before issuing its GEMMs and, once they
// are issued, arrives on the next consumer's barrier (c + 1, wrapping). Each barrier has two parties, the
// consumer that waits and the one before it (2 x 128 threads).
constexpr int PINGPONG_BAR = 1;
constexpr int EPILOGUE_BAR = PINGPONG_BAR + CONSUMERS;  // + consumer: the 128 threads of one consumer warpgroup
// CUFLASH_PINGPONG 0 leaves the consumers to issue whenever they are ready (a tuning switch: FP8's
// GEMMs are half as long as bf16's, so the turns may cost more than they hide).
constexpr bool PINGPONG = CUFLASH_PINGPONG;
#ifndef CUFLASH_TURN_FENCE
#define CUFLASH_TURN_FENCE 0
#endif
// Without the pingpong, TURN_FENCE leaves a compiler fence where a consumer would wait for its turn: it
// keeps ptxas from moving the loop's loads and address arithmetic across it, which at the register file's
// edge decides whether ptxas serialises the wgmma (FP8 d = 128 on 256-key tiles: NVRTC 13.5 does without
// the fence, 13.0 does with a fence at the turn's hand-off too).
constexpr bool TURN_FENCE = CUFLASH_TURN_FENCE;
#ifndef CUFLASH_FAST_TILE_DIV
#define CUFLASH_FAST_TILE_DIV (!CUFLASH_FP8)
#endif
// The tile order's divisions by the host's FastDivmods (TileScheduler::tile) instead of `/` and `%`: ~90
// instructions less per tile in every warp (heuristics.Fa3Tiles.fast_tile_div; see OnlineSoftmax::lse for FP8).
constexpr bool FAST_TILE_DIV = CUFLASH_FAST_TILE_DIV;
#ifndef CUFLASH_IDLE_WG_SKIP
#define CUFLASH_IDLE_WG_SKIP (CUFLASH_CONSUMERS == 3)
#endif
// A consumer warpgroup with no row of the sequence sits the tile out (idle_through_tile): with three of them
// (192-row tiles) a tile's last 64 rows are past the end at N = 512, 1k (1024 = 5 x 192 + 64: two of three)
// and other lengths, or before row 0 (the row shift). Two-warpgroup tiles (128 rows) leave it out.
constexpr bool IDLE_WG_SKIP = CUFLASH_IDLE_WG_SKIP;
__device__ __forceinline__ void wait_my_turn(int c) {
    if constexpr (PINGPONG)
        named_sync(PINGPONG_BAR + c, 256);
    else if constexpr (TURN_FENCE)
        asm volatile("" ::: "memory");
}
__device__ __forceinline__ void pass_the_turn(int c) {
    if constexpr (PINGPONG) named_arrive(PINGPONG_BAR + (c == CONSUMERS - 1 ? 0 : c + 1), 256);
}

// ---------------------------------------------------------------------------------------------------
// Consumer steps. A consumer warpgroup holds 64 query rows; each thread two of them (row_lo, row_lo + 8)
// and, of a 64 x N accumulator, element 4j + e = (row row_lo + 8 (e / 2), column 8 j + 2 q4 + e % 2).

// S = Q K^T for one K tile (asynchronous; one commit group): D / 16 k-steps, 4 per 64-column atom, 32
// bytes apart inside the atom (the zero padding of d = 96 is skipped).
__device__ __forceinline__ void issue_qk(float (&sc)[BN / 2], const unsigned char* q_rows, const unsigned char* k) {
    wgmma_abt_kmajor<BN, QK_STEPS, FP8>(sc, q_rows, BM * 128, k, BN * 128);
}

// P V for one V tile (asynchronous; one commit group): P from registers. bf16: O += P V, 16 keys per step,
// V [BN][D] read MN-major, its 64-column atoms BN x 128 bytes apart, 16 keys = 2048 bytes per step. FP8:
// acc = P V[:, columns of acc] (overwritten: the first step does not accumulate), 32 keys per step, V^T
// [D][BN] read K-major from the row of acc's first column, 32 keys = 32 bytes further along an atom of 128
// keys (the tile's VT_ATOMS atoms D x 128 bytes apart).
template <int N>
__device__ __forceinline__ void issue_pv(float (&acc)[N / 2], const u32 (&pv_a)[PV_STEPS][4], const unsigned char* v) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < PV_STEPS; ++kk) {
#if CUFLASH_FP8  // (the preprocessor: the other branch's operand shapes do not exist in this variant)
        wgmma_rs_fp8<N>(acc, pv_a[kk], wgmma_desc_advance(wgmma_desc(v + kk / 4 * D * 128), 32 * (kk % 4)), kk > 0);
#else
        wgmma_rs<N, 1>(acc, pv_a[kk], wgmma_desc_mn(v + kk * 16 * 128, BN * 128), 1);
#endif
    }
    wgmma_commit();
}

// FP8: O = O alpha + acc over the columns acc holds, O's elements from `first` on (a 64 x N accumulator's
// element i is row i % 4 / 2 of the thread's two: the layout above).
template <int N>
__device__ __forceinline__ void add_to_o(float (&o)[OD / 2], const float (&acc)[N / 2], const float (&alpha)[2],
                                         int first) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) o[first + i] = fmaf(o[first + i], alpha[i % 4 / 2], acc[i]);
}

// FP8: O = O alpha + P V now (waits for it), PV_N columns at a time through the first PV_N / 2 registers of
// S's (P is packed: S is idle). d = 256 rescales O before and passes ones (no alpha is held across the
// waits: it has no register to spare).
__device__ __forceinline__ void pv_into_o(float (&o)[OD / 2], float (&sc)[BN / 2], const u32 (&pv_a)[PV_STEPS][4],
                                          const unsigned char* v, const float (&alpha)[2]) {
    float(&acc)[PV_N / 2] = *reinterpret_cast<float(*)[PV_N / 2]>(&sc[0]);
#pragma unroll
    for (int part = 0; part < OD / PV_N; ++part) {
        issue_pv<PV_N>(acc, pv_a, v + part * PV_N * 128);  // V^T rows of 128 bytes
        wgmma_wait<0>();
        wgmma_fence_regs(acc);
        add_to_o<PV_N>(o, acc, alpha, part * PV_N / 2);
    }
}

// P_SMEM: O += P V with P from the consumer's P tile (written by store_p), V^T as issue_pv reads it.
__device__ __forceinline__ void issue_pv_smem(float (&o)[OD / 2], const unsigned char* p_tile, const unsigned char* v) {
#if CUFLASH_P_SMEM  // (FP8 wgmma shapes exist for the FP8 head dims only)
    wgmma_abt_kmajor<OD, PV_STEPS, true>(o, p_tile, 64 * 128, v, D * 128, true);
#endif
}

// P_SMEM: this warp's 16 rows of P (its A fragments) into the consumer's P tile, one stmatrix.x4 per k-step
// (matrices: rows 0-7 / 8-15 of the warp's, bytes 0-15 / 16-31 of the k-step: the fragment's registers 0-3),
// then fenced for the async proxy. Each warp's part of the P V wgmma reads its own rows only, so the warp's
// own order suffices (FlashAttention-3 syncs the warp alike); its previous P V is waited for before.
__device__ __forceinline__ void store_p(const u32 (&pv_a)[PV_STEPS][4], unsigned char* p_tile, int w, int lane) {
    const int m = lane / 8, row = 16 * w + lane % 8 + 8 * (m & 1);
    const u32 row_addr = smem_u32(p_tile) + row * 128;
#pragma unroll
    for (int kk = 0; kk < PV_STEPS; ++kk) {
        const int byte = 32 * kk + 16 * (m >> 1);  // of the row's BN keys
        stmatrix_x4(row_addr + byte / 128 * 64 * 128 + ((byte % 128 / 16) ^ (row % 8)) * 16, pv_a[kk]);
    }
    fence_async_smem();
    __syncwarp();
}

// P_n (fp32, accumulator layout) -> the A fragments of O += P V.
__device__ __forceinline__ void pack_p(const float (&sc)[BN / 2], u32 (&pv_a)[PV_STEPS][4]) {
#if CUFLASH_FP8
    acc_to_a_frags_fp8<BN>(sc, pv_a);
#else
    acc_to_a_frags<BN>(sc, pv_a);
#endif
}

// The maximum of `init` and row r's scores of this thread (sc[4 j + 2 r], sc[4 j + 2 r + 1], j < BN / 8), in
// MAX_CHAINS independent chains joined at the end.
__device__ __forceinline__ float row_max_of(const float (&sc)[BN / 2], int r, float init) {
    static_assert(MAX_CHAINS >= 1 && (BN / 8) % MAX_CHAINS == 0, "chains of equal length");
    float part[MAX_CHAINS];
#pragma unroll
    for (int c = 0; c < MAX_CHAINS; ++c) part[c] = c == 0 ? init : neg_inf();
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
        part[j % MAX_CHAINS] = fmaxf(part[j % MAX_CHAINS], fmaxf(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]));
#pragma unroll
    for (int c = 1; c < MAX_CHAINS; ++c) part[0] = fmaxf(part[0], part[c]);
    return part[0];
}

// Running max and exp-sum of this thread's two rows. Logits x are S (or tanh(S softcap_pre) with
// softcap; FP8: S times the Q and K descales), P = 2^(x scale_log2 - m scale_log2):
// cuflash/_params.logit_scales.
struct OnlineSoftmax {
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f}, alpha[2] = {1.f, 1.f};
    float pend_sum[2];  // speculate()'s sums of P until commit()

    // S_n -> P_n = exp2(S scale - m_new) in place, with the mask applied unless every (row, key) of this
    // warpgroup's rows and K tile n is visible. qrow: the query rows of this thread's two rows. Returns
    // whether O needs rescaling by alpha (a row max moved somewhere in the warp).
    __device__ __forceinline__ bool step(float (&sc)[BN / 2], const Mask& mask, bool all_visible, const int (&qrow)[2],
                                         int n, int q4, const Fa3FwdParams& p, const float (&row_scale)[2],
                                         float tile_scale) {
        if constexpr (SOFTCAP) {
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) sc[i] = tanh_approx(sc[i] * p.softcap_pre);
        }
        if (!all_visible) {  // only tiles that cross a mask edge pay for this
            // Each row's visible keys as offsets [lo, hi] from this thread's first column of the tile, so that
            // an element costs two compares against its constant offset 8 j + e and a select (Mask::visible
            // per element took the column, then three compares: H200, causal d = 64, N = 2k / 4k, +1.4 / 1.7 %).
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int first = n * BN + 2 * q4, diag = qrow[r] + mask.diag();
                const int lo = diag - mask.left - first, hi = min(mask.seqlen_k - 1, diag + mask.right) - first;
#pragma unroll
                for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (8 * j + e < lo || 8 * j + e > hi) sc[4 * j + 2 * r + e] = neg_inf();
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            // FP8: S times the row's Q descale and the tile's K descale is the logit (qk); the max of a row
            // is kept in logit units across tiles whose descales differ.
            const float qk = FP8 ? row_scale[r] * tile_scale : 1.f;
            // (bf16 starts the chain from the running max, not -inf: that form keeps d = 256 softcap varlen
            // free of spills)
            const float mx = FP8 ? fmaxf(row_max[r], quad_max(row_max_of(sc, r, neg_inf())) * qk)
                                 : quad_max(row_max_of(sc, r, row_max[r]));
            const float base = mx == neg_inf() ? 0.f : mx * p.scale_log2;
            alpha[r] = mx == row_max[r] ? 1.f : fast_exp2(row_max[r] * p.scale_log2 - base);
            row_max[r] = mx;
            const float scale_log2 = p.scale_log2 * qk;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = sc[4 * j + 2 * r + e];
                    // every EXP2_EMU-th group of columns on the FMA pipe, the rest on the SFU (poly_exp2)
                    if (EXP2_EMU > 0 && j % EXP2_EMU == EXP2_EMU - 1)
                        x = poly_exp2(x * scale_log2 - base);
                    else
                        x = fast_exp2(x * scale_log2 - base);
                    sum += x;
                }
            }
            row_sum[r] = row_sum[r] * alpha[r] + sum;
        }
        return __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f);
    }

    // SPECULATIVE_MAX, a tile every row of the warpgroup sees whole: S_n -> P_n in place with the exponentials
    // taken from the running max, and the tile's max found alongside in the same units, so no exponential
    // waits for a max chain and the quad shuffles: t = x scale_log2 - base (log2 units above the running
    // max), P = 2^t, and a row's largest t is how far its max rose. Up to SPEC_HEADROOM the old max stands
    // (P <= 2^8) and only the sums change (commit()). Beyond, or for a row with no running max yet (base
    // -inf: t and P are inf), returns true: the warpgroup (if any thread of it says so) recomputes S and
    // takes step() on the state as it was. Rare: after a row's first tiles its max seldom rises 256-fold.
    // (The max over t, not over S: S dies at its FFMA. Scaling such rows down in place instead of the
    // recompute made ptxas serialise the wgmma under NVRTC 13.0, for want of registers.)
    __device__ __forceinline__ bool speculate(float (&sc)[BN / 2], const Fa3FwdParams& p, const float (&row_scale)[2],
                                              float tile_scale) {
        if constexpr (SOFTCAP) {
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) sc[i] = tanh_approx(sc[i] * p.softcap_pre);
        }
        bool redo = false;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float qk = FP8 ? row_scale[r] * tile_scale : 1.f;  // as in step()
            const float scale_log2 = p.scale_log2 * qk, base = row_max[r] * p.scale_log2;
            float part[MAX_CHAINS], sum = 0.f;
#pragma unroll
            for (int c = 0; c < MAX_CHAINS; ++c) part[c] = neg_inf();
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = sc[4 * j + 2 * r + e];
                    x = x * scale_log2 - base;
                    part[j % MAX_CHAINS] = fmaxf(part[j % MAX_CHAINS], x);
                    x = fast_exp2(x);
                    sum += x;
                }
            }
#pragma unroll
            for (int c = 1; c < MAX_CHAINS; ++c) part[0] = fmaxf(part[0], part[c]);
            redo |= quad_max(part[0]) > SPEC_HEADROOM;  // (+inf without a running max; NaN never redoes)
            pend_sum[r] = sum;
        }
        return redo;
    }
    // speculate()'s sums join the state (the max and hence O stay as they were).
    __device__ __forceinline__ void commit() {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            alpha[r] = 1.f;
            row_sum[r] += pend_sum[r];
        }
    }

    // Row r's natural-log LSE, (m scale log2 e + log2 l) ln 2, from its quad-summed l; -inf for a row that
    // saw no key (l = 0). The epilogue's division and logarithm are the SFU's approximations (2 ulp and
    // 2^-22 absolute): the IEEE forms were ~60 instructions per tile in every warp, at short rows a few
    // per cent of the kernel. Not in FP8 variants, nor the tile order's FastDivmods (TileScheduler::tile):
    // with either, ptxas moved the FP8 d = 128 main loop's ring and descale arithmetic off the uniform
    // datapath (H200: -18 % at N = 8k).
    __device__ __forceinline__ float lse(int r, float l, float scale_log2) const {
        return l > 0.f ? (row_max[r] * scale_log2 + (FP8 ? log2f(l) : __log2f(l))) * 0.69314718055994531f : neg_inf();
    }
    // o_scale / l, the factor a row's O leaves the accumulator with (0 for a row that saw no key; l >= 1
    // otherwise: a row's max adds 1); the same SFU form as lse().
    __device__ __forceinline__ static float output_scale(float o_scale, float l) {
        return l > 0.f ? (FP8 ? o_scale / l : __fdividef(o_scale, l)) : 0.f;
    }

    __device__ __forceinline__ void rescale(float (&o)[OD / 2]) const {
#pragma unroll
        for (int j = 0; j < OD / 8; ++j) {
            o[4 * j] *= alpha[0];
            o[4 * j + 1] *= alpha[0];
            o[4 * j + 2] *= alpha[1];
            o[4 * j + 3] *= alpha[1];
        }
    }
};

// FP8 without the overlap: O = O alpha + P_{n-1} V_{n-1}; alpha joins the GEMM's FFMA where O is one part
// (d = 128), else O is rescaled first.
__device__ __forceinline__ void rescale_and_add_pv(float (&o)[OD / 2], float (&sc)[BN / 2], const u32 (&pv_a)[PV_STEPS][4],
                                                   const unsigned char* v, const OnlineSoftmax& softmax, bool rescale) {
    constexpr float one[2] = {1.f, 1.f};
    if constexpr (OD == PV_N) {
        pv_into_o(o, sc, pv_a, v, softmax.alpha);  // (alpha is 1 in every row where no rescale is due)
    } else {
        if (rescale) softmax.rescale(o);
        pv_into_o(o, sc, pv_a, v, one);
    }
}

// O o_scale / l straight from the accumulator (o_scale: FP8's last V descale, else 1) and LSE = (m scale
// log2 e + log2 l) ln 2; rows past the end of the sequence skipped (in a packed batch they belong to the next one).
// Rows count from seq.q_start.
__device__ __forceinline__ void store_output(const Fa3FwdParams& p, const float (&o)[OD / 2], const OnlineSoftmax& sm,
                                             float o_scale, const SeqInfo& seq, const int (&qrow)[2],
                                             const int (&qhead)[2], int q4, int batch) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(sm.row_sum[r]);
        const bool in_sequence = qrow[r] >= 0 && qrow[r] < seq.seqlen_q;  // (rows before 0: row_shift)
        const i64 row = i64(seq.q_start) + qrow[r];
        const int head = qhead[r];
        const float inv = OnlineSoftmax::output_scale(o_scale, l);
        u16* out = p.o + batch * p.o_batch_stride + head * p.o_head_stride + row * p.o_row_stride;
        // Column groups j, j + 1 (8 columns each, a quad's): lanes q4 and q4 ^ 1 swap one packed pair, so
        // that an even lane holds 4 consecutive columns of group j and an odd lane 4 of group j + 1: 8-byte
        // stores, with which a warp writes 32 contiguous bytes of each of its 8 rows per store instead of 16
        // (half of each 32-byte sector). The exchange runs in every lane; only rows in the sequence store.
        const bool odd = q4 & 1;
        out += 2 * (q4 & 2) + (odd ? 8 : 0);
#pragma unroll
        for (int j = 0; j < DV / 8; j += 2) {
            const u32 a = elem_t::pack2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);             // group j
            const u32 b = elem_t::pack2(o[4 * j + 4 + 2 * r] * inv, o[4 * j + 4 + 2 * r + 1] * inv);     // j + 1
            const u32 got = __shfl_xor_sync(0xffffffffu, odd ? a : b, 1);
            const u32 kept = odd ? b : a;
            if (in_sequence)  // (the lower columns are the even lane's pair)
                *reinterpret_cast<uint2*>(out + 8 * j) = odd ? make_uint2(got, kept) : make_uint2(kept, got);
        }
        if (q4 == 0 && in_sequence)
            p.lse[batch * p.row_batch_stride + head * p.row_head_stride + row] = sm.lse(r, l, p.scale_log2);
    }
}

// The TMA-store epilogue of one consumer warpgroup: O / l to its 64-row slice of sm.o in the 128-byte
// swizzle the tensor map expects (16-byte chunk c of row r at chunk c ^ (r % 8): each warp's stores hit
// 32 different banks), then one thread stores the ATOMS boxes of 64 x 64. The previous tile's store must
// have finished reading the buffer first. The LSE goes from registers as in store_output. row0: the
// warpgroup's first row, >= 0 (rows past the end the TMA store leaves out).
__device__ __forceinline__ void store_output_tma(const Fa3FwdParams& p, const TensorMap* map_o, unsigned char* o_smem,
                                                 const float (&o)[OD / 2], const OnlineSoftmax& sm, float o_scale,
                                                 int c, int t, int row0, int head, int batch) {
    const int w = t / 32, g = (t % 32) / 4, q4 = t % 4;
    if (t == 0) tma_store_wait_read();
    named_sync(EPILOGUE_BAR + c, 128);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = 16 * w + g + 8 * r;  // within the warpgroup's 64 rows
        const float l = quad_sum(sm.row_sum[r]);
        const float inv = OnlineSoftmax::output_scale(o_scale, l);
#pragma unroll
        for (int j = 0; j < OD / 8; ++j) {
            unsigned char* atom = o_smem + (j / 8) * 64 * 128;
            *reinterpret_cast<u32*>(atom + row * 128 + (((j % 8) ^ (row % 8)) * 16) + 4 * q4) =
                elem_t::pack2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
        }
        const int global_row = row0 + row;
        if (q4 == 0 && global_row < p.seqlen_q)
            p.lse[batch * p.row_batch_stride + head * p.row_head_stride + global_row] = sm.lse(r, l, p.scale_log2);
    }
    fence_async_smem();
    named_sync(EPILOGUE_BAR + c, 128);
    if (t == 0) {
#pragma unroll
        for (int a = 0; a < O_ATOMS; ++a) tma_store_4d(map_o, o_smem + a * 64 * 128, a * 64, row0, head, batch);
        tma_store_commit();
    }
}

// Stream-K tail pieces (common/tile_scheduler.cuh). A consumer warpgroup's partial in slot `slot`: per
// thread its O (unnormalised, in the accumulator layout) as OD / 8 float4, then its two rows' maxima and
// (thread-partial) sums, each float4 128 threads wide so that a warp's access is 512 contiguous bytes.
__device__ __forceinline__ float4* partial_of(const Fa3FwdParams& p, int slot, int c, int t) {
    return reinterpret_cast<float4*>(p.tail_partials) + (i64(slot) * CONSUMERS + c) * (OD / 8 + 1) * 128 + t;
}

// A piece that is not its tile's last: O and the softmax state to the slot, then the slot's flag (after
// every thread's stores are visible on the GPU).
__device__ __forceinline__ void save_partial(const Fa3FwdParams& p, int slot, int c, int t, const float (&o)[OD / 2],
                                             const OnlineSoftmax& sm) {
    float4* dst = partial_of(p, slot, c, t);
#pragma unroll
    for (int j = 0; j < OD / 8; ++j) dst[j * 128] = make_float4(o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3]);
    dst[OD / 8 * 128] = make_float4(sm.row_max[0], sm.row_max[1], sm.row_sum[0], sm.row_sum[1]);
    __threadfence();
    named_sync(EPILOGUE_BAR + c, 128);
    if (t == 0) st_release(p.tail_flags + slot * CONSUMERS + c, p.tail_tag);
}

// The tile's last piece: waits for the partial in `slot` and merges it into its own O and softmax state,
// as the online softmax merges a tile (both rescaled to the larger row maximum). The flag is reset for the
// next call (a graph replay's carries the same tag). Thread-partial sums add thread by thread: the
// epilogue's quad sum then gives the row's.
__device__ __forceinline__ void merge_partial(const Fa3FwdParams& p, int slot, int c, int t, float (&o)[OD / 2],
                                              OnlineSoftmax& sm) {
    if (t == 0) {
        u64* flag = p.tail_flags + slot * CONSUMERS + c;
        while (ld_acquire(flag) != p.tail_tag) {
        }
        *flag = 0;
    }
    named_sync(EPILOGUE_BAR + c, 128);
    const float4* src = partial_of(p, slot, c, t);
    const float4 state = __ldcg(src + OD / 8 * 128);  // (L2: written by another SM)
    const float theirs_max[2] = {state.x, state.y}, theirs_sum[2] = {state.z, state.w};
    float mine[2], theirs[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float mx = fmaxf(sm.row_max[r], theirs_max[r]);
        mine[r] = sm.row_max[r] == mx ? 1.f : fast_exp2((sm.row_max[r] - mx) * p.scale_log2);
        theirs[r] = theirs_max[r] == mx ? 1.f : fast_exp2((theirs_max[r] - mx) * p.scale_log2);
        sm.row_sum[r] = sm.row_sum[r] * mine[r] + theirs_sum[r] * theirs[r];
        sm.row_max[r] = mx;
    }
#pragma unroll
    for (int j = 0; j < OD / 8; ++j) {
        const float4 x = __ldcg(src + j * 128);
        o[4 * j] = o[4 * j] * mine[0] + x.x * theirs[0];
        o[4 * j + 1] = o[4 * j + 1] * mine[0] + x.y * theirs[0];
        o[4 * j + 2] = o[4 * j + 2] * mine[1] + x.z * theirs[1];
        o[4 * j + 3] = o[4 * j + 3] * mine[1] + x.w * theirs[1];
    }
}

// The query rows [first, last] of a tile's `rows` rows from packed row `row0` (rows = BM for the whole
// tile, 64 for one consumer's); `last` may pass the sequence's end. With GQA packing a packed row r is
// query r / group.
__device__ __forceinline__ void query_span(int row0, int rows, int group, int& first, int& last) {
    first = PACK_GQA ? row0 / group : row0;
    last = PACK_GQA ? (row0 + rows - 1) / group : row0 + rows - 1;
}

// This tile's sequence: its lengths and, in a packed batch, its first rows (common/seqlen.cuh).
__device__ __forceinline__ SeqInfo sequence(const Fa3FwdParams& p, int batch) {
    return VARLEN ? SeqInfo(p.cu_seqlens_q, p.cu_seqlens_k, batch, p.seqlen_q, p.seqlen_k)
                  : SeqInfo(nullptr, nullptr, batch, p.seqlen_q, p.seqlen_k);
}

// FP8 descale factors (Fa3FwdParams): a query row's (rows past the end clamp to the last).
__device__ __forceinline__ float q_descale(const Fa3FwdParams& p, int batch, int head, int row) {
    return p.q_descale[(i64(batch) * p.heads + head) * p.q_descale_blocks + min(row, p.seqlen_q - 1) / p.q_descale_rows];
}

// The K and V descales of K tile n of a KV head, walked a tile at a time: `index` is the entry of the
// tile's block in both arrays (they share a layout), `within` the tile's place in its block. The loop
// then divides nothing (n / p.kv_descale_tiles there cost ~15 of an FP8 iteration's ~560 issue slots) and
// holds one index, not the batch, KV head and block (a register d = 256 does not have to spare).
// (An int: the arrays hold one entry per 128 keys of each KV head, under 2^31 for any K that fits a GPU.)
struct DescaleCursor {
    int index, within;
    __device__ __forceinline__ DescaleCursor(const Fa3FwdParams& p, int batch, int kv_head, int n)
        : index((batch * p.kv_heads + kv_head) * p.kv_descale_blocks + n / p.kv_descale_tiles),
          within(n % p.kv_descale_tiles) {}
    __device__ __forceinline__ void next(const Fa3FwdParams& p) {
        if (++within == p.kv_descale_tiles) {
            within = 0;
            ++index;
        }
    }
    __device__ __forceinline__ float k(const Fa3FwdParams& p) const { return p.k_descale[index]; }
    __device__ __forceinline__ float v(const Fa3FwdParams& p) const { return p.v_descale[index]; }
    // V_{n-1}'s descale over V_n's: O's change of units when tile n starts a block, else 1 (both read
    // again, from L1: a V descale held across the loop is a register too many at d = 256)
    __device__ __forceinline__ float v_ratio(const Fa3FwdParams& p) const {
        return within == 0 ? __fdividef(p.v_descale[index - 1], p.v_descale[index]) : 1.f;
    }
};

// IDLE_WG_SKIP: a consumer warpgroup whose 64 rows all lie outside the sequence (past its end: N = 512 on
// 192-row tiles is 2 x 192 + 128, so the last tile's third warpgroup has none; or before row 0, the row
// shift's) computes nothing for the tile: it keeps step with the ring, the Q buffer and the turns exactly as
// a computing warpgroup would (every K / V tile waited for and released, one turn per GEMM issue), so the
// other warpgroups' GEMMs have the tensor cores to themselves.
__device__ __forceinline__ void idle_through_tile(Smem& sm, int c, int lane, int k_tiles, int& i, int& q_iter) {
    const int qs = q_iter % Q_STAGES;
    mbar_wait(&sm.q_full[qs], (q_iter++ / Q_STAGES) & 1);
    for (int n = 0; n < k_tiles; ++n, ++i) {
        const int s = i % STAGES;
        const u32 parity = (i / STAGES) & 1;
        wait_my_turn(c);
        mbar_wait(&sm.k_full[s], parity);
        pass_the_turn(c);
        mbar_wait(&sm.v_full[s], parity);
        if (lane == 0) {
            mbar_arrive(&sm.k_empty[s]);
            mbar_arrive(&sm.v_empty[s]);
            if (n + 1 == k_tiles) mbar_arrive(&sm.q_empty[qs]);
        }
    }
    wait_my_turn(c);  // the last P V's turn
    pass_the_turn(c);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    fa3_fwd(const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_k,
            const __grid_constant__ TensorMap map_v, const __grid_constant__ TensorMap map_o, const Fa3FwdParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    Smem& sm = aligned_smem<Smem>(smem_raw);

    const int warpgroup = warpgroup_index();
    const int group = p.heads / p.kv_heads;
    // Tiles: (packed) row blocks x heads (KV heads when packing) x batch; rows of the longest sequence when
    // VARLEN.
    const int m_blocks = PACK_GQA ? (p.seqlen_q * group + BM - 1) / BM : (p.seqlen_q + BM - 1) / BM;
    const int tile_heads = PACK_GQA ? p.kv_heads : p.heads;
    // Query block m holds rows [m BM - row_shift, (m + 1) BM - row_shift): with a causal mask the host puts
    // the spare rows of a length that is no multiple of BM before row 0, in the cheapest tile, instead of
    // after the end in the dearest (cuflash/fa3.py fill_schedule; 0 for packed, variable-length and FP8; a
    // multiple of a warpgroup's 64 rows).
    const int row_shift = PACK_GQA || VARLEN || FP8 ? 0 : p.row_shift;
    // The order the tiles run in: sections of (head, batch) pairs whose K / V share L2, dealt round by round
    // (common/tile_scheduler.cuh), as the host chose them for this call (cuflash/tile_order.py).
    const bool serpentine = p.sched_serpentine != 0;
    const TailSplit tail = TAIL_SPLIT ? TailSplit{p.tail_start, p.tail_units, p.tail_k_blocks, p.tail_slots}
                                      : TailSplit{0, 0, 1, 0};

    if (threadIdx.x == 0) {
        for (int qs = 0; qs < Q_STAGES; ++qs) {
            mbar_init(&sm.q_full[qs], 1);
            // One arrival per consumer warp: wgmma.wait_group speaks for the executing warp's part only.
            mbar_init(&sm.q_empty[qs], CONSUMER_WARPS);
        }
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&sm.k_full[s], 1);
            mbar_init(&sm.v_full[s], 1);
            mbar_init(&sm.k_empty[s], CONSUMER_WARPS);
            mbar_init(&sm.v_empty[s], CONSUMER_WARPS);
        }
        fence_barrier_init();
    }
    __syncthreads();

    // Both roles walk the same tiles and count the same K/V tiles (`i`, across tiles: the ring's slots
    // and phases carry on) and the same non-empty tiles (`q_iter`: the Q buffers' turn and phase).
    if (warpgroup == 0) {  // ---------------------------------------------------------------- producer
        regs_decrease<PRODUCER_REGS>();  // so that the consumers' increase can be granted
        if (threadIdx.x != 0) return;
        int i = 0, q_iter = 0;
        for (TileScheduler sched(m_blocks, tile_heads, p.batch, p.sched_section, serpentine, tail); sched.valid();
             sched.advance()) {
            const Tile tile = sched.tile<FAST_TILE_DIV>(p.sched_div);
            const SeqInfo seq = sequence(p, tile.batch);
            const int row0 = tile.m_block * BM - row_shift;
            int q_first, q_last;
            query_span(row0, BM, group, q_first, q_last);
            if (q_first >= seq.seqlen_q) continue;  // a shorter sequence of a packed batch
            const Mask mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};
            int n_lo, n_hi;
            mask.kv_block_range_rows<BN>(max(q_first, 0), min(q_last, seq.seqlen_q - 1), n_lo, n_hi);
            sched.clip(n_lo, n_hi);  // a tail piece: its K tiles only
            if (n_lo == n_hi) continue;
            const int kv_head = PACK_GQA ? tile.head : tile.head / group, tma_batch = VARLEN ? 0 : tile.batch;
            const int qs = q_iter % Q_STAGES;
            mbar_wait(&sm.q_empty[qs], ((q_iter++ / Q_STAGES) & 1) ^ 1);  // the S GEMMs of its last tile are done
            unsigned char* q_buf = sm.q[qs];
            u64* q_full = &sm.q_full[qs];
            mbar_arrive_expect_tx(q_full, Q_BYTES);
            if constexpr (PACK_GQA) {
#pragma unroll
                for (int a = 0; a < ATOMS; ++a)  // box (64, group, BM / group): rows (query, head) head-fastest
                    tma_load_4d(q_buf + a * BM * 128, &map_q, q_full, a * 64, kv_head * group, q_first, tile.batch);
            } else {
                // (rows before 0 come zero-filled, as rows past the end do)
                tma_load_atoms<ATOMS, ATOM_COLS>(q_buf, BM, &map_q, q_full, seq.q_start + row0, tile.head, tma_batch);
            }
            for (int n = n_lo; n < n_hi; ++n, ++i) {
                const int s = i % STAGES;
                const u32 free_parity = ((i / STAGES) & 1) ^ 1;  // the slot's previous tile is consumed
                mbar_wait(&sm.k_empty[s], free_parity);
                mbar_arrive_expect_tx(&sm.k_full[s], K_BYTES);
                tma_load_atoms<ATOMS, ATOM_COLS>(sm.k[s], BN, &map_k, &sm.k_full[s], seq.k_start + n * BN, kv_head,
                                                 tma_batch);
                mbar_wait(&sm.v_empty[s], free_parity);
                mbar_arrive_expect_tx(&sm.v_full[s], V_BYTES);
                if constexpr (FP8) {  // V^T map (keys, d, kv_heads, batch): boxes of 128 keys x D rows
#pragma unroll
                    for (int a = 0; a < VT_ATOMS; ++a)
                        tma_load_4d(sm.v[s] + a * D * 128, &map_v, &sm.v_full[s], n * BN + a * 128, 0, kv_head, tile.batch);
                } else {
                    tma_load_atoms<V_ATOMS>(sm.v[s], BN, &map_v, &sm.v_full[s], seq.k_start + n * BN, kv_head, tma_batch);
                }
            }
        }
        return;
    }

    // ------------------------------------------------------------------------------------- consumers
    regs_increase<CONSUMER_REGS>();
    const int c = warpgroup - 1;                      // which 64 rows of the block
    const int t = threadIdx.x % 128, w = t / 32, lane = t % 32, g = lane / 4, q4 = lane % 4;
    unsigned char* p_tile = sm.p + c * 64 * BN;          // (P_SMEM)
    // this warpgroup's 64 rows of every Q atom in Q buffer 0 (set here, outside the tile loop, with one buffer:
    // inside it, FP8 d = 64's 256-key tiles had ptxas serialise their wgmma under NVRTC 13.5)
    const unsigned char* q_rows0 = sm.q[0] + c * 64 * 128;

    float o[OD / 2];
    float sc[BN / 2];        // S_n, then P_n in fp32 (accumulator layout)
    u32 pv_a[PV_STEPS][4];   // P_{n-1} as wgmma A fragments, read by the in-flight O += P V
    int i = 0, q_iter = 0;
    if (c == CONSUMERS - 1) pass_the_turn(c);  // consumer 0 issues first; it takes the matching turn at the very end

    for (TileScheduler sched(m_blocks, tile_heads, p.batch, p.sched_section, serpentine, tail); sched.valid();
         sched.advance()) {
        const Tile tile = sched.tile<FAST_TILE_DIV>(p.sched_div);
        const SeqInfo seq = sequence(p, tile.batch);
        const int row0 = tile.m_block * BM - row_shift;
        int q_first, q_last, wg_first, wg_last;
        query_span(row0, BM, group, q_first, q_last);
        if (q_first >= seq.seqlen_q) continue;  // as the producer: no such rows
        query_span(row0 + c * 64, 64, group, wg_first, wg_last);  // this warpgroup's rows
        const Mask mask{seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right};
        int qrow[2], qhead[2];  // query row and head of this thread's two rows
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + c * 64 + 16 * w + g + 8 * r;
            qrow[r] = PACK_GQA ? row / group : row;
            qhead[r] = PACK_GQA ? tile.head * group + row % group : tile.head;
        }
        int n_lo, n_hi;
        mask.kv_block_range_rows<BN>(max(q_first, 0), min(q_last, seq.seqlen_q - 1), n_lo, n_hi);
        sched.clip(n_lo, n_hi);  // a tail piece: its K tiles only (never none: the host splits unmasked calls)
#pragma unroll
        for (int j = 0; j < OD / 2; ++j) o[j] = 0.f;
        OnlineSoftmax softmax;
        if (n_lo == n_hi) {  // no visible key (a window that misses the sequence): O = 0, LSE = -inf
            store_output(p, o, softmax, 1.f, seq, qrow, qhead, q4, tile.batch);
            continue;
        }
        if (IDLE_WG_SKIP && (wg_first >= seq.seqlen_q || wg_last < 0)) {
            idle_through_tile(sm, c, lane, n_hi - n_lo, i, q_iter);
            continue;
        }
        // FP8: the Q descale of this thread's rows; the K and V descales of the tiles (O is held in units of
        // the current tile's V descale).
        const int kv_head = PACK_GQA ? tile.head : tile.head / group;
        float row_scale[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) row_scale[r] = FP8 ? q_descale(p, tile.batch, qhead[r], qrow[r]) : 1.f;
        DescaleCursor descale(p, tile.batch, kv_head, FP8 ? n_lo : 0);  // (unused, and folded away, unless FP8)
        auto k_scale = [&] { return FP8 ? descale.k(p) : 1.f; };
        const int qs = q_iter % Q_STAGES;
        const unsigned char* q_rows = Q_STAGES == 1 ? q_rows0 : sm.q[qs] + c * 64 * 128;  // (as q_rows0)
        mbar_wait(&sm.q_full[qs], (q_iter++ / Q_STAGES) & 1);

        // Prologue: S_0 and its softmax; nothing to overlap with yet. rescale: O is to be multiplied by
        // softmax.alpha before the next P V is added (a row max moved in the warp, or FP8's V descale).
        bool rescale = false;
        // FP8 with the overlap: the fresh accumulator of P_{n-1} V_{n-1} and the alpha it joins O with.
        float pv[OD / 2];
        float pv_alpha[2] = {1.f, 1.f};
        if constexpr (FRESH_PV && INTRA_WG_OVERLAP) {
#pragma unroll
            for (int j = 0; j < OD / 2; ++j) pv[j] = 0.f;
        }
        {
            const int s = i % STAGES;
            wait_my_turn(c);
            mbar_wait(&sm.k_full[s], (i / STAGES) & 1);
            issue_qk(sc, q_rows, sm.k[s]);
            pass_the_turn(c);
            const float tile_scale = k_scale();
            wgmma_wait<0>();
            wgmma_fence_regs(sc);
            if (lane == 0) {
                mbar_arrive(&sm.k_empty[s]);
                if (n_lo + 1 == n_hi) mbar_arrive(&sm.q_empty[qs]);  // no more S GEMMs read this Q
            }
            softmax.step(sc, mask, mask.rows_all_visible<BN>(wg_first, wg_last, n_lo), qrow, n_lo, q4, p, row_scale,
                         tile_scale);
            pack_p(sc, pv_a);
            if constexpr (P_SMEM) store_p(pv_a, p_tile, w, lane);
        }

        for (int n = n_lo + 1; n < n_hi; ++n) {
            const int s_prev = i % STAGES, s = (i + 1) % STAGES;
            wait_my_turn(c);
            mbar_wait(&sm.k_full[s], ((i + 1) / STAGES) & 1);
            mbar_wait(&sm.v_full[s_prev], (i / STAGES) & 1);
            if constexpr (INTRA_WG_OVERLAP) {
                issue_qk(sc, q_rows, sm.k[s]);
                // under S_n: O is idle until P_{n-1} V_{n-1} is issued
                if constexpr (FRESH_PV) {
                    add_to_o<OD>(o, pv, pv_alpha, 0);  // P_{n-2} V_{n-2}
                    issue_pv<OD>(pv, pv_a, sm.v[s_prev]);
                } else {
                    if (rescale) softmax.rescale(o);
                    if constexpr (P_SMEM)
                        issue_pv_smem(o, p_tile, sm.v[s_prev]);
                    else
                        issue_pv<OD>(o, pv_a, sm.v[s_prev]);
                }
            } else {  // P_{n-1} V_{n-1} finishes before S_n takes its registers
                if constexpr (FP8) {
                    rescale_and_add_pv(o, sc, pv_a, sm.v[s_prev], softmax, rescale);  // sc: S_{n-1} is P now
                } else {
                    if (rescale) softmax.rescale(o);
                    issue_pv<OD>(o, pv_a, sm.v[s_prev]);
                    wgmma_wait<0>();
                    wgmma_fence_regs(o);
                }
                issue_qk(sc, q_rows, sm.k[s]);
            }
            pass_the_turn(c);
            if constexpr (FP8) descale.next(p);  // K tile n's
            const float tile_scale = k_scale();
            const float v_ratio = FP8 ? descale.v_ratio(p) : 1.f;  // FP8: O moves from V_{n-1}'s units to V_n's

            wgmma_wait<INTRA_WG_OVERLAP ? 1 : 0>();  // S_n is done; P_{n-1} V_{n-1} may still run
            wgmma_fence_regs(sc);
            if constexpr (FRESH_PV) {  // P_{n-1} V_{n-1}'s alpha, before step n replaces it
                pv_alpha[0] = softmax.alpha[0];
                pv_alpha[1] = softmax.alpha[1];
            }
            const bool all_visible = mask.rows_all_visible<BN>(wg_first, wg_last, n);
            if (SPECULATIVE_MAX && all_visible) {  // (uniform over the warpgroup, as the vote needs)
                if (warpgroup_any(softmax.speculate(sc, p, row_scale, tile_scale), EPILOGUE_BAR + c)) {
                    issue_qk(sc, q_rows, sm.k[s]);  // a max rose past what P holds: S_n again (K_n is still here)
                    wgmma_wait<0>();
                    wgmma_fence_regs(sc);
                    rescale = softmax.step(sc, mask, true, qrow, n, q4, p, row_scale, tile_scale);
                } else {
                    softmax.commit();
                    rescale = false;
                }
            } else {
                rescale = softmax.step(sc, mask, all_visible, qrow, n, q4, p, row_scale, tile_scale);
            }
            // K_n's slot is released after the exponentials, not right after S_n: this branch ends the block
            // that holds them, so ptxas cannot hoist the wait for P V (below) above them; in one block it
            // does, which serialises the loop (tests/test_compile.py checks the SASS).
            if (lane == 0) {
                mbar_arrive(&sm.k_empty[s]);
                if (n + 1 == n_hi) mbar_arrive(&sm.q_empty[qs]);
            }
            if (FP8 && v_ratio != 1.f) {
                softmax.alpha[0] *= v_ratio;
                softmax.alpha[1] *= v_ratio;
                rescale = true;
            }
            // P_{n-1} V_{n-1} done: its V slot is free. O is rescaled by alpha_n (and FP8's V ratio) in the
            // next iteration, under S_{n+1}, so every warp of the warpgroup waits here at the same PC
            // (wgmma.wait_group is .aligned: a wait inside a per-warp rescale branch is what
            // compute-sanitizer's synccheck flagged).
            wgmma_wait<0>();
            if constexpr (FRESH_PV)
                wgmma_fence_regs(pv);
            else
                wgmma_fence_regs(o);
            if (lane == 0) mbar_arrive(&sm.v_empty[s_prev]);
            pack_p(sc, pv_a);
            if constexpr (P_SMEM) store_p(pv_a, p_tile, w, lane);  // (P_{n-1} V_{n-1} has read the tile)
            ++i;
        }

        // The last P V, then the output.
        {
            const int s = i % STAGES;
            wait_my_turn(c);
            mbar_wait(&sm.v_full[s], (i / STAGES) & 1);
            if constexpr (!FRESH_PV) {
                if (rescale) softmax.rescale(o);
                if constexpr (P_SMEM)
                    issue_pv_smem(o, p_tile, sm.v[s]);
                else
                    issue_pv<OD>(o, pv_a, sm.v[s]);
                pass_the_turn(c);
                wgmma_wait<0>();
                wgmma_fence_regs(o);
            } else if constexpr (INTRA_WG_OVERLAP) {
                add_to_o<OD>(o, pv, pv_alpha, 0);  // P_{n-2} V_{n-2}
                issue_pv<OD>(pv, pv_a, sm.v[s]);
                pass_the_turn(c);
                wgmma_wait<0>();
                wgmma_fence_regs(pv);
                add_to_o<OD>(o, pv, softmax.alpha, 0);
            } else {
                rescale_and_add_pv(o, sc, pv_a, sm.v[s], softmax, rescale);
                pass_the_turn(c);
            }
            if (lane == 0) mbar_arrive(&sm.v_empty[s]);
            ++i;
        }
        if constexpr (TAIL_SPLIT) {  // a tail piece: leave a partial, or merge the tile's others first
            const PieceRole role = sched.role();
            if (role.slot >= 0) {
                save_partial(p, role.slot, c, t, o, softmax);
                continue;
            }
            for (int k = 0; k < role.merges; ++k) merge_partial(p, role.first + k, c, t, o, softmax);
        }
        // FP8: O is in units of the last tile's V descale
        const float v_scale = FP8 ? descale.v(p) : 1.f;
        // A TMA store's box may reach past the end of the tensor but must not start before it (a negative
        // coordinate faults with an illegal instruction; loads may): the row shift comes in whole
        // warpgroups (tile_order.SHIFT_GRANULE), and a warpgroup before row 0 has nothing to store.
        if constexpr (STORE_O_TMA) {
            if (row0 + c * 64 >= 0)
                store_output_tma(p, &map_o, sm.o + c * (O_BYTES / CONSUMERS), o, softmax, v_scale, c, t,
                                 row0 + c * 64, tile.head, tile.batch);
        } else
            store_output(p, o, softmax, v_scale, seq, qrow, qhead, q4, tile.batch);
    }
    if (c == 0) wait_my_turn(c);  // takes consumer 1's last pass: no arrival is left pending at exit
    if (STORE_O_TMA && t == 0) tma_store_wait_read();  // shared memory must outlive the last store's reads
}
