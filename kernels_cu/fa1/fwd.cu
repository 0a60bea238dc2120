// FA1-style attention forward: the algorithm of the first FlashAttention paper.
//
// One thread block owns BLOCK_M query rows of one (batch, head); its warps take 16 rows each. The Q
// tile sits in shared memory; the block walks the K/V tiles its rows can see (masked-out tiles are
// never touched), loading each into shared memory, computing S = Q K^T on the tensor cores
// (mma.sync m16n8k16, fp32 accumulation), and folding the tile into the output with the online
// softmax of the paper: running max m, running sum l, and O renormalised after every tile,
//     O <- diag(l_new)^-1 (diag(l) e^(m - m_new) O + e^(S - m_new) V).
// Nothing of size N x N exists anywhere; the extra memory is the fp32 log-sum-exp (one per row).
// Loads are plain synchronous 16-byte copies; the FA2 family adds the cp.async pipeline, exp2 with
// the folded scale, and deferred normalisation.
//
// Compile-time constants (cuflash/fa1.py): CUFLASH_HEADDIM, CUFLASH_BLOCK_M, CUFLASH_BLOCK_N,
// CUFLASH_DTYPE (0 bf16, 1 fp16).
#include "common/mask.cuh"
#include "common/ptx.cuh"
#include "common/tile.cuh"
#include "fa1/params.cuh"

constexpr int D = CUFLASH_HEADDIM;
constexpr int BM = CUFLASH_BLOCK_M;
constexpr int BN = CUFLASH_BLOCK_N;
constexpr int WARPS = BM / 16;
constexpr int THREADS = WARPS * 32;
static_assert(THREADS == CUFLASH_THREADS, "launcher and kernel disagree on the block size");
static_assert(D % 16 == 0 && BN % 16 == 0 && BM % 16 == 0, "tiles are made of 16x16 mma blocks");

struct Smem {
    SmemTile<BM, D> q;
    SmemTile<BN, D> k;
    SmemTile<BN, D> v;
};

// S (16 x BN per warp) = Q[warp rows] K^T.
__device__ __forceinline__ void qk_product(Smem& sm, int warp, int lane, float (&s)[BN / 8][4]) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
        u32 a[4];
        ldmatrix_x4(a, a_operand(sm.q, warp * 16, kk, lane));
#pragma unroll
        for (int nn = 0; nn < BN; nn += 16) {
            u32 b[4];
            ldmatrix_x4(b, b_operand_from_rows(sm.k, nn, kk, lane));
            mma_16816<elem_t>(s[nn / 8], a, {b[0], b[1]});
            mma_16816<elem_t>(s[nn / 8 + 1], a, {b[2], b[3]});
        }
    }
}

// O (16 x D per warp) += P V, P given as fp32 C fragments scaled per row by p_scale.
__device__ __forceinline__ void pv_product(Smem& sm, int lane, const float (&p)[BN / 8][4],
                                           const float (&p_scale)[2], float (&o)[D / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < BN; kk += 16) {
        // The C fragments of two adjacent 8-key tiles form the A fragment of one 16-key step.
        const float* p0 = p[kk / 8];
        const float* p1 = p[kk / 8 + 1];
        u32 a[4] = {elem_t::pack2(p0[0] * p_scale[0], p0[1] * p_scale[0]),
                    elem_t::pack2(p0[2] * p_scale[1], p0[3] * p_scale[1]),
                    elem_t::pack2(p1[0] * p_scale[0], p1[1] * p_scale[0]),
                    elem_t::pack2(p1[2] * p_scale[1], p1[3] * p_scale[1])};
#pragma unroll
        for (int dd = 0; dd < D; dd += 16) {
            u32 b[4];
            ldmatrix_x4_trans(b, b_operand_trans(sm.v, kk, dd, lane));
            mma_16816<elem_t>(o[dd / 8], a, {b[0], b[1]});
            mma_16816<elem_t>(o[dd / 8 + 1], a, {b[2], b[3]});
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) fa1_fwd(const Fa1FwdParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

    const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const int kv_head = head / (p.heads / p.kv_heads);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const Mask mask{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};

    const int row0 = m_block * BM;
    const u16* q = p.q + batch * p.q_batch_stride + head * p.q_head_stride + row0 * p.q_row_stride;
    const u16* k = p.k + batch * p.k_batch_stride + kv_head * p.k_head_stride;
    const u16* v = p.v + batch * p.v_batch_stride + kv_head * p.v_head_stride;
    load_tile_sync<THREADS>(sm.q, q, p.q_row_stride, p.seqlen_q - row0);

    // This thread's two rows of the warp's 16: g and g + 8.
    const int rows[2] = {row0 + warp * 16 + g, row0 + warp * 16 + g + 8};
    float o[D / 8][4] = {};
    float row_max[2] = {neg_inf(), neg_inf()};
    float row_sum[2] = {0.f, 0.f};

    int n_lo, n_hi;
    mask.kv_block_range<BM, BN>(m_block, n_lo, n_hi);
    for (int n = n_lo; n < n_hi; ++n) {
        __syncthreads();  // every warp is done reading the previous K/V tile
        const int key0 = n * BN;
        load_tile_sync<THREADS>(sm.k, k + key0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - key0);
        load_tile_sync<THREADS>(sm.v, v + key0 * p.v_row_stride, p.v_row_stride, p.seqlen_k - key0);
        __syncthreads();

        float s[BN / 8][4];
        qk_product(sm, warp, lane, s);

        const bool needs_mask = !mask.tile_all_visible<BM, BN>(m_block, n);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[j][e] *= p.scale;
                if (needs_mask && !mask.visible(rows[e / 2], key0 + j * 8 + 2 * t + (e & 1))) s[j][e] = neg_inf();
            }
        }

        // Online softmax. A row that has seen no visible key yet has max -inf; exponentiate against 0
        // then, so masked entries give exactly 0 and nothing becomes NaN.
        float o_scale[2], p_scale[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = neg_inf();
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
            const float m_new = fmaxf(row_max[r], quad_max(mx));
            const float base = m_new == neg_inf() ? 0.f : m_new;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                s[j][2 * r] = __expf(s[j][2 * r] - base);
                s[j][2 * r + 1] = __expf(s[j][2 * r + 1] - base);
                sum += s[j][2 * r] + s[j][2 * r + 1];
            }
            const float alpha = __expf(row_max[r] - base);
            const float l_new = alpha * row_sum[r] + quad_sum(sum);
            const float inv = l_new > 0.f ? 1.f / l_new : 0.f;
            o_scale[r] = alpha * row_sum[r] * inv;
            p_scale[r] = inv;
            row_max[r] = m_new;
            row_sum[r] = l_new;
        }
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            o[j][0] *= o_scale[0];
            o[j][1] *= o_scale[0];
            o[j][2] *= o_scale[1];
            o[j][3] *= o_scale[1];
        }
        pv_product(sm, lane, s, p_scale, o);
    }

    // O is already normalised; a row that saw no key has O = 0 and LSE = -inf.
    u16* out = p.o + batch * p.o_batch_stride + head * p.o_head_stride;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= p.seqlen_q) continue;
        u16* dst = out + rows[r] * p.o_row_stride + 2 * t;
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
            *reinterpret_cast<u32*>(dst + j * 8) = elem_t::pack2(o[j][2 * r], o[j][2 * r + 1]);
        if (t == 0)
            p.lse[(i64(batch) * p.heads + head) * p.seqlen_q + rows[r]] =
                row_sum[r] > 0.f ? row_max[r] + logf(row_sum[r]) : neg_inf();
    }
}
