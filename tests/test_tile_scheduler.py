"""CPU tier: the FA3 forward's persistent tile scheduler (kernels_cu/common/tile_scheduler.cuh), compiled on
the host (tests/cpp/scheduler_harness.cpp, g++) and walked for every block of a grid.

Properties:
  * every (query block, head, batch) tile is visited exactly once over all blocks, for full and partial
    last rounds and sections that do or do not divide the (head, batch) pairs;
  * rounds: block b takes position b of every round, except with the serpentine, where odd rounds give it
    position gridDim.x - 1 - b;
  * L2 sections: the tiles of any section-long stretch of the order span at most `section` pairs, and
    within a section the query blocks come heaviest (last) first;
  * balance: with causal costs (query block m sees m + 1 key blocks) the busiest block's work stays within
    5 % of the mean and below a plain round-robin's over the same order (1.06 at 64 blocks x 32 pairs);
  * the host's model of it (cuflash/tile_order.py): the same linear order and deal, tile costs as the
    kernel's mask counts K tiles, sections within the L2 budget, and the choice of section and deal.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cuflash import heuristics, tile_order
from host_harness import build


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = build("scheduler_harness.cpp", "common", tmp_path_factory.mktemp("scheduler_harness"))
    lib.scheduler_walk.argtypes = [ctypes.c_int] * 6 + [ctypes.POINTER(ctypes.c_int32), ctypes.c_longlong]
    lib.scheduler_walk.restype = ctypes.c_longlong
    lib.scheduler_walk_plain_div.argtypes = lib.scheduler_walk.argtypes
    lib.scheduler_walk_plain_div.restype = ctypes.c_longlong
    return lib


def walk(lib, m_blocks, heads, batch, section, grid, serpentine=None) -> np.ndarray:
    """(tiles, 4) rows (block, m_block, head, batch) in each block's visiting order, blocks in order.
    ``serpentine`` None: with a single section (the deal the host takes for equal tiles there)."""
    if serpentine is None:
        serpentine = section >= heads * batch
    cap = m_blocks * heads * batch + 1
    out = np.full((cap, 4), -7, np.int32)
    n = lib.scheduler_walk(m_blocks, heads, batch, section, int(serpentine), grid,
                           out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), cap)
    assert n >= 0, "the scheduler visited more tiles than exist"
    return out[:n]


def linear_index(m_blocks, heads, batch, section, m, h, b):
    """Position of tile (m, h, b) in the heavy-first, sectioned order (a model of tile(); inverse map)."""
    pair = b * heads + h
    first = pair // section * section
    width = min(section, heads * batch - first)
    return first * m_blocks + (m_blocks - 1 - m) * width + (pair - first)


SHAPES = [  # m_blocks, heads, batch, section, grid
    (16, 16, 8, 32, 132), (4, 16, 32, 128, 132), (64, 16, 2, 4, 132), (64, 8, 2, 16, 132), (7, 5, 3, 4, 11),
    (3, 3, 1, 2, 132), (1, 1, 1, 1, 1), (13, 6, 5, 8, 17), (9, 2, 7, 1, 5), (5, 7, 2, 64, 9),
]


@pytest.mark.parametrize("serpentine", [False, True])
@pytest.mark.parametrize("m_blocks,heads,batch,section,grid", SHAPES)
def test_every_tile_once_in_round_order(lib, m_blocks, heads, batch, section, grid, serpentine):
    rows = walk(lib, m_blocks, heads, batch, section, grid, serpentine)
    total = m_blocks * heads * batch
    assert len(rows) == total
    tiles = {tuple(r[1:]) for r in rows}
    assert len(tiles) == total
    assert all(0 <= m < m_blocks and 0 <= h < heads and 0 <= b < batch for m, h, b in tiles)
    for block in range(grid):
        mine = rows[rows[:, 0] == block]
        for r, (_, m, h, b) in enumerate(mine):
            pos = grid - 1 - block if r % 2 and serpentine else block
            assert linear_index(m_blocks, heads, batch, section, m, h, b) == r * grid + pos, (block, r)


@pytest.mark.parametrize("m_blocks,heads,batch,section,grid", SHAPES + [(128, 32, 32, 4096, 132), (1, 1, 1, 7, 1)])
def test_host_divisors_are_the_kernels(lib, m_blocks, heads, batch, section, grid):
    """cuflash/fa3.py's tile_order_divisors (what a launch passes in Fa3FwdParams.sched_div) builds the words
    tile_order_divisors in the header does, and they divide every tile index the kernel can form as `/` does."""
    from cuflash import fa3

    out = np.zeros(12, np.uint32)
    lib.scheduler_divisors(m_blocks, heads, batch, section, out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)))
    host = fa3.tile_order_divisors(m_blocks, heads, batch, section)
    assert [w for d in host for w in d] == out.tolist()
    n = np.arange(m_blocks * heads * batch, dtype=np.uint64)
    for d, m, shift in host:
        assert np.array_equal((((n * m) >> 32) + n) >> shift, n // d), d
    p = np.zeros(1, fa3.PARAMS)
    p["sched_div"] = host
    assert p["sched_div"]["heads"]["divisor"][0] == heads
    # the plain-division walk (TileScheduler::tile<false>, the FP8 forward's) visits the same tiles in the same order
    for serpentine in (False, True):
        cap = m_blocks * heads * batch + 1
        plain = np.full((cap, 4), -7, np.int32)
        n = lib.scheduler_walk_plain_div(m_blocks, heads, batch, section, int(serpentine), grid,
                                         plain.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), cap)
        assert np.array_equal(plain[:n], walk(lib, m_blocks, heads, batch, section, grid, serpentine))


@pytest.mark.parametrize("m_blocks,heads,batch,section,grid", SHAPES)
def test_sections_keep_few_pairs_and_heavy_first(lib, m_blocks, heads, batch, section, grid):
    rows = walk(lib, m_blocks, heads, batch, section, grid)
    order = sorted(rows.tolist(), key=lambda r: linear_index(m_blocks, heads, batch, section, *r[1:]))
    pairs = [r[3] * heads + r[2] for r in order]
    span = section * m_blocks
    for start in range(0, len(order), span):  # one whole section at a time
        assert len(set(pairs[start:start + span])) <= section
        ms = [r[1] for r in order[start:start + span]]
        assert ms == sorted(ms, reverse=True), "a section's query blocks are not heaviest first"


def _busiest_over_mean(rows, grid):
    work = np.zeros(grid)
    np.add.at(work, rows[:, 0], rows[:, 1] + 1)  # causal: query block m sees m + 1 key blocks
    return work.max() / work.mean()


@pytest.mark.parametrize("m_blocks,heads,batch,grid", [(64, 16, 2, 132), (16, 16, 8, 132), (32, 16, 4, 132)])
def test_serpentine_balances_causal_work(lib, m_blocks, heads, batch, grid):
    pairs = heads * batch
    rows = walk(lib, m_blocks, heads, batch, pairs, grid)  # one section: the plain heavy-first order
    serpentine = _busiest_over_mean(rows, grid)
    # The same order dealt round-robin (block b takes b, b + grid, ...), for comparison.
    order = sorted(rows.tolist(), key=lambda r: linear_index(m_blocks, heads, batch, pairs, *r[1:]))
    plain = np.array([[i % grid] + r[1:] for i, r in enumerate(order)])
    round_robin = _busiest_over_mean(plain, grid)
    print(f"busiest / mean: serpentine {serpentine:.3f}, round-robin {round_robin:.3f}")
    assert serpentine <= 1.05 and serpentine <= round_robin, (serpentine, round_robin)
    if round_robin > 1.05:  # where the plain deal is measurably off, the serpentine must fix most of it
        assert serpentine - 1 < (round_robin - 1) / 3, (serpentine, round_robin)


def test_section_fit():
    """The largest power of two of pairs whose K/V fit the budget, at least one."""
    mib = 1 << 20
    for kv_bytes, want in [(1 * mib, 32), (3 * mib, 8), (8 * mib, 4), (32 * mib, 1), (100 * mib, 1), (256 << 10, 128),
                           (0, 1 << 20), (-5, 1 << 20)]:
        assert tile_order.section_fit(kv_bytes, 32 * mib) == want, kv_bytes


@pytest.mark.parametrize("serpentine", [False, True])
@pytest.mark.parametrize("m_blocks,heads,batch,section,grid", SHAPES)
def test_model_deals_the_tiles_as_the_kernel(lib, m_blocks, heads, batch, section, grid, serpentine):
    """tile_order's linear order and deal give every block the tiles the kernel's scheduler walks."""
    rows = walk(lib, m_blocks, heads, batch, section, grid, serpentine)
    pairs = heads * batch
    m, pair = tile_order.linear_order(m_blocks, pairs, section)
    # each tile costs its own code + 1 below: block_work must give every block the sum of its tiles'
    code = (m * pairs + pair).astype(np.float64)
    want = {b: set() for b in range(grid)}
    rounds = -(-len(code) // grid)
    for i in range(len(code)):
        r, pos = divmod(i, grid)
        block = grid - 1 - pos if serpentine and r % 2 else pos
        want[block].add((int(m[i]), int(pair[i] % heads), int(pair[i] // heads)))
    for b in range(grid):
        got = {(int(x[1]), int(x[2]), int(x[3])) for x in rows[rows[:, 0] == b]}
        assert got == want[b], b
    work = tile_order.block_work(code + 1, grid, serpentine)
    assert rounds >= 1 and np.isclose(work.sum(), (code + 1).sum())
    for b in range(grid):
        assert np.isclose(work[b], sum(mm * pairs + (bb * heads + hh) + 1 for mm, hh, bb in want[b])), b


@pytest.mark.parametrize("seed", range(40))
def test_tile_costs_count_the_kernels_k_tiles(seed):
    """tile_costs: K tiles of each query block as reference.kv_block_range counts them (the kernel's
    Mask::kv_block_range_rows), plus one; None without a mask."""
    from cuflash import _validate
    from cuflash import reference as ref

    rng = np.random.default_rng(seed)
    sq, sk = (int(x) for x in rng.integers(1, 700, 2))
    block_m, block_n = int(rng.choice([64, 128, 192])), int(rng.choice([64, 80, 128]))
    causal = bool(rng.integers(2))
    window = tuple(int(x) for x in rng.choice([-1, 0, 5, 100], 2)) if rng.integers(2) else (-1, -1)
    dims = _validate.Dims(1, sq, sk, 1, 1, 64, "bfloat16")
    bounds = _validate.window_bounds(window, causal, dims)
    m_blocks = -(-sq // block_m)
    got = tile_order.tile_costs(m_blocks, block_m, block_n, sq, sk, bounds)
    if bounds[0] >= sk and bounds[1] >= sq:
        assert got is None
        return
    want = []
    for m in range(m_blocks):
        lo, hi = ref.kv_block_range(m, seqlen_q=sq, seqlen_k=sk, block_m=block_m, block_n=block_n, causal=causal,
                                    window_size=window)
        want.append(hi - lo + 1)
    assert list(got) == want


@pytest.mark.parametrize("seed", range(40))
def test_shifted_tile_costs_count_the_rows_each_tile_holds(seed):
    """tile_costs with a row_shift: query block m holds rows [m block_m - shift, ...) (fa3/fwd.cu), and a
    tile's K tiles are those its real rows (0 .. seqlen_q - 1) see, counted row by row here."""
    from cuflash import _validate

    rng = np.random.default_rng(seed)
    sq, sk = (int(x) for x in rng.integers(1, 700, 2))
    block_m, block_n = int(rng.choice([64, 128, 192])), int(rng.choice([64, 80, 128]))
    window = tuple(int(x) for x in rng.choice([-1, 0, 5, 100], 2))
    dims = _validate.Dims(1, sq, sk, 1, 1, 64, "bfloat16")
    left, right = _validate.window_bounds(window, bool(rng.integers(2)), dims)
    if left >= sk and right >= sq:
        return
    m_blocks = -(-sq // block_m)
    shift = int(rng.integers(0, m_blocks * block_m - sq + 1))
    got = tile_order.tile_costs(m_blocks, block_m, block_n, sq, sk, (left, right), row_shift=shift)
    for m in range(m_blocks):
        blocks = set()
        for row in range(max(0, m * block_m - shift), min(sq, (m + 1) * block_m - shift)):
            lo, hi = max(0, row + sk - sq - left), min(sk - 1, row + sk - sq + right)
            blocks.update(range(lo // block_n, hi // block_n + 1) if hi >= lo else ())
        want = max(blocks) + 1 - min(blocks) if blocks else 0  # the kernel visits the span between
        assert got[m] == want + 1, (m, shift)


def test_row_shift_puts_the_spare_rows_where_they_cost_least():
    """Causal d = 64 tiles of 192 rows at N = 2k (11 blocks, 64 spare rows): the shift takes them from the
    last tile (2048 keys) to the first (128); without a mask, or where tiles of 128 rows see the same K
    tiles either way, no shift."""
    causal = tile_order.row_shift(11, 192, 128, 2048, 2048, (2048, 0))
    assert causal[0] == 64 and sum(causal[1]) < sum(tile_order.tile_costs(11, 192, 128, 2048, 2048, (2048, 0)))
    assert causal[1][0] == 2 and causal[1][-1] == 17  # rows -64 .. 127: one K tile; 1856 .. 2047: 16
    assert tile_order.row_shift(11, 192, 128, 2048, 2048, (2048, 2048)) == (0, None)
    assert tile_order.row_shift(8, 128, 128, 1000, 1000, (1000, 0))[0] == 0
    assert tile_order.row_shift(22, 192, 128, 4096, 4096, (4096, 0))[0] == 128


@pytest.mark.parametrize("seed", range(20))
def test_row_shift_moves_whole_warpgroups(seed):
    """The shift is a multiple of a consumer warpgroup's 64 rows (a TMA store of O must not start before
    row 0: a warpgroup's rows are all before 0 or none are), and at most the spare rows (the first tile keeps
    a real row)."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        block_m = int(rng.choice([64, 128, 192]))
        sq, sk = (int(x) for x in rng.integers(1, 5000, 2))
        m_blocks = -(-sq // block_m)
        shift = tile_order.row_shift(m_blocks, block_m, 128, sq, sk, (sk, int(rng.choice([0, 7]))))[0]
        assert shift % tile_order.SHIFT_GRANULE == 0 and 0 <= shift <= m_blocks * block_m - sq
    assert tile_order.row_shift(6, 192, 128, 1030, 1030, (1030, 0))[0] == 64  # 122 spare rows: one warpgroup


def test_choose():
    """The model's choices for the H200's shapes (grid 132): equal tiles take the budget's sections; d = 128,
    N = 2k causal (16 query blocks, 128 pairs, 2 fit in 2 MiB) takes 2-pair sections with the serpentine
    (the plain deal of them is 1.09 of the even share: measured 526 against 529 at 4 pairs); long causal
    rows (d = 256, 8k: 64 query blocks of 2 (m + 1) K tiles, 16 pairs, 1 fits) keep one section of every
    pair with the serpentine, which the model has 2 % better."""
    assert tile_order.choose(16, 128, 132, 4, None) == (4, False)
    assert tile_order.choose(16, 2, 132, 4, None) == (4, True)
    causal_2k = tile_order.tile_costs(16, 128, 128, 2048, 2048, (2048, 0))
    assert causal_2k == tuple(range(2, 18))
    assert tile_order.choose(16, 128, 132, 2, causal_2k) == (2, True)
    causal_8k = tile_order.tile_costs(64, 128, 64, 8192, 8192, (8192, 0))
    assert tile_order.choose(64, 16, 132, 1, causal_8k) == (16, True)
    m, _ = tile_order.linear_order(16, 128, 2)
    work = {serp: tile_order.block_work(np.asarray(causal_2k, float)[m], 132, serp) for serp in (True, False)}
    assert work[True].max() / work[True].mean() < 1.04 < work[False].max() / work[False].mean()


def test_wide_sections_only_where_device_memory_keeps_up():
    """One section of every pair beyond the L2 budget only where min(pairs, grid) K/V tiles stay within
    heuristics.FA3_WIDE_SECTION_MAX_STREAM_BYTES: causal d = 128 N = 4k (64 pairs x 64 KB of K/V tiles =
    4 MiB) keeps the budget's one pair per section with the serpentine (measured 566-607 against 544-561 TF/s
    for every pair); d = 128 8k (32 pairs, 2 MiB) and d = 256 8k (16 pairs, 1 MiB) still take every pair."""
    from cuflash import fa3, heuristics
    from cuflash._validate import Dims

    limit = heuristics.FA3_WIDE_SECTION_MAX_STREAM_BYTES
    assert tile_order.wide_section_ok(32, 132, 64 << 10, limit) and not tile_order.wide_section_ok(64, 132, 64 << 10, limit)
    assert tile_order.wide_section_ok(200, 132, 16 << 10, limit)  # the grid bounds the pairs in flight
    causal_4k = tile_order.tile_costs(32, 128, 128, 4096, 4096, (4096, 0))
    assert tile_order.choose(32, 64, 132, 1, causal_4k) == (64, True)
    assert tile_order.choose(32, 64, 132, 1, causal_4k, False) == (1, True)

    def section(d, n, block_n):
        dims = Dims(16384 // n, n, n, 2048 // d, 2048 // d, d, np.dtype("float16"))
        budget = heuristics.fa3_l2_section_kib(d, n)
        return fa3.schedule(dims, (n, 0), 128, block_n, 2, budget, False, 132)[:2]

    assert section(128, 4096, 128) == (1, True)
    assert section(128, 8192, 128) == (32, True)
    assert section(256, 8192, 64) == (16, True)


@pytest.mark.parametrize("seed", range(30))
def test_bwd_steps_count_the_blocks_with_visible_rows(seed):
    """bwd_steps with a row shift: per K block, the Q blocks [m block_m - shift, ...) that hold a row seeing
    one of its keys, counted row by row here (the band of rows that see a key block is contiguous, so the
    kernel's span from the first to the last such Q block is exactly these)."""
    from cuflash import _validate

    rng = np.random.default_rng(seed)
    sq, sk = (int(x) for x in rng.integers(1, 500, 2))
    block_m, block_n = int(rng.choice([64, 80, 96])), int(rng.choice([64, 128]))
    window = tuple(int(x) for x in rng.choice([-1, 0, 5, 100], 2))
    dims = _validate.Dims(1, sq, sk, 1, 1, 64, "bfloat16")
    left, right = _validate.window_bounds(window, bool(rng.integers(2)), dims)
    shift = int(rng.integers(0, -(-sq // block_m) * block_m - sq + 1))
    want = 0
    for n in range(-(-sk // block_n)):
        keys = range(n * block_n, min(sk, (n + 1) * block_n))
        blocks = {(r + shift) // block_m for r in range(sq) if any(r + sk - sq - left <= j <= r + sk - sq + right
                                                                   for j in keys)}
        want += max(blocks) + 1 - min(blocks) if blocks else 0
    assert tile_order.bwd_steps(sq, sk, (left, right), block_m, block_n, shift) == want


def test_bwd_row_shift():
    """Causal d = 128 (steps of 80 rows, 128-key blocks) at N = 2k: 32 spare rows before row 0 save 2.6 % of
    the steps; d = 64 (96 rows) 64 of them 5.1 %; without a mask no shift (it only adds steps); a length that
    is a multiple of the step none."""
    base = tile_order.bwd_steps(2048, 2048, (2048, 0), 80, 128)
    assert tile_order.bwd_row_shift(2048, 2048, (2048, 0), 80, 128) == 32
    assert tile_order.bwd_steps(2048, 2048, (2048, 0), 80, 128, 32) == 224 < base == 230
    assert tile_order.bwd_row_shift(2048, 2048, (2048, 0), 96, 128) == 64
    assert tile_order.bwd_row_shift(2048, 2048, (2048, 2048), 80, 128) == 0
    assert tile_order.bwd_row_shift(2000, 2000, (2000, 0), 80, 128) == 0
    assert list(tile_order.bwd_steps(2048, 2048, (2048, 0), 80, 128, np.array([0, 32]))) == [230, 224]


def _shifted_backward_model(dout, q, k, v, out, lse, left, right, block_m, block_n, shift):
    """fa3/bwd.cu's data flow with a row shift, one head, float64: Q block m holds padded rows [m block_m,
    (m + 1) block_m), query row = padded row - shift; Q / dO zero before row 0 (TMA's fill) and past the
    end; the padded LSE / D rows +inf / 0 in the shift's padding (bwd_aux.cu) and past the end (column_values'
    `outside`); dq_accum's padding rows start as NaN (never zeroed, never read); the mask as Mask::visible
    (which does not exclude rows before 0), the K blocks' Q blocks as Mask::q_block_range."""
    sq, d = q.shape
    sk = k.shape[0]
    pitch = -(-(sq + shift) // block_m) * block_m
    pad = lambda x, fill: np.concatenate([np.full((shift,) + x.shape[1:], fill), x,  # noqa: E731
                                          np.full((pitch - shift - sq,) + x.shape[1:], fill)])
    q_rows, do_rows = pad(q, 0.0), pad(dout, 0.0)
    lse_rows, d_rows = pad(lse, np.inf), pad((dout * out).sum(-1), 0.0)
    dq_accum = np.concatenate([np.full((shift, d), np.nan), np.zeros((sq, d))])
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    scale = d ** -0.5
    diag = sk - sq
    for n in range(-(-sk // block_n)):
        keys = np.arange(n * block_n, min(sk, (n + 1) * block_n))
        row_first = max(0, keys[0] - diag - right)
        row_last = min(sq - 1, keys[-1] - diag + left)
        if row_last < row_first:
            continue
        for m in range((row_first + shift) // block_m, (row_last + shift) // block_m + 1):
            rows = np.arange(m * block_m, (m + 1) * block_m)  # padded
            qb, dob = q_rows[rows], do_rows[rows]
            with np.errstate(over="ignore"):
                p = np.exp(scale * qb @ k[keys].T - lse_rows[rows][:, None])
            true_rows = rows[:, None] - shift
            visible = (keys[None, :] <= true_rows + diag + right) & (keys[None, :] >= true_rows + diag - left)
            p = np.where(visible, p, 0.0)
            dv[keys] += p.T @ dob
            ds = p * (dob @ v[keys].T - d_rows[rows][:, None])
            dk[keys] += scale * ds.T @ qb
            inside = rows < shift + sq  # the TMA reduce-add drops rows past dq_accum's end
            dq_accum[rows[inside]] += scale * (ds @ k[keys])[inside]
    return dq_accum[shift:], dk, dv


@pytest.mark.parametrize("seed", range(24))
def test_shifted_backward_model_matches_the_exact_gradients(seed):
    """The row shift's padding argument: Q and dO rows before 0 are zero and their LSE +inf, so they add
    nothing to dK, dV or the real rows of dQ -- also where the mask would let a row before 0 see keys (Sq <
    Sk causal). Shifts as bwd_row_shift picks them, and any other in range."""
    from cuflash import _validate, reference

    rng = np.random.default_rng(seed)
    sq, sk = (int(x) for x in rng.integers(1, 600, 2))
    d, block_m, block_n = 16, int(rng.choice([64, 80, 96])), int(rng.choice([64, 128]))
    causal = bool(rng.integers(2))
    window = (-1, -1) if causal else tuple(int(x) for x in rng.choice([-1, 3, 50], 2))
    dims = _validate.Dims(1, sq, sk, 1, 1, d, "float32")
    left, right = _validate.window_bounds(window, causal, dims)
    q, k, v, dout = (rng.standard_normal((1, n, 1, d)) for n in (sq, sk, sk, sq))
    out, lse = reference.attention_ref(q, k, v, causal=causal, window_size=window, compute_dtype="float64")
    want = reference.attention_ref_backward(dout, q, k, v, causal=causal, window_size=window, compute_dtype="float64")
    spare = -(-sq // block_m) * block_m - sq
    for shift in {tile_order.bwd_row_shift(sq, sk, (left, right), block_m, block_n), int(rng.integers(0, spare + 1))}:
        lse_1 = np.where(np.isfinite(lse[0, 0]), lse[0, 0], np.inf)  # rows that see no key: +inf, as preprocessed
        got = _shifted_backward_model(dout[0, :, 0], q[0, :, 0], k[0, :, 0], v[0, :, 0], out[0, :, 0], lse_1,
                                      left, right, block_m, block_n, shift)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w[0, :, 0], rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------------------------------
# the stream-K tail (TailSplit; cuflash/tile_order.py tail_split)
# ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tail_lib(lib):
    lib.scheduler_walk_tail.argtypes = [ctypes.c_int] * 10 + [ctypes.POINTER(ctypes.c_int32), ctypes.c_longlong]
    lib.scheduler_walk_tail.restype = ctypes.c_longlong
    return lib


def walk_tail(lib, m_blocks, heads, batch, section, grid, serpentine, start, units, k_blocks, slots) -> np.ndarray:
    """(visits, 9) rows (block, m_block, head, batch, n_lo, n_hi, slot, first, merges), blocks in order."""
    cap = m_blocks * heads * batch * 2 + 2 * grid + 1
    out = np.full((cap, 9), -7, np.int32)
    n = lib.scheduler_walk_tail(m_blocks, heads, batch, section, int(serpentine), grid, start, units, k_blocks, slots,
                                out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), cap)
    assert n >= 0, "the scheduler visited more tiles and pieces than can exist"
    return out[:n]


TAIL_SHAPES = [  # m_blocks, heads, batch, section, grid, k_blocks: the benchmark shapes and odd ones
    (16, 16, 8, 2, 132, 16), (32, 16, 4, 1, 132, 32), (64, 16, 2, 8, 132, 64), (8, 8, 16, 4, 132, 26),
    (7, 5, 3, 4, 11, 9), (13, 6, 5, 8, 64, 12), (9, 2, 7, 1, 5, 3), (5, 7, 2, 64, 9, 40), (3, 3, 1, 2, 4, 7),
    (2, 1, 67, 1, 132, 2),
]


@pytest.mark.parametrize("serpentine", [False, True])
@pytest.mark.parametrize("m_blocks,heads,batch,section,grid,k_blocks", TAIL_SHAPES)
def test_tail_pieces_cover_every_key_once_and_merge_safely(tail_lib, m_blocks, heads, batch, section, grid, k_blocks,
                                                           serpentine):
    """With the split tile_order's model makes (whatever its gain): the rounds' tiles once each with all their K tiles, then every tail
    tile's K tiles exactly once over its pieces; one piece per tail tile (the one holding its last K tile)
    merges, and the others' slots are exactly its range; a block takes at most two pieces, its merging one
    last, and a merge waits only for pieces of lower-numbered blocks, each that block's first piece (so no
    block ever waits for a block that waits)."""
    tiles = m_blocks * heads * batch
    # (the split the model makes with any gain: the scheduler must be right for every split it could take)
    split = tile_order._tail_split(tiles, grid, k_blocks, 0.0, heuristics.FA3_TAIL_MERGE_COST,
                                   heuristics.FA3_TAIL_MAX_PIECES)
    assert split is not None, "every shape here leaves a part-empty last round worth splitting"
    start, units, slots = split
    assert start % grid == 0 and 0 < tiles - start < grid and 1 <= units <= k_blocks
    rows = walk_tail(tail_lib, m_blocks, heads, batch, section, grid, serpentine, start, units, k_blocks, slots)
    index = {tuple(r[1:4]): linear_index(m_blocks, heads, batch, section, *r[1:4]) for r in rows}
    regular = [r for r in rows if index[tuple(r[1:4])] < start]
    assert len(regular) == start and len({tuple(r[1:4]) for r in regular}) == start
    assert all(r[4] == 0 and r[5] == k_blocks and tuple(r[6:]) == (-1, 0, 0) for r in regular)
    pieces = {}
    for pos, r in enumerate(rows):
        j = index[tuple(r[1:4])] - start
        if j >= 0:
            pieces.setdefault(j, []).append((pos, *r))
    assert sorted(pieces) == list(range(tiles - start))
    for j, got in pieces.items():
        keys = sorted(k for piece in got for k in range(piece[5], piece[6]))
        assert keys == list(range(k_blocks)), (j, keys)
        owners = [piece for piece in got if piece[7] < 0]
        assert len(owners) == 1 and owners[0][6] == k_blocks, (j, got)
        owner = owners[0]
        others = sorted(piece[7] for piece in got if piece[7] >= 0)
        assert owner[8] == j * slots and owner[9] == len(others) and others == list(range(j * slots, j * slots + len(others)))
        assert len(others) <= slots
        for piece in got:
            if piece[7] >= 0:
                assert piece[1] < owner[1], "a merge waits for a block numbered above it"
                first_of_block = next(r for r in rows if r[0] == piece[1] and index[tuple(r[1:4])] >= start)
                assert tuple(first_of_block[1:4]) == tuple(piece[2:5]), "a partial is not its block's first piece"
    for block in range(grid):
        mine = [r for r in rows if r[0] == block]
        tail = [r for r in mine if index[tuple(r[1:4])] >= start]
        assert len(tail) <= 2 and mine[-len(tail):] == tail if tail else True
        assert all(r[6] < 0 for r in tail[1:]), "a block's second piece must be the merging one"
        assert sum(r[5] - r[4] for r in tail) <= units


def test_tail_split_only_where_the_model_gains():
    """tile_order.tail_split: none without a part-empty last round, a whole round or when the pieces' own
    costs eat the gain (heuristics.FA3_TAIL_MIN_GAIN); at the benchmark shapes (2048 / 1024 tiles on 132
    SMs) from 2k keys on (16 / 26 K tiles per tile and more) the busiest block's modelled work falls by
    1.8-3 % and the tail is taken; at 1k (8 / 13 K tiles, 0.7-0.9 %) it is not."""
    assert tile_order.tail_split(264, 132, 16) is None  # whole rounds
    assert tile_order.tail_split(100, 132, 16) is None  # less than one round: nothing waits on a tail
    assert tile_order.tail_split(2048, 132, 1) is None  # one K tile per tile: nothing to split
    assert tile_order.tail_split(131 + 132, 132, 16) is None  # 131 of 132 blocks busy in the last round
    assert tile_order.tail_split(2048, 132, 8) is None and tile_order.tail_split(1024, 132, 13) is None
    for tiles, k_blocks in ((2048, 16), (1024, 26), (2048, 32), (2048, 64), (2048, 128), (1024, 52), (1024, 103)):
        start, units, slots = tile_order.tail_split(tiles, 132, k_blocks)
        rounds = start // 132
        before = (rounds + 1) * (k_blocks + 1)
        after = rounds * (k_blocks + 1) + units + 2 + 0.5 * slots
        assert start == 132 * (tiles // 132) and 0.015 < 1 - after / before < 0.04, (tiles, k_blocks, after / before)


@pytest.mark.parametrize("d,dv", [(64, None), (128, None), (128, 64), (256, None), (256, 128), (96, None)])
def test_fill_tail_sizes_the_partials_as_the_kernel_indexes_them(monkeypatch, d, dv):
    """cuflash.fa3.fill_tail (host only, CuPy's allocations faked): the tail_* fields are tail_split's, and
    the TailSplit it returns allocates per call partials that hold every slot's (tail tiles x slots x
    consumers) OD / 8 + 1 float4 for 128 threads (fa3/fwd.cu partial_of), one flag each, and a new non-zero
    tag each call."""
    import sys
    from unittest import mock

    from cuflash import _validate, fa3

    made = []

    def empty(shape, dtype):
        arr = mock.MagicMock(name="cupy array")
        arr.size, arr.dtype, arr.data.ptr = int(np.prod(shape)), np.dtype(dtype), 4096 * (len(made) + 1)
        made.append(arr)
        return arr

    fake = mock.MagicMock(name="cupy")
    fake.empty, fake.float32, fake.uint64 = empty, np.float32, np.uint64
    monkeypatch.setitem(sys.modules, "cupy", fake)
    t = fa3.fwd_tiles(d, unmasked=True)
    block_m, grid, n = fa3.fwd_block_m(t), 132, 4096
    dims = _validate.Dims(16384 // n, n, n, 2048 // d, 2048 // d, d, "bfloat16", headdim_v=dv)
    p = np.zeros(1, fa3.PARAMS)
    split = fa3.fill_tail(p, dims, block_m, t, grid)
    assert split is not None
    m_blocks = -(-n // block_m)
    k_blocks = -(-n // t.block_n)
    start, units, slots = tile_order.tail_split(m_blocks * dims.heads * dims.batch, grid, k_blocks)
    assert (int(p["tail_start"][0]), int(p["tail_units"][0]), int(p["tail_k_blocks"][0]),
            int(p["tail_slots"][0])) == (start, units, k_blocks, slots)
    entries = (m_blocks * dims.heads * dims.batch - start) * slots * t.consumers
    od = -(-(dv or d) // 64) * 64
    calls = [split.buffers() for _ in range(2)]
    for partials, flags, _ in calls:
        assert partials.size == entries * (od // 8 + 1) * 128 * 4 and partials.dtype == np.float32
        assert flags.size == entries and flags.dtype == np.uint64
    assert calls[0][0] is not calls[1][0] and calls[0][1] is not calls[1][1]
    tags = [tag for _, _, tag in calls]
    assert 0 not in tags and tags[0] != tags[1]
