"""CPU tier: the FA3 forward's persistent tile scheduler (kernels_cu/common/tile_scheduler.cuh), compiled on
the host (tests/cpp/scheduler_harness.cpp, g++) and walked for every block of a grid.

Properties:
  * every (query block, head, batch) tile is visited exactly once over all blocks, for full and partial
    last rounds and sections that do or do not divide the (head, batch) pairs;
  * rounds: block b takes position b of every round, except with a single section (serpentine), where
    odd rounds give it position gridDim.x - 1 - b;
  * L2 sections: the tiles of any section-long stretch of the order span at most `section` pairs, and
    within a section the query blocks come heaviest (last) first;
  * balance: with causal costs (query block m sees m + 1 key blocks) the busiest block's work stays within
    5 % of the mean and below a plain round-robin's over the same order (1.06 at 64 blocks x 32 pairs);
  * ``l2_section_heads``: the largest power of two whose K/V fit in 32 MiB, at least one.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from host_harness import build


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = build("scheduler_harness.cpp", "common", tmp_path_factory.mktemp("scheduler_harness"))
    lib.scheduler_walk.argtypes = [ctypes.c_int] * 5 + [ctypes.POINTER(ctypes.c_int32), ctypes.c_longlong]
    lib.scheduler_walk.restype = ctypes.c_longlong
    lib.scheduler_section_heads.argtypes = [ctypes.c_longlong]
    lib.scheduler_section_heads.restype = ctypes.c_int
    return lib


def walk(lib, m_blocks, heads, batch, section, grid) -> np.ndarray:
    """(tiles, 4) rows (block, m_block, head, batch) in each block's visiting order, blocks in order."""
    cap = m_blocks * heads * batch + 1
    out = np.full((cap, 4), -7, np.int32)
    n = lib.scheduler_walk(m_blocks, heads, batch, section, grid, out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                           cap)
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


@pytest.mark.parametrize("m_blocks,heads,batch,section,grid", SHAPES)
def test_every_tile_once_in_round_order(lib, m_blocks, heads, batch, section, grid):
    rows = walk(lib, m_blocks, heads, batch, section, grid)
    total = m_blocks * heads * batch
    assert len(rows) == total
    tiles = {tuple(r[1:]) for r in rows}
    assert len(tiles) == total
    assert all(0 <= m < m_blocks and 0 <= h < heads and 0 <= b < batch for m, h, b in tiles)
    for block in range(grid):
        mine = rows[rows[:, 0] == block]
        for r, (_, m, h, b) in enumerate(mine):
            pos = grid - 1 - block if r % 2 and section >= heads * batch else block
            assert linear_index(m_blocks, heads, batch, section, m, h, b) == r * grid + pos, (block, r)


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


def test_l2_section_heads(lib):
    mib = 1 << 20
    for kv_bytes, want in [(1 * mib, 32), (3 * mib, 8), (8 * mib, 4), (32 * mib, 1), (100 * mib, 1), (256 << 10, 128),
                           (0, 1 << 20), (-5, 1 << 20)]:
        assert lib.scheduler_section_heads(kv_bytes) == want, kv_bytes


def test_l2_probe_section_heads_match_the_kernel(lib):
    """scripts/fa3_l2_probe.py labels each budget with the heads per section by a model of
    tile_scheduler.cuh's l2_section_heads (here at the harness's 32 MiB)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "fa3_l2_probe.py"
    spec = importlib.util.spec_from_file_location("fa3_l2_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    for kv_bytes in (1, 1 << 20, 3 << 20, 4 << 20, 8 << 20, 16 << 20, 33 << 20, 256 << 10):
        assert probe.section_heads(kv_bytes, 32 << 20) == lib.scheduler_section_heads(kv_bytes), kv_bytes
