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


@dataclass(frozen=True)
class Fa2Tiles:
    block_m: int  # query rows per thread block
    block_n: int  # keys per K/V tile in shared memory (two of K and two of V are in flight)
    warps: int  # each warp owns block_m / warps rows (one or two 16-row m-tiles)
    compute_n: int = 0  # keys per S/softmax/PV step within a tile (0 = block_n); bounds S registers


# head dim -> FA2 forward tiles, measured on the H200 (bench/NOTES.md, FA2 v0). Two m-tiles per warp
# (block_m = 128 with 4 warps) let each K/V fragment read from shared memory feed two MMAs; that needs
# O (d/2 fp32 per m-tile) + S (block_n/2 per m-tile) in 255 registers without spills, so block_n
# shrinks as d grows. Every row keeps Q + 2 x (K + V) under 99 KB so the kernels also launch on
# sm_86/sm_89 (larger tiles measured up to 10 % faster on the H200 at d = 256; a per-arch table can
# take them later).
FA2_TILES = {
    32: Fa2Tiles(block_m=128, block_n=64, warps=4),
    64: Fa2Tiles(block_m=128, block_n=64, warps=4),
    96: Fa2Tiles(block_m=128, block_n=32, warps=4),
    128: Fa2Tiles(block_m=128, block_n=32, warps=4),
    192: Fa2Tiles(block_m=64, block_n=32, warps=4),
    256: Fa2Tiles(block_m=64, block_n=32, warps=4),
}


# impl="auto" takes the first implementation in this order that runs on the GPU and supports the call
# (head dim, direction, features): the fastest first.
IMPL_PREFERENCE = ("fa2", "fa1")
