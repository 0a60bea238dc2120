// Where the FP8 forward's P and V^T bytes go, as plain index functions: the kernel (acc_to_a_frags_fp8 in
// common/hopper.cuh, fa3/fp8_transpose_v.cu) computes with them, and the CPU tier builds this header on the
// host (tests/cpp/fp8_layout_harness.cpp) and checks them against the PTX register layouts
// (tests/test_fp8_layout.py). No includes: the host build defines __host__ and __device__ away.
#pragma once

// The 8-bit A fragment of wgmma m64nNk32 holds, per thread (lane = 4 g + q4), rows g (registers 0, 2) and
// g + 8 (1, 3), k-elements 4 q4 .. 4 q4 + 3 (registers 0, 1) and 16 + 4 q4 .. (2, 3): four consecutive k
// per register. The fp32 accumulator of S gives a thread pairs of consecutive columns instead (element
// 4 j + e: row g + 8 (e / 2), column 8 j + 2 q4 + e % 2). So that P needs no shuffles between lanes, byte
// `byte` of register `reg` of k-step kk takes accumulator element fp8_p_acc_index(kk, reg, byte): the
// thread's own pairs of two neighbouring 8-column groups. Fragment k-position 4 q4 + i of a 16-key half
// then holds key 2 q4 + (i & 1) + 8 (i >> 1) of that half.
__host__ __device__ constexpr int fp8_p_acc_index(int kk, int reg, int byte) {
    return 4 * (4 * kk + 2 * (reg >> 1) + (byte >> 1)) + 2 * (reg & 1) + (byte & 1);
}

// ... so the B operand (V^T) lists its keys in that order: position p (0..15) of each 16-key group of a V^T
// row holds key fp8_v_key_order(p) of the group.
__host__ __device__ constexpr int fp8_v_key_order(int p) { return 2 * (p >> 2) + (p & 1) + 8 * ((p >> 1) & 1); }
