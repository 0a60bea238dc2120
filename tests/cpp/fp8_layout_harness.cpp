// Host build of kernels_cu/common/fp8_layout.cuh (tests/test_fp8_layout.py builds it with g++ and calls it
// through ctypes), so the CPU tier checks the very index functions the FP8 forward packs P and lays out V^T with.
#define __host__
#define __device__

#include "fp8_layout.cuh"

extern "C" {

int p_acc_index(int kk, int reg, int byte) { return fp8_p_acc_index(kk, reg, byte); }
int v_key_order(int p) { return fp8_v_key_order(p); }

}  // extern "C"
