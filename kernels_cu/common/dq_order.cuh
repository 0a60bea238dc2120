// The deterministic FA3 backward's dQ order: in which order a K block visits its Q blocks, and in which
// order the K blocks touching a Q block add their dQ shares into it (kernels_cu/fa3/bwd_roles.cuh).
//
// Descending (the general order): K block n visits its Q blocks [m_lo, m_hi) upwards; the K blocks
// [n_first, n_end) touching Q block m add in descending order, turn n_end - 1 - n. Launched highest
// first, a block only ever waits for blocks launched before it, so the order finishes with any number of
// blocks resident. Without a mask, though, every K block starts at Q block 0 at once: block n's add waits
// for block n + 1's, which waits for n + 2's ..., and the lowest block of a head makes its first add
// NK - 1 add latencies late (at d = 256, N = 2k, 32 K blocks of short work each: 0.70 of the default).
//
// Rotated (no mask bounding the rows, so every K block of a sequence touches each of its M Q blocks): K
// block n starts at Q block n % M and wraps around. Q block m's adds go in the order the blocks reach it
// when they run in step: by step j = (m - n % M) mod M, and among blocks of one step (n = n' mod M,
// when NK > M) highest first. Every add then waits for one made a step earlier, not for a chain. A block
// may wait for blocks launched after it, though: every K block of a head must be resident at once, which
// the host checks before it asks for this order (cuflash/fa3.py).
#pragma once

// Q block (relative to the first of the range, 0 .. m_count - 1) that K block n visits at step i of its
// walk over the range; `rotated` as above.
__device__ __forceinline__ int dq_order_q_block(int i, int n, int m_count, bool rotated) {
    if (!rotated) return i;
    const int m = i + n % m_count;
    return m < m_count ? m : m - m_count;
}

// K block n's turn among the n_count K blocks touching Q block m (relative to the first of its range) in
// the rotated order, for a range of m_count Q blocks; the turns of one Q block are 0 .. n_count - 1.
__device__ __forceinline__ int dq_order_rotated_turn(int n, int m, int n_count, int m_count) {
    const int j = m >= n % m_count ? m - n % m_count : m - n % m_count + m_count;  // n's step at Q block m
    // Blocks at an earlier step: those n' whose residue n' mod m_count is one of the j residues m, m - 1,
    // ..., m - j + 1 (cyclically); residue c has per + 1 blocks below n_count if c < extra, else per.
    const int per = n_count / m_count, extra = n_count % m_count;
    const int lo = m - j + 1;
    int with_extra;  // how many of those j residues are below `extra`
    if (lo >= 0) {
        with_extra = max(0, min(m, extra - 1) - lo + 1);
    } else {
        with_extra = min(m, extra - 1) + 1 + max(0, extra - (lo + m_count));
    }
    const int same_step_above = (n_count - 1 - n) / m_count;  // n + m_count, n + 2 m_count, ... go first
    return j * per + with_extra + same_step_above;
}
