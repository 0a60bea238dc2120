// Decode attention (Flash-Decoding) over a contiguous or paged KV cache: mma.sync + cp.async, sm_80+.
//
// Grid (num_splits * m_blocks, kv_heads, batch). A thread block's 16 rows are the query heads of one
// GQA group packed with the queries: row r is query r / g of head kv_head * g + r % g (g = heads /
// kv_heads), so every head of the group shares each K/V byte the block reads; for decoding (seqlen_q = 1)
// with g <= 16 one block per KV head reads its K/V exactly once.
//
// The keys that the block's real rows can see, in tiles of BN, are dealt to the num_splits splits in
// contiguous runs (cuflash.reference.decode_split_tiles models it). Inside a block:
//   - a STAGES-deep cp.async ring streams K and V tiles in 16-byte copies; rows past the entry's key
//     count are zero-filled, never read. In a paged cache every row is looked up on its own (page_size
//     may be 1) in a ring of page-table entries in shared memory, which the same cp.async groups fill
//     STAGES - 1 tiles ahead of their use: no global load stands between one tile's copies and the next
//     (a page-table load issued one tile ahead into registers did, at one block per SM);
//   - each warp (BN / 16 of them) takes 16 keys of every tile and keeps its own online softmax over them:
//     S (16 x 16) = Q K^T on mma.sync m16n8k16 (fp32 accumulation), mask, exp2 with the scale folded
//     into one multiply, O (16 x D) += P V with P straight from the S registers;
//   - after the loop the warps' (max, sum, O) are merged through shared memory (the drained ring).
// One split writes O (input dtype) and LSE; several write fp32 partials that decode/combine.cu merges,
// launched on sm_90+ as this kernel's programmatic dependent (see grid_dependents_launch() below).
// Every tile gets the per-element mask (key < keys of the entry, causal / window bottom-right): the kernel
// is memory-bound and the compare is free next to the loads.
//
// Compile-time constants (cuflash/decode.py): CUFLASH_HEADDIM, CUFLASH_BLOCK_N (16 per warp), CUFLASH_STAGES,
// CUFLASH_COPY_CHUNKS (16-byte chunks of a row each thread copies), CUFLASH_PAGED (0/1), CUFLASH_DTYPE;
// CUFLASH_PROBE_NO_COMPUTE (timing probes only: no attention math).
#ifndef CUFLASH_PROBE_NO_COMPUTE
#define CUFLASH_PROBE_NO_COMPUTE 0
#endif
#include "common/fast_divmod.cuh"
#include "common/mask.cuh"
#include "common/ptx.cuh"
#include "common/tile.cuh"
#include "decode/params.cuh"

constexpr int D = CUFLASH_HEADDIM;
constexpr int BN = CUFLASH_BLOCK_N;
constexpr int STAGES = CUFLASH_STAGES;
constexpr bool PAGED = CUFLASH_PAGED;
constexpr int BM = 16;  // rows per block: one m16 tile
constexpr int WN = 16;  // keys of each tile that one warp owns: its P is exactly one 16 x 16 A fragment of P V
constexpr int WARPS = BN / WN;
constexpr int THREADS = WARPS * 32;
static_assert(BN % WN == 0 && THREADS == CUFLASH_THREADS, "launcher and kernel disagree on the block size");
static_assert(STAGES >= 2 && D % 64 == 0, "a ring of at least two swizzled stages");

// The tile copy: ROW_THREADS threads share a row, thread tid copying 16-byte chunks tid % ROW_THREADS +
// ROW_THREADS c (c < COPY_CHUNKS) of rows tid / ROW_THREADS + ROWS_PER_PASS i: each instruction moves
// ROW_THREADS contiguous chunks of 32 / ROW_THREADS rows, and a row's address (a page lookup and 64-bit
// math in a paged cache) is worked out once per COPY_CHUNKS copies.
constexpr int CHUNKS = D / 8;
constexpr int COPY_CHUNKS = CUFLASH_COPY_CHUNKS;
constexpr int ROW_THREADS = CHUNKS / COPY_CHUNKS;
constexpr int ROWS_PER_PASS = THREADS / ROW_THREADS;
constexpr int PASSES = BN / ROWS_PER_PASS;  // rows of a tile each thread copies
static_assert(CHUNKS % COPY_CHUNKS == 0 && THREADS % ROW_THREADS == 0 && BN % ROWS_PER_PASS == 0,
              "copy passes cover a tile exactly");
// Paged: tiles whose page-table entries the ring holds (one slot of at most BN entries per tile). Entries
// for tile n + 2 STAGES - 2 are written while those of tile n + STAGES - 1 are read: with 2 STAGES slots
// a slot is rewritten only STAGES + 1 iterations (and barriers) after its last read.
constexpr int PAGE_RING = 2 * STAGES;
static_assert(THREADS >= BN, "one thread per page-table entry of a tile");

typedef FastSmemTile<BM, D> QTile;
typedef FastSmemTile<BN, D> KVTile;
typedef LdsmAddr<BM, D, true> QAddr;
typedef LdsmAddr<BN, D, true> KVAddr;
typedef float Frag[4];  // one m16n8 fp32 accumulator fragment

struct Smem {
    QTile q;
    KVTile k[STAGES];
    KVTile v[STAGES];
};

// The warps' fp32 O tiles meet here after the loop, in the ring's memory. Rows padded by 4 floats:
// still 16-byte aligned for the vector reads, and the fragment writes of a warp's 8 row groups spread
// over more banks.
constexpr int O_PITCH = D + 4;
static_assert(sizeof(KVTile) * 2 * STAGES >= sizeof(float) * WARPS * BM * O_PITCH, "merge scratch fits in the ring");

// Copies K/V tiles of one (batch entry, KV head) into the ring.
struct KvCopier {
    const u16* k;  // this KV head's K cache (kv_head * head_stride applied)
    const u16* v;
    i64 k_outer, k_row, v_outer, v_row;  // outer = the entry's batch stride, or the page stride
    i64 k_entry, v_entry;                // contiguous: the entry's offset (its cache row)
    const int* pages;                    // paged: the entry's page_table row
    FastDivmod page_size;                // paged: key -> (page-table slot, row within the page)
    int seqlen_k;
    int row0, col;                       // this thread's first row and its column (elements)

    // Paged: the page-table entries of `tile`'s keys into `slot` of the page ring, one 4-byte cp.async
    // per entry (thread e copies the tile's e-th), in the caller's commit group.
    __device__ __forceinline__ void fetch_pages(int* slot, int tile) const {
        const int key0 = tile * BN, keys = min(BN, seqlen_k - key0);
        if (keys <= 0) return;
        const int first = page_size.div(key0), count = page_size.div(key0 + keys - 1) + 1 - first;
        if (int(threadIdx.x) < count) cp_async_4(slot + threadIdx.x, pages + first + threadIdx.x);
    }

    // `slot`: paged, the tile's page-table entries (fetch_pages, landed). The row of a paged cache from
    // one multiply-high per row instead of an integer division (the paged kernel had twice the
    // contiguous one's instructions, ~16 divisions per tile and thread, and ran at 38-65 % of its
    // bandwidth on the H200).
    __device__ __forceinline__ void copy(Smem& sm, int tile, int stage, const int* slot) const {
        const int first = PAGED ? page_size.div(tile * BN) : 0;
#pragma unroll
        for (int i = 0; i < PASSES; ++i) {
            const int r = row0 + ROWS_PER_PASS * i, j = tile * BN + r;
            const bool in = j < seqlen_k;
            int page = 0, within = 0;
            if constexpr (PAGED) {
                int s;
                page_size.divmod(j, s, within);
                page = in ? slot[s - first] : 0;  // (rows past the keys: slots the ring does not hold)
            }
            const u16* k_src = k + (in ? (PAGED ? page * k_outer + within * k_row : k_entry + j * k_row) + col : 0);
            const u16* v_src = v + (in ? (PAGED ? page * v_outer + within * v_row : v_entry + j * v_row) + col : 0);
#pragma unroll
            for (int c = 0; c < COPY_CHUNKS; ++c) {
                const int dc = 8 * ROW_THREADS * c;  // elements (rows past the keys: the same zero-filled source)
                cp_async_16(sm.k[stage].at(r, col + dc), k_src + (in ? dc : 0), in ? 16 : 0);
                cp_async_16(sm.v[stage].at(r, col + dc), v_src + (in ? dc : 0), in ? 16 : 0);
            }
        }
    }
};

// One warp's step over its 16 keys of a tile: S = Q K^T, mask, online softmax, O += P V.
// vis_lo / vis_hi: the inclusive key interval each of the thread's two rows (g, g + 8) sees.
__device__ __forceinline__ void attend(const QAddr& q, const KVAddr& k, const KVAddr& v, u32 stage_off, int key_row0,
                                       int key0, const int (&vis_lo)[2], const int (&vis_hi)[2], const DecodeParams& p,
                                       float (&row_max)[2], float (&row_sum)[2], Frag (&o)[D / 8]) {
    Frag s[2] = {};
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
        u32 a[4], b[4];
        ldmatrix_x4_at(a, q.at(0, kk));
        ldmatrix_x4_at(b, k.at(key_row0, kk) + stage_off);
        mma_16816<elem_t>(s[0], a, {b[0], b[1]});
        mma_16816<elem_t>(s[1], a, {b[2], b[3]});
    }
    const bool softcap = p.softcap_pre > 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = e / 2, key = key0 + 8 * j + (e & 1);
            float x = s[j][e];
            if (softcap) x = tanh_approx(x * p.softcap_pre);
            s[j][e] = key < vis_lo[r] || key > vis_hi[r] ? neg_inf() : x;
        }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float mx = quad_max(fmaxf(row_max[r], fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]),
                                                          fmaxf(s[1][2 * r], s[1][2 * r + 1]))));
        // A row that has seen nothing yet keeps max -inf: exponentiate against 0 then (gives 0, not NaN).
        const float base = mx == neg_inf() ? 0.f : mx * p.scale_log2;
        alpha[r] = mx == row_max[r] ? 1.f : fast_exp2(row_max[r] * p.scale_log2 - base);
        row_max[r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            s[j][2 * r] = fast_exp2(s[j][2 * r] * p.scale_log2 - base);
            s[j][2 * r + 1] = fast_exp2(s[j][2 * r + 1] * p.scale_log2 - base);
            sum += s[j][2 * r] + s[j][2 * r + 1];
        }
        row_sum[r] = row_sum[r] * alpha[r] + sum;
    }
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
        o[c][0] *= alpha[0], o[c][1] *= alpha[0];
        o[c][2] *= alpha[1], o[c][3] *= alpha[1];
    }
    // P as the A operand: the C fragments of the two 8-key halves are the A fragment's column halves.
    const u32 pa[4] = {elem_t::pack2(s[0][0], s[0][1]), elem_t::pack2(s[0][2], s[0][3]),
                       elem_t::pack2(s[1][0], s[1][1]), elem_t::pack2(s[1][2], s[1][3])};
#pragma unroll
    for (int dd = 0; dd < D; dd += 16) {
        u32 b[4];
        ldmatrix_x4_trans_at(b, v.at(key_row0, dd) + stage_off);
        mma_16816<elem_t>(o[dd / 8], pa, {b[0], b[1]});
        mma_16816<elem_t>(o[dd / 8 + 1], pa, {b[2], b[3]});
    }
}

// Two blocks of 4 warps per SM (two rings in flight; registers <= 255 either way); 8 warps fill the
// schedulers twice over in one block.
extern "C" __global__ void __launch_bounds__(THREADS, THREADS <= 128 ? 2 : 1) decode_fwd(const DecodeParams p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
    __shared__ float warp_max[WARPS][BM], warp_sum[WARPS][BM];
    __shared__ int page_ring[PAGED ? PAGE_RING : 1][BN];  // paged: the tiles' page-table entries
    // With several splits the combine is launched as this grid's programmatic dependent (sm_90+): it may
    // become resident as soon as every block of this grid has passed here, i.e. once the whole grid is on
    // the SMs, so it takes no slot from a block of this grid, and its launch hides behind this grid's
    // work instead of following it. It reads the partials only after griddepcontrol.wait, which waits
    // for this grid to complete: the trigger's place does not matter for correctness.
    grid_dependents_launch();

    const int split = blockIdx.x % p.num_splits, m_block = blockIdx.x / p.num_splits;
    const int kv_head = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int group = p.heads / p.kv_heads;
    const int rows = group * p.seqlen_q;  // real rows of this (entry, KV head)
    const int row0 = m_block * BM;
    const int seqlen_k = p.cache_seqlens[b] + p.seqlen_new;
    const Mask mask{p.seqlen_q, seqlen_k, p.window_left, p.window_right};

    // Keys the block's real rows see (rows are query-major, so their queries are i_first .. i_last),
    // in tiles, and this split's run of them: [t_lo, t_hi).
    const int i_first = row0 / group, i_last = (min(row0 + BM, rows) - 1) / group;
    const int key_first = max(0, i_first + mask.diag() - mask.left);
    const int key_last = min(seqlen_k - 1, i_last + mask.diag() + mask.right);
    int t_lo = 0, t_hi = 0;
    if (key_last >= key_first) {
        const int first = key_first / BN, count = key_last / BN + 1 - first;
        const int per = (count + p.num_splits - 1) / p.num_splits;
        t_lo = first + split * per;
        t_hi = min(t_lo + per, first + count);
    }
    // The key interval each of this thread's rows (g and g + 8) sees; padding rows see nothing.
    int vis_lo[2], vis_hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + g + 8 * r, i = row / group;
        vis_lo[r] = row < rows ? max(0, i + mask.diag() - mask.left) : 1;
        vis_hi[r] = row < rows ? min(seqlen_k - 1, i + mask.diag() + mask.right) : 0;
    }

    // Q: the block's packed rows (zeros past the real rows); in the first commit group (paged: the group
    // of the first tiles' page-table entries).
    for (int idx = threadIdx.x; idx < BM * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8, row = row0 + r;
        const bool in = row < rows;
        const u16* src = p.q;
        if (in) {
            const int i = row / group, head = kv_head * group + row % group;
            src += b * p.q_batch_stride + i * p.q_row_stride + head * p.q_head_stride + c;
        }
        cp_async_16(sm.q.at(r, c), src, in ? 16 : 0);
    }

    KvCopier kv;
    kv.page_size = FastDivmod(PAGED ? p.page_size : 1);
    kv.k = p.k + kv_head * p.k_head_stride;
    kv.v = p.v + kv_head * p.v_head_stride;
    kv.k_outer = p.k_batch_stride, kv.k_row = p.k_row_stride;
    kv.v_outer = p.v_batch_stride, kv.v_row = p.v_row_stride;
    const i64 entry = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    kv.k_entry = entry * p.k_batch_stride, kv.v_entry = entry * p.v_batch_stride;
    kv.pages = PAGED ? p.page_table + b * p.page_table_stride : nullptr;
    kv.seqlen_k = seqlen_k;
    kv.row0 = threadIdx.x / ROW_THREADS, kv.col = (threadIdx.x % ROW_THREADS) * 8;

    // Paged: the page-table entries of the first STAGES - 1 tiles, waited for here (one round trip, as
    // the first tiles' page lookups always took). Tile t_lo + n's entries live in page_ring[n % PAGE_RING].
    if constexpr (PAGED) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s)
            if (t_lo + s < t_hi) kv.fetch_pages(page_ring[s], t_lo + s);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
    }
    // Prologue: STAGES - 1 tiles in flight (one commit group each, empty past the run); each group also
    // fetches the page-table entries of the tile STAGES - 1 after its own, which it copies when that
    // group has landed.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (t_lo + s < t_hi) kv.copy(sm, t_lo + s, s, page_ring[PAGED ? s : 0]);
        if constexpr (PAGED)
            if (t_lo + s + STAGES - 1 < t_hi) kv.fetch_pages(page_ring[s + STAGES - 1], t_lo + s + STAGES - 1);
        cp_async_commit();
    }

    const QAddr q_addr = a_addr(sm.q, lane);
    const KVAddr k_addr = b_rows_addr(sm.k[0], lane);
    const KVAddr v_addr = b_trans_addr(sm.v[0], lane);
    Frag o[D / 8] = {};
    float row_max[2] = {neg_inf(), neg_inf()}, row_sum[2] = {0.f, 0.f};  // row_sum: this thread's partial sums

    for (int tile = t_lo; tile < t_hi; ++tile) {
        const int n = tile - t_lo;
        cp_async_wait<STAGES - 2>();  // this tile's group has landed (later tiles may be in flight)
        __syncthreads();              // ... for every thread; and every warp is done with the stage refilled next
        const int next = tile + STAGES - 1;  // its page-table entries came with this tile's group
        if (next < t_hi)
            kv.copy(sm, next, (n + STAGES - 1) % STAGES, page_ring[PAGED ? (n + STAGES - 1) % PAGE_RING : 0]);
        if constexpr (PAGED)
            if (next + STAGES - 1 < t_hi)
                kv.fetch_pages(page_ring[(n + 2 * STAGES - 2) % PAGE_RING], next + STAGES - 1);
        cp_async_commit();
#if CUFLASH_PROBE_NO_COMPUTE  // timing only (scripts/decode_probe.py --ab): the copies without the math
        if (o[0][0] == 1.2345f) row_sum[0] += float(n);
#else
        attend(q_addr, k_addr, v_addr, (n % STAGES) * sizeof(KVTile), warp * WN, tile * BN + warp * WN + 2 * t, vis_lo,
               vis_hi, p, row_max, row_sum, o);
#endif
    }
    cp_async_wait<0>();

    // Merge the warps: each publishes its row maxima and sums, rescales its O to the common maximum
    // and stages it in the (now idle) ring; then every thread sums 8 columns of a row over the warps.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(row_sum[r]);
        if (t == 0) warp_max[warp][g + 8 * r] = row_max[r], warp_sum[warp][g + 8 * r] = l;
    }
    __syncthreads();  // every warp is past its last tile: the ring is free
    float* scratch = reinterpret_cast<float*>(&sm.k[0]);  // [WARPS][BM][O_PITCH]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        float mx = warp_max[0][row];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) mx = fmaxf(mx, warp_max[w][row]);
        const float f = row_max[r] == neg_inf() ? 0.f : fast_exp2((row_max[r] - mx) * p.scale_log2);
        float* dst = scratch + (warp * BM + row) * O_PITCH + 2 * t;
#pragma unroll
        for (int c = 0; c < D / 8; ++c)
            *reinterpret_cast<float2*>(dst + 8 * c) = make_float2(o[c][2 * r] * f, o[c][2 * r + 1] * f);
    }
    __syncthreads();

    const bool direct = p.num_splits == 1;
    for (int idx = threadIdx.x; idx < BM * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8, row = row0 + r;
        if (row >= rows) continue;
        float mx = warp_max[0][r];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) mx = fmaxf(mx, warp_max[w][r]);
        float l = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w)
            if (warp_max[w][r] != neg_inf()) l += warp_sum[w][r] * fast_exp2((warp_max[w][r] - mx) * p.scale_log2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        float acc[8] = {};
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float4* src = reinterpret_cast<const float4*>(scratch + (w * BM + r) * O_PITCH + c);
            const float4 x = src[0], y = src[1];
            acc[0] += x.x, acc[1] += x.y, acc[2] += x.z, acc[3] += x.w;
            acc[4] += y.x, acc[5] += y.y, acc[6] += y.z, acc[7] += y.w;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] *= inv;
        const int i = row / group, head = kv_head * group + row % group;
        const float lse = l > 0.f ? (mx * p.scale_log2 + log2f(l)) * 0.69314718055994531f : neg_inf();
        if (direct) {
            uint4 packed;
            packed.x = elem_t::pack2(acc[0], acc[1]), packed.y = elem_t::pack2(acc[2], acc[3]);
            packed.z = elem_t::pack2(acc[4], acc[5]), packed.w = elem_t::pack2(acc[6], acc[7]);
            *reinterpret_cast<uint4*>(p.o + b * p.o_batch_stride + i * p.o_row_stride + head * p.o_head_stride + c) =
                packed;
            if (c == 0) p.lse[(i64(b) * p.heads + head) * p.seqlen_q + i] = lse;
        } else {
            const i64 split_row = (i64(split) * p.batch + b) * p.seqlen_q + i;  // (split, batch, query)
            float4* dst = reinterpret_cast<float4*>(p.o_partial + (split_row * p.heads + head) * D + c);
            dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
            if (c == 0) p.lse_partial[((i64(split) * p.batch + b) * p.heads + head) * p.seqlen_q + i] = lse;
        }
    }
}
