// Test kernel for kernels_cu/common/hopper.cuh and wgmma_ops.cuh: C (64 x N, fp32) = A (64 x K) B with
// one thread block of two warpgroups. Warpgroup 0 is the producer: it gives registers back
// (setmaxnreg.dec) and one thread TMA-loads every 64-deep K slice of A and B into its own stage, each
// completing its own mbarrier. Warpgroup 1 takes registers (setmaxnreg.inc), waits for each stage and
// issues four m64nNk16 wgmmas per stage. Variants cover what the FA3 kernels rely on:
//   B_MN = 0: B stored [N][K] (K-major, like K in S = Q K^T): descriptor steps of 32 bytes in the atom;
//   B_MN = 1: B stored [K][N] (MN-major, like V in O += P V): 64-wide N atoms `lbo` bytes apart, 8-row
//             K groups `sbo` bytes apart (run-time arguments, so one GPU run can tell the layouts apart);
//   A_REGS = 1: A fed from registers in the mma.sync A-fragment layout (like P in O += P V);
//   A_MN = 1: A stored [K][M] (MN-major, like dS^T in the backward's dQ = dS K), read with the transpose
//             flag (wgmma_ss_mn; needs B_MN = 1).
// Compile-time constants: CUFLASH_K (multiple of 64, <= 256), CUFLASH_N (64 or 128), CUFLASH_B_MN,
// CUFLASH_A_REGS, CUFLASH_A_MN, CUFLASH_DTYPE.
#include "common/hopper.cuh"

constexpr int K = CUFLASH_K;
constexpr int N = CUFLASH_N;
constexpr int STAGES = K / 64;
constexpr bool B_MN = CUFLASH_B_MN;
constexpr bool A_REGS = CUFLASH_A_REGS;
constexpr bool A_MN = CUFLASH_A_MN;
static_assert(!A_MN || (B_MN && !A_REGS), "MN-major A goes with MN-major B, from shared memory");
constexpr int A_BYTES = 64 * 128;  // 64 rows x 64 16-bit elements
constexpr int B_BYTES = N * 128;   // N x 64 (K-major) or 64 x N as N / 64 atoms of 64 x 64 (MN-major)

struct Smem {
    alignas(1024) unsigned char a[STAGES][A_BYTES];
    alignas(1024) unsigned char b[STAGES][B_BYTES];
    u64 full[STAGES];
};

extern "C" __global__ void __launch_bounds__(256, 1)
    wgmma_gemm(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b, const u16* a_global,
               float* c, unsigned lbo, unsigned sbo) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    Smem& sm = *reinterpret_cast<Smem*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(&sm.full[s], 1);
        fence_barrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        regs_decrease<40>();
        if (threadIdx.x == 0) {
            for (int s = 0; s < STAGES; ++s) {
                mbar_arrive_expect_tx(&sm.full[s], A_BYTES + B_BYTES);
                if constexpr (A_MN)
                    tma_load_2d(sm.a[s], &map_a, &sm.full[s], 0, s * 64);  // box: 64 M-elements x 64 K-rows
                else
                    tma_load_2d(sm.a[s], &map_a, &sm.full[s], s * 64, 0);  // box: 64 K-elements x 64 M-rows
                if constexpr (B_MN) {
                    for (int atom = 0; atom < N / 64; ++atom)  // box: 64 N-elements x 64 K-rows
                        tma_load_2d(sm.b[s] + atom * 64 * 128, &map_b, &sm.full[s], atom * 64, s * 64);
                } else {
                    tma_load_2d(sm.b[s], &map_b, &sm.full[s], s * 64, 0);  // box: 64 K-elements x N rows
                }
            }
        }
    } else {
        regs_increase<232>();
        const int t = threadIdx.x - 128, w = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;
        float acc[N / 2];
#pragma unroll
        for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
        for (int s = 0; s < STAGES; ++s) {
            mbar_wait(&sm.full[s], 0);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const u64 db = B_MN ? wgmma_desc_mn(sm.b[s] + kk * 16 * 128, lbo, sbo)
                                    : wgmma_desc_advance(wgmma_desc(sm.b[s]), 32 * kk);
                if constexpr (A_MN) {
                    wgmma_ss_mn<N>(acc, wgmma_desc_mn(sm.a[s] + kk * 16 * 128, 64 * 128, 1024), db, 1);
                } else if constexpr (A_REGS) {
                    const u16* row_lo = a_global + (16 * w + g) * K + s * 64 + kk * 16 + 2 * q;
                    const u16* row_hi = row_lo + 8 * K;
                    const u32 a[4] = {*reinterpret_cast<const u32*>(row_lo), *reinterpret_cast<const u32*>(row_hi),
                                      *reinterpret_cast<const u32*>(row_lo + 8), *reinterpret_cast<const u32*>(row_hi + 8)};
                    wgmma_rs<N, B_MN>(acc, a, db, 1);
                } else {
                    wgmma_ss<N, B_MN>(acc, wgmma_desc_advance(wgmma_desc(sm.a[s]), 32 * kk), db, 1);
                }
            }
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_regs(acc);
        }
#pragma unroll
        for (int i = 0; i < N / 8; ++i) {
            const int col = 8 * i + 2 * q;
            c[(16 * w + g) * N + col] = acc[4 * i];
            c[(16 * w + g) * N + col + 1] = acc[4 * i + 1];
            c[(16 * w + g + 8) * N + col] = acc[4 * i + 2];
            c[(16 * w + g + 8) * N + col + 1] = acc[4 * i + 3];
        }
    }
}
