"""CPU tier: a NumPy model of the FA3 forward's speculative max (kernels_cu/fa3/fwd.cu SPECULATIVE_MAX,
OnlineSoftmax::speculate / commit / step) against plain softmax attention.

Per K tile, with a running max m: the exponentials are taken from m (t = s - m in log2 units, P = 2^t) while
the tile's max is found alongside; if no row's t exceeds SPEC_HEADROOM the tile commits (sums added, m and O
untouched), else -- or when a row has no running max yet -- the tile is redone by the exact step (new max
first, O and the sum rescaled). The first tile always takes the exact step. The model keeps the kernel's
invariants: P never exceeds 2^SPEC_HEADROOM in a committed tile (e4m3 holds 448), and the result is the
softmax whatever the order in which the maxima rise.
"""
import math

import numpy as np
import pytest

SPEC_HEADROOM = 8.0  # log2 units, as in fwd.cu


def attention_by_tiles(s, v, block_n, speculative):
    """Rows of scores ``s`` (log2 units) over keys in tiles of ``block_n``: (out, lse2, redone tiles, largest
    committed P). fp64 throughout."""
    rows = s.shape[0]
    m = np.full(rows, -np.inf)
    l = np.zeros(rows)
    o = np.zeros((rows, v.shape[1]))
    redone, p_top = 0, 0.0
    for n in range(0, s.shape[1], block_n):
        tile, vt = s[:, n:n + block_n], v[n:n + block_n]
        if speculative and n > 0:
            with np.errstate(invalid="ignore", over="ignore"):
                t = tile - m[:, None]  # +inf where a row has no running max
                p = np.exp2(t)
            if not (t.max(axis=1) > SPEC_HEADROOM).any():  # the warpgroup's vote
                l += p.sum(axis=1)
                o += p @ vt
                p_top = max(p_top, float(p.max()))
                continue
            redone += 1
        m_new = np.maximum(m, tile.max(axis=1))
        base = np.where(np.isfinite(m_new), m_new, 0.0)
        alpha = np.exp2(np.where(np.isfinite(m), m - base, -np.inf))
        p = np.exp2(tile - base[:, None])
        l = l * alpha + p.sum(axis=1)
        o = o * alpha[:, None] + p @ vt
        m = m_new
    return o / l[:, None], m + np.log2(l), redone, p_top


def softmax_attention(s, v):
    w = np.exp2(s - s.max(axis=1, keepdims=True))
    return (w @ v) / w.sum(axis=1, keepdims=True), s.max(axis=1) + np.log2(w.sum(axis=1))


def scores(rng, rows, keys, spread):
    return rng.standard_normal((rows, keys)) * spread


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("spread", [0.5, 2.0, 30.0])
def test_tiles_equal_softmax(speculative, spread):
    rng = np.random.default_rng(int(spread * 10) + speculative)
    s, v = scores(rng, 64, 1000, spread), rng.standard_normal((1000, 16))
    out, lse, _, p_top = attention_by_tiles(s, v, 128, speculative)
    ref_out, ref_lse = softmax_attention(s, v)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)
    assert p_top <= 2.0 ** SPEC_HEADROOM


def test_random_scores_commit_every_tile():
    """N(0, 1)-like logits (what the benchmark runs): after the first tile a row's max never rises 256-fold,
    so no tile is redone and the speculative step is all that runs."""
    rng = np.random.default_rng(1)
    s = scores(rng, 128, 8192, 1.0 / math.log(2))  # natural-log logits of unit spread, in log2 units
    _, _, redone, p_top = attention_by_tiles(s, rng.standard_normal((8192, 8)), 128, True)
    assert redone == 0 and 1.0 < p_top < 2.0 ** SPEC_HEADROOM


def test_rising_maxima_are_redone_and_still_exact():
    """Keys whose scores grow tile by tile (tests/gpu_checks.rising_maxima_inputs on the GPU): the tiles where a
    max rises past the headroom are redone, the others commit, the result is the softmax."""
    rng = np.random.default_rng(2)
    s = scores(rng, 32, 1024, 1.0) * np.repeat([1.0, 4.0, 16.0, 16.0, 16.0, 16.0, 16.0, 16.0], 128)[None, :]
    s[:4, 900] = 200.0  # a late key only a few rows align with
    v = rng.standard_normal((1024, 8))
    out, lse, redone, p_top = attention_by_tiles(s, v, 128, True)
    ref_out, ref_lse = softmax_attention(s, v)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)
    assert 2 <= redone < 7 and p_top <= 2.0 ** SPEC_HEADROOM


def test_a_row_without_a_running_max_is_redone():
    """A row whose first tile was masked (-inf scores: a window) has no running max: the next tile cannot take
    its exponentials from one and is redone."""
    rng = np.random.default_rng(3)
    s = scores(rng, 8, 384, 1.0)
    s[3, :128] = -np.inf
    v = rng.standard_normal((384, 4))
    out, _, redone, _ = attention_by_tiles(s, v, 128, True)
    assert redone == 1
    np.testing.assert_allclose(out, softmax_attention(s, v)[0], rtol=1e-12, atol=1e-12)
