// The FP8 forward's pre-pass: V (batch, seqlen_k, kv_heads, d) e4m3 -> V^T (batch, kv_heads, d, keys_padded).
// FP8 wgmma reads its shared-memory B operand K-major only, and for O += P V the K dimension is the keys:
// V^T rows hold keys contiguously. Within each 16-key group the keys are stored in fp8_v_key_order
// (common/fp8_layout.cuh), the order in which the kernel packs P into fragments. keys_padded = seqlen_k rounded
// up to 16 (rows 16-byte aligned for TMA); keys past seqlen_k are zeros (P is 0 there, but 0 x NaN is NaN).
//
// One block per 64 keys of one (batch, KV head): the 64 x d bytes go through shared memory; each thread
// then writes 16 bytes of one V^T row, four threads covering a row's 64 contiguous bytes.
// Compile-time constant: CUFLASH_HEADDIM.
#include "common/fp8.cuh"
#include "common/types.cuh"

struct Fp8TransposeParams {
    const unsigned char* v;  // (batch, seqlen_k, kv_heads, d), last dim contiguous, 16-byte aligned rows
    unsigned char* vt;       // (batch, kv_heads, d, keys_padded), contiguous
    i64 v_batch_stride, v_row_stride, v_head_stride;  // elements (= bytes)
    int seqlen_k, keys_padded, kv_heads;
};

constexpr int D = CUFLASH_HEADDIM;
constexpr int KEYS = 64;
constexpr int THREADS = 256;
static_assert(THREADS == CUFLASH_THREADS, "launcher and kernel disagree on the block size");
static_assert(D % 16 == 0, "rows are read 16 bytes at a time");

extern "C" __global__ void __launch_bounds__(THREADS) fp8_transpose_v(const Fp8TransposeParams p) {
    __shared__ __align__(16) unsigned char tile[KEYS][D + 16];  // + 16: rows start in different banks
    const int key0 = blockIdx.x * KEYS, kv_head = blockIdx.y, batch = blockIdx.z;
    const unsigned char* v = p.v + batch * p.v_batch_stride + kv_head * p.v_head_stride;
    for (int c = threadIdx.x; c < KEYS * D / 16; c += THREADS) {
        const int row = c / (D / 16), col = c % (D / 16) * 16;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (key0 + row < p.seqlen_k) x = *reinterpret_cast<const uint4*>(v + (key0 + row) * p.v_row_stride + col);
        *reinterpret_cast<uint4*>(&tile[row][col]) = x;
    }
    __syncthreads();
    unsigned char* vt = p.vt + (i64(batch) * p.kv_heads + kv_head) * D * p.keys_padded;
    for (int c = threadIdx.x; c < D * KEYS / 16; c += THREADS) {
        const int group = c % (KEYS / 16), d = c / (KEYS / 16);
        const int key = key0 + 16 * group;
        if (key >= p.keys_padded) continue;
        u32 w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            w[q] = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) w[q] |= u32(tile[16 * group + fp8_v_key_order(4 * q + i)][d]) << (8 * i);
        }
        *reinterpret_cast<uint4*>(vt + i64(d) * p.keys_padded + key) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}
