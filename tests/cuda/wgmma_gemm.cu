// Test kernel for kernels_cu/common/hopper.cuh: C (64 x 64, fp32) = A (64 x K) B^T with A, B both
// K-major 16-bit, one thread block of two warpgroups. Warpgroup 0 is the producer: it gives registers
// back (setmaxnreg.dec) and one thread TMA-loads every 64-wide K slice of A and B into its own stage,
// each completing its own mbarrier. Warpgroup 1 takes registers (setmaxnreg.inc), waits for each
// stage and issues four m64n64k16 wgmmas per stage (32-byte descriptor steps inside the 128-byte
// swizzle atom). It exercises exactly what the FA3 kernels rely on: tensor maps passed as
// __grid_constant__, the 128-byte swizzle shared by TMA and the wgmma descriptors, mbarrier
// transaction counts, the warpgroup register split and the accumulator layout.
// Compile-time constants: CUFLASH_K (a multiple of 64, at most 256), CUFLASH_DTYPE.
#include "common/hopper.cuh"

constexpr int K = CUFLASH_K;
constexpr int STAGES = K / 64;
constexpr int TILE_BYTES = 64 * 128;  // 64 rows x 64 16-bit elements

struct Smem {
    alignas(1024) unsigned char a[STAGES][TILE_BYTES];
    alignas(1024) unsigned char b[STAGES][TILE_BYTES];
    u64 full[STAGES];
};

extern "C" __global__ void __launch_bounds__(256, 1)
    wgmma_gemm(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b, float* c) {
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
                mbar_arrive_expect_tx(&sm.full[s], 2 * TILE_BYTES);
                tma_load_2d(sm.a[s], &map_a, &sm.full[s], s * 64, 0);
                tma_load_2d(sm.b[s], &map_b, &sm.full[s], s * 64, 0);
            }
        }
    } else {
        regs_increase<232>();
        float acc[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] = 0.f;
        for (int s = 0; s < STAGES; ++s) {
            mbar_wait(&sm.full[s], 0);
            wgmma_fence();
            const u64 da = wgmma_desc(sm.a[s]), db = wgmma_desc(sm.b[s]);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_64x64x16_ss(acc, wgmma_desc_advance(da, 32 * kk), wgmma_desc_advance(db, 32 * kk), 1);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_regs(acc);
        }
        const int t = threadIdx.x - 128, w = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int col = 8 * i + 2 * q;
            c[(16 * w + g) * 64 + col] = acc[4 * i];
            c[(16 * w + g) * 64 + col + 1] = acc[4 * i + 1];
            c[(16 * w + g + 8) * 64 + col] = acc[4 * i + 2];
            c[(16 * w + g + 8) * 64 + col + 1] = acc[4 * i + 3];
        }
    }
}
