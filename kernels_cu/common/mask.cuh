// Which keys a query row may see, and which tiles contain anything visible.
//
// Rows and keys are aligned bottom-right: query row i sits on the key diagonal j = i + (Sk - Sq).
// window (left, right), with "unbounded" stored as a large number, makes key j visible to row i iff
//     i + diag - left <= j <= i + diag + right,   0 <= j < Sk.
// causal is right = 0. The tile ranges below are what the kernels loop over, so masked-out tiles are
// skipped; cuflash/reference.py (kv_block_range) models the same arithmetic.
#pragma once

struct Mask {
    int seqlen_q, seqlen_k;
    int left, right;  // >= 0; "unbounded" = seqlen_k (left) / seqlen_q (right), see _validate.window_bounds

    __device__ __forceinline__ int diag() const { return seqlen_k - seqlen_q; }

    __device__ __forceinline__ bool visible(int row, int col) const {
        int d = row + diag();
        return col < seqlen_k && col <= d + right && col >= d - left;
    }

    // K blocks [lo, hi) holding a key visible to some row of Q block m (rows [m*BM, m*BM+BM)).
    template <int BM, int BN>
    __device__ __forceinline__ void kv_block_range(int m, int& lo, int& hi) const {
        kv_block_range_rows<BN>(m * BM, min(m * BM + BM, seqlen_q) - 1, lo, hi);
    }

    // The same for any run of rows [row_first, row_last], row_last < seqlen_q (e.g. the query rows of a
    // tile that packs the heads of a GQA group).
    template <int BN>
    __device__ __forceinline__ void kv_block_range_rows(int row_first, int row_last, int& lo, int& hi) const {
        int key_first = max(0, row_first + diag() - left);
        int key_last = min(seqlen_k - 1, row_last + diag() + right);
        lo = key_first / BN;
        hi = key_last < key_first ? lo : key_last / BN + 1;
    }

    // Q blocks [lo, hi) holding a row that sees some key of K block n (keys [n*BN, n*BN+BN)); empty for a
    // block past the last key (packed batches launch blocks for the longest sequence; the FA3 deterministic
    // backward would wait forever for a turn such a block cannot have).
    // shift: Q block m holds rows [m*BM - shift, m*BM+BM - shift) (the FA3 backward's spare rows before row 0).
    template <int BM, int BN>
    __device__ __forceinline__ void q_block_range(int n, int& lo, int& hi, int shift = 0) const {
        int key_first = n * BN;
        int key_last = min(key_first + BN, seqlen_k) - 1;
        // row sees key j iff row >= j - diag - right and row <= j - diag + left
        int row_first = max(0, key_first - diag() - right);
        int row_last = min(seqlen_q - 1, key_last - diag() + left);
        lo = (row_first + shift) / BM;
        hi = row_last < row_first || key_last < key_first ? lo : (row_last + shift) / BM + 1;
    }

    // True when every (row, key) of the tile is visible, so the per-element mask can be skipped.
    template <int BM, int BN>
    __device__ __forceinline__ bool tile_all_visible(int m, int n, int shift = 0) const {
        return rows_all_visible<BN>(m * BM - shift, m * BM + BM - 1 - shift, n);
    }

    // The same for rows [r0, r1] against K block n.
    template <int BN>
    __device__ __forceinline__ bool rows_all_visible(int r0, int r1, int n) const {
        int c0 = n * BN, c1 = c0 + BN - 1;
        return r1 < seqlen_q && c1 < seqlen_k && c1 <= r0 + diag() + right && c0 >= r1 + diag() - left;
    }
};
