// Host build of kernels_cu/fp8/signs.cuh (tests/test_fp8_cpu.py builds it with g++ and calls it through
// ctypes), so the CPU tier checks that cuflash.fp8.hadamard_signs draws the very signs the kernel uses.
#define __device__
#define __forceinline__ inline

#include "signs.cuh"

extern "C" {

// bits[i] = hadamard_sign_bit(key, i) for i < d.
void fp8_sign_bits(unsigned key, int d, unsigned char* bits) {
    for (int i = 0; i < d; ++i) bits[i] = (unsigned char)hadamard_sign_bit(key, (unsigned)i);
}

}  // extern "C"
