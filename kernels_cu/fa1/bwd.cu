// FA1-style attention backward: recompute P from Q, K and the saved log-sum-exp, never store it.
//
// One thread block owns BLOCK_N keys of one (batch, KV head) and keeps dK and dV for them in
// registers. It walks every query head of the GQA group and every Q block whose rows can see these
// keys (the outer loop of the paper's Algorithm 4 is the grid; its inner loop is this loop), and per
// (Q block i, K block j):
//     S^T  = K_j Q_i^T              P^T  = exp(scale * S^T - lse_i)
//     dV_j += P^T dO_i              dP^T = V_j dO_i^T
//     dS^T = P^T o (dP^T - D_i)     dK_j += dS^T Q_i
//     dQ_i += dS K_j                (fp32 atomics into dq_accum; K/V blocks run in parallel)
// with D_i = rowsum(dO_i o O_i) from fa1_bwd_preprocess. Working with transposed S keeps the keys on
// the mma's M dimension, so each warp's dK/dV rows stay in its registers.
//
// Warps: KEY_WARPS warps own 16 keys each; D_SPLIT > 1 splits the head dim of dK/dV (and of dQ)
// between D_SPLIT warps per key group, each recomputing S^T and dP^T, so that large head dims fit
// in registers. BLOCK_M = BLOCK_N = 16 * KEY_WARPS.
//
// Compile-time constants (cuflash/fa1.py): CUFLASH_HEADDIM, CUFLASH_KEY_WARPS, CUFLASH_D_SPLIT,
// CUFLASH_DTYPE.
#include "common/mask.cuh"
#include "common/ptx.cuh"
#include "common/tile.cuh"
#include "fa1/params.cuh"

constexpr int D = CUFLASH_HEADDIM;
constexpr int KEY_WARPS = CUFLASH_KEY_WARPS;
constexpr int D_SPLIT = CUFLASH_D_SPLIT;
constexpr int BN = 16 * KEY_WARPS;
constexpr int BM = BN;
constexpr int DW = D / D_SPLIT;  // head-dim columns of dK/dV/dQ owned by one warp
constexpr int THREADS = KEY_WARPS * D_SPLIT * 32;
static_assert(THREADS == CUFLASH_THREADS, "launcher and kernel disagree on the block size");
static_assert(DW % 16 == 0, "each warp's share of the head dim must be whole 16-column blocks");

struct Smem {
    SmemTile<BN, D> k;
    SmemTile<BN, D> v;
    SmemTile<BM, D> q;
    SmemTile<BM, D> dout;
    SmemTile<BM, BN> ds;  // dS (rows = queries), for dQ = dS K
    float lse[BM];
    float dsum[BM];
};

// acc (16 keys x BM queries) = X[key rows] Y^T, X a [BN][D] tile, Y a [BM][D] tile.
__device__ __forceinline__ void keys_by_queries(SmemTile<BN, D>& x, SmemTile<BM, D>& y, int key_row,
                                                int lane, float (&acc)[BM / 8][4]) {
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
        u32 a[4];
        ldmatrix_x4(a, a_operand(x, key_row, kk, lane));
#pragma unroll
        for (int mm = 0; mm < BM; mm += 16) {
            u32 b[4];
            ldmatrix_x4(b, b_operand_from_rows(y, mm, kk, lane));
            mma_16816<elem_t>(acc[mm / 8], a, {b[0], b[1]});
            mma_16816<elem_t>(acc[mm / 8 + 1], a, {b[2], b[3]});
        }
    }
}

// acc (16 rows x DW columns starting at col0) += A Y[:, col0:col0+DW], A given as fp32 C fragments
// over K_DIM (the C fragments of two adjacent 8-column tiles form one 16-deep A fragment), Y a tile
// stored [K_DIM][D].
template <int K_DIM, int ROWS>
__device__ __forceinline__ void frag_times_tile(const float (&a_frag)[K_DIM / 8][4], SmemTile<ROWS, D>& y,
                                                int col0, int lane, float (&acc)[DW / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < K_DIM; kk += 16) {
        const float* c0 = a_frag[kk / 8];
        const float* c1 = a_frag[kk / 8 + 1];
        u32 a[4] = {elem_t::pack2(c0[0], c0[1]), elem_t::pack2(c0[2], c0[3]), elem_t::pack2(c1[0], c1[1]),
                    elem_t::pack2(c1[2], c1[3])};
#pragma unroll
        for (int dd = 0; dd < DW; dd += 16) {
            u32 b[4];
            ldmatrix_x4_trans(b, b_operand_trans(y, kk, col0 + dd, lane));
            mma_16816<elem_t>(acc[dd / 8], a, {b[0], b[1]});
            mma_16816<elem_t>(acc[dd / 8 + 1], a, {b[2], b[3]});
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) fa1_bwd(const Fa1BwdParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

    const int n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
    const int group = p.heads / p.kv_heads;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int kw = warp % KEY_WARPS;           // which 16 keys (and which 16 dQ rows)
    const int col0 = (warp / KEY_WARPS) * DW;  // which head-dim columns of dK, dV, dQ
    const Mask mask{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};

    const int key0 = n_block * BN;
    load_tile_sync<THREADS>(sm.k, p.k + batch * p.k_batch_stride + kv_head * p.k_head_stride + key0 * p.k_row_stride,
                            p.k_row_stride, p.seqlen_k - key0);
    load_tile_sync<THREADS>(sm.v, p.v + batch * p.v_batch_stride + kv_head * p.v_head_stride + key0 * p.v_row_stride,
                            p.v_row_stride, p.seqlen_k - key0);

    const int keys[2] = {key0 + kw * 16 + g, key0 + kw * 16 + g + 8};  // this thread's two key rows
    float dk[DW / 8][4] = {}, dv[DW / 8][4] = {};

    int m_lo, m_hi;
    mask.q_block_range<BM, BN>(n_block, m_lo, m_hi);
    for (int hq = kv_head * group; hq < (kv_head + 1) * group; ++hq) {
        const i64 row_base = (i64(batch) * p.heads + hq) * p.seqlen_q;  // lse / dsum / dq_accum rows
        for (int m = m_lo; m < m_hi; ++m) {
            const int row0 = m * BM;
            __syncthreads();  // the previous Q block's tiles are no longer read
            load_tile_sync<THREADS>(sm.q, p.q + batch * p.q_batch_stride + hq * p.q_head_stride + row0 * p.q_row_stride,
                                    p.q_row_stride, p.seqlen_q - row0);
            load_tile_sync<THREADS>(sm.dout,
                                    p.dout + batch * p.do_batch_stride + hq * p.do_head_stride + row0 * p.do_row_stride,
                                    p.do_row_stride, p.seqlen_q - row0);
            for (int i = threadIdx.x; i < BM; i += THREADS) {
                // Rows past the end get lse = +inf, so their P is exactly 0.
                const bool in = row0 + i < p.seqlen_q;
                sm.lse[i] = in ? p.lse[row_base + row0 + i] : -neg_inf();
                sm.dsum[i] = in ? p.dsum[row_base + row0 + i] : 0.f;
            }
            __syncthreads();

            // P^T (16 keys x BM queries), recomputed.
            float pt[BM / 8][4];
            keys_by_queries(sm.k, sm.q, kw * 16, lane, pt);
            const bool needs_mask = !mask.tile_all_visible<BM, BN>(m, n_block);
#pragma unroll
            for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = j * 8 + 2 * t + (e & 1);  // query within the block
                    const bool vis = !needs_mask || mask.visible(row0 + col, keys[e / 2]);
                    pt[j][e] = vis ? __expf(pt[j][e] * p.scale - sm.lse[col]) : 0.f;
                }
            }
            frag_times_tile<BM>(pt, sm.dout, col0, lane, dv);  // dV += P^T dO

            // dS^T = P^T o (dP^T - D), dP^T = V dO^T.
            float dst[BM / 8][4];
            keys_by_queries(sm.v, sm.dout, kw * 16, lane, dst);
#pragma unroll
            for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) dst[j][e] = pt[j][e] * (dst[j][e] - sm.dsum[j * 8 + 2 * t + (e & 1)]);
            }
            frag_times_tile<BM>(dst, sm.q, col0, lane, dk);  // dK += dS^T Q

            // dS to shared memory, transposed to (queries x keys), for dQ = dS K.
            if (col0 == 0) {
#pragma unroll
                for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        *sm.ds.at(j * 8 + 2 * t + (e & 1), kw * 16 + g + (e / 2) * 8) = elem_t::from_float(dst[j][e]);
                }
            }
            __syncthreads();

            // dQ rows [kw*16, kw*16 + 16) of this Q block, columns [col0, col0 + DW).
            float dq[DW / 8][4] = {};
#pragma unroll
            for (int kk = 0; kk < BN; kk += 16) {
                u32 a[4];
                ldmatrix_x4(a, a_operand(sm.ds, kw * 16, kk, lane));
#pragma unroll
                for (int dd = 0; dd < DW; dd += 16) {
                    u32 b[4];
                    ldmatrix_x4_trans(b, b_operand_trans(sm.k, kk, col0 + dd, lane));
                    mma_16816<elem_t>(dq[dd / 8], a, {b[0], b[1]});
                    mma_16816<elem_t>(dq[dd / 8 + 1], a, {b[2], b[3]});
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = row0 + kw * 16 + g + 8 * r;
                if (row >= p.seqlen_q) continue;
                float* dst_row = p.dq_accum + (row_base + row) * D + col0 + 2 * t;
#pragma unroll
                for (int j = 0; j < DW / 8; ++j) {
                    atomicAdd(dst_row + j * 8, dq[j][2 * r]);
                    atomicAdd(dst_row + j * 8 + 1, dq[j][2 * r + 1]);
                }
            }
        }
    }

    // dK carries the softmax scale (S = scale * Q K^T); keys past the end are not written.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (keys[r] >= p.seqlen_k) continue;
        u16* dk_row = p.dk + batch * p.dk_batch_stride + kv_head * p.dk_head_stride + keys[r] * p.dk_row_stride + col0 + 2 * t;
        u16* dv_row = p.dv + batch * p.dv_batch_stride + kv_head * p.dv_head_stride + keys[r] * p.dv_row_stride + col0 + 2 * t;
#pragma unroll
        for (int j = 0; j < DW / 8; ++j) {
            *reinterpret_cast<u32*>(dk_row + j * 8) = elem_t::pack2(dk[j][2 * r] * p.scale, dk[j][2 * r + 1] * p.scale);
            *reinterpret_cast<u32*>(dv_row + j * 8) = elem_t::pack2(dv[j][2 * r], dv[j][2 * r + 1]);
        }
    }
}
