"""Tile sizes and implementation choice: short tables, each row with the reason for it.

The kernels take these as compile-time constants (see cuflash/_jit.py); a new kernel family adds a
table here and a line to ``choose_impl``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fa1Tiles:
    block_m: int  # forward: query rows per thread block (16 per warp)
    block_n: int  # forward: keys per K/V tile
    bwd_key_warps: int  # backward: warps that own 16 keys each (BLOCK_N = BLOCK_M = 16 * key_warps)
    bwd_d_split: int  # backward: warps sharing one key group's head dim, so dK/dV fit in registers


# head dim -> tiles. Forward: 4 warps x 16 rows; O is (d/2) fp32 registers per thread, so d = 256
# halves the K/V tile to keep Q + K + V under 99 KB of shared memory (the sm_86/sm_89 limit) and the
# registers under 255. Backward: dK and dV take d fp32 registers per thread when one warp owns the
# whole head dim; at d = 128 that spills (measured: 255 registers + 4 spill bytes), so the head
# dim is split across two warps from d = 128 up, and d = 256 also halves the key block to stay in
# shared memory.
FA1_TILES = {
    32: Fa1Tiles(block_m=64, block_n=64, bwd_key_warps=4, bwd_d_split=1),
    64: Fa1Tiles(block_m=64, block_n=64, bwd_key_warps=4, bwd_d_split=1),
    96: Fa1Tiles(block_m=64, block_n=64, bwd_key_warps=4, bwd_d_split=1),
    128: Fa1Tiles(block_m=64, block_n=64, bwd_key_warps=4, bwd_d_split=2),
    256: Fa1Tiles(block_m=64, block_n=32, bwd_key_warps=2, bwd_d_split=2),
}


def choose_impl(headdim: int, compute_capability: tuple[int, int]) -> str:
    """``impl="auto"``: the best implementation that supports this call on this GPU."""
    if headdim in FA1_TILES and compute_capability >= (8, 0):
        return "fa1"
    raise ValueError(
        f"no cuflash implementation supports head dim {headdim} on sm_{compute_capability[0]}"
        f"{compute_capability[1]}; supported head dims: {sorted(FA1_TILES)} on sm_80 and newer"
    )
