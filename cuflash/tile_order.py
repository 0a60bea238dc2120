"""The FA3 forward's persistent tile order (kernels_cu/common/tile_scheduler.cuh) and the host's choice of its
two parameters for a call: how many (head, batch) pairs share an L2 section, and whether odd rounds run
backwards (the serpentine).

The grid's blocks take one tile per round in the scheduler's linear order: sections of ``section`` pairs one
after the other, each from its last query block down (with a causal mask the heaviest first), its pairs
fastest. A section's pairs keep their K and V within an L2 budget (heuristics.fa3_l2_section_kib), so the
blocks of a round read few heads' K/V, each many times from L2. Where tile costs differ (a causal mask, a
window) the order must also keep the blocks' sums of work even; ``choose`` models that: a tile costs the K
tiles it visits plus one (its prologue and epilogue), and among the sections within the budget and both
deals it takes the one whose busiest block has the least work (ties: the larger section). On the H200 the
model ranked d = 128, N = 2k causal with 2 / 4 / 8 / 16 / 32 pairs per section and no serpentine (526 / 529
/ 380 / 450 / 486 TF/s) as the measurements did (1.09 / 1.03 / 1.47 / 1.25 / 1.14 of the even share).
"""
from __future__ import annotations

import functools

import numpy as np


def section_fit(kv_bytes_per_pair: int, budget_bytes: int) -> int:
    """Pairs per section that fit the budget: the largest power of two whose K/V fit, at least one."""
    fit, section = budget_bytes // max(kv_bytes_per_pair, 1), 1
    while section * 2 <= fit and section < (1 << 20):
        section *= 2
    return section


def linear_order(m_blocks: int, pairs: int, section: int) -> tuple[np.ndarray, np.ndarray]:
    """(query block, pair) of each tile in the scheduler's linear order (TileScheduler::tile)."""
    index = np.arange(m_blocks * pairs)
    per_section = section * m_blocks
    first_pair = index // per_section * section
    width = np.minimum(section, pairs - first_pair)
    rest = index - first_pair * m_blocks
    return m_blocks - 1 - rest // width, first_pair + rest % width


def block_work(costs: np.ndarray, grid: int, serpentine: bool) -> np.ndarray:
    """Each block's sum of ``costs`` (tile costs in linear order) when the grid deals them a round at a time
    (TileScheduler::advance: block b takes position b of a round, or grid - 1 - b in odd rounds with the
    serpentine)."""
    rounds = -(-len(costs) // grid)
    table = np.zeros(rounds * grid)
    table[:len(costs)] = costs
    table = table.reshape(rounds, grid)
    if serpentine:
        table[1::2] = table[1::2, ::-1]
    return table.sum(axis=0)


@functools.lru_cache(maxsize=512)
def choose(m_blocks: int, pairs: int, grid: int, fit: int, m_costs: tuple | None,
           all_pairs_ok: bool = True) -> tuple[int, bool]:
    """(pairs per section, serpentine) for ``pairs`` (head, batch) pairs of ``m_blocks`` query blocks on
    ``grid`` blocks, sections of at most ``fit`` pairs. ``m_costs``: a tile's cost by query block, None when
    all tiles cost the same (then the budget's sections, with the serpentine when one section holds every
    pair: with equal tiles the deal does not matter). ``all_pairs_ok``: one section of every pair may be
    taken beyond the budget (below); the caller says no where those pairs' K/V would stream from device
    memory faster than it delivers (wide_section_ok)."""
    if m_costs is None:
        return fit, fit >= pairs
    costs = np.asarray(m_costs, dtype=np.float64)

    def busiest(in_order, serpentine):
        return round(float(block_work(in_order, grid, serpentine).max()), 6)

    best = None
    section = fit
    while section >= 1:
        in_order = costs[linear_order(m_blocks, pairs, section)[0]]
        for serpentine in (True, False):
            key = (busiest(in_order, serpentine), -section)
            if best is None or key < best[0]:
                best = (key, min(section, pairs), serpentine)
        section //= 2
    # With fewer pairs than half the grid, one section of every pair with the serpentine (what the kernel
    # took there before session 16, whatever the budget) where the model has it 2 % better.
    if fit < pairs and 2 * pairs < grid and all_pairs_ok:
        if busiest(costs[linear_order(m_blocks, pairs, pairs)[0]], True) < 0.98 * best[0][0]:
            return pairs, True
    return best[1], best[2]


def wide_section_ok(pairs: int, grid: int, kv_tile_bytes: int, limit_bytes: int) -> bool:
    """Whether one section of every pair may leave the L2 budget (``choose``'s all_pairs_ok). Every running
    block then works on a pair of its own or nearly (the heaviest query block of each pair first), and the
    blocks of one pair walk its K/V tiles together, so device memory must deliver about min(pairs, grid) K/V
    tiles (``kv_tile_bytes`` each: K and V of one tile of keys) in the time a block takes over one:
    ``limit_bytes`` (heuristics.FA3_WIDE_SECTION_MAX_STREAM_BYTES) bounds that."""
    return min(pairs, grid) * kv_tile_bytes <= limit_bytes


@functools.lru_cache(maxsize=512)
def tile_costs(m_blocks: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, window: tuple[int, int],
               group: int = 1, row_shift: int = 0) -> tuple | None:
    """A tile's cost by query block for ``choose`` (the K tiles its rows see, as Mask::kv_block_range_rows
    counts them, plus one), or None when no mask bounds the rows (``window`` = (left, right) as the kernel
    takes them, "unbounded" = the sequence lengths). ``group``: query heads packed into a tile's rows (GQA
    packing: packed row r is query r // group). ``row_shift``: query block m holds rows from m block_m -
    row_shift (fa3/fwd.cu; no packing)."""
    left, right = window
    if left >= seqlen_k and right >= seqlen_q:
        return None
    row0 = np.arange(m_blocks) * block_m - row_shift
    first, last = np.maximum(row0, 0) // group, (row0 + block_m - 1) // group
    last = np.minimum(last, seqlen_q - 1)
    diag = seqlen_k - seqlen_q
    key_first = np.maximum(0, first + diag - left)
    key_last = np.minimum(seqlen_k - 1, last + diag + right)
    visited = np.where(key_last >= key_first, key_last // block_n + 1 - key_first // block_n, 0)
    visited = np.where(first < seqlen_q, visited, 0)
    return tuple(int(x) + 1 for x in visited)


# Rows of one consumer warpgroup of the FA3 forward: a row shift moves whole warpgroups before row 0, so a
# warpgroup's rows are either all before 0 (it stores nothing) or none are (a TMA store's box must not
# start at a negative row: the H200 faults with an illegal instruction).
SHIFT_GRANULE = 64


def row_shift(m_blocks: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int,
              window: tuple[int, int]) -> tuple[int, tuple | None]:
    """(row_shift, tile costs) for a call whose query blocks may start before row 0 (fa3/fwd.cu: not packed,
    not variable-length, not FP8). When seqlen_q is no multiple of block_m one tile holds rows that do not
    exist: after the end as tiled from row 0, where a causal mask makes the tile the dearest (the bottom
    rows see the most keys), or before row 0 in the cheapest tile with a shift of the spare rows (in whole
    warpgroups: SHIFT_GRANULE). The shift is taken where it lowers the sum of the tiles' costs (causal
    d = 64 tiles of 192 rows at N = 2k / 4k: -5 % of the K tiles visited; 8k / 16k -1.5 %)."""
    costs = tile_costs(m_blocks, block_m, block_n, seqlen_q, seqlen_k, window)
    shift = (m_blocks * block_m - seqlen_q) // SHIFT_GRANULE * SHIFT_GRANULE
    if costs is None or shift == 0:
        return 0, costs
    shifted = tile_costs(m_blocks, block_m, block_n, seqlen_q, seqlen_k, window, row_shift=shift)
    return (shift, shifted) if sum(shifted) < sum(costs) else (0, costs)


def bwd_steps(seqlen_q: int, seqlen_k: int, window: tuple[int, int], block_m: int, block_n: int,
              row_shift=0):
    """Query steps the FA3 backward's K blocks walk in all (per query head; fa3/bwd.cu): K block n visits
    the Q blocks holding a row that sees one of its keys (Mask::q_block_range), Q block m holding rows
    [m block_m - row_shift, (m + 1) block_m - row_shift). ``window`` = (left, right) as the kernel takes it.
    ``row_shift`` may be an array of shifts (then an array of counts)."""
    left, right = window
    diag = seqlen_k - seqlen_q
    key_first = np.arange(-(-seqlen_k // block_n)) * block_n
    key_last = np.minimum(key_first + block_n, seqlen_k) - 1
    row_first = np.maximum(0, key_first - diag - right)
    row_last = np.minimum(seqlen_q - 1, key_last - diag + left)
    shift = np.asarray(row_shift)[..., None]
    lo, hi = (row_first + shift) // block_m, (row_last + shift) // block_m + 1
    steps = np.where(row_last >= row_first, hi - lo, 0).sum(axis=-1)
    return int(steps) if steps.ndim == 0 else steps


@functools.lru_cache(maxsize=512)
def bwd_row_shift(seqlen_q: int, seqlen_k: int, window: tuple[int, int], block_m: int, block_n: int) -> int:
    """Rows of the FA3 backward's first Q block before row 0 (fa3/bwd_roles.cuh row_shift_of): the shift in
    [0, spare rows] with the fewest steps (bwd_steps; the least of equals). Under a causal mask every K
    block walks down to the last Q block, which a length that is no multiple of block_m leaves partly
    empty; shifted, the partly empty block is the first, which only the first K blocks visit (causal
    d = 128, steps of 80 rows, N = 2k / 4k: -2.6 / -2.8 % of the steps; d = 64, 96 rows, 2k -5.1 %).
    Without a mask every K block walks every Q block and a shift only adds."""
    spare = -(-seqlen_q // block_m) * block_m - seqlen_q
    steps = bwd_steps(seqlen_q, seqlen_k, window, block_m, block_n, np.arange(spare + 1))
    return int(np.argmin(steps))  # (the first of equals: the least shift)


def tail_split(tiles: int, grid: int, k_blocks: int) -> tuple[int, int, int] | None:
    """_tail_split with heuristics.FA3_TAIL_* (None when FA3_TAIL_SPLIT is off)."""
    from . import heuristics

    if not heuristics.FA3_TAIL_SPLIT:
        return None
    return _tail_split(tiles, grid, k_blocks, heuristics.FA3_TAIL_MIN_GAIN, heuristics.FA3_TAIL_MERGE_COST,
                       heuristics.FA3_TAIL_MAX_PIECES)


@functools.lru_cache(maxsize=512)
def _tail_split(tiles: int, grid: int, k_blocks: int, min_gain: float, merge_cost: float,
                max_pieces: int) -> tuple[int, int, int] | None:
    """The FA3 forward's stream-K tail for ``tiles`` equal tiles of ``k_blocks`` K tiles each on ``grid``
    persistent blocks (kernels_cu/common/tile_scheduler.cuh TailSplit): (start, units, slots), or None where
    it does not pay. The rounds stop at the last whole one (start = rounds x grid); the K tiles of the rest,
    in order, go out ``units`` = ceil(rest x k_blocks / grid) to a block (at least ceil(k_blocks /
    heuristics.FA3_TAIL_MAX_PIECES)), a block's range holding at most the end of one tile and the start of
    the next; ``slots``: the most pieces a tile has, less one (its last
    piece merges the others). Cost model (tile_costs'): a tile or piece costs its K tiles plus one (prologue
    and epilogue), a merge ``merge_cost`` per partial; the split is taken where the busiest block's work
    falls by more than ``min_gain``, with at most ``max_pieces`` pieces per tile (heuristics.FA3_TAIL_*). At the
    benchmark shapes (2048 tiles of 128 rows, 132 SMs: 15 rounds and 68 tiles) d = 128, N = 2k: 16 x 17 = 272
    -> 15 x 17 + 9 + 2 + 1 = 267. Cached: it runs on every forward call's host path."""
    rounds, rest = divmod(tiles, grid)
    if rounds == 0 or rest == 0 or k_blocks < 2:
        return None
    # (at least a share of a tile per block: a merge reads each partial one after the other)
    units = max(-(-rest * k_blocks // grid), -(-k_blocks // max_pieces))
    total = rest * k_blocks
    if total >= 2 ** 31 or grid * units >= 2 ** 31:
        return None
    worst, slots = 0.0, 0
    for block in range(grid):
        lo, hi = min(block * units, total), min(block * units + units, total)
        if lo == hi:
            continue
        first, last = lo // k_blocks, (hi - 1) // k_blocks
        cost = (hi - lo) + (last - first + 1)  # its K tiles, +1 per piece
        for j in range(first, last + 1):
            if hi >= (j + 1) * k_blocks:  # this block holds tile j's last piece: it merges the others
                others = block - j * k_blocks // units
                slots = max(slots, others)
                cost += merge_cost * others
        worst = max(worst, cost)
    if rounds * (k_blocks + 1) + worst > (rounds + 1) * (k_blocks + 1) * (1 - min_gain):
        return None
    return rounds * grid, units, max(slots, 1)
