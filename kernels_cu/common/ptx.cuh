// Ampere-generation warp-level building blocks: mma.sync m16n8k16, ldmatrix, cp.async; and the
// programmatic-dependent-launch controls, which compile to nothing below sm_90.
//
// Fragment layouts of mma.m16n8k16 (lane = 4*g + t, g = lane/4 "group", t = lane%4):
//   A (16x16, row-major): a[0] = (g,   2t..2t+1)  a[1] = (g+8, 2t..)  a[2] = (g, 2t+8..)  a[3] = (g+8, 2t+8..)
//   B (16x8,  "col"):     b[0] = (k 2t..2t+1, n g)  b[1] = (k 2t+8.., n g)
//   C (16x8,  fp32):      c[0..1] = (g, 2t..2t+1)   c[2..3] = (g+8, 2t..2t+1)
// ldmatrix.x4 loads four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and
// register i of every lane receives matrix i in the "row g, columns 2t..2t+1" layout (.trans: the
// transposed matrix).
#pragma once
#include "types.cuh"

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]);

template <>
__device__ __forceinline__ void mma_16816<bf16_t>(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16816<fp16_t>(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// 16-byte asynchronous global->shared copy; src_bytes < 16 zero-fills the rest (0 = all zeros).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(smem)), "l"(gmem),
                 "r"(src_bytes));
}
// 4 bytes (an int of a page table): the .ca form (.cg takes only 16-byte copies).
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Sum / max across the four lanes of a quad (the lanes that share a row of a C fragment).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// 2^x on the special-function unit (FA2+ fold log2(e) into the softmax scale and use this).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ldmatrix from a shared-memory address already in the shared window (see LdsmAddr in tile.cuh).
__device__ __forceinline__ void ldmatrix_x4_at(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans_at(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// tanh on the special-function unit (softcap: logits = softcap * tanh(scale * s / softcap)).
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Acquire / release accesses to a global flag (ordered dQ accumulation across thread blocks).
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release(int* p, int v) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// ... and 64-bit ones (the FA3 forward's tail pieces: a flag holds the call's 64-bit tag when set).
__device__ __forceinline__ u64 ld_acquire(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release(u64* p, u64 v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Programmatic dependent launch (sm_90+; no-ops below, where the launcher never asks for it). A grid
// launched with the programmatic-stream-serialisation attribute after this one (cuflash._jit.launch_dependent)
// may start launching once every block of this grid has executed grid_dependents_launch() or exited:
// its blocks become resident and run their prologue while this grid still runs. That is all it allows;
// it publishes no data.
__device__ __forceinline__ void grid_dependents_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Blocks until every prerequisite grid has completed and its memory operations are visible to this
// one, wherever those grids executed grid_dependents_launch(). Returns at once in a grid launched
// without the attribute (its prerequisites completed before it started).
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
