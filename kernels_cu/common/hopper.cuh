// Hopper (sm_90a) building blocks: TMA tensor copies, mbarriers, wgmma and its shared-memory
// descriptors, setmaxnreg, named barriers. The FA3-style kernels are written in these words.
//
// Shared-memory operands of wgmma here are always "K-major with the 128-byte swizzle": a tile of R rows
// by 64 16-bit elements (128 bytes per row), stored as TMA writes it with CU_TENSOR_MAP_SWIZZLE_128B —
// 16-byte chunk c of row r lands at chunk c ^ (r % 8) — so 8-row groups are 1024 bytes apart. Wider
// tiles (head dim 128 = two 64-column atoms) are stored atom after atom.
#pragma once
#include "fp8.cuh"
#include "types.cuh"
#include "wgmma_ops.cuh"

// The driver's CUtensorMap is 128 opaque bytes, 64-byte aligned (cuda.h does not compile under
// NVRTC). The host encodes it (cuflash/_tma.py) and passes it as a const __grid_constant__ parameter.
struct alignas(64) TensorMap {
    u64 opaque[16];
};

__device__ __forceinline__ u32 smem_u32(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// The dynamic shared memory as a T at the first 1024-byte boundary (128-byte-swizzled TMA boxes and wgmma
// tiles need it; the launcher asks for 1023 bytes of slack). Pointer arithmetic on the __shared__ array
// keeps the shared address space visible to the compiler: stores through it are STS, and a proxy fence
// after them needs no MEMBAR. Rounding the address as an integer loses that (generic ST and a
// MEMBAR.ALL.CTA before every fence.proxy.async, seen in the FA3 backward's dS and dQ staging).
template <typename T>
__device__ __forceinline__ T& aligned_smem(unsigned char* raw) {
    return *reinterpret_cast<T*>(raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u));
}

// ---------------------------------------------------------------------------------------------------
// mbarrier: a transaction counter in shared memory. The producer arms it with the bytes it expects,
// TMA completes those bytes, and consumers wait on its phase parity.

__device__ __forceinline__ void mbar_init(u64* bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrivals));
}
// Make mbarrier.init visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait_loop:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_loop;\n"
        "}\n" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}

// ---------------------------------------------------------------------------------------------------
// TMA: whole tiles between global and shared memory, described by a tensor map.

// Load the box at coordinates (c0 innermost, c1, c2, c3) into dst; completes `bar`'s transaction bytes.
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap* map, u64* bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
        "[%2];" ::"r"(smem_u32(dst)),
        "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* map, u64* bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
            smem_u32(dst)),
        "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
        : "memory");
}
// Load a [rows][ATOMS x 64] 16-bit tile, stored atom after atom, as ATOMS boxes of 64 columns x rows of a
// (d, rows, heads, batch) tensor map.
template <int ATOMS, int ATOM_COLS = 64>
__device__ __forceinline__ void tma_load_atoms(unsigned char* dst, int rows, const TensorMap* map, u64* bar, int row,
                                               int head, int batch) {
#pragma unroll
    for (int a = 0; a < ATOMS; ++a) tma_load_4d(dst + a * rows * 128, map, bar, a * ATOM_COLS, row, head, batch);
}

// Store a box from shared memory; the writes must be fenced for the async proxy first (fence_async_smem).
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(map),
                 "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}
// Add a box from shared memory into global memory element by element (atomically with respect to other
// reductions into the same elements); fence the shared writes first, as for a store.
__device__ __forceinline__ void tma_reduce_add_3d(const TensorMap* map, const void* src, int c0, int c1, int c2) {
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                     map),
                 "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;"); }
__device__ __forceinline__ void tma_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Wait until the committed stores/reductions have been performed in global memory, not just read from
// shared memory (before telling another thread block they are there).
__device__ __forceinline__ void tma_store_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Order this thread's generic-proxy global accesses with its async-proxy (TMA) ones.
__device__ __forceinline__ void fence_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// Ordinary shared-memory stores read next by TMA or wgmma need this fence in the writing threads.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// stmatrix.x4: four 8x8 b16 matrices from registers to shared memory; register i of every lane holds row
// lane / 4, columns 2 (lane % 4) .. + 1 of matrix i (ldmatrix's layout) and lanes 8i .. 8i + 7 give the row
// addresses of matrix i (16 bytes each, 16-byte aligned).
__device__ __forceinline__ void stmatrix_x4(u32 addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3])
                 : "memory");
}

// ---------------------------------------------------------------------------------------------------
// Warp specialisation: register budgets per warpgroup, and named barriers between warpgroups.

template <int REGS>
__device__ __forceinline__ void regs_increase() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void regs_decrease() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Whether `pred` holds in any thread of this warpgroup (named barrier `id` over its 128 threads, which all
// call this at the same point).
__device__ __forceinline__ bool warpgroup_any(bool pred, int id) {
    u32 any;
    asm volatile(
        "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n barrier.cta.red.or.pred q, %2, 128, p;\n"
        " selp.u32 %0, 1, 0, q;\n}"
        : "=r"(any) : "r"(u32(pred)), "r"(id) : "memory");
    return any != 0;
}

// ---------------------------------------------------------------------------------------------------
// wgmma: a warpgroup (4 warps) multiplies a 64 x 16 A by a 16 x N B into a 64 x N fp32 accumulator.
// Thread layout of the accumulator (per warp w of the group, lane = 4 g + t): for each 8-column group
// i, acc[4i + 0, 1] = (row 16 w + g, columns 8 i + 2 t, + 1), acc[4i + 2, 3] = (row 16 w + g + 8, ...):
// the mma.sync C layout repeated; an A fragment in registers follows the mma.sync A layout.

// This thread's warpgroup, broadcast from lane 0: the compiler then knows it is warp-uniform, so shared-memory
// addresses and wgmma descriptors derived from it live in uniform registers instead of being moved there
// (R2UR) in front of every wgmma.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0); }

// Shared-memory matrix descriptor of a 128-byte-swizzled operand starting at `p`: start address,
// leading and stride byte offsets (all >> 4), swizzle mode 1 (128 B).
//   K-major (wgmma_desc): leading offset unused (1), stride 1024 bytes between 8-row groups.
//   MN-major (wgmma_desc_mn): the 8-row groups along K are `k_group_bytes` apart (1024 for a tile
//   stored as 64-element-wide atoms of 128-byte rows) and the 64-element atoms along MN
//   `mn_atom_bytes` apart (rows x 128 bytes when atoms are stored one after another).
__device__ __forceinline__ u64 make_wgmma_desc(const void* p, u32 leading_bytes, u32 stride_bytes) {
    const u64 addr = (smem_u32(p) & 0x3FFFF) >> 4;
    return addr | (u64(leading_bytes >> 4) << 16) | (u64(stride_bytes >> 4) << 32) | (u64(1) << 62);
}
__device__ __forceinline__ u64 wgmma_desc(const void* p) { return make_wgmma_desc(p, 16, 1024); }
__device__ __forceinline__ u64 wgmma_desc_mn(const void* p, u32 mn_atom_bytes, u32 k_group_bytes = 1024) {
    return make_wgmma_desc(p, mn_atom_bytes, k_group_bytes);
}
// The descriptor of the next 16-element K slice inside a 128-byte atom: 32 bytes further.
__device__ __forceinline__ u64 wgmma_desc_advance(u64 desc, int bytes) { return desc + u64(bytes >> 4); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// x in a register of its own: the compiler cannot see that it equals another value (accumulator starting
// values that repeat would otherwise share a register and be copied right before the wgmma).
__device__ __forceinline__ float own_register(float x) {
    asm volatile("mov.b32 %0, %0;" : "+f"(x));
    return x;
}
// Keep the compiler from moving accumulator reads/writes across an in-flight wgmma.
template <int N>
__device__ __forceinline__ void wgmma_fence_regs(float (&acc)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// A 64 x N fp32 accumulator (e.g. P) as 16-bit A fragments of the next wgmma (e.g. O += P V): the
// accumulator of 8 columns is the A layout of 8 k-elements, so k-step kk (columns 16 kk .. 16 kk + 15) is
// accumulator elements 8 kk .. 8 kk + 7.
template <int N>
__device__ __forceinline__ void acc_to_a_frags(const float (&acc)[N / 2], u32 (&a)[N / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) a[kk][r] = elem_t::pack2(acc[8 * kk + 2 * r], acc[8 * kk + 2 * r + 1]);
}

// The FP8 version, for O += P V on e4m3 (m64nNk32, A from registers): each 8-bit A-fragment register
// packs four of the thread's own accumulator elements (fp8_p_acc_index, common/fp8_layout.cuh), so the
// B operand (V^T) holds its keys in fp8_v_key_order (the V transpose pre-pass, fa3/fp8_transpose_v.cu).
template <int N>
__device__ __forceinline__ void acc_to_a_frags_fp8(const float (&acc)[N / 2], u32 (&a)[N / 32][4]) {
#pragma unroll
    for (int kk = 0; kk < N / 32; ++kk)
#pragma unroll
        for (int reg = 0; reg < 4; ++reg)
            a[kk][reg] = e4m3x4(acc[fp8_p_acc_index(kk, reg, 0)], acc[fp8_p_acc_index(kk, reg, 1)],
                                acc[fp8_p_acc_index(kk, reg, 2)], acc[fp8_p_acc_index(kk, reg, 3)]);
}

// The wgmma instructions themselves (m64nNk16 for N = 64, 128, 256; A from shared memory or registers;
// B K-major or MN-major) are generated: common/wgmma_ops.cuh.

// acc (64 x N) = A B^T over K = 16 KSTEPS, both operands K-major in shared memory as 64-column atoms of
// 128-byte rows (4 k-steps of 32 bytes per atom): A's 64 rows at `a`, its atoms `a_atom_bytes` apart; B's
// N rows at `b`, its atoms `b_atom_bytes` apart. Asynchronous: one commit group (FA3's S = Q K^T forward,
// S^T = K Q^T and dP^T = V dO^T backward). `onto_acc`: the product is added to acc's values (else it
// overwrites them).
template <int N, int KSTEPS, bool FP8 = false>
__device__ __forceinline__ void wgmma_abt_kmajor(float (&acc)[N / 2], const unsigned char* a, int a_atom_bytes,
                                                 const unsigned char* b, int b_atom_bytes, bool onto_acc = false) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        const int atom = kk / 4, step = kk % 4;  // a k-step is 32 bytes: 16 bf16/fp16 or 32 e4m3 elements
        const u64 da = wgmma_desc_advance(wgmma_desc(a + atom * a_atom_bytes), 32 * step);
        const u64 db = wgmma_desc_advance(wgmma_desc(b + atom * b_atom_bytes), 32 * step);
        if constexpr (FP8)
            wgmma_ss_fp8<N>(acc, da, db, onto_acc || kk > 0);
        else
            wgmma_ss<N, 0>(acc, da, db, onto_acc || kk > 0);
    }
    wgmma_commit();
}
