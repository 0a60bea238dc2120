"""The FA3 backward's padded LSE / D rows of packed batches (kernels_cu/common/padded_rows.cuh, built on the
host, with cuflash.fa3.varlen_row_pitch): every sequence's 64-row blocks start 16-byte aligned (a TMA load
at an unaligned row faults on the H200), no two sequences' blocks overlap, and all fit the head's row."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import fa3
from host_harness import build

BLOCK = fa3.BWD_BLOCK_M


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return build("padded_rows_harness.cpp", "common", tmp_path_factory.mktemp("padded_rows"))


def _check(rows, lens):
    cu = np.concatenate([[0], np.cumsum(lens)])
    pitch = fa3.varlen_row_pitch(int(cu[-1]), len(lens))
    assert pitch % BLOCK == 0
    spans = []
    for b, n in enumerate(lens):
        start = rows.seq_start(int(cu[b]), b)
        assert start % BLOCK == 0 and start >= cu[b], (lens, b)
        if n:
            spans.append((start, start + -(-n // BLOCK) * BLOCK))  # the blocks the producer loads
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), lens
    assert not spans or spans[-1][1] <= pitch, (lens, spans[-1], pitch)


@pytest.mark.parametrize("lens", [[0], [1, 0, 0, 1], [64, 64, 63, 65, 128], [300, 7, 1024], [1, 1, 1]])
def test_sequences_get_aligned_disjoint_blocks_within_the_pitch(rows, lens):
    _check(rows, lens)


def test_random_batches(rows):
    rng = np.random.default_rng(0)
    for _ in range(300):
        lens = rng.integers(0, 300, size=int(rng.integers(1, 40)))
        lens[rng.random(len(lens)) < 0.2] = 0  # empty sequences
        _check(rows, [int(x) for x in lens])
