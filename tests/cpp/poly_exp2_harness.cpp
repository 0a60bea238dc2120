// Host build of kernels_cu/common/poly_exp2.cuh (tests/test_poly_exp2.py builds it with g++ and calls it
// through ctypes), so the CPU tier checks the very arithmetic the FA3 softmax runs on the FMA pipe.
#include <cmath>
#include <cstring>

#define __device__
#define __forceinline__ inline
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }

#include "poly_exp2.cuh"

extern "C" {

// y[i] = poly_exp2(x[i]).
void poly_exp2_many(const float* x, float* y, long long count) {
    for (long long i = 0; i < count; ++i) y[i] = poly_exp2(x[i]);
}

}  // extern "C"
