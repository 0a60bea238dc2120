// Host build of kernels_cu/common/padded_rows.cuh (tests/test_padded_rows.py builds it with g++ and calls it
// through ctypes): the start of each packed sequence in the FA3 backward's padded LSE / D rows.
#define __host__
#define __device__

#include "padded_rows.cuh"

extern "C" {

int seq_start(int cu_start, int b) { return padded_seq_start(cu_start, b); }

}  // extern "C"
