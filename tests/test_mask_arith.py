"""CPU tier: the kernels' tile-visiting arithmetic (kernels_cu/common/mask.cuh) against brute force.

The kernels decide which (Q block, K block) tiles to visit and which tiles need the per-element mask
with ``Mask::visible``, ``kv_block_range<BM, BN>`` (forward: the K blocks of a Q block),
``q_block_range<BM, BN>`` (backward: the Q blocks of a K block) and ``tile_all_visible<BM, BN>`` (the
fast path that skips the per-element mask). This module compiles that header itself on the host
(tests/cpp/mask_harness.cpp, g++, once per session) and checks it against the (Sq x Sk) visibility
matrix of ``cuflash.reference.mask_matrix``. The kernel receives (left, right) already resolved by
``cuflash._validate.window_bounds`` (-1 -> Sq + Sk, causal -> right = 0), and so does the harness.

Properties, for every instantiated (BM, BN):
  * ``visible(row, col)`` equals the brute-force matrix on [0, Sq) x [0, Sk);
  * ``kv_block_range(m)`` contains every K block holding a key visible to a real row (< Sq) of Q
    block m, never reaches past the last K block, and is empty (lo >= hi) when there is none; it is
    also tight (exactly those blocks: the docstrings promise it, and an extra block is wasted work);
  * ``q_block_range(n)`` likewise for the Q blocks with a real row that sees a key of K block n;
  * the two agree: n is in kv_block_range(m) exactly when m is in q_block_range(n). The deterministic
    FA2 backward relies on it: K block n adds into dQ block m at turn n - lo of kv_block_range(m), so
    a pair one range has and the other lacks would stall that semaphore forever (or skip a turn);
  * ``tile_all_visible(m, n)`` implies that every (row, col) of the tile is in range and visible; how
    often it is conservatively false is reported (no assertion);
  * the FA3 backward's deterministic dQ order, simulated on these ranges (descending turns, highest block
    launched first, blocks past the last key, as few as one resident block), always finishes (with the
    header before session 5, blocks past the last key waited forever: 5 cases fail).
"""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from cuflash import _validate
from cuflash import reference as ref
from host_harness import build

if shutil.which("g++") is None:
    pytest.skip("g++ is not installed: cannot build the host harness for mask.cuh", allow_module_level=True)

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

HARNESS = "tests/cpp/mask_harness.cpp"

# (BM, BN) instantiated in the harness: small and square ones plus the tiles the kernels use today
# (fa1 forward 64x64 / 64x32, fa1 backward 64x64 / 32x32, fa2 forward 128x64 / 128x32 / 64x32,
# fa2 backward 64x128 / 64x64 / 64x32).
TILES = [(16, 16), (16, 64), (32, 32), (64, 32), (64, 64), (64, 128), (128, 32), (128, 64), (128, 128)]

_i32p = ctypes.POINTER(ctypes.c_int32)
_u8p = ctypes.POINTER(ctypes.c_uint8)
_int = ctypes.c_int


# ----------------------------------------------------------------------------------------------------
# the harness
# ----------------------------------------------------------------------------------------------------

class MaskLib:
    """ctypes front of the compiled mask.cuh; numpy in, numpy out."""

    def __init__(self, lib: ctypes.CDLL):
        lib.mask_has_tile.argtypes = [_int, _int]
        lib.mask_visible_matrix.argtypes = [_int] * 6 + [_u8p]
        lib.mask_visible_matrix.restype = None
        lib.mask_visible.argtypes = [_int] * 6
        lib.mask_kv_block_ranges.argtypes = [_int] * 8 + [_i32p, _i32p]
        lib.mask_q_block_ranges.argtypes = [_int] * 8 + [_i32p, _i32p]
        lib.mask_tile_all_visible.argtypes = [_int] * 10 + [_u8p]
        lib.dq_q_block.argtypes = [_int] * 4
        lib.dq_rotated_turn.argtypes = [_int] * 4
        self.lib = lib

    def visible_matrix(self, sq, sk, left, right, rows=None, cols=None) -> np.ndarray:
        rows, cols = rows or sq, cols or sk
        out = np.full((rows, cols), 7, np.uint8)
        self.lib.mask_visible_matrix(sq, sk, left, right, rows, cols, out.ctypes.data_as(_u8p))
        assert set(np.unique(out)) <= {0, 1}
        return out.astype(bool)

    def _ranges(self, fn, tile, sq, sk, left, right, first, count):
        lo = np.full(count, -12345, np.int32)
        hi = np.full(count, -12345, np.int32)
        rc = fn(tile[0], tile[1], sq, sk, left, right, first, count, lo.ctypes.data_as(_i32p), hi.ctypes.data_as(_i32p))
        assert rc == 0, f"tile {tile} is not instantiated in {HARNESS}"
        return lo, hi

    def kv_ranges(self, tile, sq, sk, left, right, first, count):
        return self._ranges(self.lib.mask_kv_block_ranges, tile, sq, sk, left, right, first, count)

    def q_ranges(self, tile, sq, sk, left, right, first, count):
        return self._ranges(self.lib.mask_q_block_ranges, tile, sq, sk, left, right, first, count)

    def tile_all_visible(self, tile, sq, sk, left, right, m0, n_m, n0, n_n) -> np.ndarray:
        out = np.full((n_m, n_n), 7, np.uint8)
        rc = self.lib.mask_tile_all_visible(tile[0], tile[1], sq, sk, left, right, m0, n_m, n0, n_n,
                                            out.ctypes.data_as(_u8p))
        assert rc == 0, f"tile {tile} is not instantiated in {HARNESS}"
        assert set(np.unique(out)) <= {0, 1}
        return out.astype(bool)


@pytest.fixture(scope="session")
def masklib(tmp_path_factory) -> MaskLib:
    lib = MaskLib(build("mask_harness.cpp", "common", tmp_path_factory.mktemp("mask_harness")))
    for tile in TILES:
        assert lib.lib.mask_has_tile(*tile) == 1, tile
    return lib


def _report(request, line: str) -> None:
    """Print past pytest's output capture (a report line, not a failure)."""
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        print(line)
        return
    with capman.global_and_fixture_disabled():
        print("\n" + line)


# ----------------------------------------------------------------------------------------------------
# the checks
# ----------------------------------------------------------------------------------------------------

def kernel_window(sq, sk, causal, window):
    """(left, right) as the kernels receive them, resolved by the real argument check."""
    dims = _validate.Dims(1, sq, sk, 1, 1, 64, "bfloat16")
    return _validate.window_bounds(window, causal, dims)


def _ceil(a, b):
    return -(-a // b)


def _describe(sq, sk, causal, window, tile=None):
    s = f"Sq={sq} Sk={sk} causal={causal} window_size={window} (kernel left/right={kernel_window(sq, sk, causal, window)})"
    return s if tile is None else s + f" BM,BN={tile}"


def check_case(lib: MaskLib, sq, sk, causal, window, tiles=TILES, tight=True):
    """Every property of the module docstring for one (Sq, Sk, causal, window). Returns, per tile,
    (tiles fully visible by brute force, of those the ones tile_all_visible misses)."""
    left, right = kernel_window(sq, sk, causal, window)
    truth = ref.mask_matrix(sq, sk, causal=causal, window_size=window)
    pad = max(bm for bm, _ in tiles)  # the padding of the last tiles, where the kernels call visible() too
    got = lib.visible_matrix(sq, sk, left, right, sq + pad, sk + pad)
    if not np.array_equal(got[:sq, :sk], truth):
        r, c = (int(x) for x in np.argwhere(got[:sq, :sk] != truth)[0])
        raise AssertionError(f"visible({r}, {c}) = {bool(got[r, c])}, brute force says {bool(truth[r, c])}; "
                             f"{_describe(sq, sk, causal, window)}")
    # Keys past the end are zero-filled padding in the last K tile: visible() must mask them for every
    # row, padded rows included (the forward drops rows >= Sq at the store; the backward zeroes their
    # P through lse = +inf, but a visible padded key would still enter real rows' softmax).
    if got[:, sk:].any():
        r, c = (int(x) for x in np.argwhere(got[:, sk:])[0])
        raise AssertionError(f"visible({r}, {sk + c}) is true for a key past seqlen_k; {_describe(sq, sk, causal, window)}")
    stats = {}
    for tile in tiles:
        bm, bn = tile
        n_m, n_n = _ceil(sq, bm), _ceil(sk, bn)
        padded = np.zeros((n_m * bm, n_n * bn), bool)  # rows >= Sq and keys >= Sk: never visible
        padded[:sq, :sk] = truth
        blocks = padded.reshape(n_m, bm, n_n, bn)
        any_vis = blocks.any(axis=(1, 3))  # (n_m, n_n): the tile holds a visible (real row, real key)
        all_vis = blocks.all(axis=(1, 3))  # every (row, key) of the tile is real and visible
        what = _describe(sq, sk, causal, window, tile)

        lo, hi = lib.kv_ranges(tile, sq, sk, left, right, 0, n_m)
        for m in range(n_m):
            _check_range("kv_block_range", m, int(lo[m]), int(hi[m]), np.flatnonzero(any_vis[m]), n_n, tight, what)
            if lo[m] < hi[m]:  # the Python model of the same arithmetic (cuflash.reference) agrees
                model = ref.kv_block_range(m, seqlen_q=sq, seqlen_k=sk, block_m=bm, block_n=bn, causal=causal,
                                           window_size=window)
                assert model == (lo[m], hi[m]), f"reference.kv_block_range({m}) = {model}, kernel {lo[m], hi[m]}; {what}"

        kv_pairs = np.zeros((n_m, n_n), bool)
        for m in range(n_m):
            kv_pairs[m, max(0, lo[m]):max(0, hi[m])] = True

        lo, hi = lib.q_ranges(tile, sq, sk, left, right, 0, n_n)
        for n in range(n_n):
            _check_range("q_block_range", n, int(lo[n]), int(hi[n]), np.flatnonzero(any_vis[:, n]), n_m, tight, what)
        q_pairs = np.zeros((n_m, n_n), bool)
        for n in range(n_n):
            q_pairs[max(0, lo[n]):max(0, hi[n]), n] = True
        if not np.array_equal(kv_pairs, q_pairs):
            m, n = (int(x) for x in np.argwhere(kv_pairs != q_pairs)[0])
            raise AssertionError(
                f"(Q block {m}, K block {n}) is in {'kv_block_range' if kv_pairs[m, n] else 'q_block_range'} "
                f"but not in the other: the deterministic backward's dQ turn order would stall; {what}")

        fast = lib.tile_all_visible(tile, sq, sk, left, right, 0, n_m, 0, n_n)
        wrong = fast & ~all_vis
        if wrong.any():
            m, n = (int(x) for x in np.argwhere(wrong)[0])
            r0, c0 = m * bm, n * bn
            sub = padded[r0:r0 + bm, c0:c0 + bn]
            bad = np.argwhere(~sub)[0]
            raise AssertionError(
                f"tile_all_visible({m}, {n}) is true but (row {r0 + bad[0]}, key {c0 + bad[1]}) is "
                f"{'out of range' if r0 + bad[0] >= sq or c0 + bad[1] >= sk else 'masked'}; {what}")
        stats[tile] = (int(all_vis.sum()), int((all_vis & ~fast).sum()))
    return stats


def _check_range(fn, idx, lo, hi, needed, n_blocks, tight, what):
    """[lo, hi) from the kernel vs the blocks ``needed`` (sorted indices of blocks with something visible)."""
    if needed.size == 0:
        assert lo >= hi, f"{fn}({idx}) = [{lo}, {hi}) but no block has anything visible; {what}"
        return
    first, last = int(needed[0]), int(needed[-1])
    assert lo <= first and hi > last, (
        f"{fn}({idx}) = [{lo}, {hi}) misses block(s) with visible entries {needed.tolist()}; {what}")
    assert lo >= 0 and hi <= n_blocks, (
        f"{fn}({idx}) = [{lo}, {hi}) reaches outside the {n_blocks} blocks that exist; {what}")
    if tight:
        assert (lo, hi) == (first, last + 1) and needed.size == last - first + 1, (
            f"{fn}({idx}) = [{lo}, {hi}) visits blocks with nothing visible (needed: {needed.tolist()}); {what}")


# ----------------------------------------------------------------------------------------------------
# hand-picked edge cases and a hypothesis search
# ----------------------------------------------------------------------------------------------------

BIG = 10**6  # a window wider than everything (clipped to Sq + Sk by window_bounds)
EDGE_CASES = [
    # (Sq, Sk, causal, window_size)
    (1, 1, False, (-1, -1)),
    (1, 1, True, (-1, -1)),
    (1, 1, False, (0, 0)),
    (1, 700, True, (-1, -1)),
    (700, 1, True, (-1, -1)),  # all rows but the last see nothing
    (1, 700, False, (0, 0)),  # the single row sees only the last key
    (700, 1, False, (0, 0)),
    (77, 133, True, (-1, -1)),  # Sq < Sk, causal
    (133, 77, True, (-1, -1)),  # Sq > Sk, causal: the top 56 rows are empty
    (64, 64, True, (-1, -1)),  # exact multiples of every tile
    (128, 128, False, (0, 0)),  # the diagonal only
    (129, 127, False, (0, 0)),
    (300, 300, False, (BIG, BIG)),  # big windows = no mask
    (300, 301, True, (BIG, BIG)),
    (200, 50, True, (10, -1)),  # left window + causal
    (50, 200, False, (3, -1)),  # left only
    (50, 200, False, (-1, 3)),  # right only
    (500, 17, False, (-1, 0)),  # the same as causal
    (17, 500, False, (0, -1)),
    (255, 257, False, (16, 16)),
    (65, 63, True, (0, 0)),
    (1000, 30, False, (5, 5)),  # Sq >> Sk: most Q blocks see nothing
    (30, 1000, False, (5, 5)),  # Sq << Sk: most K blocks are seen by nobody
    (113, 239, True, (17, 40)),
    (239, 113, False, (17, 40)),
]


@pytest.mark.parametrize("sq,sk,causal,window", EDGE_CASES,
                         ids=[f"{c[0]}x{c[1]}-{'causal' if c[2] else 'full'}-w{c[3][0]}_{c[3][1]}" for c in EDGE_CASES])
def test_edge_cases(masklib, sq, sk, causal, window):
    check_case(masklib, sq, sk, causal, window)


_seqlen = st.one_of(st.integers(1, 40), st.integers(1, 320), st.sampled_from([1, 15, 16, 17, 63, 64, 65, 127, 128, 129]))
_side = st.one_of(st.just(-1), st.integers(0, 8), st.integers(0, 400), st.just(BIG))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sq=_seqlen, sk=_seqlen, causal=st.booleans(), left=_side, right=_side)
@example(sq=1, sk=1, causal=True, left=0, right=0)
@example(sq=300, sk=7, causal=True, left=-1, right=-1)
@example(sq=7, sk=300, causal=False, left=0, right=0)
def test_against_brute_force(masklib, sq, sk, causal, left, right):
    check_case(masklib, sq, sk, causal, (left, right))


# ----------------------------------------------------------------------------------------------------
# long sequences: per-row intervals instead of the full matrix (32-bit arithmetic in the kernels)
# ----------------------------------------------------------------------------------------------------

def _row_interval(r, sq, sk, causal, window):
    """Keys [lo, hi] row r sees, straight from the mask's definition (None when it sees nothing)."""
    left, right = (int(w) for w in window)
    if causal:
        right = 0
    d = r + sk - sq
    lo = 0 if left < 0 else max(0, d - left)
    hi = sk - 1 if right < 0 else min(sk - 1, d + right)
    return (lo, hi) if lo <= hi else None


def _row_intervals(rows, sq, sk, causal, window):
    """``_row_interval`` for an array of rows: (lo, hi) arrays, lo > hi where a row sees nothing."""
    left, right = (int(w) for w in window)
    if causal:
        right = 0
    d = rows + (sk - sq)
    lo = np.zeros_like(rows) if left < 0 else np.maximum(0, d - left)
    hi = np.full_like(rows, sk - 1) if right < 0 else np.minimum(sk - 1, d + right)
    return lo, hi


def _key_interval(j, sq, sk, causal, window):
    """Rows [lo, hi] that see key j (None when no row does)."""
    left, right = (int(w) for w in window)
    if causal:
        right = 0
    lo = 0 if right < 0 else max(0, j - (sk - sq) - right)
    hi = sq - 1 if left < 0 else min(sq - 1, j - (sk - sq) + left)
    return (lo, hi) if lo <= hi else None


def _block_span(intervals, block):
    """Smallest and largest block touched by a list of [lo, hi] intervals, and whether they form one run."""
    ivs = sorted(iv for iv in intervals if iv is not None)
    if not ivs:
        return None
    merged = [list(ivs[0])]
    for lo, hi in ivs[1:]:
        if lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    blocks = [(lo // block, hi // block) for lo, hi in merged]
    contiguous = all(b[0] <= a[1] + 1 for a, b in zip(blocks, blocks[1:]))
    return blocks[0][0], max(b[1] for b in blocks), contiguous


@settings(max_examples=120, deadline=None)
@given(sq=st.integers(1, 1 << 26), sk=st.integers(1, 1 << 26), causal=st.booleans(),
       left=st.one_of(st.just(-1), st.integers(0, 300), st.integers(0, 1 << 27)),
       right=st.one_of(st.just(-1), st.integers(0, 300), st.integers(0, 1 << 27)),
       tile=st.sampled_from(TILES), picks=st.lists(st.floats(0, 1), min_size=3, max_size=3))
@example(sq=1 << 26, sk=1 << 26, causal=True, left=-1, right=-1, tile=(128, 64), picks=[0.5, 0.99, 0.0])
@example(sq=1, sk=1 << 26, causal=False, left=-1, right=-1, tile=(64, 32), picks=[0.5, 0.99, 0.0])
def test_long_sequences(masklib, sq, sk, causal, left, right, tile, picks):
    window = (left, right)
    kl, kr = kernel_window(sq, sk, causal, window)
    bm, bn = tile
    n_m, n_n = _ceil(sq, bm), _ceil(sk, bn)
    what = _describe(sq, sk, causal, window, tile)
    # a few Q blocks: the ends, random ones, and the ones where the diagonal enters and leaves
    diag_m = [max(0, min(n_m - 1, (sq - sk) // bm + i)) for i in (-1, 0, 1)]
    ms = sorted({0, n_m - 1, *diag_m, *(min(n_m - 1, int(p * n_m)) for p in picks)})
    for m in ms:
        rows = range(m * bm, min(sq, (m + 1) * bm))
        span = _block_span([_row_interval(r, sq, sk, causal, window) for r in rows], bn)
        lo, hi = (int(x[0]) for x in masklib.kv_ranges(tile, sq, sk, kl, kr, m, 1))
        if span is None:
            assert lo >= hi, f"kv_block_range({m}) = [{lo}, {hi}) but no key is visible; {what}"
        else:
            assert span[2], f"the visible K blocks of Q block {m} are not one run ({what})"
            assert (lo, hi) == (span[0], span[1] + 1), (
                f"kv_block_range({m}) = [{lo}, {hi}), want [{span[0]}, {span[1] + 1}); {what}")
            assert hi <= n_n
    diag_n = [max(0, min(n_n - 1, (sk - sq) // bn + i)) for i in (-1, 0, 1)]
    ns = sorted({0, n_n - 1, *diag_n, *(min(n_n - 1, int(p * n_n)) for p in picks)})
    for n in ns:
        keys = range(n * bn, min(sk, (n + 1) * bn))
        span = _block_span([_key_interval(j, sq, sk, causal, window) for j in keys], bm)
        lo, hi = (int(x[0]) for x in masklib.q_ranges(tile, sq, sk, kl, kr, n, 1))
        if span is None:
            assert lo >= hi, f"q_block_range({n}) = [{lo}, {hi}) but no row sees a key of it; {what}"
        else:
            assert span[2], f"the Q blocks seeing K block {n} are not one run ({what})"
            assert (lo, hi) == (span[0], span[1] + 1), (
                f"q_block_range({n}) = [{lo}, {hi}), want [{span[0]}, {span[1] + 1}); {what}")
            assert hi <= n_m
    # K blocks past the last key (a packed batch's shorter sequences) visit nothing
    for n in (n_n, n_n + 2):
        lo, hi = (int(x[0]) for x in masklib.q_ranges(tile, sq, sk, kl, kr, n, 1))
        assert lo >= hi, f"q_block_range({n}) = [{lo}, {hi}) past the last K block ({n_n}); {what}"
    # the two ranges agree at their ends (what the deterministic backward's dQ turn order needs)
    def kv(m):
        return tuple(int(x[0]) for x in masklib.kv_ranges(tile, sq, sk, kl, kr, m, 1))

    def qr(n):
        return tuple(int(x[0]) for x in masklib.q_ranges(tile, sq, sk, kl, kr, n, 1))

    for m in ms:
        lo, hi = kv(m)
        for n in {lo - 1, lo, hi - 1, hi} & set(range(n_n)):
            q_lo, q_hi = qr(n)
            assert (lo <= n < hi) == (q_lo <= m < q_hi), (
                f"kv_block_range({m}) = [{lo}, {hi}) but q_block_range({n}) = [{q_lo}, {q_hi}); {what}")
    for n in ns:
        lo, hi = qr(n)
        for m in {lo - 1, lo, hi - 1, hi} & set(range(n_m)):
            k_lo, k_hi = kv(m)
            assert (lo <= m < hi) == (k_lo <= n < k_hi), (
                f"q_block_range({n}) = [{lo}, {hi}) but kv_block_range({m}) = [{k_lo}, {k_hi}); {what}")
    for m in ms:
        for n in ns:
            fast = bool(masklib.tile_all_visible(tile, sq, sk, kl, kr, m, 1, n, 1)[0, 0])
            if not fast:
                continue
            assert (m + 1) * bm <= sq and (n + 1) * bn <= sk, f"tile_all_visible({m}, {n}) on a partial tile; {what}"
            lo, hi = _row_intervals(np.arange(m * bm, (m + 1) * bm, dtype=np.int64), sq, sk, causal, window)
            bad = np.flatnonzero((lo > n * bn) | (hi < (n + 1) * bn - 1))
            assert bad.size == 0, (f"tile_all_visible({m}, {n}) but row {m * bm + bad[0]} sees only keys "
                                   f"[{lo[bad[0]]}, {hi[bad[0]]}]; {what}")


# ----------------------------------------------------------------------------------------------------
# how often the fast path is missed (report only)
# ----------------------------------------------------------------------------------------------------

def test_tile_all_visible_fast_path_report(masklib, request, record_property):
    """Over a fixed sweep, count the tiles that are fully visible but that tile_all_visible does not
    recognise (they take the per-element mask needlessly). Printed and recorded; no assertion."""
    total_full = total_missed = 0
    per_tile = {t: [0, 0] for t in TILES}
    for sq in (1, 63, 64, 77, 128, 133, 300, 511):
        for sk in (1, 64, 77, 133, 300, 512):
            for causal in (False, True):
                for window in ((-1, -1), (0, 0), (32, 32), (100, -1), (-1, 7)):
                    for t, (full, missed) in check_case(masklib, sq, sk, causal, window).items():
                        per_tile[t][0] += full
                        per_tile[t][1] += missed
    for full, missed in per_tile.values():
        total_full += full
        total_missed += missed
    detail = ", ".join(f"{bm}x{bn}: {missed}/{full}" for (bm, bn), (full, missed) in per_tile.items())
    _report(request, f"mask.cuh tile_all_visible: {total_missed} of {total_full} fully visible tiles "
                     f"conservatively reported as needing the mask ({detail})")
    record_property("tile_all_visible_missed", total_missed)
    record_property("tile_all_visible_full", total_full)


# ----------------------------------------------------------------------------------------------------
# the FA3 backward's deterministic dQ order (kernels_cu/fa3/bwd_roles.cuh: dq_turn), simulated
# ----------------------------------------------------------------------------------------------------

def simulate_dq_order(masklib, tile, sq, sk, left, right, *, extra_blocks, resident, descending=True,
                      rotated=False):
    """The deterministic FA3 backward's schedule, one head and one dQ part: K block n visits the Q blocks of
    q_block_range(n) (upwards, or rotated: common/dq_order.cuh's dq_order_q_block) and may add into Q block
    m only when m's counter equals its turn (descending: n_end - 1 - n, as dq_turn; rotated:
    dq_order_rotated_turn; else n - n_first, the order before session 5); blocks are launched highest first
    into `resident` slots (as many blocks as the SMs hold), a slot freeing when its block finishes.
    `extra_blocks` blocks past the last key are launched too (a packed batch's shorter sequences).
    Returns None when every block finishes and every counter reached its block count, else what stuck."""
    return run_dq_schedule(masklib, tile, sq, sk, left, right, extra_blocks=extra_blocks, resident=resident,
                           descending=descending, rotated=rotated)[0]


def run_dq_schedule(masklib, tile, sq, sk, left, right, *, extra_blocks, resident, descending=True, rotated=False,
                    one_add_per_round=False, planes=1):
    """simulate_dq_order's model; also returns the rounds it took. ``one_add_per_round``: in a round each
    running block makes at most one add (blocks running in step, one Q block each per step), so the rounds
    count the steps of the slowest block, waits included. ``planes`` (descending only, a power of two): dQ
    accumulator planes, K block n adding into plane n mod planes at turn (n_end - 1 - n) / planes of that
    plane's own counter (dq_turn with p.dq_plane_shift)."""
    assert planes == 1 or (descending and not rotated and planes & (planes - 1) == 0)
    shift = planes.bit_length() - 1
    bm, bn = tile
    n_blocks = _ceil(sk, bn) + extra_blocks
    work = {}
    for n in range(n_blocks):
        lo, hi = (int(x[0]) for x in masklib.q_ranges(tile, sq, sk, left, right, n, 1))
        count = max(0, hi - lo)
        work[n] = [lo + masklib.lib.dq_q_block(i, n, count, int(rotated)) for i in range(count)]
    kv = {m: tuple(int(x[0]) for x in masklib.kv_ranges(tile, sq, sk, left, right, m, 1)) for m in range(_ceil(sq, bm))}
    if rotated:
        m_count = _ceil(sq, bm)
        turn = lambda n, m: masklib.lib.dq_rotated_turn(n, m, kv[m][1] - kv[m][0], m_count)  # noqa: E731
    elif descending:
        turn = lambda n, m: (kv[m][1] - 1 - n) >> shift  # noqa: E731
    else:
        turn = lambda n, m: n - kv[m][0]  # noqa: E731
    counter = {(m, plane): 0 for m in kv for plane in range(planes)}  # a counter per Q block and plane
    waiting = list(range(n_blocks - 1, -1, -1))  # launch order: highest first
    running = []
    rounds = 0
    while waiting or running:
        while waiting and len(running) < resident:
            running.append(waiting.pop(0))
        rounds += 1
        moved = False
        def my_turn(n):  # block n's next Q block's counter (in n's plane) says it is n's turn
            return work[n] and counter[work[n][0], n % planes] == turn(n, work[n][0])

        ready = [n for n in running if my_turn(n)]
        for n in list(running):
            while my_turn(n):
                if one_add_per_round and n not in ready:
                    break  # its turn came this round: the add is next round's
                counter[work[n].pop(0), n % planes] += 1
                moved = True
                if one_add_per_round:
                    break
            if not work[n]:
                running.remove(n)
                moved = True
        if not moved:
            return f"stuck: blocks {running} wait at Q blocks {[work[n][0] for n in running]}", rounds
    # every plane's counter of Q block m ends at the number of m's K blocks in that plane
    short = {(m, plane): (counter[m, plane], len(range(lo + (plane - lo) % planes, hi, planes)))
             for m, (lo, hi) in kv.items() for plane in range(planes)
             if counter[m, plane] != len(range(lo + (plane - lo) % planes, hi, planes))}
    return (f"counters short of their block counts: {short}" if short else None), rounds


@pytest.mark.parametrize("m_count", [1, 2, 3, 7, 16, 33])
@pytest.mark.parametrize("n_count", [1, 2, 5, 16, 17, 33, 64, 100])
def test_rotated_dq_turns_are_a_permutation_in_step_order(masklib, m_count, n_count):
    """dq_order_rotated_turn gives the n_count K blocks of each Q block the turns 0 .. n_count - 1, in the
    order they reach the Q block when they run in step (step j = (m - n mod M) mod M, ties highest n first),
    and dq_order_q_block walks each K block over every Q block once, starting at n mod M."""
    lib = masklib.lib
    for n in range(n_count):
        walk = [lib.dq_q_block(i, n, m_count, 1) for i in range(m_count)]
        assert sorted(walk) == list(range(m_count)) and walk[0] == n % m_count, (n, walk)
        assert [lib.dq_q_block(i, n, m_count, 0) for i in range(m_count)] == list(range(m_count))
    for m in range(m_count):
        turns = [lib.dq_rotated_turn(n, m, n_count, m_count) for n in range(n_count)]
        order = sorted(range(n_count), key=lambda n: ((m - n % m_count) % m_count, -n))
        assert [turns[n] for n in order] == list(range(n_count)), (m, turns)


@pytest.mark.parametrize("tile", [(64, 128), (64, 64)])
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (2048, 2048), (300, 1900), (1900, 300), (64, 5000)])
def test_rotated_dq_order_runs_in_step_without_a_chain(masklib, tile, sq, sk):
    """Without a mask (every K block touches every Q block), every K block resident, one add per block and
    per Q block in a step: the rotated order finishes in max(M, NK) steps, the least there can be (each
    block has M Q blocks to add to, each Q block NK adds to take); the descending order needs M + NK - 1
    (block n's first add waits for the chain of the blocks above it). With fewer resident blocks than
    K blocks the rotated order can get stuck (a block waits for one not launched yet): cuflash/fa3.py asks
    for it only when the K blocks of a head fit on the GPU with room to spare."""
    left, right = kernel_window(sq, sk, False, (-1, -1))
    nk, mq = _ceil(sk, tile[1]), _ceil(sq, tile[0])
    stuck, rounds = run_dq_schedule(masklib, tile, sq, sk, left, right, extra_blocks=0, resident=nk, rotated=True,
                                    one_add_per_round=True)
    assert stuck is None, stuck
    assert rounds == max(mq, nk), (rounds, mq, nk)
    stuck, chained = run_dq_schedule(masklib, tile, sq, sk, left, right, extra_blocks=0, resident=nk,
                                     one_add_per_round=True)
    assert stuck is None and chained == mq + nk - 1, (chained, mq, nk)
    for extra in (0, 3):
        assert simulate_dq_order(masklib, tile, sq, sk, left, right, extra_blocks=extra, resident=nk + extra,
                                 rotated=True) is None
    if nk >= 3 and mq >= 2:
        assert simulate_dq_order(masklib, tile, sq, sk, left, right, extra_blocks=0, resident=1,
                                 rotated=True) is not None


@pytest.mark.parametrize("tile", [(64, 128), (64, 64)])  # fa3/bwd.cu, fa3/bwd_wide.cu
@pytest.mark.parametrize("sq, sk, causal, window", [
    (1000, 1000, False, (-1, -1)), (1000, 1000, True, (-1, -1)), (300, 1900, True, (-1, -1)),
    (1900, 300, True, (-1, -1)), (1500, 1500, False, (256, 0)), (1500, 1500, False, (100, 300)),
    (777, 2049, False, (-1, 64)), (64, 5000, True, (-1, -1)),
])
def test_deterministic_dq_order_never_waits_forever(masklib, tile, sq, sk, causal, window):
    """Descending turns with the highest block launched first finish with any number of resident blocks
    (down to one) and blocks past the last key: a block only ever waits for blocks launched before it.
    The ascending order with the same launch order gets stuck under a causal mask: the model can fail."""
    left, right = kernel_window(sq, sk, causal, window)
    for resident in (1, 2, 5, 1000):
        for extra in (0, 3):
            stuck = simulate_dq_order(masklib, tile, sq, sk, left, right, extra_blocks=extra, resident=resident)
            assert stuck is None, f"tile {tile}, {resident} resident, {extra} blocks past the end: {stuck}"
    if causal and sk >= 2 * tile[1]:
        assert simulate_dq_order(masklib, tile, sq, sk, left, right, extra_blocks=0, resident=1,
                                 descending=False) is not None


def test_the_host_asks_for_the_rotated_order_only_unmasked_and_resident():
    """cuflash.fa3.bwd_rotates: rotated only without causal or window, and only when the K blocks of a head
    number at most heuristics.FA3_BWD_ROTATE_SM_FRACTION of the SMs (66 of 132)."""
    from cuflash import fa3, heuristics
    from cuflash._validate import Dims

    dims = Dims(batch=2, seqlen_q=2048, seqlen_k=2048, heads=8, kv_heads=8, headdim=256, dtype="bfloat16")
    unbounded = kernel_window(2048, 2048, False, (-1, -1))
    limit = int(132 * heuristics.FA3_BWD_ROTATE_SM_FRACTION)
    assert limit == 66
    assert fa3.bwd_rotates(unbounded, dims, 32, 132) and fa3.bwd_rotates(unbounded, dims, limit, 132)
    assert not fa3.bwd_rotates(unbounded, dims, limit + 1, 132)
    assert not fa3.bwd_rotates(kernel_window(2048, 2048, True, (-1, -1)), dims, 32, 132)
    assert not fa3.bwd_rotates(kernel_window(2048, 2048, False, (256, -1)), dims, 32, 132)
    assert not fa3.bwd_rotates(kernel_window(2048, 2048, False, (-1, 0)), dims, 32, 132)


@pytest.mark.parametrize("planes", [2, 4, 8])
@pytest.mark.parametrize("tile", [(64, 128), (64, 64)])  # fa3/bwd.cu, fa3/bwd_wide.cu
@pytest.mark.parametrize("sq, sk, causal, window", [
    (1000, 1000, False, (-1, -1)), (1000, 1000, True, (-1, -1)), (300, 1900, True, (-1, -1)),
    (1900, 300, True, (-1, -1)), (1500, 1500, False, (256, 0)), (777, 2049, False, (-1, 64)),
])
def test_dq_planes_never_wait_forever_and_shorten_the_chain(masklib, planes, tile, sq, sk, causal, window):
    """Several dQ accumulator planes (cuflash/fa3.py bwd_dq_accumulators): K block n adds into plane
    n mod planes in that plane's descending order. Highest first, a block still only waits for blocks
    launched before it (any residency, blocks past the last key); every plane's counters end at their
    block counts; and with every block resident, in step, the chain of hand-offs that one plane needs
    (M + NK - 1 steps unmasked) shrinks to M + ceil(NK / planes) - 1."""
    left, right = kernel_window(sq, sk, causal, window)
    for resident in (1, 2, 5, 1000):
        for extra in (0, 3):
            stuck, _ = run_dq_schedule(masklib, tile, sq, sk, left, right, extra_blocks=extra, resident=resident,
                                       planes=planes)
            assert stuck is None, f"tile {tile}, {resident} resident, {extra} blocks past the end: {stuck}"
    nk, mq = _ceil(sk, tile[1]), _ceil(sq, tile[0])
    if not causal and window == (-1, -1):
        stuck, rounds = run_dq_schedule(masklib, tile, sq, sk, left, right, extra_blocks=0, resident=nk,
                                        one_add_per_round=True, planes=planes)
        assert stuck is None and rounds == mq + _ceil(nk, planes) - 1, (rounds, mq, nk)


def test_the_host_takes_dq_planes_only_deterministic_with_few_heads(monkeypatch):
    """cuflash.fa3.bwd_dq_accumulators: 1 outside deterministic mode, under a causal mask or a window and in
    the rotated order; else planes until planes x batch x KV heads reaches heuristics.FA3_DET_DQ_GRID_HEADS,
    within FA3_DET_MAX_DQ_ACCUMULATORS and FA3_DET_DQ_ACCUM_MAX_BYTES."""
    from cuflash import _validate, fa3, heuristics
    from cuflash._validate import Dims

    monkeypatch.setattr(fa3, "_sm_count", lambda: 132)

    def planes(batch, kv_heads, n, causal=False, window=(-1, -1), deterministic=True, plane_bytes=1 << 20):
        dims = Dims(batch, n, n, 2 * kv_heads, kv_heads, 256, "bfloat16")
        return fa3.bwd_dq_accumulators(dims, _validate.window_bounds(window, causal, dims), plane_bytes,
                                       deterministic)

    grid_heads, most = heuristics.FA3_DET_DQ_GRID_HEADS, heuristics.FA3_DET_MAX_DQ_ACCUMULATORS
    assert planes(1, 1, 8192, deterministic=False) == 1
    assert planes(1, 1, 8192, causal=True) == 1 and planes(1, 1, 8192, window=(1000, 0)) == 1
    assert planes(1, 1, 2048) == 1  # 32 K blocks of 64 keys: the rotated order
    assert planes(1, 1, 8192) == min(most, grid_heads)  # 128 K blocks: descending
    for batch, kv_heads in ((1, 1), (1, 2), (2, 2), (1, 8), (2, 8), (4, 8)):
        got = planes(batch, kv_heads, 8192)
        assert got & (got - 1) == 0 and got <= most
        assert got * batch * kv_heads <= max(grid_heads, batch * kv_heads)
        assert got == 1 or 2 * got * batch * kv_heads > grid_heads or 2 * got > most
    assert planes(1, 1, 8192, plane_bytes=heuristics.FA3_DET_DQ_ACCUM_MAX_BYTES // 2) == 2
