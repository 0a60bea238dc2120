"""Device-memory (HBM) bytes and FLOPs of one attention call, counted from what the code reads and writes.

The first FlashAttention paper (Dao et al. 2022, Theorem 2) shows that standard attention makes
Θ(N·d + N²) HBM accesses and the tiled algorithm Θ(N²·d²/M), M the on-chip memory. This module makes
both concrete for cuflash's own code, for a shape (batch, heads, kv_heads, seqlen_q, seqlen_k, headdim)
and tile sizes (``cuflash.heuristics`` by default):

``naive`` -- ``cuflash.reference.attention_naive`` / ``attention_naive_backward`` on CuPy, pass by pass:
    every GEMM, cast, elementwise op and reduction reads its inputs from and writes its output to device
    memory. The score matrix S (B·H·Sq·Sk elements) is written by the QKᵀ GEMM in the input dtype, cast
    to fp32, scaled, masked (causal), reduced for the row max, shifted, exponentiated, reduced for the
    row sum, normalised, cast back to the input dtype as P and read by the PV GEMM: 4e + 48 bytes per
    score in the forward (e = element size; + 9 for the causal mask pass). Layout copies are counted
    where the code makes them: the (B, S, H, d) -> (B, H, S, d) operand views are copied for cuBLAS when
    H > 1, GQA repeats K and V per query head (``cupy.repeat``), and the result is transposed back.
    ``naive_matmul="cublas"`` follows the bf16 path (cuflash's own strided-batched cuBLAS call: a
    transposed view of a contiguous matrix is passed without a copy); ``"cupy"`` follows
    ``cupy.matmul`` (fp16), which copies every operand that is not C-contiguous (Kᵀ always; Pᵀ and dSᵀ
    in the backward).

``fa1`` / ``fa2`` forward -- one thread block per (batch, query head, Q block of BLOCK_M rows): it reads
    its Q tile once and every K and V tile of the range ``cuflash.reference.kv_block_range`` gives
    (the causal / window tiles; fully masked tiles are never loaded), then writes its O rows and their
    fp32 log-sum-exp. Rows past the end of a sequence are zero-filled in shared memory, not read. FA1
    loads the Q tile even when the range is empty; FA2 does not. With GQA every query head's blocks read
    the K/V of their KV head again. So K+V ≈ 2·e·B·H·⌈Sq/BLOCK_M⌉·Sk·d (·≈½ causal)
    ≈ 2·e·B·H·Sq·Sk·d / BLOCK_M: Θ(N²·d²/M) with M ∝ BLOCK_M·d the shared memory that holds the Q tile.

``fa1`` / ``fa2`` backward -- three kernels (kernels_cu/common/bwd_aux.cu and the family's bwd.cu):
    ``bwd_preprocess`` reads O and dO, writes D = rowsum(dO∘O) (fp32) and zeroes the fp32 dQ accumulator;
    the main kernel runs one block per (batch, KV head, K block of BLOCK_N keys): it reads K and V once,
    then for every query head of the GQA group and every Q block that sees these keys (the inverse of
    ``kv_block_range``, ``q_block_range`` here, as kernels_cu/common/mask.cuh) it reads Q, dO, LSE and D
    and adds its dQ share with fp32 atomics (a read and a write of the accumulator rows), and at the end
    writes dK and dV (summed over the group); ``bwd_convert_dq`` reads the accumulator and writes dQ.
    So the re-read part is B·H·Sq·Sk·(2·e·d + 8·d + 8) / BLOCK_N (·≈½ causal). FA1 always loads K/V;
    FA2 skips a K block no query sees. FA1's tiles: BLOCK_M = BLOCK_N = 16·bwd_key_warps.

``fa3`` forward -- kernels_cu/fa3/fwd.cu, tiles as ``cuflash.fa3.forward`` picks them (``fa3.fwd_tiles``:
    BLOCK_M = 64 × consumer warpgroups, 128, or 192 at d = 64; the unmasked table's BLOCK_N without a
    mask). A persistent grid of about one block per SM walks the tiles; per tile the producer TMA-loads Q
    once (not for a tile that sees no key) and the K/V tiles of ``kv_block_range``, as FA2's blocks do,
    and the epilogue writes O and the fp32 LSE. TMA never reads past a tensor's edge (rows past a sequence,
    the padding columns of d = 96): real rows and d columns only. With GQA packing (``fa3.pack_gqa``: few
    query rows) a tile holds BLOCK_M (query, head) rows of one KV head's group, BLOCK_M/g queries of all g
    heads, so the group shares each K/V tile: K+V ≈ 2·e·B·Hkv·⌈g·Sq/BLOCK_M⌉·Sk·d. The wave bound follows
    the tile scheduler (common/tile_scheduler.cuh): rounds of ``wave_blocks`` tiles (the grid) in its L2
    section order, last query blocks first.

``fa3`` backward -- FA2's three kernels with FA3's main kernel (fa3/bwd.cu; fa3/bwd_wide.cu above d = 128):
    one block per (batch, KV head, K block of BLOCK_N = ``fa3.bwd_block_n``: 128 keys, 64 above d = 128)
    loads K and V once (not when no Q block sees them) and streams (Q, dO) blocks of BLOCK_M rows
    (``fa3.bwd_block_m`` of a call without softcap: 96 at d = 64, 80 at d = 96 and 128, 64 above) with
    their LSE and D rows. Those come from copies in rows padded to a multiple of BLOCK_M (``bwd_preprocess``
    also reads the LSE and writes ``lse_rows``), loaded as whole blocks. dQ tiles go to the fp32 accumulator
    by TMA reduce-add (a read and a write per visit, as FA2's atomics); dK, dV are summed over the group in
    registers and written once. The deterministic mode's counters are not counted.

``decode`` -- ``flash_attn_with_kvcache`` on a contiguous cache that already holds the keys (kv_append and
    q_rotary are not counted), every entry with Sk keys, Sq new queries (1 for plain decoding): ``decode_fwd``
    runs one block per (split, 16-row block, KV head, batch), the rows being the group's heads × the queries.
    Each block reads its Q rows and its split's run of K/V tiles (``reference.decode_split_tiles``), so with
    g·Sq <= 16 K and V are read exactly once; one split writes O and LSE, several write fp32 partial O and
    LSE that ``attn_combine`` reads (the partial rows of splits whose LSE is finite) and merges into O and
    LSE. ``num_splits`` defaults to ``heuristics.decode_num_splits`` for ``num_sms`` SMs (132: H200).

Two bounds
----------
``hbm_bytes`` (the prediction) assumes *no L2 reuse between thread blocks or passes*: every tile a block
loads and every byte a pass touches comes from DRAM. ``hbm_bytes_min`` assumes *perfect L2 reuse within a
wave*: thread blocks are launched in grid order (blockIdx.x fastest) in waves of ``wave_blocks``
concurrently resident blocks, and within a wave each distinct tile row is read once (and each dQ
accumulator row read and written once); ``wave_blocks=None`` makes the whole grid one wave, i.e. each
kernel's compulsory traffic (every distinct byte it reads once, every byte it writes once) -- how ncu
measures a kernel with ``--cache-control all`` (cold L2 per kernel). The naive passes stream whole arrays,
so there the two bounds differ only where an array is broadcast (the causal mask, GQA repeats). A large
L2 (50-60 MB on H100/H200) brings measured DRAM bytes from the upper bound towards the lower one at
small N. Note that an L2 is write-back: bytes still dirty in L2 when a kernel ends are not counted as DRAM
writes of that kernel, so measured writes of small outputs can fall below both bounds.

FLOPs
-----
Matmul FLOPs only (2 per multiply-add; softmax, masking and casts are not counted). ``flops_executed``
counts what the tensor cores run: the forward does S = QKᵀ and O += PV, 2 products of 2·BLOCK_M·BLOCK_N·d
each per visited tile pair -- whole tiles, masked-out elements and padding rows included. The backward
does 5 products per visited pair: S = QKᵀ (recomputed), dP = dO·Vᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q,
dQ += dS·K, 5·2·BLOCK_M·BLOCK_N·d = 2.5× the forward; FA1 with ``bwd_d_split`` > 1 recomputes S and dP
in each of its d_split warps, (4·d_split + 6)·BLOCK_M·BLOCK_N·d per pair. The naive attention computes
the full Sq × Sk matrices: 4·B·H·Sq·Sk·d forward, 10·B·H·Sq·Sk·d backward. FA3 runs its products over
whole 128-byte atoms: the forward's P·V over d padded to 64 columns (d = 96: 2·BLOCK_M·BLOCK_N·(96 + 128) per
pair), the backward's five over 64-column atoms, 256 columns in bwd_wide.cu (d = 192 as 256). Decode runs
S and P·V on whole 16-row blocks: 4·16·BLOCK_N·d per visited tile of each block. ``flops_useful`` counts only
visible (query, key) pairs: 4·d per pair forward, 10·d backward -- half of the full matrix (N(N+1)/2
pairs) for causal Sq = Sk. ``arithmetic_intensity`` = flops_executed / hbm_bytes (FLOP per byte).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

from . import fa2, fa3, heuristics, tile_order
from ._validate import Dims, window_bounds
from .reference import decode_split_tiles, kv_block_range, visible_key_span

__all__ = ["IMPLS", "DIRECTIONS", "predict", "q_block_range", "visible_pairs", "add_arguments", "run"]

IMPLS = ("naive", "fa1", "fa2", "fa3", "decode")
DIRECTIONS = ("forward", "backward")
NAIVE_MATMULS = ("cublas", "cupy")
F32 = 4  # bytes of an fp32 element (LSE, D, the dQ accumulator, the naive softmax)

#: Keys every ``predict`` result carries (the CLI's ``--json`` rows too).
RESULT_KEYS = (
    "impl", "direction", "batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "headdim", "causal",
    "window_size", "dtype_bytes", "hbm_bytes", "hbm_read_bytes", "hbm_write_bytes", "hbm_bytes_min",
    "hbm_read_bytes_min", "hbm_write_bytes_min", "quadratic_bytes", "breakdown", "breakdown_min", "kernels",
    "flops_executed", "flops_useful", "arithmetic_intensity", "tiles", "tile_pairs_visited", "tile_pairs_total",
    "wave_blocks", "formula",
)


# ----------------------------------------------------------------------------------------------------
# bookkeeping
# ----------------------------------------------------------------------------------------------------

@dataclass
class _Kernel:
    """Bytes one kernel (or one naive pass) reads and writes, per array, under both bounds."""
    name: str
    blocks: int = 0
    flops: int = 0
    reads: dict = field(default_factory=dict)
    writes: dict = field(default_factory=dict)
    reads_min: dict = field(default_factory=dict)
    writes_min: dict = field(default_factory=dict)

    def read(self, array: str, nbytes, nbytes_min=None) -> None:
        _add(self.reads, array, nbytes)
        _add(self.reads_min, array, nbytes if nbytes_min is None else nbytes_min)

    def write(self, array: str, nbytes, nbytes_min=None) -> None:
        _add(self.writes, array, nbytes)
        _add(self.writes_min, array, nbytes if nbytes_min is None else nbytes_min)

    def summary(self) -> dict:
        return {"name": self.name, "blocks": self.blocks, "read_bytes": sum(self.reads.values()),
                "write_bytes": sum(self.writes.values()), "read_bytes_min": sum(self.reads_min.values()),
                "write_bytes_min": sum(self.writes_min.values()), "flops_executed": self.flops}


def _add(d: dict, key: str, value) -> None:
    value = int(value)
    if value:
        d[key] = d.get(key, 0) + value


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class _Shape:
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    causal: bool
    window: tuple
    e: int  # bytes per element of q, k, v, o and the gradients

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def mask_kw(self) -> dict:
        return {"seqlen_q": self.seqlen_q, "seqlen_k": self.seqlen_k, "causal": self.causal,
                "window_size": self.window}

    def dims(self) -> Dims:  # for cuflash.fa3's choices (the dtype does not enter them)
        return Dims(self.batch, self.seqlen_q, self.seqlen_k, self.heads, self.kv_heads, self.headdim, "bfloat16")

    def fa3_unmasked(self) -> bool:
        """No causal mask or window bounds the rows (FA3's tile choice and its scheduler's sections)."""
        return fa3._unmasked(window_bounds(self.window, self.causal, self.dims()), self.dims())

    def fa3_short_masked(self) -> bool:
        """A mask bounds short rows (FA3's tile choice: two consumer warpgroups instead of three)."""
        return fa3._short_masked(window_bounds(self.window, self.causal, self.dims()), self.dims())


# ----------------------------------------------------------------------------------------------------
# tile ranges
# ----------------------------------------------------------------------------------------------------

def q_block_range(n_block, *, seqlen_q, seqlen_k, block_m, block_n, causal=False, window_size=(-1, -1)):
    """Q blocks whose rows see some key of K block ``n_block``: ``(m_lo, m_hi)``, hi exclusive, (0, 0) if none.

    The backward's loop range, as ``Mask::q_block_range`` in kernels_cu/common/mask.cuh (with the
    kernels' window bounds: unbounded left = seqlen_k, unbounded right = seqlen_q, causal right = 0).
    """
    left, right = (int(w) for w in window_size)
    left = seqlen_k if left < 0 else min(left, seqlen_k)
    right = seqlen_q if right < 0 else min(right, seqlen_q)
    if causal:
        right = 0
    key_first = n_block * block_n
    key_last = min(key_first + block_n, seqlen_k) - 1
    diag = seqlen_k - seqlen_q
    row_first = max(0, key_first - diag - right)
    row_last = min(seqlen_q - 1, key_last - diag + left)
    if row_last < row_first or key_last < key_first:
        return 0, 0
    return row_first // block_m, row_last // block_m + 1


def _kv_ranges(s: _Shape, block_m: int, block_n: int) -> list[tuple[int, int]]:
    return [kv_block_range(m, block_m=block_m, block_n=block_n, **s.mask_kw())
            for m in range(_cdiv(s.seqlen_q, block_m))]


def _q_ranges(s: _Shape, block_m: int, block_n: int) -> list[tuple[int, int]]:
    return [q_block_range(n, block_m=block_m, block_n=block_n, **s.mask_kw())
            for n in range(_cdiv(s.seqlen_k, block_n))]


def _real_rows(lo: int, hi: int, block: int, seqlen: int) -> int:
    """Rows below ``seqlen`` in tiles [lo, hi) of ``block`` rows (the kernels never load rows past the end)."""
    if hi <= lo:
        return 0
    return max(0, min(hi * block, seqlen) - lo * block)


def _union_rows(intervals, block: int, seqlen: int) -> int:
    """Real rows in the union of tile intervals [lo, hi)."""
    total, cur_lo, cur_hi = 0, None, None
    for lo, hi in sorted(intervals):
        if cur_hi is not None and lo <= cur_hi:
            cur_hi = max(cur_hi, hi)
            continue
        if cur_hi is not None:
            total += _real_rows(cur_lo, cur_hi, block, seqlen)
        cur_lo, cur_hi = lo, hi
    if cur_hi is not None:
        total += _real_rows(cur_lo, cur_hi, block, seqlen)
    return total


def _distinct_rows(blocks, wave_blocks, block: int, seqlen: int) -> int:
    """Rows read at least once per wave: ``blocks`` yields, per thread block in launch order, a list of
    (key, tile_lo, tile_hi) it reads (key = which array slice, e.g. (batch, kv_head)); blocks are
    grouped in waves of ``wave_blocks`` (None: one wave), and each wave reads the union of its blocks'
    tiles of each key once."""
    total, groups = 0, {}

    def flush():
        return sum(_union_rows(iv, block, seqlen) for iv in groups.values())

    for i, items in enumerate(blocks):
        if wave_blocks and i and i % wave_blocks == 0:
            total += flush()
            groups = {}
        for key, lo, hi in items:
            if hi > lo:
                groups.setdefault(key, []).append((lo, hi))
    return total + flush()


def visible_pairs(*, seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)) -> int:
    """Number of visible (query, key) pairs of one (batch, head) -- the masks of cuflash.reference."""
    import numpy

    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    i = numpy.arange(seqlen_q, dtype=numpy.int64)
    diag = i + (seqlen_k - seqlen_q)
    lo = numpy.maximum(0, diag - left) if left >= 0 else numpy.zeros_like(i)
    hi = numpy.minimum(seqlen_k - 1, diag + right) if right >= 0 else numpy.full_like(i, seqlen_k - 1)
    return int(numpy.clip(hi - lo + 1, 0, None).sum())


# ----------------------------------------------------------------------------------------------------
# flash kernels
# ----------------------------------------------------------------------------------------------------

def _flash_forward(name: str, s: _Shape, bm: int, bn: int, *, load_q_when_empty: bool, reverse: bool,
                   wave_blocks) -> tuple[list[_Kernel], int, int, int]:
    """The forward kernel. Returns (kernels, quadratic bytes, visited and all tile pairs per (batch, head))."""
    d, e = s.headdim, s.e
    ranges = _kv_ranges(s, bm, bn)
    n_m = len(ranges)
    bh = s.batch * s.heads
    q_rows = kv_rows = pairs = 0
    for m, (lo, hi) in enumerate(ranges):
        if hi > lo or load_q_when_empty:
            q_rows += min(bm, s.seqlen_q - m * bm)
        kv_rows += _real_rows(lo, hi, bn, s.seqlen_k)
        pairs += max(0, hi - lo)

    def blocks(batch, heads):  # launch order: blockIdx.x (Q block) fastest, then head, then batch
        for b in range(batch):
            for h in range(heads):
                for x in range(n_m):
                    m = n_m - 1 - x if reverse else x
                    yield [((b, h // s.group), *ranges[m])]

    if wave_blocks is None:  # one wave: the same union for every (batch, KV head)
        kv_min = _distinct_rows(blocks(1, s.group), None, bn, s.seqlen_k) * s.batch * s.kv_heads
    else:
        kv_min = _distinct_rows(blocks(s.batch, s.heads), wave_blocks, bn, s.seqlen_k)

    k = _Kernel(name, blocks=bh * n_m, flops=bh * pairs * 4 * bm * bn * d)
    k.read("q", bh * q_rows * d * e)
    k.read("k", bh * kv_rows * d * e, kv_min * d * e)
    k.read("v", bh * kv_rows * d * e, kv_min * d * e)
    k.write("o", bh * s.seqlen_q * d * e)
    k.write("lse", bh * s.seqlen_q * F32)
    return [k], 2 * bh * kv_rows * d * e, pairs, n_m * _cdiv(s.seqlen_k, bn)


def _atom_cols(d: int) -> int:
    """Columns of a 16-bit tile row of whole 128-byte atoms (FA3: d = 96 is stored and multiplied as 128)."""
    return _cdiv(d, 64) * 64


def _fa3_tile_order(s: _Shape, m_blocks: int, heads: int, grid: int, pack: bool, block_m: int, block_n: int):
    """(m_block, head, batch) of each tile in TileScheduler's linear order (kernels_cu/common/tile_scheduler.cuh)
    with the section cuflash/fa3.py's fill_schedule chooses (cuflash/tile_order.py). Round r of the persistent
    grid runs tiles [r·grid, (r + 1)·grid), one per block (the serpentine only permutes a round), so waves of
    ``grid`` tiles. Sections of (head, batch) pairs come one after the other, each from its last query block
    down, its heads fastest."""
    pairs = heads * s.batch
    dims = s.dims()
    # (the traffic below counts the tiles from row 0: a row shift moves one tile's spare rows)
    section, _, _ = fa3.schedule(dims, window_bounds(s.window, s.causal, dims), block_m, block_n, 2,
                                 heuristics.fa3_l2_section_kib(s.headdim, s.seqlen_k), pack, grid, not pack)
    m_block, pair = tile_order.linear_order(m_blocks, pairs, section)
    for m, p in zip(m_block.tolist(), pair.tolist()):
        yield m, p % heads, p // heads


def _fa3_forward(s: _Shape, tiles: dict, wave_blocks) -> tuple[list[_Kernel], int, int, int]:
    """kernels_cu/fa3/fwd.cu. Returns (kernels, quadratic bytes, visited and all tile pairs per (batch, tile
    head): per (batch, head), or per (batch, KV head) with GQA packing)."""
    d, e, g = s.headdim, s.e, s.group
    bm, bn, pack = tiles["block_m"], tiles["block_n"], tiles["pack_gqa"]
    rows = bm // g if pack else bm  # queries per tile: packed, the group's g heads share the tile's rows
    tile_heads = s.kv_heads if pack else s.heads
    ranges = _kv_ranges(s, rows, bn)
    n_m = len(ranges)
    q_rows = kv_rows = pairs = 0
    for m, (lo, hi) in enumerate(ranges):
        if hi > lo:  # a tile that sees no key loads no Q (it writes O = 0, LSE = -inf)
            q_rows += min(rows, s.seqlen_q - m * rows)
        kv_rows += _real_rows(lo, hi, bn, s.seqlen_k)
        pairs += max(0, hi - lo)
    n_tiles = s.batch * tile_heads * n_m

    if wave_blocks is None:  # one wave: every tile of a KV head reads from the same union
        kv_min = _distinct_rows([[(0, *r) for r in ranges]], None, bn, s.seqlen_k) * s.batch * s.kv_heads
    else:
        grid = min(n_tiles, wave_blocks)
        order = _fa3_tile_order(s, n_m, tile_heads, grid, pack, bm, bn)
        kv_min = _distinct_rows(([((b, h if pack else h // g), *ranges[m])] for m, h, b in order), grid, bn,
                                s.seqlen_k)

    # blocks: the tiles (the persistent grid, about one block per SM, walks them)
    k = _Kernel("fa3_fwd", blocks=n_tiles, flops=s.batch * tile_heads * pairs * 2 * bm * bn * (d + _atom_cols(d)))
    k.read("q", s.batch * s.heads * q_rows * d * e)  # packed: g heads x the tile's queries
    k.read("k", s.batch * tile_heads * kv_rows * d * e, kv_min * d * e)
    k.read("v", s.batch * tile_heads * kv_rows * d * e, kv_min * d * e)
    k.write("o", s.batch * s.heads * s.seqlen_q * d * e)
    k.write("lse", s.batch * s.heads * s.seqlen_q * F32)
    return [k], 2 * s.batch * tile_heads * kv_rows * d * e, pairs, n_m * _cdiv(s.seqlen_k, bn)


def _preprocess(s: _Shape, copy_lse: bool = False) -> _Kernel:
    """bwd_preprocess; ``copy_lse``: FA3's, which also copies the LSE into padded rows beside D."""
    rows = s.batch * s.heads * s.seqlen_q
    k = _Kernel("bwd_preprocess", blocks=_cdiv(rows, 4))
    k.read("o", rows * s.headdim * s.e)
    k.read("do", rows * s.headdim * s.e)
    k.write("dsum", rows * F32)
    k.write("dq_accum", rows * s.headdim * F32)
    if copy_lse:
        k.read("lse", rows * F32)
        k.write("lse_rows", rows * F32)
    return k


def _convert_dq(s: _Shape) -> _Kernel:
    rows = s.batch * s.heads * s.seqlen_q
    k = _Kernel("bwd_convert_dq", blocks=_cdiv(rows, 4))
    k.read("dq_accum", rows * s.headdim * F32)
    k.write("dq", rows * s.headdim * s.e)
    return k


def _flash_backward(name: str, s: _Shape, bm: int, bn: int, *, flops_per_pair: int, load_kv_when_empty: bool,
                    wave_blocks, padded_rows: bool = False) -> tuple[list[_Kernel], int, int, int]:
    """Preprocess, main kernel, dQ conversion. ``flops_per_pair``: per (Q block, K block, query head).
    ``padded_rows``: FA3's LSE and D, read as whole BLOCK_M-row blocks of the preprocess's padded copies.
    Returns (kernels, quadratic bytes, visited and all tile pairs per (batch, head))."""
    d, e = s.headdim, s.e
    ranges = _q_ranges(s, bm, bn)
    n_n = len(ranges)
    bkv = s.batch * s.kv_heads
    kv_rows = q_rows = pairs = 0
    for n, (lo, hi) in enumerate(ranges):
        if hi > lo or load_kv_when_empty:
            kv_rows += min(bn, s.seqlen_k - n * bn)
        q_rows += _real_rows(lo, hi, bm, s.seqlen_q)
        pairs += max(0, hi - lo)
    q_rows_all = q_rows * s.heads * s.batch  # each query head of the group walks the same Q blocks
    # LSE and D rows per visit: the real rows, or FA3's whole padded blocks
    pitch = _cdiv(s.seqlen_q, bm) * bm if padded_rows else s.seqlen_q
    stat_rows_all = pairs * bm * s.heads * s.batch if padded_rows else q_rows_all

    def blocks(batch, kv_heads):  # launch order: blockIdx.x (K block) fastest, then KV head, then batch
        for b in range(batch):
            for kvh in range(kv_heads):
                for n in range(n_n):
                    yield [((b, hq), *ranges[n]) for hq in range(kvh * s.group, (kvh + 1) * s.group)]

    def distinct(seqlen):
        if wave_blocks is None:
            return _distinct_rows(blocks(1, 1), None, bm, seqlen) * bkv
        return _distinct_rows(blocks(s.batch, s.kv_heads), wave_blocks, bm, seqlen)

    q_min = distinct(s.seqlen_q)
    stat_min = distinct(pitch) if padded_rows else q_min
    stat = "lse_rows" if padded_rows else "lse"

    main = _Kernel(name, blocks=bkv * n_n, flops=s.batch * s.heads * pairs * flops_per_pair)
    main.read("k", bkv * kv_rows * d * e)
    main.read("v", bkv * kv_rows * d * e)
    main.read("q", q_rows_all * d * e, q_min * d * e)
    main.read("do", q_rows_all * d * e, q_min * d * e)
    main.read(stat, stat_rows_all * F32, stat_min * F32)
    main.read("dsum", stat_rows_all * F32, stat_min * F32)
    # fp32 atomics (FA1, FA2) or TMA reduce-adds (FA3): a read-modify-write of the accumulator rows
    main.read("dq_accum", q_rows_all * d * F32, q_min * d * F32)
    main.write("dq_accum", q_rows_all * d * F32, q_min * d * F32)
    main.write("dk", bkv * s.seqlen_k * d * e)
    main.write("dv", bkv * s.seqlen_k * d * e)
    quadratic = q_rows_all * (2 * d * e + 2 * d * F32) + 2 * stat_rows_all * F32
    kernels = [_preprocess(s, copy_lse=padded_rows), main, _convert_dq(s)]
    return kernels, quadratic, pairs, n_n * _cdiv(s.seqlen_q, bm)


def _fa3_backward(s: _Shape, tiles: dict, wave_blocks) -> tuple[list[_Kernel], int, int, int]:
    """kernels_cu/fa3/bwd.cu (bwd_wide.cu above d = 128) between the common preprocess and dQ conversion."""
    bm, bn = tiles["block_m"], tiles["block_n"]
    wide = s.headdim > 128
    cols = 256 if wide else _atom_cols(s.headdim)  # the five products run over whole atoms; bwd_wide over 256
    return _flash_backward("fa3_bwd_wide" if wide else "fa3_bwd", s, bm, bn, flops_per_pair=10 * bm * bn * cols,
                           load_kv_when_empty=False, wave_blocks=wave_blocks, padded_rows=True)


# ----------------------------------------------------------------------------------------------------
# decode (flash_attn_with_kvcache: kernels_cu/decode/fwd.cu and combine.cu)
# ----------------------------------------------------------------------------------------------------

def _key_span(s: _Shape, i_first: int, i_last: int) -> tuple[int, int]:
    """Keys that query rows i_first..i_last see, (first, last) inclusive (last < first: none)."""
    return visible_key_span(i_first, i_last, seqlen_q=s.seqlen_q, seqlen_k=s.seqlen_k, causal=s.causal,
                            window_size=s.window)


def _decode(s: _Shape, tiles: dict, wave_blocks) -> tuple[list[_Kernel], int, int, int]:
    """decode_fwd, and attn_combine with several splits. Returns (kernels, quadratic bytes, visited and all
    tile pairs per (batch, KV head): the 16-row blocks x the K/V tiles their splits stream)."""
    d, e, g = s.headdim, s.e, s.group
    bm, bn, splits = tiles["block_m"], tiles["block_n"], tiles["num_splits"]
    rows = g * s.seqlen_q  # packed rows of a (batch, KV head): query r // g of head r % g of the group
    m_blocks = _cdiv(rows, bm)
    runs = []  # (m_block, first tile, end tile) of each block of a (batch, KV head), in launch order
    q_rows = kv_rows = pairs = partial_rows = 0
    for m in range(m_blocks):
        real = min(bm, rows - m * bm)
        first, last = _key_span(s, m * bm // g, (m * bm + real - 1) // g)
        for split in range(splits):  # blockIdx.x = m_block * num_splits + split
            lo, hi = decode_split_tiles(split, splits, first, last, bn)
            runs.append((m, lo, hi))
            q_rows += real  # every split loads the block's Q rows
            kv_rows += _real_rows(lo, hi, bn, s.seqlen_k)
            pairs += hi - lo
            if splits > 1:  # the combine reads a split's partial row when its LSE is finite: the row sees a key
                run_last = min(hi * bn, s.seqlen_k) - 1
                for r in range(m * bm, m * bm + real):
                    vis_first, vis_last = _key_span(s, r // g, r // g)
                    partial_rows += max(vis_first, lo * bn) <= min(vis_last, run_last)
    bkv = s.batch * s.kv_heads

    def blocks(batch, kv_heads, rows_of):  # launch order: blockIdx.x fastest, then KV head, then batch
        for b in range(batch):
            for h in range(kv_heads):
                for run in runs:
                    yield [((b, h), *rows_of(run))]

    def distinct(rows_of, block, seqlen):
        if wave_blocks is None:
            return _distinct_rows(blocks(1, 1, rows_of), None, block, seqlen) * bkv
        return _distinct_rows(blocks(s.batch, s.kv_heads, rows_of), wave_blocks, block, seqlen)

    kv_min = distinct(lambda run: run[1:], bn, s.seqlen_k)
    q_min = distinct(lambda run: (run[0], run[0] + 1), bm, rows)

    out_rows = s.batch * s.heads * s.seqlen_q
    fwd = _Kernel("decode_fwd", blocks=bkv * len(runs), flops=bkv * pairs * 4 * bm * bn * d)
    fwd.read("q", bkv * q_rows * d * e, q_min * d * e)
    fwd.read("k", bkv * kv_rows * d * e, kv_min * d * e)
    fwd.read("v", bkv * kv_rows * d * e, kv_min * d * e)
    kernels = [fwd]
    if splits == 1:
        fwd.write("o", out_rows * d * e)
        fwd.write("lse", out_rows * F32)
    else:  # every split writes all its rows (0 and -inf when it sees nothing)
        fwd.write("o_partial", splits * out_rows * d * F32)
        fwd.write("lse_partial", splits * out_rows * F32)
        combine = _Kernel("attn_combine", blocks=_cdiv(out_rows, 4))
        combine.read("lse_partial", splits * out_rows * F32)
        combine.read("o_partial", bkv * partial_rows * d * F32)
        combine.write("o", out_rows * d * e)
        combine.write("lse", out_rows * F32)
        kernels.append(combine)
    return kernels, 2 * bkv * kv_rows * d * e, pairs, m_blocks * _cdiv(s.seqlen_k, bn)


# ----------------------------------------------------------------------------------------------------
# naive attention (cuflash.reference.attention_naive / attention_naive_backward on CuPy)
# ----------------------------------------------------------------------------------------------------

# Arrays of B·H·Sq·Sk elements: what makes the naive attention quadratic.
_SCORE_ARRAYS = ("s", "s_fp32", "p", "p_t", "mask", "dp", "ds_fp32", "ds", "ds_t")


class _Passes:
    """The naive attention as a list of passes (kernels), each streaming whole arrays."""

    def __init__(self, s: _Shape, matmul: str):
        self.s, self.matmul, self.kernels = s, matmul, []
        b, h, hkv, sq, sk, d = s.batch, s.heads, s.kv_heads, s.seqlen_q, s.seqlen_k, s.headdim
        self.ss = b * h * sq * sk  # score elements
        self.rows = b * h * sq
        self.nq = b * sq * h * d  # elements of q, o, do, dq
        self.nkr = b * sk * h * d  # K or V repeated to every query head
        self.nk = b * sk * hkv * d

    def add(self, name, reads=(), writes=(), flops=0, reads_min=None):
        k = _Kernel(name, flops=flops)
        mins = dict(reads_min or {})
        for array, nbytes in reads:
            k.read(array, nbytes, mins.get(array))
        for array, nbytes in writes:
            k.write(array, nbytes)
        self.kernels.append(k)

    def operand(self, array, nelem, copied: bool) -> str:
        """A transposed view handed to a GEMM: copied to a contiguous ``<array>_c`` when the matmul path
        cannot take it as it is. Returns the name of what the GEMM reads."""
        if not copied:
            return array
        self.add(f"copy {array} for GEMM", [(array, nelem * self.s.e)], [(array + "_c", nelem * self.s.e)])
        return array + "_c"

    def repeat(self, array) -> str:
        """GQA: ``xp.repeat(x, g, axis=2)``, a broadcast copy per KV head (each source row read g times)."""
        s = self.s
        if s.group == 1:
            return array
        self.add(f"repeat {array}", [(array, s.group * self.nk * s.e)], [(array + "_rep", self.nkr * s.e)],
                 reads_min={array: self.nk * s.e})
        return array + "_rep"

    def row_where(self, name, array):
        """``xp.where(test(x), x, c)`` on a (B, H, Sq, 1) fp32 row statistic: the test, then the select."""
        r = self.rows
        self.add(f"{name} test", [(array, r * F32)], [(array + "_ok", r)])
        self.add(f"{name} where", [(array, r * F32), (array + "_ok", r)], [(array, r * F32)])

    def probs(self):
        """``_naive_probs``: S = QKᵀ in the input dtype, then the fp32 softmax, pass by pass."""
        s, e, ss, r = self.s, self.s.e, self.ss, self.rows
        multi = s.heads > 1
        k_src = self.repeat("k")
        qa = self.operand("q", self.nq, multi)
        # Kᵀ view (B, H, d, Sk): cuflash's bf16 GEMM takes it transposed when H == 1; cupy.matmul always copies
        ka = self.operand(k_src, self.nkr, multi or self.matmul == "cupy")
        self.add("GEMM S = Q Kᵀ", [(qa, self.nq * e), (ka, self.nkr * e)], [("s", ss * e)], flops=2 * ss * s.headdim)
        self.add("S to fp32", [("s", ss * e)], [("s_fp32", ss * F32)])
        self.add("S *= scale", [("s_fp32", ss * F32)], [("s_fp32", ss * F32)])
        if s.causal:
            mn = s.seqlen_q * s.seqlen_k  # bool (Sq, Sk): three comparisons/ands and a copy
            self.add("causal mask build", [("mask", 3 * mn)], [("mask", 4 * mn)])
            self.add("S = where(mask, S, -inf)", [("s_fp32", ss * F32), ("mask", ss)], [("s_fp32", ss * F32)],
                     reads_min={"mask": mn})
        self.add("row max", [("s_fp32", ss * F32)], [("row_stats", r * F32)])
        self.row_where("row max", "row_stats")
        self.add("S -= max", [("s_fp32", ss * F32), ("row_stats", r * F32)], [("s_fp32", ss * F32)])
        self.add("exp(S)", [("s_fp32", ss * F32)], [("s_fp32", ss * F32)])
        self.add("row sum", [("s_fp32", ss * F32)], [("row_stats", r * F32)])
        self.row_where("row sum", "row_stats")
        self.add("P = S / sum", [("s_fp32", ss * F32), ("row_stats", r * F32)], [("s_fp32", ss * F32)])

    def forward(self):
        s, e, ss = self.s, self.s.e, self.ss
        multi = s.heads > 1
        self.probs()
        v_src = self.repeat("v")
        self.add("P to input dtype", [("s_fp32", ss * F32)], [("p", ss * e)])
        va = self.operand(v_src, self.nkr, multi)
        out = "o_heads" if multi else "o"
        self.add("GEMM O = P V", [("p", ss * e), (va, self.nkr * e)], [(out, self.nq * e)], flops=2 * ss * s.headdim)
        if multi:
            self.add("O to (B, S, H, d)", [(out, self.nq * e)], [("o", self.nq * e)])

    def backward(self):
        s, e, ss, r, d = self.s, self.s.e, self.ss, self.rows, self.s.headdim
        multi, cupy_mm = s.heads > 1, self.matmul == "cupy"
        self.probs()
        kr, vr = self.repeat("k"), self.repeat("v")
        self.add("dO copy (astype)", [("do", self.nq * e)], [("do_copy", self.nq * e)])
        self.add("P to input dtype", [("s_fp32", ss * F32)], [("p", ss * e)])
        pa = "p"  # Pᵀ, a transposed view: taken as it is by the bf16 GEMM, copied by cupy.matmul
        if cupy_mm:
            self.add("copy Pᵀ for GEMM", [("p", ss * e)], [("p_t", ss * e)])
            pa = "p_t"
        da = self.operand("do_copy", self.nq, multi)
        self.add("GEMM dV = Pᵀ dO", [(pa, ss * e), (da, self.nq * e)], [("dv_heads", self.nkr * e)], flops=2 * ss * d)
        da = self.operand("do_copy", self.nq, multi)
        va = self.operand(vr, self.nkr, multi or cupy_mm)
        self.add("GEMM dP = dO Vᵀ", [(da, self.nq * e), (va, self.nkr * e)], [("dp", ss * e)], flops=2 * ss * d)
        # delta = (dout.astype(f32) * out.astype(f32)).sum(-1)
        self.add("dO to fp32", [("do", self.nq * e)], [("do_fp32", self.nq * F32)])
        self.add("O to fp32", [("o", self.nq * e)], [("o_fp32", self.nq * F32)])
        self.add("dO * O", [("do_fp32", self.nq * F32), ("o_fp32", self.nq * F32)], [("do_o", self.nq * F32)])
        self.add("D = rowsum", [("do_o", self.nq * F32)], [("delta", r * F32)])
        self.add("dP to fp32", [("dp", ss * e)], [("ds_fp32", ss * F32)])
        self.add("dS -= D", [("ds_fp32", ss * F32), ("delta", r * F32)], [("ds_fp32", ss * F32)])
        self.add("dS *= P", [("ds_fp32", ss * F32), ("s_fp32", ss * F32)], [("ds_fp32", ss * F32)])
        self.add("dS *= scale", [("ds_fp32", ss * F32)], [("ds_fp32", ss * F32)])
        self.add("dS to input dtype", [("ds_fp32", ss * F32)], [("ds", ss * e)])
        ka = self.operand(kr, self.nkr, multi)
        dq_out = "dq_heads" if multi else "dq"
        self.add("GEMM dQ = dS K", [("ds", ss * e), (ka, self.nkr * e)], [(dq_out, self.nq * e)], flops=2 * ss * d)
        if cupy_mm:
            self.add("copy dSᵀ for GEMM", [("ds", ss * e)], [("ds_t", ss * e)])
        qa = self.operand("q", self.nq, multi)
        self.add("GEMM dK = dSᵀ Q", [("ds_t" if cupy_mm else "ds", ss * e), (qa, self.nq * e)],
                 [("dk_heads", self.nkr * e)], flops=2 * ss * d)
        dk, dv = "dk_heads", "dv_heads"
        if s.group > 1:  # sum over the group in fp32: astype, sum(axis=2), astype
            for g in ("dk", "dv"):
                self.add(f"{g} to fp32", [(f"{g}_heads", self.nkr * e)], [(f"{g}_heads_fp32", self.nkr * F32)])
                self.add(f"{g} group sum", [(f"{g}_heads_fp32", self.nkr * F32)], [(f"{g}_sum", self.nk * F32)])
                self.add(f"{g} to input dtype", [(f"{g}_sum", self.nk * F32)], [(f"{g}_kv", self.nk * e)])
            dk, dv = "dk_kv", "dv_kv"
        if multi:
            self.add("dQ to (B, S, H, d)", [(dq_out, self.nq * e)], [("dq", self.nq * e)])
        for src, dst in ((dk, "dk"), (dv, "dv")):
            if s.kv_heads > 1:
                self.add(f"{dst} to (B, S, H, d)", [(src, self.nk * e)], [(dst, self.nk * e)])
            else:  # already contiguous: the result is the array itself
                for k in self.kernels:
                    for table in (k.writes, k.writes_min, k.reads, k.reads_min):
                        if src in table:
                            table[dst] = table.pop(src)


def _naive(s: _Shape, direction: str, matmul: str) -> tuple[list[_Kernel], int]:
    passes = _Passes(s, matmul)
    passes.forward() if direction == "forward" else passes.backward()
    quadratic = sum(n for k in passes.kernels for table in (k.reads, k.writes)
                    for a, n in table.items() if a in _SCORE_ARRAYS)
    return passes.kernels, quadratic


# ----------------------------------------------------------------------------------------------------
# public entry point
# ----------------------------------------------------------------------------------------------------

def _tiles(impl: str, direction: str, headdim: int, block_m, block_n, hopper: bool) -> dict:
    """Tile sizes of one kernel: the row the launcher takes for the head dim (a call without softcap,
    ALiBi or dropout; ``hopper``: on sm_90, where FA2 has rows of its own), overridden where given."""
    if direction == "forward":
        table = heuristics.FA1_TILES if impl == "fa1" else heuristics.FA2_TILES
        row = table.get(headdim)
        if impl == "fa2" and row is not None:
            row = fa2.fwd_tiles(headdim, sm90=hopper)
        if row is None and (block_m is None or block_n is None):
            raise ValueError(f"{impl} has no {direction} tiles for head dim {headdim} (table: {sorted(table)}); "
                             f"pass block_m= and block_n=")
        tiles = {"block_m": block_m or row.block_m, "block_n": block_n or row.block_n}
        if impl == "fa2" and row is not None:
            tiles["warps"] = row.warps
        return tiles
    if impl == "fa1":
        row = heuristics.FA1_TILES.get(headdim)
        if block_m is not None and block_n is not None and block_m != block_n:
            raise ValueError(f"the fa1 backward has BLOCK_M = BLOCK_N (16 x bwd_key_warps); got {block_m}, {block_n}")
        block = block_m or block_n or (16 * row.bwd_key_warps if row else None)
        if block is None:
            raise ValueError(f"fa1 has no backward tiles for head dim {headdim} "
                             f"(table: {sorted(heuristics.FA1_TILES)}); pass block_m=")
        return {"block_m": block, "block_n": block, "d_split": row.bwd_d_split if row else 1}
    row = fa2.bwd_tiles(headdim, sm90=hopper) if headdim in heuristics.FA2_BWD_TILES else None
    if row is None and (block_m is None or block_n is None):
        raise ValueError(f"fa2 has no backward tiles for head dim {headdim} "
                         f"(table: {sorted(heuristics.FA2_BWD_TILES)}); pass block_m= and block_n=")
    return {"block_m": block_m or row.block_m, "block_n": block_n or row.block_n}


def _fa3_tiles(direction: str, s: _Shape, block_m, block_n) -> dict:
    """FA3's tiles as cuflash.fa3's launchers pick them for this shape, overridden where given."""
    d = s.headdim
    table = fa3.HEADDIMS if direction == "forward" else fa3.BWD_HEADDIMS
    if d not in table and (block_m is None or block_n is None):
        raise ValueError(f"fa3 has no {direction} tiles for head dim {d} (table: {sorted(table)}); "
                         f"pass block_m= and block_n=")
    if direction == "backward":
        return {"block_m": block_m or fa3.bwd_block_m(d, False), "block_n": block_n or fa3.bwd_block_n(d)}
    pack = fa3.pack_gqa(s.dims(), varlen=False)
    if d in table:
        t = fa3.fwd_tiles(d, unmasked=s.fa3_unmasked(), pack_gqa=pack, short_masked=s.fa3_short_masked())
        block_m, block_n = block_m or fa3.fwd_block_m(t), block_n or t.block_n
    if pack and block_m % s.group:
        raise ValueError(f"a GQA-packed FA3 tile holds whole groups: block_m ({block_m}) must be a multiple of "
                         f"heads / kv_heads ({s.group})")
    return {"block_m": block_m, "block_n": block_n, "pack_gqa": pack}


def _decode_tiles(s: _Shape, block_m, block_n, num_splits, num_sms: int) -> dict:
    """The decode kernel's tiles (heuristics.DECODE_TILES) and split count (the given one, else
    heuristics.decode_num_splits for ``num_sms`` SMs, as flash_attn_with_kvcache(num_splits=0))."""
    row = heuristics.DECODE_TILES.get(s.headdim)
    if row is None and block_n is None:
        raise ValueError(f"decode has no tiles for head dim {s.headdim} (table: {sorted(heuristics.DECODE_TILES)}); "
                         f"pass block_n=")
    block_m, block_n = block_m or heuristics.DECODE_BLOCK_M, block_n or row.block_n
    if num_splits is None:
        m_blocks = _cdiv(s.group * s.seqlen_q, block_m)
        num_splits = heuristics.decode_num_splits(s.batch, s.kv_heads, m_blocks, s.seqlen_k, block_n, num_sms)
    return {"block_m": block_m, "block_n": block_n, "num_splits": num_splits}


def _positive(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return value


def _formula(impl: str, direction: str, s: _Shape, tiles: dict, naive_per_score: float) -> str:
    """The leading terms, symbolic, with this call's element size and tiles."""
    half = "; causal: about half the tile pairs" if s.causal else ""
    if impl == "naive":
        return (f"≈ {naive_per_score:g}·B·H·Sq·Sk (bytes per score: the S/P passes in the input dtype and in "
                f"fp32) + O(B·H·N·d), e = {s.e} -- Θ(N·d + N²)")
    if impl == "decode":
        n = tiles["num_splits"]
        partials = (f"; {n} splits: fp32 partial O and LSE written and read by the combine, "
                    f"≤ 2·{n}·B·H·Sq·(4·d + 4)" if n > 1 else "")
        return (f"K,V 2·e·B·Hkv·⌈g·Sq/16⌉·Sk·d (each 16-row block of the group's heads × queries reads its "
                f"keys once: with g·Sq ≤ 16 the cache once){half}; Q e·B·H·Sq·d per split; O, LSE: "
                f"(e·d + 4)·B·H·Sq{partials} (e = {s.e}, g = {s.group}) -- memory-bound, Θ(Sk·d) per KV head")
    if direction == "forward":
        packed = impl == "fa3" and tiles["pack_gqa"]
        tiles_per_head = "Hkv·⌈g·Sq/BLOCK_M⌉" if packed else "H·⌈Sq/BLOCK_M⌉"
        if packed:
            half += f"; GQA packing: the g = {s.group} query heads of a KV head share each tile"
        return (f"K,V re-reads 2·e·B·{tiles_per_head}·Sk·d ≈ 2·e·B·H·Sq·Sk·d/BLOCK_M{half}; "
                f"Q, O: 2·e·B·H·Sq·d; LSE: 4·B·H·Sq (e = {s.e}, BLOCK_M = {tiles['block_m']}) -- Θ(N²·d²/M), "
                f"M ∝ BLOCK_M·d")
    stats, aux = "LSE and D (8) per visited row", "(3·e + 8)·d + 4"
    if impl == "fa3":  # LSE and D from the preprocess's padded copies, whole 64-row blocks
        stats, aux = "LSE and D (8) per row of each visited padded block", "(3·e + 8)·d + 12"
    return (f"Q, dO (2·e·d), dQ accumulator fp32 read+write (8·d) per visited row, {stats}: "
            f"≈ B·H·Sq·Sk·(2·e·d + 8·d + 8)/BLOCK_N{half}; K, V, dK, dV: 4·e·B·Hkv·Sk·d; preprocess + dQ "
            f"conversion: B·H·Sq·({aux}) (e = {s.e}, BLOCK_N = {tiles['block_n']}) -- Θ(N²·d²/M), "
            f"M ∝ BLOCK_N·d")


def predict(impl: str, *, batch: int, heads: int, kv_heads: int | None = None, seqlen_q: int,
            seqlen_k: int | None = None, headdim: int, causal: bool = False, window_size=(-1, -1),
            dtype_bytes: int = 2, direction: str = "forward", block_m: int | None = None,
            block_n: int | None = None, wave_blocks: int | None = None, naive_matmul: str = "cublas",
            num_splits: int | None = None, num_sms: int = 132, hopper: bool = True) -> dict:
    """Predicted device-memory bytes and FLOPs of one ``impl`` call (see the module docstring).

    ``impl``: "naive", "fa1", "fa2", "fa3" or "decode" (forward only: ``flash_attn_with_kvcache``, Sq new
    queries over a cache of Sk keys); ``direction``: "forward" or "backward". Tiles come from
    ``cuflash.heuristics`` (FA3: as ``cuflash.fa3`` picks them for the shape) unless ``block_m`` /
    ``block_n`` override them. ``wave_blocks``: thread blocks resident at once, for the lower bound (None:
    the whole grid; FA3's forward: its persistent grid). ``naive_matmul``: "cublas" (the bf16 path) or
    "cupy" (cupy.matmul, the fp16 path). ``num_splits``: decode's KV splits (None:
    ``heuristics.decode_num_splits`` on a GPU of ``num_sms`` SMs); other impls ignore both. fa3 and
    decode model the 16-bit kernels only (``dtype_bytes`` = 2; not the FP8 forward). ``hopper``: the tiles
    are an sm_90 GPU's (the H200 the ncu comparison runs on; FA2's backward has rows of its own there).

    Returns a dict (``RESULT_KEYS``): ``hbm_bytes`` (no L2 reuse), ``hbm_read_bytes``, ``hbm_write_bytes``,
    the ``_min`` variants (perfect L2 reuse within a wave), ``breakdown`` / ``breakdown_min`` (bytes read
    + written per array), ``kernels`` (per kernel or naive pass), ``quadratic_bytes`` (the part that grows
    with Sq·Sk: K/V re-reads, Q/dO/dQ re-reads, the score matrices), ``flops_executed``, ``flops_useful``,
    ``arithmetic_intensity`` (executed FLOP per byte), ``tiles``, ``tile_pairs_visited`` /
    ``tile_pairs_total`` (per (batch, head); per (batch, KV head) for decode and GQA-packed FA3, whose tiles
    hold the group's heads) and ``formula`` (the leading terms, in words).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}; got {direction!r}")
    if naive_matmul not in NAIVE_MATMULS:
        raise ValueError(f"naive_matmul must be one of {NAIVE_MATMULS}; got {naive_matmul!r}")
    kv_heads = heads if kv_heads is None else kv_heads
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    for name, value in (("batch", batch), ("heads", heads), ("kv_heads", kv_heads), ("seqlen_q", seqlen_q),
                        ("seqlen_k", seqlen_k), ("headdim", headdim), ("dtype_bytes", dtype_bytes)):
        _positive(name, value)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if wave_blocks is not None:
        _positive("wave_blocks", wave_blocks)
    window = tuple(int(w) for w in window_size)
    if len(window) != 2 or min(window) < -1:
        raise ValueError(f"window_size must be (left, right) with -1 = unbounded; got {window_size!r}")
    if impl == "naive" and window != (-1, -1):
        raise ValueError("the naive attention (cuflash.reference.attention_naive) has no sliding window")
    if impl in ("fa3", "decode") and dtype_bytes != 2:
        raise ValueError(f"{impl} is modelled for 16-bit inputs (dtype_bytes=2) only; got {dtype_bytes}")
    if impl == "decode" and direction != "forward":
        raise ValueError("decode (flash_attn_with_kvcache) has no backward")
    if num_splits is not None:
        _positive("num_splits", num_splits)
    _positive("num_sms", num_sms)
    s = _Shape(batch, heads, kv_heads, seqlen_q, seqlen_k, headdim, bool(causal), window, dtype_bytes)

    useful_pairs = visible_pairs(**s.mask_kw())
    per_pair = 4 if direction == "forward" else 10
    flops_useful = batch * heads * useful_pairs * per_pair * headdim
    naive_per_score = 0.0
    if impl == "naive":
        tiles = {}
        kernels, quadratic = _naive(s, direction, naive_matmul)
        visited, total = 1, 1
        mask_build = 7 * seqlen_q * seqlen_k if s.causal else 0  # once, not per (batch, head)
        naive_per_score = (quadratic - mask_build) / (batch * heads * seqlen_q * seqlen_k)
    elif impl == "decode":
        tiles = _decode_tiles(s, block_m, block_n, num_splits, num_sms)
        kernels, quadratic, visited, total = _decode(s, tiles, wave_blocks)
    elif impl == "fa3":
        tiles = _fa3_tiles(direction, s, block_m, block_n)
        build = _fa3_forward if direction == "forward" else _fa3_backward
        kernels, quadratic, visited, total = build(s, tiles, wave_blocks)
    else:
        tiles = _tiles(impl, direction, headdim, block_m, block_n, hopper)
        bm, bn = tiles["block_m"], tiles["block_n"]
        if direction == "forward":
            kernels, quadratic, visited, total = _flash_forward(
                f"{impl}_fwd", s, bm, bn, load_q_when_empty=impl == "fa1", reverse=impl == "fa2",
                wave_blocks=wave_blocks)
        else:
            per = 4 * tiles["d_split"] + 6 if impl == "fa1" else 10
            kernels, quadratic, visited, total = _flash_backward(
                f"{impl}_bwd", s, bm, bn, flops_per_pair=per * bm * bn * headdim, load_kv_when_empty=impl == "fa1",
                wave_blocks=wave_blocks)

    def totals(attr_r, attr_w):
        breakdown = {}
        for k in kernels:
            for table in (getattr(k, attr_r), getattr(k, attr_w)):
                for a, n in table.items():
                    breakdown[a] = breakdown.get(a, 0) + n
        reads = sum(sum(getattr(k, attr_r).values()) for k in kernels)
        writes = sum(sum(getattr(k, attr_w).values()) for k in kernels)
        return breakdown, reads, writes

    breakdown, reads, writes = totals("reads", "writes")
    breakdown_min, reads_min, writes_min = totals("reads_min", "writes_min")
    flops = sum(k.flops for k in kernels)
    hbm = reads + writes
    return {
        "impl": impl, "direction": direction, "batch": batch, "heads": heads, "kv_heads": kv_heads,
        "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "headdim": headdim, "causal": bool(causal),
        "window_size": list(window), "dtype_bytes": dtype_bytes,
        "hbm_bytes": hbm, "hbm_read_bytes": reads, "hbm_write_bytes": writes,
        "hbm_bytes_min": reads_min + writes_min, "hbm_read_bytes_min": reads_min, "hbm_write_bytes_min": writes_min,
        "quadratic_bytes": quadratic,
        "breakdown": breakdown, "breakdown_min": breakdown_min,
        "kernels": [k.summary() for k in kernels],
        "flops_executed": flops, "flops_useful": flops_useful,
        "arithmetic_intensity": flops / hbm if hbm else 0.0,
        "tiles": tiles, "tile_pairs_visited": visited, "tile_pairs_total": total,
        "wave_blocks": wave_blocks,
        "formula": _formula(impl, direction, s, tiles, naive_per_score),
    }


# ----------------------------------------------------------------------------------------------------
# command line: python -m cuflash iomodel
# ----------------------------------------------------------------------------------------------------

def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _impl_list(text: str) -> list[str]:
    impls = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in impls if x not in IMPLS]
    if not impls or bad:
        raise argparse.ArgumentTypeError(f"implementations are {', '.join(IMPLS)}; got {text!r}")
    return impls


def _window(text: str) -> tuple[int, int]:
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (-1 = unbounded), got {text!r}") from None
    return left, right


# decode answers another question (new queries over a cache), so it is shown when asked for
DEFAULT_IMPLS = ("naive", "fa1", "fa2", "fa3")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--impls", type=_impl_list, default=list(DEFAULT_IMPLS),
                        help=f"comma list of {','.join(IMPLS)} (default: {','.join(DEFAULT_IMPLS)})")
    parser.add_argument("--headdim", type=int, default=128, help="head dim (default 128)")
    parser.add_argument("--seqlens", type=_int_list, default=[1024, 4096, 16384],
                        help="comma list of sequence lengths, Sq = Sk = N (default: 1024,4096,16384)")
    parser.add_argument("--seqlen-k", type=int, default=None, help="fixed key length (default: = N)")
    parser.add_argument("--batch", type=int, default=1, help="batch (default 1)")
    parser.add_argument("--heads", type=int, default=16, help="query heads (default 16)")
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads, GQA (default: = heads)")
    parser.add_argument("--causal", action="store_true", help="causal mask (bottom-right aligned)")
    parser.add_argument("--window", type=_window, default=(-1, -1), help="sliding window LEFT,RIGHT")
    parser.add_argument("--direction", choices=DIRECTIONS, default="forward")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                        help="element type (2 bytes either way; fp16 takes the naive cupy.matmul path)")
    parser.add_argument("--block-m", type=int, default=None, help="override BLOCK_M of the tile table")
    parser.add_argument("--block-n", type=int, default=None, help="override BLOCK_N of the tile table")
    parser.add_argument("--wave-blocks", type=int, default=None,
                        help="resident thread blocks per wave for the L2 lower bound (default: the whole grid)")
    parser.add_argument("--decode-queries", type=int, default=1,
                        help="decode: new queries per sequence (default 1); its N is the cache length")
    parser.add_argument("--num-splits", type=int, default=None,
                        help="decode: KV splits (default: heuristics.decode_num_splits for --num-sms)")
    parser.add_argument("--num-sms", type=int, default=132, help="decode: SMs for the default splits (132: H200)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _predict_all(args) -> tuple[list[dict], list[str]]:
    results, notes = [], []
    for impl in args.impls:
        for n in args.seqlens:
            # decode: decode_queries new queries over a cache of N keys
            sq, sk = (args.decode_queries, n) if impl == "decode" else (n, args.seqlen_k or n)
            try:
                results.append(predict(
                    impl, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, seqlen_q=sq,
                    seqlen_k=sk, headdim=args.headdim, causal=args.causal,
                    window_size=args.window, dtype_bytes=2, direction=args.direction, block_m=args.block_m,
                    block_n=args.block_n, wave_blocks=args.wave_blocks,
                    naive_matmul="cupy" if args.dtype == "fp16" else "cublas", num_splits=args.num_splits,
                    num_sms=args.num_sms))
            except ValueError as exc:
                note = f"{impl}: skipped ({exc})"
                if note not in notes:
                    notes.append(note)
                break
    return results, notes


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f}" if x < 1e11 else f"{x / 1e9:.1f}"


def _print_table(results: list[dict], notes: list[str], args) -> None:
    from rich.console import Console
    from rich.table import Table

    kv = args.kv_heads or args.heads
    mask = "causal" if args.causal else ("window " + ",".join(map(str, args.window)) if args.window != (-1, -1)
                                         else "no mask")
    title = (f"cuflash IO model: {args.direction}, d = {args.headdim}, batch {args.batch}, heads {args.heads}"
             f"{'' if kv == args.heads else f' (kv {kv})'}, {mask}, {args.dtype}")
    table = Table(title=title)
    for col in ("impl", "N", "HBM GB", "HBM GB min (L2)", "× prev N", "N² part", "GFLOP exec", "GFLOP useful",
                "FLOP/B", "naive ÷ impl", "tiles"):
        table.add_column(col, justify="left" if col in ("impl", "tiles") else "right")
    naive = {r["seqlen_q"]: r["hbm_bytes"] for r in results if r["impl"] == "naive"}
    prev = {}
    for r in results:
        decode = r["impl"] == "decode"
        n = r["seqlen_k"] if decode else r["seqlen_q"]
        growth = "-"
        if r["impl"] in prev:
            pn, pb = prev[r["impl"]]
            scale = f"N ×{n / pn:g}" if decode else f"N² ×{(n / pn) ** 2:g}"  # decode reads the cache once
            growth = f"×{r['hbm_bytes'] / pb:.1f} ({scale})"
        prev[r["impl"]] = (n, r["hbm_bytes"])
        tiles = " ".join(f"{k.replace('block_', '')}={v}" for k, v in r["tiles"].items()) or "-"
        vs = f"{naive[n] / r['hbm_bytes']:.1f}" if n in naive and r["impl"] != "naive" and not decode else "-"
        table.add_row(r["impl"], str(n), _gb(r["hbm_bytes"]), _gb(r["hbm_bytes_min"]), growth,
                      f"{100 * r['quadratic_bytes'] / r['hbm_bytes']:.0f} %", f"{r['flops_executed'] / 1e9:.1f}",
                      f"{r['flops_useful'] / 1e9:.1f}", f"{r['arithmetic_intensity']:.1f}", vs, tiles)
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    console.print(table)
    seen = set()
    for r in results:
        if r["impl"] not in seen:
            seen.add(r["impl"])
            console.print(f"  {r['impl']}: {r['formula']}", highlight=False)
    wave = "the whole grid" if args.wave_blocks is None else f"{args.wave_blocks} blocks"
    for line in (
        "Theorem 2 (FlashAttention): standard attention makes Θ(N·d + N²) HBM accesses, "
        "the tiled one Θ(N²·d²/M).",
        "HBM GB: no L2 reuse between thread blocks or passes; min (L2): perfect L2 reuse within a wave "
        f"({wave}). N² part: the share of bytes that grows with Sq·Sk.",
        "FLOPs: matmuls only (2 per multiply-add); exec = whole visited tiles, useful = visible pairs; "
        "backward = 5 products (QKᵀ, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q, dS·K) = 2.5 × the forward's 2.",
    ):
        console.print("  " + line, highlight=False)
    if "decode" in seen:
        console.print(f"  decode: N = keys in the cache, {args.decode_queries} new quer"
                      f"{'y' if args.decode_queries == 1 else 'ies'} per sequence.", highlight=False)
    for note in notes:
        console.print(f"  {note}", highlight=False)


def run(args) -> int:
    results, notes = _predict_all(args)
    if args.json:
        config = {k: getattr(args, k) for k in ("impls", "headdim", "seqlens", "seqlen_k", "batch", "heads",
                                                  "kv_heads", "causal", "direction", "dtype", "block_m", "block_n",
                                                  "wave_blocks", "decode_queries", "num_splits", "num_sms")}
        config["window"] = list(args.window)
        json.dump({"config": config, "results": results, "notes": notes}, sys.stdout, indent=1)
        print()
    else:
        _print_table(results, notes, args)
    for note in notes:
        print(note, file=sys.stderr)
    return 0 if results else 2
