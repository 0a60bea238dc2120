"""The FP8 forward's register and shared-memory layouts (kernels_cu/common/fp8_layout.cuh, built on the host),
checked against the PTX ISA's register fragments: P goes from the S accumulator into the 8-bit A fragments
of O += P V without moving bytes between lanes, and V^T's key order makes every product pair a key of P
with the same key of V. A wrong index here gives a wrong answer on the GPU, which CI (no GPU) would not see.

The layouts (PTX ISA, wgmma):
* fp32 accumulator of m64nN, per thread (lane = 4 g + q4) of warp w: element 4 j + e is row 16 w + g +
  8 (e // 2), column 8 j + 2 q4 + e % 2;
* 8-bit A fragment of m64nNk32, per thread: register r (0..3), byte b (0..3) is row 16 w + g + 8 (r % 2),
  k-element 4 q4 + b + 16 (r // 2).
"""
from __future__ import annotations

import pytest

from host_harness import build

BLOCK_N = 128  # keys per tile of the FP8 forward: k-steps of 32 keys


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    return build("fp8_layout_harness.cpp", "common", tmp_path_factory.mktemp("fp8_layout"))


def accumulator_element(index: int, g: int, q4: int) -> tuple[int, int]:
    j, e = divmod(index, 4)
    return g + 8 * (e // 2), 8 * j + 2 * q4 + e % 2


def a_fragment_element(reg: int, byte: int, g: int, q4: int) -> tuple[int, int]:
    return g + 8 * (reg % 2), 4 * q4 + byte + 16 * (reg // 2)


def test_v_key_order_is_a_permutation_of_16(layout):
    assert sorted(layout.v_key_order(p) for p in range(16)) == list(range(16))


def test_p_fragments_and_v_rows_pair_the_same_keys(layout):
    """For every lane, k-step, register and byte: the accumulator element packed there is in the fragment's
    row, and its key (column of P) is the key V^T holds at the fragment's k position."""
    for g in range(8):
        for q4 in range(4):
            seen = set()
            for kk in range(BLOCK_N // 32):
                for reg in range(4):
                    for byte in range(4):
                        index = layout.p_acc_index(kk, reg, byte)
                        assert 0 <= index < BLOCK_N // 2
                        seen.add(index)
                        row, key = accumulator_element(index, g, q4)
                        frag_row, k = a_fragment_element(reg, byte, g, q4)
                        position = 32 * kk + k  # along V^T's row of BLOCK_N keys
                        v_key = 16 * (position // 16) + layout.v_key_order(position % 16)
                        assert (row, key) == (frag_row, v_key), (g, q4, kk, reg, byte)
            assert seen == set(range(BLOCK_N // 2))  # every element of the thread's S packed exactly once
