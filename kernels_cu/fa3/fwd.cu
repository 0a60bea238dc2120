// FA3-style attention forward for Hopper (sm_90a): TMA, an mbarrier ring, warp specialisation, wgmma.
//
// A thread block owns BLOCK_M = 128 query rows of one (batch, head) and runs three warpgroups:
//   producer  (warpgroup 0): gives registers back (setmaxnreg.dec); one thread TMA-loads the Q tile once
//             and streams the K and V tiles the rows can see through a STAGES-deep shared-memory ring,
//             each tile completing a "full" mbarrier, each slot waiting on its "empty" mbarrier first;
//   consumers (warpgroups 1 and 2, 64 rows each): take registers (setmaxnreg.inc) and per K/V tile run
//             S = Q K^T (wgmma, both operands in shared memory), the online softmax on the accumulator
//             registers (exp2 with the scale folded in, O rescaled only when a row max moves), and
//             O += P V (wgmma with P fed from registers, V read MN-major), then free the slot.
// Tiles in shared memory are 64-column atoms with the 128-byte swizzle that TMA writes and wgmma reads
// (common/hopper.cuh). This is version 0: the two consumers do not yet pingpong, and the softmax of one
// tile does not yet overlap the GEMMs of the next (bench/NOTES.md tracks what comes next).
//
// Compile-time constants (cuflash/fa3.py): CUFLASH_HEADDIM (64, 128, 256), CUFLASH_BLOCK_N,
// CUFLASH_STAGES, CUFLASH_DTYPE.
#include "common/hopper.cuh"
#include "common/mask.cuh"
#include "common/ptx.cuh"
#include "fa3/params.cuh"

constexpr int D = CUFLASH_HEADDIM;
constexpr int BM = 128;  // two consumer warpgroups x 64 rows
constexpr int BN = CUFLASH_BLOCK_N;
constexpr int STAGES = CUFLASH_STAGES;
constexpr int ATOMS = D / 64;  // 64-column atoms per row
constexpr int THREADS = 384;
constexpr int Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
static_assert(THREADS == CUFLASH_THREADS, "launcher and kernel disagree on the block size");
static_assert(D % 64 == 0 && BN % 16 == 0 && BN <= 256, "tiles are whole 64-column atoms; BN is a wgmma N");

struct Smem {
    alignas(1024) unsigned char q[Q_BYTES];             // ATOMS atoms of [BM][64]
    alignas(1024) unsigned char k[STAGES][KV_BYTES];    // ATOMS atoms of [BN][64]
    alignas(1024) unsigned char v[STAGES][KV_BYTES];
    u64 q_full, k_full[STAGES], v_full[STAGES], kv_empty[STAGES];
};

// Load a [rows][D] tile as ATOMS boxes of 64 columns (the tensor map's box is 64 x rows).
__device__ __forceinline__ void load_atoms(unsigned char* dst, int rows, const TensorMap* map, u64* bar, int row,
                                           int head, int batch) {
#pragma unroll
    for (int a = 0; a < ATOMS; ++a) tma_load_4d(dst + a * rows * 128, map, bar, a * 64, row, head, batch);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    fa3_fwd(const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_k,
            const __grid_constant__ TensorMap map_v, const Fa3FwdParams p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    Smem& sm = *reinterpret_cast<Smem*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));

    const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest causal blocks first
    const int head = blockIdx.y, batch = blockIdx.z;
    const int kv_head = head / (p.heads / p.kv_heads);
    const int warpgroup = threadIdx.x / 128;
    const Mask mask{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
    int n_lo, n_hi;
    mask.kv_block_range<BM, BN>(m_block, n_lo, n_hi);

    if (threadIdx.x == 0) {
        mbar_init(&sm.q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&sm.k_full[s], 1);
            mbar_init(&sm.v_full[s], 1);
            mbar_init(&sm.kv_empty[s], 2);  // one arrival per consumer warpgroup
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {  // ---------------------------------------------------------------- producer
        // 128 x 24 + 256 x 240 = 64512 <= 65536 registers: the consumers' increase can be granted.
        regs_decrease<24>();
        if (threadIdx.x == 0 && n_lo < n_hi) {
            mbar_arrive_expect_tx(&sm.q_full, Q_BYTES);
            load_atoms(sm.q, BM, &map_q, &sm.q_full, m_block * BM, head, batch);
            for (int n = n_lo, i = 0; n < n_hi; ++n, ++i) {
                const int s = i % STAGES;
                mbar_wait(&sm.kv_empty[s], ((i / STAGES) & 1) ^ 1);  // the slot's previous tile is consumed
                mbar_arrive_expect_tx(&sm.k_full[s], KV_BYTES);
                load_atoms(sm.k[s], BN, &map_k, &sm.k_full[s], n * BN, kv_head, batch);
                mbar_arrive_expect_tx(&sm.v_full[s], KV_BYTES);
                load_atoms(sm.v[s], BN, &map_v, &sm.v_full[s], n * BN, kv_head, batch);
            }
        }
        return;
    }

    // ------------------------------------------------------------------------------------- consumers
    regs_increase<240>();
    const int c = warpgroup - 1;                      // which 64 rows of the block
    const int t = threadIdx.x % 128, w = t / 32, lane = t % 32, g = lane / 4, q4 = lane % 4;
    const int row_lo = m_block * BM + c * 64 + 16 * w + g;  // this thread's rows: row_lo and row_lo + 8

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};

    if (n_lo < n_hi) mbar_wait(&sm.q_full, 0);
    for (int n = n_lo, i = 0; n < n_hi; ++n, ++i) {
        const int s = i % STAGES;
        const u32 parity = (i / STAGES) & 1;

        // S = Q K^T: D / 16 k-steps, 4 per 64-column atom, 32 bytes apart inside the atom.
        float sc[BN / 2];
        mbar_wait(&sm.k_full[s], parity);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const int atom = kk / 4, step = kk % 4;
            const u64 da = wgmma_desc_advance(wgmma_desc(sm.q + atom * BM * 128 + c * 64 * 128), 32 * step);
            const u64 db = wgmma_desc_advance(wgmma_desc(sm.k[s] + atom * BN * 128), 32 * step);
            wgmma_ss<BN, 0>(sc, da, db, kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(sc);

        // Online softmax on the accumulator: element 4j + e is row row_lo + 8 (e / 2), key n BN + 8 j + 2 q4 + e % 2.
        if (!mask.tile_all_visible<BM, BN>(m_block, n)) {  // only tiles that cross a mask edge pay for this
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!mask.visible(row_lo + 8 * (e / 2), n * BN + 8 * j + 2 * q4 + e % 2)) sc[4 * j + e] = neg_inf();
        }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = row_max[r];
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]));
            mx = quad_max(mx);
            const float base = mx == neg_inf() ? 0.f : mx * p.scale_log2;
            alpha[r] = mx == row_max[r] ? 1.f : fast_exp2(row_max[r] * p.scale_log2 - base);
            row_max[r] = mx;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = sc[4 * j + 2 * r + e];
                    x = fast_exp2(x * p.scale_log2 - base);
                    sum += x;
                }
            }
            row_sum[r] = row_sum[r] * alpha[r] + sum;
        }
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int j = 0; j < D / 8; ++j) o[4 * j] *= alpha[0], o[4 * j + 1] *= alpha[0], o[4 * j + 2] *= alpha[1],
                                                 o[4 * j + 3] *= alpha[1];
        }

        // O += P V: P (64 x BN) from registers 16 keys at a time; V [BN][D] is read MN-major, its 64-column
        // atoms BN x 128 bytes apart, 16 keys = 2048 bytes per step.
        mbar_wait(&sm.v_full[s], parity);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const u32 a[4] = {elem_t::pack2(sc[8 * kk], sc[8 * kk + 1]), elem_t::pack2(sc[8 * kk + 2], sc[8 * kk + 3]),
                              elem_t::pack2(sc[8 * kk + 4], sc[8 * kk + 5]),
                              elem_t::pack2(sc[8 * kk + 6], sc[8 * kk + 7])};
            wgmma_rs<D, 1>(o, a, wgmma_desc_mn(sm.v[s] + kk * 16 * 128, BN * 128), 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_regs(o);
        if (t == 0) mbar_arrive(&sm.kv_empty[s]);  // this warpgroup is done with the slot
    }

    // Epilogue: O /= l straight from the accumulator, LSE = (m c + log2 l) ln 2; rows past the end skipped.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_lo + 8 * r;
        const float l = quad_sum(row_sum[r]);
        if (row >= p.seqlen_q) continue;
        const float inv = l > 0.f ? 1.f / l : 0.f;
        u16* out = p.o + batch * p.o_batch_stride + head * p.o_head_stride + row * p.o_row_stride + 2 * q4;
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
            *reinterpret_cast<u32*>(out + 8 * j) = elem_t::pack2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
        if (q4 == 0)
            p.lse[batch * p.row_batch_stride + head * p.row_head_stride + row] =
                l > 0.f ? (row_max[r] * p.scale_log2 + log2f(l)) * 0.69314718055994531f : neg_inf();
    }
}
