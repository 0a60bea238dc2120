"""Tile sizes and implementation choice: short tables, each row with the reason for it.

The kernels take these as compile-time constants (see cuflash/_jit.py); a new kernel family adds a
table here and its name to ``IMPL_PREFERENCE``. The FA3 calls read them when they plan a layout (cuflash.fa3's
plans, memoised per layout): after editing a table at run time, ``cuflash.clear_plans()``.
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
    block_n: int  # keys per K/V tile in shared memory
    warps: int  # each warp owns block_m / warps rows (one or two 16-row m-tiles)
    compute_n: int = 0  # keys per S/softmax/PV step within a tile (0 = block_n); bounds S registers
    q_in_regs: bool = False  # Q's A fragments stay in registers (block_m / warps x d / 2 bf16 per lane);
    #                          taken only by variants without softcap, ALiBi or dropout (fa2.fwd_tiles)
    kv_stages: int = 2  # K / V buffers each: 2 = a ring; 1 = one each, refilled as freed (compute_n = block_n)


# head dim -> FA2 forward tiles, measured on the H200 (bench/NOTES.md, FA2 v0). Two m-tiles per warp
# (block_m = 128 with 4 warps) let each K/V fragment read from shared memory feed two MMAs; that needs
# O (d/2 fp32 per m-tile) + S (block_n/2 per m-tile) in 255 registers without spills, so block_n
# shrinks as d grows. From d = 128 one m-tile per warp with wider key tiles and one K / V buffer each
# measured faster (rows below). Every row keeps Q + K/V buffers under 99 KB so the kernels also launch on
# sm_86/sm_89. d <= 64 keeps Q in registers (16-32 per lane next to 64 for S and O: no spills with
# NVRTC 13.0 / 13.5); from d = 128 O alone is 128 registers and Q would spill. Static analysis and the
# rejected candidates (spills): bench/NOTES.md, "FA2 forward: static analysis".
FA2_TILES = {
    32: Fa2Tiles(block_m=128, block_n=64, warps=4, q_in_regs=True),
    # 128 keys per tile loaded, computed 64 at a time: half the barriers and copy setup of 64-key tiles;
    # H200 (scripts/tune_fa2.py, session 3): 303-317 TF/s vs 296-310 for 128 x 64, torch flash 297-309.
    64: Fa2Tiles(block_m=128, block_n=128, warps=4, compute_n=64, q_in_regs=True),
    96: Fa2Tiles(block_m=128, block_n=32, warps=4),
    # One K and one V buffer of 128 keys (80 KB, 242 registers: two blocks per SM), one m-tile per warp.
    # H200 (scripts/tune_fa2.py, session 11, TF/s at N = 2k / 8k, x torch flash in the same run): 320 / 327
    # (0.92 / 0.91), causal 273 / 316 (0.96 / 0.99), against the former 128 x 64 tiles computed 32 keys at a
    # time in a two-stage ring, 309 / 321 (0.89), causal 254 / 295 (0.89 / 0.92). On sm_90: FA2_TILES_SM90.
    128: Fa2Tiles(block_m=64, block_n=128, warps=4, kv_stages=1),
    192: Fa2Tiles(block_m=64, block_n=32, warps=4),
    # One K and one V buffer (FlashAttention-2's schedule, kv_stages=1) let 64-key tiles keep two blocks per
    # SM (98 KB; a ring of two would take 160 KB, one block): half the iterations, copies and barriers per
    # key of the former 64 x 32 ring. H200 (scripts/tune_fa2.py, session 11, TF/s at N = 2k / 8k): 323 / 336
    # (1.01 / 1.03 x torch flash, which runs this tile), causal 277 / 307 (1.03 / 1.06), against 64 x 32's
    # 275 / 280, causal 236 / 262 (0.85-0.91).
    256: Fa2Tiles(block_m=64, block_n=64, warps=4, kv_stages=1),
}
# head dim -> the FA2 forward's tiles on sm_90 for calls without dropout (fa2.fwd_tiles), where they differ
# from FA2_TILES. d = 128: one K and one V buffer of 64 keys, two m-tiles (32 rows) per warp -- torch flash's
# own tile (64 KB, 255 registers: two blocks per SM; the copies' per-thread offsets are read from shared
# memory, fa2/fwd.cu, or ptxas spills). H200 (scripts/tune_fa2.py, session 21, TF/s at N = 2k / 8k, x torch
# flash in the same run): 363 / 382 (1.05 / 1.06), causal 300 / 339 (1.05 / 1.10), against FA2_TILES' 64 x
# 128 one m-tile per warp 321 / 310-328 (0.92 / 0.86-0.91), causal 275 / 313 (0.96 / 1.01). Not elsewhere:
# NVRTC 13.5 spills it for sm_80 / sm_86 (8-64 bytes), and with dropout (the Philox state) for sm_90 too.
FA2_TILES_SM90 = {
    128: Fa2Tiles(block_m=128, block_n=64, warps=4, kv_stages=1),
}


@dataclass(frozen=True)
class Fa2BwdTiles:
    block_m: int  # query rows per step
    block_n: int  # keys per thread block (dK, dV for them live in registers)
    warps: int
    q_stages: int  # Q / dO tiles in flight (2 = the next block streams in during this one)
    warps_s_m: int  # warp rows of the S / dP layout (BLOCK_M x BLOCK_N); the rest split columns
    warps_kv_n: int  # warp rows of the dK / dV layout (BLOCK_N x d)
    warps_q_m: int  # warp rows of the dQ layout (BLOCK_M x d)
    s_split: int = 1  # column chunks of each warp's S / dP tile (fewer live registers next to dK, dV)
    q_split: int = 1  # column chunks of each warp's dQ tile


# head dim -> FA2 backward tiles (compile-checked: no spills in any variant with NVRTC 13.0 and 13.5; speed
# not yet tuned). 8 warps. d <= 64: BLOCK_M x BLOCK_N = 64 x 128, S/dP split 2 x 4 over warps (each
# 32 x 32), dK/dV (128 x d) split 4 x 2; S/dP in two column chunks where registers are tight. d = 96, 128
# and 192 take BLOCK_N = 64: at 128 with dK + dV at 32 x 64 per warp (128 registers) ptxas spilled in some
# variants, and at 96 NVRTC 13.0 spilled up to 120 bytes with BLOCK_N = 128 (13.5 did not). d = 256 takes
# BLOCK_N = 32 (dK/dV 16 x 64 per warp) and one Q/dO stage: 106 KB of shared memory, so it also runs
# on sm_86/sm_89-class limits only at d <= 64 (the rest needs the 163 KB+ of sm_80/sm_90).
FA2_BWD_TILES = {
    32: Fa2BwdTiles(64, 128, 8, 2, warps_s_m=2, warps_kv_n=4, warps_q_m=4),
    64: Fa2BwdTiles(64, 128, 8, 2, warps_s_m=2, warps_kv_n=4, warps_q_m=2, s_split=2),
    96: Fa2BwdTiles(64, 64, 8, 2, warps_s_m=2, warps_kv_n=4, warps_q_m=4),
    128: Fa2BwdTiles(64, 64, 8, 2, warps_s_m=2, warps_kv_n=4, warps_q_m=2),
    192: Fa2BwdTiles(64, 64, 8, 2, warps_s_m=2, warps_kv_n=4, warps_q_m=4, q_split=2),
    256: Fa2BwdTiles(64, 32, 8, 1, warps_s_m=4, warps_kv_n=2, warps_q_m=2, q_split=2),
}

# Overrides for the variants without softcap, ALiBi or dropout (those features cost 10-30 registers; the
# launcher sizes the grid by the variant's own tiles): at d <= 64 the plain variant computes each warp's
# 32 x 32 S / dP tile in one chunk (0.156 instead of 0.181 bytes of shared memory per MAC: bench/NOTES.md,
# "FA2 backward: static analysis"); 232 registers with NVRTC 13.5, 226 with 13.0, no spills.
FA2_BWD_TILES_PLAIN = {
    64: Fa2BwdTiles(64, 128, 8, 2, warps_s_m=2, warps_kv_n=4, warps_q_m=2),
}
# ... and on sm_90 (these layouts sit at 248-255 registers; ptxas for sm_80 spills 16-72 bytes of them with
# NVRTC 13.0 or 13.5, for sm_90a neither does): FlashAttention-2's tiles or wider, more keys per block than
# the general rows, so fewer Q / dO passes and dQ atomics per key and larger warp tiles per ldmatrix. d = 64:
# 64 x 256 (half the Q / dO passes of the other d = 64 rows; dK / dV 64 x 32 per warp, dQ with 4 warp rows),
# S / dP in 2 chunks. d = 128: 64 x 128, FlashAttention-2's layout (dQ 32 x 32 per warp in one chunk: it
# spilled 8 bytes until session 12's precomputed ldmatrix addresses, then measured +2 % over dQ in 4 warp
# rows x 2 column chunks at 2k and 8k, causal and not). d = 256: 64 x 64 with two
# Q / dO stages (210 KB: the next Q / dO tiles stream in under this block), S / dP in one 32 x 16 chunk
# per warp (warps_s_m = 2), dQ in 2 column chunks. With ALiBi or dropout alone NVRTC 13.0 spills 24-40
# bytes at d = 256, so the feature variants keep the general rows. H200 (scripts/tune_fa2_bwd.py), N = 2k /
# 8k, of torch flash: d = 64 0.79-0.83 -> 0.84-0.92 (session 9; FlashAttention-2's 128 x 128 0.87-0.91),
# d = 128 0.60 -> 0.86-0.87 (session 8), d = 256 0.48 -> 0.71-0.76 (session 8) -> 0.83-0.86 (session 9);
# with the ldmatrix addresses precomputed (session 12, backward suite at N >= 2k): d = 64 0.95-0.99, d = 128
# 0.91-0.94, d = 256 0.84-0.87.
# Rejected: d = 256 with S / dP in one 16 x 32 chunk (+5 % in session 9 with 48 bytes spilled; spill-free
# since session 12 but within 1 % of this row), d = 64 with 128 x 128 (0.89-0.93 of torch flash against
# this row's 0.95-0.99, session 12).
FA2_BWD_TILES_PLAIN_SM90 = {
    64: Fa2BwdTiles(64, 256, 8, 2, warps_s_m=2, warps_kv_n=4, warps_q_m=4, s_split=2, q_split=1),
    128: Fa2BwdTiles(64, 128, 8, 2, warps_s_m=2, warps_kv_n=4, warps_q_m=2, s_split=1, q_split=1),
    256: Fa2BwdTiles(64, 64, 8, 2, warps_s_m=2, warps_kv_n=2, warps_q_m=4, s_split=1, q_split=2),
}


# ... and on GPUs that give a block at most 99 KB of shared memory (sm_86, sm_89: _device.ARCH_SMEM_PER_BLOCK),
# where the rows above do not fit (d = 128 113 KB, d = 192 161 KB, d = 256 107 KB): one Q / dO stage at
# d = 128 (80.5 KB), blocks of 32 keys at d = 192 (80.5 KB), of 16 keys with 4 warps at d = 256 (84.5 KB;
# 8 warps cannot split a 64 x 16 S tile into 16 x 16 blocks). fa2.bwd_tiles takes them where the device's
# limit (or the arch's, for the compile check) is below the row's need. Compile-checked for sm_86 (no
# spills in any feature variant); not timed: no such GPU here.
FA2_BWD_TILES_SMALL_SMEM = {
    128: Fa2BwdTiles(64, 64, 8, 1, warps_s_m=2, warps_kv_n=4, warps_q_m=2),
    192: Fa2BwdTiles(64, 32, 8, 1, warps_s_m=4, warps_kv_n=2, warps_q_m=4, q_split=2),
    256: Fa2BwdTiles(64, 16, 4, 1, warps_s_m=4, warps_kv_n=1, warps_q_m=4, q_split=4),
}


@dataclass(frozen=True)
class Fa3Tiles:
    block_n: int  # keys per K/V tile
    stages: int  # K/V tiles in flight in the shared-memory ring
    consumers: int = 2  # consumer warpgroups of 64 query rows (BLOCK_M = 64 x consumers); 3 get 160 registers
    # within a consumer warpgroup, S_n = Q K_n^T runs under P_{n-1} V_{n-1} (kernels_cu/fa3/fwd.cu)
    intra_wg_overlap: bool = True
    # the two consumer warpgroups take turns issuing their GEMMs (named barriers; kernels_cu/fa3/fwd.cu)
    pingpong: bool = True
    # the softmax computes one group of 8 key columns in exp2_emu on the FMA pipe instead of the SFU
    # (common/poly_exp2.cuh); 0 = none
    exp2_emu: int = 0
    # a tile's exponentials from the running max, its max found alongside (kernels_cu/fa3/fwd.cu
    # SPECULATIVE_MAX; S recomputed in the rare tile where a row's max rises past 2^8)
    speculative_max: bool = False
    # FP8 with the overlap: P_{n-1} through shared memory and O accumulated by the P V wgmma itself
    # (kernels_cu/fa3/fwd.cu P_SMEM) instead of P in registers and a fresh accumulator per tile
    p_smem: bool = False
    # without the pingpong, a compiler fence where a consumer would wait for its turn (fwd.cu TURN_FENCE: how
    # ptxas allocates registers at the register file's edge)
    turn_fence: bool = False
    # the persistent tile order's divisions by the host's FastDivmods (common/tile_scheduler.cuh) instead of
    # `/` and `%` (fwd.cu FAST_TILE_DIV; FP8 variants never take them: their loop had no uniform register
    # to spare)
    fast_tile_div: bool = True
    # Q buffers (fwd.cu Q_STAGES): with two the producer loads the next tile's Q and first K / V tiles while
    # this tile runs, not once its last S GEMM has read Q
    q_stages: int = 1


# head dim -> FA3 forward tiles. S is 64 x block_n fp32 per consumer warpgroup (block_n / 2 registers per
# thread) next to O (d / 2) and P_{n-1} (block_n / 4, packed): block_n = 128 up to d = 128, 64 at d = 192
# and 256 (O alone is 96-128 registers). Two stages: Q + 2 x (K + V) is 80 KB at d = 64, 160 KB at d = 96
# (stored as 128) and 128, 144 KB at d = 192, 192 KB at d = 256.
#
# d = 128 and the 64-key tiles of d = 256 run without the pingpong: both consumers' softmaxes then run at
# once and hide each other's latency, as FP8's did (session 10). Measured on the H200 (scripts/ab_probe.py
# bf16-pingpong, interleaved rounds, TF/s, pingpong -> none, A/A in brackets): d = 128 N = 8k 596 -> 605
# (594), causal 545 -> 553 (544), 2k 506 -> 537 (510), causal 413 -> 414; d = 256 causal 8k 598 -> 615
# (598), 2k 469 -> 469. d = 64 moved both ways within its spread and keeps it; d = 256's 80-key tiles spill
# 40 bytes without it and keep it too.
#
# d = 128 takes the speculative max (a tile's exponentials from the running max, its max found alongside;
# fwd.cu SPECULATIVE_MAX): ab_probe fwd-spec-d128 (H200, 7 rounds, TF/s, after the max -> speculative) N = 2k
# 591 -> 618, causal 501 -> 522; 4k 636 -> 630, causal 554 -> 562; 8k 611 -> 607 (3 rounds). d = 64 and 256
# lost 1-5 % at 8k with it, FP8 d = 128's 256-key tiles 2-4 % at 8k / 16k (session 26).
FA3_TILES = {
    64: Fa3Tiles(block_n=128, stages=2),
    96: Fa3Tiles(block_n=128, stages=2),
    128: Fa3Tiles(block_n=128, stages=2, pingpong=False, speculative_max=True),
    192: Fa3Tiles(block_n=64, stages=2),
    256: Fa3Tiles(block_n=64, stages=2, pingpong=False),
}
# Calls without a mask bounding the rows (not causal, no window) at these head dims take these tiles
# instead: fewer, longer iterations per tile, so the per-iteration row reductions, barriers and waits count
# less (causal keeps the narrower ones: more of its tiles cross the diagonal). d = 64: 192 keys
# (FlashAttention-3 runs them with three consumer warpgroups; here two), S 96 + P 48 + O 32 registers,
# 130 KB. d = 256: 80 keys (FlashAttention-3's width), S 40 + P 20 + O 128 registers, 224 KB (of 227: no
# room for the TMA-store O staging). No spills under NVRTC 13.0 and 13.5. Measured on the H200
# (scripts/fa3_tiles_probe.py, TF/s, against the FA3_TILES row in the same process): d = 64 N = 2k 406 ->
# 421, 8k 441 -> 450; d = 256 2k 645 -> 661, 8k 760 -> 781. Causal with 80 keys at d = 256 measured
# 493 -> 487 (2k), 701 -> 698 (8k), so it keeps 64. Tried and rejected: 176 keys at d = 128 (FlashAttention-3's
# width there), 609 -> 573 at 2k and 679 -> 670 at 8k (no room left for the O staging, and a partly masked
# last tile).
FA3_TILES_UNMASKED = {
    64: Fa3Tiles(block_n=192, stages=2),
    256: Fa3Tiles(block_n=80, stages=2),
}
# Three consumer warpgroups (BLOCK_M = 192, 160 registers each, FlashAttention-3's arrangement at d = 64)
# where the softmax of a tile takes longer than its GEMMs: two warpgroups' softmaxes then run beside one's
# GEMMs instead of one. Taken before the tables above, causal or not, except with softcap or GQA packing
# (S 64 + P 32 + O 32 registers at 128 keys: the plain and varlen variants compile without spills under
# NVRTC 13.5; softcap spills 32 bytes, packing 72; 192 keys make ptxas serialise the wgmma). H200
# (scripts/fa3_tiles_probe.py, session 8; two warpgroups' best -> three): non-causal N = 2k 414 -> 461
# TF/s, 8k 477 -> 514 (cuDNN 466, 487); causal 8k 426 -> 443, but 2k 348 -> 338 (192-row tiles cross the
# diagonal more: short causal rows may want two).
# Both d = 64 rows (this and FA3_TILES_SHORT_MASKED below) hold two Q buffers (q_stages=2): the producer loads
# the next tile's Q and first K / V while this tile runs. H200 (scripts/ab_probe.py fwd-q-stages, session 33,
# 5 rounds, TF/s, one -> two): N = 512 389 -> 411, causal 241 -> 248; 1k 437 -> 447, causal 311 -> 321; causal
# 2k 400 -> 413; 4k-16k level to +1 % (486 / 482 at 4k, 507 / 503 at 8k, 512 / 510 at 16k). d = 128 level
# (498 / 498 at 512, 625 / 628 at 2k): its tiles are long enough to hide the next Q behind one buffer.
FA3_TILES_3WG = {
    64: Fa3Tiles(block_n=128, stages=2, consumers=3, q_stages=2),
}
# ... except where a mask bounds rows shorter than this: causal d = 64 on the H200 (short causal rows:
# fewer, taller tiles, more of each on the diagonal, and fewer tiles than SMs at 1k). Session 8 (bench
# suite, two warpgroups -> three, TF/s): N = 512 211 -> 188, 1k 286 -> 249, 2k 357 -> 343, 4k 405 -> 400,
# 8k 438 -> 455, 16k 441 -> 467. Since the modelled tile order (cuflash/tile_order.py) three win from 2k
# (ab_probe fwd-d64-causal, session 17, same process): 1k 268 -> 232, 2k 345 -> 371, 4k 391 -> 438. With
# the spare rows before row 0 (tile_order.row_shift) three win from 1k (ab_probe fwd-row-shift, session 18:
# 1k two 278, three 288, three without the shift 247).
FA3_3WG_MIN_MASKED_SEQLEN = 1024
# ... and those short masked rows at d = 64 take three K / V stages (2 Q + 3 x (K + V) + the O staging, 146 KB):
# tiles of 1-4 K tiles each, so the next tile's first K / V load ahead through more of the last one. H200
# (session 32's A/B, bench/NOTES.md; 3 rounds, TF/s, two stages -> three): causal N = 512 237 -> 240; and two Q
# buffers (above).
FA3_TILES_SHORT_MASKED = {
    64: Fa3Tiles(block_n=128, stages=3, q_stages=2),
}
# ... and bf16 / fp16 calls of at least FA3_LONG_MIN_SEQLEN query rows (causal or not) at d = 128 divide
# the persistent tile order by `/` and `%` instead of the host's FastDivmods (Fa3Tiles.fast_tile_div): the
# same loop, scheduled differently by ptxas. H200 (session 33, scripts/ab_probe.py fwd-d128-div, 5 rounds,
# TF/s, FastDivmods -> plain, A/A in brackets): 16k 599 -> 611 (595), causal 573 -> 583 (574); 8k 596 -> 599
# (595), causal 548 -> 555 (552); 2k 584 -> 585, causal 502 -> 498; but 512 502 -> 496, causal 329 -> 319,
# where the short rows keep the FastDivmods of FA3_TILES.
FA3_TILES_LONG = {
    128: Fa3Tiles(block_n=128, stages=2, pingpong=False, speculative_max=True, fast_tile_div=False),
}
FA3_LONG_MIN_SEQLEN = 4096

# The FA3 forward's persistent scheduler runs the (head, batch) pairs in L2 sections: as many pairs (a power
# of two) as fit their K and V in a budget of KiB run together, so the blocks of a round share K/V in L2
# (kernels_cu/common/tile_scheduler.cuh); cuflash/tile_order.py picks the section within the budget and the
# deal. Head dim -> ((longest seqlen_k, KiB), ...), the first row whose length the call's keys do not pass,
# FA3_L2_SECTION_KIB_LONG beyond; FP8 forwards take FA3_FP8_L2_SECTION_KIB. Measured on the H200
# (scripts/fa3_l2_probe.py, interleaved rounds, TF/s; causal d = 256 and d = 128 at 4k took one section of
# every pair then, whatever the budget):
#   session 10: 4, 8, 16 and 32 MiB (1 to 16 heads per section) within 1-2 % of each other at d = 64 / 128 /
#   256, N = 8k / 16k, causal and not.
#   session 16, 32 MiB -> 2 MiB at N = 2k / 4k: d = 128 574 -> 636 / 588 -> 620, causal 486 -> 526 / 515 ->
#   534; d = 256 631 -> 685 / 651 -> 722, causal level (457 / 592). ncu at d = 128, N = 2k: 623 MB read
#   from device memory with 32 MiB (cuDNN: 201, the inputs once): the K/V of the 32 heads a round touched
#   did not stay in L2. At d = 128 the prefill suite with 2 MiB everywhere lost at short rows (N = 512
#   0.86 -> 0.70 of cuDNN, causal 1k 0.90 -> 0.74) while d = 256 gained there (causal 512 0.68 -> 0.84, 1k
#   0.74 -> 0.87, non-causal 512 0.76 -> 0.83), and the probe read d = 128 N = 8k at 649 with 32 MiB against
#   614-626 with 2. Causal d = 128 2k was 380 at 8 MiB and 450 at 16 MiB with the plain deal (sections of
#   about one round of heavy-first tiles gave the same blocks the heavy tiles every round: what
#   tile_order's model now avoids). d = 64 (three consumer warpgroups,
#   192-row tiles) goes the other way: 2k 459 at 32 MiB, 447 at 8, 381 at 2; causal level. d = 96 / 192
#   follow d = 128 / 256 (not measured).
#   session 31, N = 512 / 1k (the short cells' 32 MiB rows were chosen in session 16, when the host path, not
#   the kernel, timed those calls), TF/s at 1 / 2 / 4 / 8 / 32 MiB (cuDNN): d = 128 512 488 / 483 / 480 /
#   479 / 455 (537), causal 319 / 314 / 308 / 307 / 299 (344); 1k 570 / 574 / 574 / 566 / 527 (608), causal
#   438 / 435 / 418 / 420 / 420 (438) -- ncu at 512 read K / V ~1.6 times from device memory with 32 MiB (128
#   pairs: a pair's four query blocks run in four different rounds). d = 64 512 333 / 336 / 343 / 341 / 342,
#   causal 213 / 213 / 215 / 218 / 210; 1k 379 / 398 / 399 / 402 / 402, causal 297 / 302 / 304 / 304 / 300.
FA3_L2_SECTION_KIB = {
    64: ((1024, 8 * 1024),),
    96: ((512, 1024), (4096, 2 * 1024)),
    128: ((512, 1024), (4096, 2 * 1024)),
    192: ((1 << 30, 2 * 1024),),
    256: ((1 << 30, 2 * 1024),),
}
FA3_L2_SECTION_KIB_LONG = 32 * 1024  # and d = 64 beyond 1k
FA3_FP8_L2_SECTION_KIB = 32 * 1024  # (not measured below 32 MiB)
# ... except that with a mask and fewer pairs than half the grid tile_order.choose may take one section of
# every pair where its balance model rates that better; not where the blocks would then stream more than this
# many bytes of K/V tiles at once (tile_order.wide_section_ok: min(pairs, grid) x one K and V tile). H200,
# causal, scripts/ab_probe.py fwd-sections / fwd-all-pairs-gain (session 22, TF/s, every pair / one pair per
# section with the serpentine): d = 128 N = 4k (64 pairs x 64 KB = 4 MiB) 561 / 607 and 544 / 566 in a second
# run; at 2 MiB one section of every pair held its own: d = 128 8k 614 / 619 and 593 / 581, d = 256 4k 640 /
# 656 and 596 / 588, d = 64 8k / 16k (2 / 1 MiB) 482 / 479 and 508 / 495 against 16 and 8 pairs per section.
FA3_WIDE_SECTION_MAX_STREAM_BYTES = 3 << 20
# The FA3 forward's stream-K tail (cuflash/tile_order.py tail_split, kernels_cu/common/tile_scheduler.cuh): for
# calls without a mask, the part-empty last round of the persistent grid (2048 tiles on 132 SMs at every
# benchmark shape of d = 128, 1024 at d = 256: 3 % of the blocks' time idle) is cut over the keys into one
# range of K tiles per block, a tile's pieces merged by the block holding its last. Taken where the model's
# busiest block gains more than FA3_TAIL_MIN_GAIN; a merge is modelled as FA3_TAIL_MERGE_COST K tiles per
# partial (reading 64 KB per warpgroup from L2 after a flag). H200 (scripts/ab_probe.py fwd-tail, session
# 23, 9 interleaved rounds, TF/s tail / none, model's gain in brackets): d = 64 2k 441 / 433 (2.0 %), 4k 467
# / 454 (2.5 %), 8k 490 / 489 (0.5 %); d = 128 2k 559 / 561 (1.8 %), 4k 603 / 591 (2.5 %), 8k 604 / 592
# (2.8 %); d = 256 2k 648 / 670 (1.9 %), 4k 682 / 673 (2.4 %), 8k 708 / 693 (2.6 %). The model runs
# 0.5-1 point high where the tiles are long and missed the 2k cells of d >= 128 by 2-5 points then (a piece's
# fixed costs weighed more than "one K tile"). Since session 32's per-tile trims the 2k cells gain as modelled
# (ab_probe fwd-tail-short, session 33, 7 rounds, TF/s none / tail, model's gain in brackets): d = 64 2k 455 /
# 464 (2.0 %), d = 128 2k 624 / 635 (1.8 %), d = 256 2k 687 / 688 (1.9 %), hence a 1.5 % bar: the tail runs from
# 2k on at the benchmark shapes, not at 1k (0.7-1.2 % modelled).
FA3_TAIL_SPLIT = True
FA3_TAIL_MIN_GAIN = 0.015
FA3_TAIL_MERGE_COST = 0.5
FA3_TAIL_MAX_PIECES = 4  # (at most this many pieces per tile: a tile's merge reads its partials one by one)


def fa3_l2_section_kib(headdim: int, seqlen_k: int) -> int:
    """The bf16 / fp16 FA3 forward's L2 section budget (FA3_L2_SECTION_KIB) for keys of this length."""
    for longest, kib in FA3_L2_SECTION_KIB.get(headdim, ()):
        if seqlen_k <= longest:
            return kib
    return FA3_L2_SECTION_KIB_LONG


# head dim -> FA3 FP8 forward tiles (e4m3 Q/K/V, kernels_cu/fa3/fwd.cu with CUFLASH_FP8). block_n is 128:
# a V^T tile row of 128 keys is exactly one 128-byte swizzle atom. Tiles are half the bytes of bf16's, so
# two stages are 80 KB at d = 64 (Q and K rows padded to 128 bytes) and 128, 160 KB at d = 256. At
# d = 256, O (128 registers per thread), S (64) and P (16) do not fit a consumer's 240 together: P V
# completes before S is issued there (no intra-warpgroup overlap; the pingpong between the two consumer
# warpgroups remains), which measured 1019-1124 TF/s non-causal at N = 8k-16k on the H200.
# No speculative max (fwd.cu SPECULATIVE_MAX) for FP8: at d = 64 it gained 2-5 % (H200, scripts/ab_probe.py
# fp8-spec-long, session 27: N = 2k 393 -> 408, causal 322 -> 330, 8k 440 -> 462, causal 421 -> 435; d = 128
# lost 1-2 %), but a row that keeps an old max rounds its P to e4m3 on a grid shifted by a fraction of a
# binade from the exact max's, so its rounding errors no longer follow the reference's model: fuzz seed
# 909998490 (d = 64, 128 x 512, per-tensor descales) came out 6.95e-2 from the exact output against 4.83e-2
# allowed, and within it after the max (session 30).
FA3_FP8_TILES = {
    64: Fa3Tiles(block_n=128, stages=2),
    128: Fa3Tiles(block_n=128, stages=2),
    256: Fa3Tiles(block_n=128, stages=2, intra_wg_overlap=False),
}
# FP8 calls with at least FA3_FP8_LONG_MIN_SEQLEN query rows take these tiles where the head dim has a row.
# d = 128 without pingpong: both consumers' softmaxes run at once, each hiding the other's latency (ncu,
# session 10: with pingpong one warp per sub-partition runs its softmax alone, latency-bound). Measured on
# the H200 (scripts/ab_probe.py fp8-d128, interleaved: 780 -> 804 TF/s at N = 8k, A/A 772-782; the fp8
# suite: 2k-16k +3-6 %, e.g. 8k 772 -> 796, 16k 778 -> 825, causal 8k 732 -> 764). Below 2k the same run
# measured 1k at 441 / 227 causal against session 9's 551 / 381 with pingpong, so short rows kept it; but
# session 11 measured 1k with the pingpong at 415 / 374: the 1k drop was not the pingpong, and the
# threshold is not measured either way.
FA3_FP8_TILES_LONG = {
    128: Fa3Tiles(block_n=128, stages=2, pingpong=False),
}
FA3_FP8_LONG_MIN_SEQLEN = 2048
# FP8 calls with long rows whose K/V descale blocks are whole multiples of these tiles' keys take them (the
# kernel reads one K and one V descale per tile): d = 128 on 256-key tiles without the intra-warpgroup
# overlap (S 128 + O 64 + P 32 registers; P V through S's; measured first with the pingpong, below without):
# a tile's fixed costs (the row maxima's chains and quad shuffles, the GEMM waits, O's FFMA) spread over
# twice the keys; FlashAttention-3
# uses 224. Measured on the H200 (scripts/ab_probe.py fp8-d128-keys / fp8-d128-blocks, interleaved rounds,
# TF/s, FA3_FP8_TILES_LONG's 128-key tiles -> these): N = 8k 797 -> 897, causal 771 -> 810, 16k 808 -> 881,
# causal 760 -> 823; another run 8k 793 -> 863 (K / V blocks of 256), 865 per tensor. A tile that spans two
# descale blocks (blocks of 128 keys) would need a K descale per half (cheap) and V's ratio in the second
# half's exponent: that version measured 848 at 8k but made ptxas serialise the wgmma (too few registers,
# NVRTC 13.5), so blocks of 128 keep the 128-key tiles.
# d = 64 on 256-key tiles too, with neither the intra-warpgroup overlap nor the pingpong (both consumers'
# softmaxes at once; with the pingpong ptxas serialises the wgmma under NVRTC 13.0, with the overlap it spills
# 48 bytes): H200 (scripts/ab_probe.py fp8-d64-wide, session 28, 3 rounds, TF/s, the 128-key tiles of
# FA3_FP8_TILES -> these, blocks of 256): N = 2k 413 -> 462, causal 332 -> 353, 8k 464 -> 572, causal 442 ->
# 516; with the overlap and pingpong (spilling) 404 / 303 / 454 / 417.
# d = 256 on 128-key tiles with the intra-warpgroup overlap, P_{n-1} through shared memory and O accumulated
# by the P V wgmma itself (fwd.cu P_SMEM: S 64 + O 128 registers, which with P in registers and a fresh
# accumulator did not fit), no pingpong. H200 (scripts/ab_probe.py fp8-p-smem, session 29, 3 rounds, TF/s,
# FA3_FP8_TILES[256] -> these, descale blocks of 256): N = 2k 885 -> 935, causal 730 -> 759, 8k 1018 -> 1151,
# causal 984 -> 1071, 16k 999 -> 1138, causal 938 -> 1131 (with the pingpong 0-3 % less). The same at d = 128
# (256 keys) measured level with these tables (no pingpong 855 / 807 / 873 against 859 / 797 / 888 at 8k,
# causal 8k, 16k) and at d = 64 8-20 % slower: not taken there.
# d = 128's 256-key tiles without the pingpong since session 31: both consumers' exponentials then reach the
# SFU together (as cuDNN's FP8 kernel's do: its MUFU stalls are "mio", the SFU's queue full, ours with the
# pingpong "wait", one warp paced at the SFU's rate). NVRTC 13.5 serialises that variant's wgmma unless a
# compiler fence sits where the turn would be taken (turn_fence; clean under 13.0 either way). H200
# (scripts/ab_probe.py fp8-wide-pingpong, 3 rounds, TF/s, pingpong / none / none + fence): N = 2k 722 / 755 /
# 752, causal 539 / 559 / 559; 8k 853 / 889 / 873, causal 821 / 830 / 849; 16k 873 / 904 / 888, causal 785 /
# 843 / 825 (an earlier call, pingpong / none: 8k 861 / 915, 16k 868 / 907). The fence on d = 64's and 256's
# tables' tiles lost 1-10 % (d = 64 8k 571 -> 514): they keep none.
FA3_FP8_TILES_WIDE = {
    64: Fa3Tiles(block_n=256, stages=2, intra_wg_overlap=False, pingpong=False),
    128: Fa3Tiles(block_n=256, stages=2, intra_wg_overlap=False, pingpong=False, turn_fence=True),
    256: Fa3Tiles(block_n=128, stages=2, intra_wg_overlap=True, pingpong=False, p_smem=True),
}
# P_SMEM tiles keep O in the FP8 wgmma's accumulator, which keeps ~14 bits of what it adds to, so O loses
# ~2^-15 of itself at every rescale (each K / V descale block: O moves to the next V descale's units). Rows
# with more keys than this take the fresh-accumulator tiles instead (fwd_tiles' many_keys). H200 (ab_probe
# fp8-p-smem-decay, session 29: each row's weight on one key near the start, blocks of 256; max |out - ref| /
# max |ref|, P_SMEM against the fresh accumulator): d = 256 8k 3.5e-3 / 2.1e-3, 32k 6.3e-3 / 1.9e-3, 128k
# 2.3e-2 / 2.1e-3, 1M 0.16 / 1.7e-3 (d = 64 / 128 alike); per-tensor descales no different from the fresh
# accumulator's.
FA3_FP8_P_SMEM_MAX_SEQLEN_K = 16384

FA3_FORWARD_TABLES = (FA3_TILES, FA3_TILES_UNMASKED, FA3_TILES_3WG, FA3_TILES_SHORT_MASKED, FA3_TILES_LONG,
                      FA3_FP8_TILES, FA3_FP8_TILES_LONG, FA3_FP8_TILES_WIDE)


# Deterministic FA3 backward without a mask: the rotated dQ order (kernels_cu/common/dq_order.cuh) when a
# head's K blocks number at most this fraction of the SMs. Its blocks may wait for blocks of their head
# launched after them, so all of a head's must be resident together; the fraction leaves the rest for
# kernels running beside the backward (NCCL's hold SMs for the whole of a step, typically up to 32). At
# 132 SMs: up to 66 K blocks, N <= 4k at d = 192 / 256 (64 keys per block), N <= 8k below (128). Measured
# on the H200 (deterministic / default TF/s, not causal): d = 256 N = 2k 0.70 -> 0.85, 4k 0.70 -> 0.84
# (0.25 of the SMs left 4k out); d = 128 8k 0.97 either way.
FA3_BWD_ROTATE_SM_FRACTION = 0.5
# Deterministic FA3 backward without a mask, in the descending order: dQ accumulator planes (cuflash/fa3.py
# bwd_dq_accumulators) until planes x batch x KV heads reaches FA3_DET_DQ_GRID_HEADS. Each Q block's adds are a
# chain of hand-offs of about a step each; with many (batch, KV head) columns in the grid other heads' work
# hides it (session 21, d = 256 N = 8k, deterministic / default by batch x heads: 1: 0.51, 2: 0.62, 4: 0.72,
# 16: 0.875), with few it is most of the time. Planes cost their zeroing and reading (a plane is the size of
# dQ in fp32), so at most FA3_DET_MAX_DQ_ACCUMULATORS of them and FA3_DET_DQ_ACCUM_MAX_BYTES in all. H200
# (scripts/ab_probe.py bwd-det-heads, session 23, d = 256 N = 8k, TF/s, default / planes / one plane):
# non-causal 1 head 359 / 303 (8 planes) / 210, 2 heads 454 / 343 (8) / 284, 4 heads 460 / 367 (4) / 331,
# 16 heads 434 / 380 / 377 (1: the same kernel); causal 1 head 216 / 166 / 199, 2 heads 441 / 167 / 247,
# 4 heads 451 / 227 / 309 -- under a causal mask the planes lost 15-32 %, so they are for unmasked calls only.
FA3_DET_DQ_GRID_HEADS = 16
FA3_DET_MAX_DQ_ACCUMULATORS = 8
FA3_DET_DQ_ACCUM_MAX_BYTES = 1 << 30
# head dim -> query rows per step of the FA3 backward (fa3/bwd.cu) without a softcap (with one: 64, its
# registers). FlashAttention-3's hopper/ backward runs d = 128 on 80 x 128 tiles with dQ computed
# transposed (without a mask): each step carries 25 % more rows over the same barriers, LSE reads and dQ
# hand-offs. At d = 96 / 128, 80 rows leave shared memory for one staged dQ tile per consumer (two at
# d = 64); 96 rows do not fit the registers there (S^T, dP^T 48 + dK, dV 64 each). H200
# (scripts/ab_probe.py bwd-rows, session 15, TF/s, not causal / causal): d = 128, 64 -> 80 rows: N = 2k
# 461 -> 458 / 361 -> 357, 4k 479 -> 497 / 418 -> 421, 8k 474 -> 513 / 457 -> 475, 16k 500 -> 527 /
# 489 -> 504; d = 64, 64 -> 80 -> 96 rows: 2k 383 -> 414 -> 411 / 324 -> 331 -> 327, 4k 400 -> 431 -> 450
# / 355 -> 370 -> 379, 8k 410 -> 435 -> 446 / 388 -> 414 -> 436, 16k 414 -> 445 -> 453 / 411 -> 433 ->
# 454 (128 rows, 192 bytes spilled: no better than 64).
FA3_BWD_BLOCK_M = {64: 96, 96: 80, 128: 80}


# impl="auto" takes the first implementation in this order that runs on the GPU and supports the call
# (head dim, direction, features): the fastest first. Measured on the H200 (scripts/quick_perf.py,
# bf16, 16k tokens, N = 2k-8k): forward FA3 334-754 TF/s > FA2 250-330 > FA1 55-147; backward FA3 (d = 64,
# 128; its d = 96, softcap, varlen and deterministic modes are not measured yet) 227-417 > FA2 158-228 > FA1
# 89-129 at d <= 128, and FA2 115-126 > FA1 65-68 at d = 256 (2026-11-30).
IMPL_PREFERENCE = {"forward": ("fa3", "fa2", "fa1"), "backward": ("fa3", "fa2", "fa1")}


# ---------------------------------------------------------------------------------------------------------
# Decode (flash_attn_with_kvcache): tiles and the number of KV splits (Flash-Decoding)


@dataclass(frozen=True)
class DecodeTiles:
    block_n: int  # keys per K/V tile; one warp per 16 of them (its own online softmax)
    stages: int  # K/V tiles in flight in the cp.async ring (the bytes in flight that decode lives on)
    copy_chunks: int = 1  # 16-byte chunks of a K/V row each thread copies (a row's address worked out once)
    paged_copy_chunks: int = 1  # the same for a paged cache (a row's address there is a page lookup too)
    paged_rule: bool = True  # a paged cache with small pages splits by decode_num_splits' paged rule
    paged_wave_stages: int = 0  # a paged cache's ring when the grid is one block per SM or fewer (0: stages)


# head dim -> decode tiles. A thread block holds 16 query rows (the GQA group's heads x the queries) and
# streams K/V; the kernel is memory-bound, so what matters is bytes in flight per SM (~40 KB keeps the
# H200's HBM busy at ~1 us latency) and enough blocks. A stage is 2 x 64 x d x 2 bytes: 16 KB at d = 64
# (4 stages, 66 KB: three blocks per SM on Hopper), 32 KB at d = 128 (3 stages, 100 KB: two blocks per
# SM), 64 KB at d = 256 (2 stages, 136 KB). All fit sm_80's 163 KB.
# A paged cache's copies at d = 128 / 256 take 2 / 4 chunks of a row per thread and split like a contiguous
# cache. H200 (scripts/decode_probe.py --ab, session 19; 32 query / 8 KV heads, page size 16, us, table
# before -> now, contiguous in brackets): d = 128 1 x 32k 43.6 -> 40.1 (38.3), 16 x 8k 132.3 -> 129.5
# (123.2), page 1 43.8 -> 41.5 and 134.2 -> 132.9; d = 256 1 x 32k 116.7 -> 77.9 (76.3), 16 x 8k 336.5 ->
# 252.8 (245.6). Contiguous caches gain nothing from more chunks (d = 128 level, d = 64 and 4 chunks at
# d = 128 slower), nor does d = 64 paged at 16 x 8k (75.0 as is, 78.7 with 2 chunks, 94.0 with 2 chunks
# split like a contiguous cache; 1 x 32k 38.2 -> 35.8 would gain).
# A paged cache's rows are spread over the whole cache, so its loads wait longer (page 1 most, then 16, 64):
# at d = 128 a grid of at most one block per SM takes a ring of 4 stages (135 KB: one block per SM either
# way). H200 (session 19, 3 -> 4 stages, us): 1 x 32k page 1 40.9 -> 39.6, page 16 40.1 -> 39.4 (contiguous
# 38.0 -> 38.3, so it keeps 3); 16 x 8k page 1 129.9 -> 126.3, page 16 127.1 -> 125.4. Where two blocks fit
# per SM the third stage loses them: 64 x 4k page 1 249.0 -> 256.4, page 16 244.6 -> 254.5.
DECODE_TILES = {
    64: DecodeTiles(block_n=64, stages=4),
    128: DecodeTiles(block_n=64, stages=3, paged_copy_chunks=2, paged_rule=False, paged_wave_stages=4),
    256: DecodeTiles(block_n=64, stages=2, paged_copy_chunks=4, paged_rule=False),
}
# ... and where a block gets at most 99 KB of shared memory (sm_86, sm_89; cuflash.decode.tiles): d = 128 in
# two stages (68 KB), d = 256 in tiles of 32 keys (two warps; 72 KB). Compile-checked for sm_86, not timed.
DECODE_TILES_SMALL_SMEM = {
    128: DecodeTiles(block_n=64, stages=2, paged_copy_chunks=2, paged_rule=False),
    256: DecodeTiles(block_n=32, stages=2, paged_copy_chunks=4, paged_rule=False),
}
DECODE_BLOCK_M = 16  # query rows per thread block (one m16 MMA tile)
DECODE_MAX_SPLITS = 128  # the combine reads every split's partial O: past this the merge costs more than it buys
DECODE_MIN_TILES_PER_SPLIT = 4  # a split streams at least 4 tiles (256 keys): its partial write stays small next to its reads
# Page sizes from which a paged cache splits like a contiguous one (decode_num_splits' paged rule is for smaller
# pages). H200 (scripts/decode_probe.py, session 9; 32 query / 8 KV heads, d = 128, us for 1 / 2 / 16 / 33
# splits): 1 x 32k contiguous - / - / 39.3 / 42.9, page 16 - / - / 44.9 / 44.6, page 64 - / - / 40.9 /
# 42.3, page 256 - / - / 40.1 / 42.2; 16 x 8k contiguous 123.0 / 129.9, page 16 141.7 / 131.6, page 64
# 131.5 / 132.5, page 256 132.8 / 131.8. From page 64 the contiguous counts (16 and 1) are as fast or 3-5 %
# faster; at page 16 the paged rule's (33 and 2) still win at 16 x 8k (7 %). Page 1 fitted the rule.
DECODE_SMALL_PAGE_BELOW = 64


def decode_num_splits(batch: int, kv_heads: int, m_blocks: int, max_keys: int, block_n: int, num_sms: int,
                      paged: bool = False, page_size: int | None = None) -> int:
    """KV splits for a decode call (num_splits=0). Flash-Decoding: when batch x kv_heads x m_blocks thread
    blocks cannot fill the GPU, split each entry's keys: a contiguous cache into one wave of one block per
    SM (H200, 1 x 32k, 8 KV heads, d = 128: 16 splits 39.7 µs, 12 40.0, 24 44.0, 33 43.0 -- one block per SM
    keeps its 3 stages in flight and the HBM busy, and fewer splits shorten the combine, 4.4 µs at 16
    against 6.4 at 33); a paged cache into about two blocks per SM (a block's page-table loads for its next
    tile stall it; the same shape with page size 1: 33 splits 44.7 µs, 24 46.0, 16 46.8). Never split below
    DECODE_MIN_TILES_PER_SPLIT tiles, and not at all when the unsplit grid already covers 80 % of the SMs
    (a partial wave costs less than the extra pass of the combine) -- except for a paged cache whose
    unsplit grid is about one block per SM: there two splits give each SM a second block (H200, 16 x 8k,
    page size 1: 148 -> 132 µs; a contiguous cache there is 123 µs unsplit and 129 with two splits).
    ``max_keys``: the longest entry's key count (or the cache capacity when the lengths are not known on
    the host). ``paged``: the paged rule applies (a paged cache whose head dim's DecodeTiles.paged_rule is
    set). ``page_size``: a paged cache's; from DECODE_SMALL_PAGE_BELOW it splits like a contiguous one
    (None: the paged rule, an upper bound of both)."""
    paged = paged and (page_size is None or page_size < DECODE_SMALL_PAGE_BELOW)
    blocks = batch * kv_heads * m_blocks
    tiles = -(-max_keys // block_n)
    if blocks >= 0.8 * num_sms:
        one_wave = blocks <= num_sms
        return 2 if paged and one_wave and tiles >= 2 * DECODE_MIN_TILES_PER_SPLIT else 1
    want = -(-2 * num_sms // blocks) if paged else num_sms // blocks
    return max(1, min(want, tiles // DECODE_MIN_TILES_PER_SPLIT, DECODE_MAX_SPLITS))


# ---------------------------------------------------------------------------------------------------------
# Cascade attention (cuflash.cascade_attention): the pass over the shared prefix

# Query rows per KV head (batch x seqlen_q x the GQA group) from which the prefix goes through the prefill
# kernels instead of the decode kernel. The decode kernel's blocks hold 16 rows: below 64 rows that is at
# most 3 blocks per KV head streaming the prefix side by side, memory-bound, which a 128-row prefill tile
# (mostly padding then) cannot beat by much. From 64 rows its blocks re-read the prefix 4+ times on small
# MMA tiles: at issue 6's shape (256 rows, 16 blocks per KV head, a 32k prefix) that pass was most of the
# cascade's 400 µs on the H200, against 34 GFLOP for the prefill kernels (~60 µs at FA3's rate). 64 is an
# estimate, not a measured crossover: scripts/cascade_probe.py times both paths (--batch 16: 64 rows).
CASCADE_PREFILL_MIN_ROWS = 64
CASCADE_TILE_ROWS = 128  # query rows per prefill tile (FA3's BLOCK_M, FA2's up to d = 128)
CASCADE_MIN_CHUNK = 512  # keys: a tile's Q load, epilogue and partial output stay small next to its key loop
CASCADE_CHUNK_ALIGN = 128  # chunk boundaries on K/V tile boundaries (FA3's block_n up to d = 128)


def cascade_prefix_chunk(rows: int, kv_heads: int, prefix_len: int, num_sms: int) -> int:
    """Keys per chunk of the shared prefix when it goes through the prefill kernels (calls with
    CASCADE_PREFILL_MIN_ROWS ``rows`` or more).

    ``rows``: the query rows per KV head, which cascade_attention packs into one sequence per chunk, so
    each chunk is ceil(rows / 128) x kv_heads tiles; unchunked, a few hundred rows would make a few dozen
    tiles, each walking the whole prefix, on a GPU of 132 SMs. The chunk count is the largest that keeps
    the tiles at 2 x num_sms or fewer: FA3's persistent blocks take tiles round-robin, so no SM takes more
    than two, and fewer than one chunk's tiles of the 2 x num_sms places go unused. Chunks keep
    CASCADE_MIN_CHUNK keys or more (each one adds a partial output to the merge). The length is rounded
    up to CASCADE_CHUNK_ALIGN, which may leave fewer chunks than counted, the last one shorter. Issue 6's
    shape (256 rows, 8 KV heads, 32k keys, 132 SMs): 16 tiles per chunk, 16 chunks of 2048 keys."""
    tiles_per_chunk = -(-rows // CASCADE_TILE_ROWS) * kv_heads
    chunks = max(1, min(2 * num_sms // tiles_per_chunk, prefix_len // CASCADE_MIN_CHUNK))
    keys = -(-prefix_len // chunks)
    return -(-keys // CASCADE_CHUNK_ALIGN) * CASCADE_CHUNK_ALIGN
