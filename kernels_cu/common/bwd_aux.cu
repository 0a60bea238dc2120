// The two small passes around every attention backward, a group of lanes per (batch, head, row), one
// 16-byte chunk of the row per lane (a warp per row left 3/4 of its lanes idle at d = 64):
//   bwd_preprocess: D = rowsum(dO o O) in fp32, and zero the row's fp32 dQ accumulator; D (and, when
//                   lse_rows is set, the forward's LSE in log2 units) go to rows row_pitch apart, so a kernel
//                   that loads them with TMA gets blocks at 16-byte aligned offsets (FA3: pitch a multiple of 64);
//   bwd_convert_dq: dQ = scale * dq_accum (the sum of its planes, in order), rounded to the element type.
// row_shift (the FA3 backward's spare rows before row 0, fa3/bwd_roles.cuh): each head's dq_accum rows and
// padded rows start with row_shift rows of padding, row i at i + row_shift; the preprocess writes the
// padding of the LSE / D rows (+inf, 0: no probability flows there) and leaves dq_accum's (never read).
// Compile-time constants: CUFLASH_HEADDIM, CUFLASH_DTYPE.
#include "common/padded_rows.cuh"
#include "common/types.cuh"

struct BwdAuxParams {
    const u16* o;
    const u16* dout;
    float* dq_accum;  // (batch, heads, row_shift + seqlen_q, headdim) fp32
    u16* dq;
    float* dsum;  // (batch, heads, row_pitch) fp32; entries past seqlen_q are left unwritten
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 do_batch_stride, do_row_stride, do_head_stride;
    i64 dq_batch_stride, dq_row_stride, dq_head_stride;
    int batch, heads, seqlen_q;
    float scale;  // dQ = scale * dq_accum
    const float* lse;  // the forward's LSE, contiguous (batch, heads, seqlen_q); read only when lse_rows is set
    float* lse_rows;   // null, or its copy in dsum's layout, in log2 units (LSE log2(e), +inf for a row that saw
                       // no key): what the FA3 backward subtracts in its exponent, as it reads it
    i64 row_pitch;     // >= seqlen_q
    // Packed variable-length rows (batch 1 of seqlen_q = total rows) with lse_rows: null, or the (varlen_batch
    // + 1) sequence offsets; row i of sequence b then goes to row padded_seq_start(cu[b], b) + (i - cu[b]) of
    // its head's padded row (common/padded_rows.cuh: the FA3 backward's layout); rows of no sequence are not
    // written.
    const int* cu_seqlens_q;
    int varlen_batch;
    int row_shift;  // 0 with cu_seqlens_q
    // dq_accum holds this many planes, accum_plane_stride floats apart (the deterministic FA3 backward's
    // per-residue accumulators, fa3/bwd_roles.cuh dq_turn): the preprocess zeroes each and the conversion
    // sums them in plane order, so the sum is the same every run. 1 elsewhere.
    int accum_planes;
    i64 accum_plane_stride;
};

constexpr int D = CUFLASH_HEADDIM;
constexpr int CHUNKS = D / 8;  // 8 elements (16 bytes) per lane
constexpr int GROUP = CHUNKS <= 4 ? 4 : CHUNKS <= 8 ? 8 : CHUNKS <= 16 ? 16 : 32;  // lanes per row: a power of two
static_assert(CHUNKS <= 32, "a group of at most one warp covers a row");
constexpr int ROWS_PER_BLOCK = CUFLASH_THREADS / GROUP;  // cuflash/_bwd_aux.py sizes the grid by the same rule

// This lane's row of the flattened (batch, heads, seqlen_q) index space and its chunk of it. 32-bit index
// arithmetic: the host checks that the rows number fewer than 2^31.
struct RowChunk {
    int r;         // the flattened row
    int b, h, i;   // its batch entry, head and row within the sequence
    int chunk;     // this lane's 16-byte chunk
    bool in_rows;  // r is a row, not past the end (a whole group is in or out)

    __device__ __forceinline__ explicit RowChunk(const BwdAuxParams& p) {
        r = int(blockIdx.x) * ROWS_PER_BLOCK + int(threadIdx.x) / GROUP;
        chunk = int(threadIdx.x) % GROUP;
        const int bh = r / p.seqlen_q;
        i = r - bh * p.seqlen_q;
        b = bh / p.heads;
        h = bh - b * p.heads;
        in_rows = b < p.batch;
    }
    __device__ __forceinline__ bool active() const { return in_rows && chunk < CHUNKS; }
};

// The lane's row of dq_accum: after its head's row_shift rows of padding.
__device__ __forceinline__ i64 accum_row(const BwdAuxParams& p, const RowChunk& rc) {
    return (i64(rc.b) * p.heads + rc.h) * (p.seqlen_q + p.row_shift) + p.row_shift + rc.i;
}

extern "C" __global__ void __launch_bounds__(CUFLASH_THREADS) bwd_preprocess(const BwdAuxParams p) {
    const RowChunk rc(p);
    const int b = rc.b, h = rc.h, i = rc.i;
    float acc = 0.f;
    if (rc.active()) {
        const int c = rc.chunk * 8;
        const uint4 o = *reinterpret_cast<const uint4*>(p.o + b * p.o_batch_stride + i * p.o_row_stride +
                                                         h * p.o_head_stride + c);
        const uint4 d = *reinterpret_cast<const uint4*>(p.dout + b * p.do_batch_stride + i * p.do_row_stride +
                                                         h * p.do_head_stride + c);
        const u32 ow[4] = {o.x, o.y, o.z, o.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            acc += elem_t::to_float(u16(ow[w] & 0xffff)) * elem_t::to_float(u16(dw[w] & 0xffff));
            acc += elem_t::to_float(u16(ow[w] >> 16)) * elem_t::to_float(u16(dw[w] >> 16));
        }
        float* row = p.dq_accum + accum_row(p, rc) * D + c;
        for (int plane = 0; plane < p.accum_planes; ++plane, row += p.accum_plane_stride) {
            reinterpret_cast<float4*>(row)[0] = make_float4(0.f, 0.f, 0.f, 0.f);
            reinterpret_cast<float4*>(row)[1] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    // The row's sum over its group (every lane of the warp takes part: groups are aligned within it).
#pragma unroll
    for (int off = GROUP / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (rc.in_rows && rc.chunk == 0) {
        i64 row = (i64(b) * p.heads + h) * p.row_pitch + p.row_shift + i;
        if (p.cu_seqlens_q) {
            const int* cu = p.cu_seqlens_q;
            if (i >= cu[p.varlen_batch]) return;  // past the last sequence
            int lo = 0, hi = p.varlen_batch;      // the sequence holding row i: the last lo with cu[lo] <= i
            while (hi - lo > 1) {
                const int mid = (lo + hi) / 2;
                if (cu[mid] <= i) lo = mid;
                else hi = mid;
            }
            row = i64(h) * p.row_pitch + padded_seq_start(cu[lo], lo) + (i - cu[lo]);
        }
        p.dsum[row] = acc;
        if (p.lse_rows) {
            const float l = p.lse[rc.r];
            p.lse_rows[row] = l == neg_inf() ? -neg_inf() : l * 1.4426950408889634f;
        }
        // The padding before row 0 (row_shift): row i's thread writes padding rows i, i + seqlen_q, ...
        for (int j = i; j < p.row_shift; j += p.seqlen_q) {
            const i64 pad = (i64(b) * p.heads + h) * p.row_pitch + j;
            p.dsum[pad] = 0.f;
            if (p.lse_rows) p.lse_rows[pad] = -neg_inf();
        }
    }
}

extern "C" __global__ void __launch_bounds__(CUFLASH_THREADS) bwd_convert_dq(const BwdAuxParams p) {
    const RowChunk rc(p);
    if (!rc.active()) return;
    const int c = rc.chunk * 8;
    const float* row = p.dq_accum + accum_row(p, rc) * D + c;
    float4 x = reinterpret_cast<const float4*>(row)[0], y = reinterpret_cast<const float4*>(row)[1];
    for (int plane = 1; plane < p.accum_planes; ++plane) {  // in plane order: the same sum every run
        row += p.accum_plane_stride;
        const float4 a = reinterpret_cast<const float4*>(row)[0], b = reinterpret_cast<const float4*>(row)[1];
        x = make_float4(x.x + a.x, x.y + a.y, x.z + a.z, x.w + a.w);
        y = make_float4(y.x + b.x, y.y + b.y, y.z + b.z, y.w + b.w);
    }
    const float s = p.scale;
    uint4 out;
    out.x = elem_t::pack2(x.x * s, x.y * s);
    out.y = elem_t::pack2(x.z * s, x.w * s);
    out.z = elem_t::pack2(y.x * s, y.y * s);
    out.w = elem_t::pack2(y.z * s, y.w * s);
    *reinterpret_cast<uint4*>(p.dq + rc.b * p.dq_batch_stride + rc.i * p.dq_row_stride + rc.h * p.dq_head_stride + c) =
        out;
}
