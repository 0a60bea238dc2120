// Host build of kernels_cu/common/fast_divmod.cuh (tests/test_fast_divmod.py builds it with g++ and calls
// it through ctypes), so the CPU tier checks the very arithmetic the decode kernel's paged copies run.
#include <cstdint>
#include <cstring>

#define __device__
#define __forceinline__ inline
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }

#include "fast_divmod.cuh"

extern "C" {

// q[i], r[i] = divmod(n[i], d) through FastDivmod.
void fast_divmod(int d, const int32_t* n, int32_t* q, int32_t* r, long long count) {
    const FastDivmod fd(d);
    for (long long i = 0; i < count; ++i) {
        int qi, ri;
        fd.divmod(n[i], qi, ri);
        q[i] = qi, r[i] = ri;
    }
}

}  // extern "C"
