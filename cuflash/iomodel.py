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
the full Sq × Sk matrices: 4·B·H·Sq·Sk·d forward, 10·B·H·Sq·Sk·d backward. ``flops_useful`` counts only
visible (query, key) pairs: 4·d per pair forward, 10·d backward -- half of the full matrix (N(N+1)/2
pairs) for causal Sq = Sk. ``arithmetic_intensity`` = flops_executed / hbm_bytes (FLOP per byte).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

from . import heuristics
from .reference import kv_block_range

__all__ = ["IMPLS", "DIRECTIONS", "predict", "q_block_range", "visible_pairs", "add_arguments", "run"]

IMPLS = ("naive", "fa1", "fa2")
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
                   wave_blocks) -> tuple[list[_Kernel], int, int]:
    """The forward kernel. Returns (kernels, quadratic bytes, visited tile pairs per (batch, head))."""
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
    return [k], 2 * bh * kv_rows * d * e, pairs


def _preprocess(s: _Shape) -> _Kernel:
    rows = s.batch * s.heads * s.seqlen_q
    k = _Kernel("bwd_preprocess", blocks=_cdiv(rows, 4))
    k.read("o", rows * s.headdim * s.e)
    k.read("do", rows * s.headdim * s.e)
    k.write("dsum", rows * F32)
    k.write("dq_accum", rows * s.headdim * F32)
    return k


def _convert_dq(s: _Shape) -> _Kernel:
    rows = s.batch * s.heads * s.seqlen_q
    k = _Kernel("bwd_convert_dq", blocks=_cdiv(rows, 4))
    k.read("dq_accum", rows * s.headdim * F32)
    k.write("dq", rows * s.headdim * s.e)
    return k


def _flash_backward(name: str, s: _Shape, bm: int, bn: int, *, flops_per_pair: int, load_kv_when_empty: bool,
                    wave_blocks) -> tuple[list[_Kernel], int, int]:
    """Preprocess, main kernel, dQ conversion. Returns (kernels, quadratic bytes, visited pairs per (b, h))."""
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

    def blocks(batch, kv_heads):  # launch order: blockIdx.x (K block) fastest, then KV head, then batch
        for b in range(batch):
            for kvh in range(kv_heads):
                for n in range(n_n):
                    yield [((b, hq), *ranges[n]) for hq in range(kvh * s.group, (kvh + 1) * s.group)]

    if wave_blocks is None:
        q_min = _distinct_rows(blocks(1, 1), None, bm, s.seqlen_q) * bkv
    else:
        q_min = _distinct_rows(blocks(s.batch, s.kv_heads), wave_blocks, bm, s.seqlen_q)

    main = _Kernel(name, blocks=bkv * n_n, flops=s.batch * s.heads * pairs * flops_per_pair * bm * bn * d)
    main.read("k", bkv * kv_rows * d * e)
    main.read("v", bkv * kv_rows * d * e)
    main.read("q", q_rows_all * d * e, q_min * d * e)
    main.read("do", q_rows_all * d * e, q_min * d * e)
    main.read("lse", q_rows_all * F32, q_min * F32)
    main.read("dsum", q_rows_all * F32, q_min * F32)
    main.read("dq_accum", q_rows_all * d * F32, q_min * d * F32)  # fp32 atomics: read-modify-write
    main.write("dq_accum", q_rows_all * d * F32, q_min * d * F32)
    main.write("dk", bkv * s.seqlen_k * d * e)
    main.write("dv", bkv * s.seqlen_k * d * e)
    quadratic = q_rows_all * (2 * d * e + 2 * F32 + 2 * d * F32)
    return [_preprocess(s), main, _convert_dq(s)], quadratic, pairs


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

def _tiles(impl: str, direction: str, headdim: int, block_m, block_n) -> dict:
    """Tile sizes of one kernel: the heuristics table's row for the head dim, overridden where given."""
    if direction == "forward":
        table = heuristics.FA1_TILES if impl == "fa1" else heuristics.FA2_TILES
        row = table.get(headdim)
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
    row = heuristics.FA2_BWD_TILES.get(headdim)
    if row is None and (block_m is None or block_n is None):
        raise ValueError(f"fa2 has no backward tiles for head dim {headdim} "
                         f"(table: {sorted(heuristics.FA2_BWD_TILES)}); pass block_m= and block_n=")
    return {"block_m": block_m or row.block_m, "block_n": block_n or row.block_n}


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
    if direction == "forward":
        return (f"K,V re-reads 2·e·B·H·⌈Sq/BLOCK_M⌉·Sk·d ≈ 2·e·B·H·Sq·Sk·d/BLOCK_M{half}; "
                f"Q, O: 2·e·B·H·Sq·d; LSE: 4·B·H·Sq (e = {s.e}, BLOCK_M = {tiles['block_m']}) -- Θ(N²·d²/M), "
                f"M ∝ BLOCK_M·d")
    return (f"Q, dO (2·e·d), dQ accumulator fp32 read+write (8·d), LSE and D (8) per visited row: "
            f"≈ B·H·Sq·Sk·(2·e·d + 8·d + 8)/BLOCK_N{half}; K, V, dK, dV: 4·e·B·Hkv·Sk·d; preprocess + dQ "
            f"conversion: B·H·Sq·((3·e + 8)·d + 4) (e = {s.e}, BLOCK_N = {tiles['block_n']}) -- Θ(N²·d²/M), "
            f"M ∝ BLOCK_N·d")


def predict(impl: str, *, batch: int, heads: int, kv_heads: int | None = None, seqlen_q: int,
            seqlen_k: int | None = None, headdim: int, causal: bool = False, window_size=(-1, -1),
            dtype_bytes: int = 2, direction: str = "forward", block_m: int | None = None,
            block_n: int | None = None, wave_blocks: int | None = None, naive_matmul: str = "cublas") -> dict:
    """Predicted device-memory bytes and FLOPs of one ``impl`` call (see the module docstring).

    ``impl``: "naive", "fa1" or "fa2"; ``direction``: "forward" or "backward". Tiles come from
    ``cuflash.heuristics`` unless ``block_m`` / ``block_n`` override them. ``wave_blocks``: thread blocks
    resident at once, for the lower bound (None: the whole grid). ``naive_matmul``: "cublas" (the bf16
    path) or "cupy" (cupy.matmul, the fp16 path).

    Returns a dict (``RESULT_KEYS``): ``hbm_bytes`` (no L2 reuse), ``hbm_read_bytes``, ``hbm_write_bytes``,
    the ``_min`` variants (perfect L2 reuse within a wave), ``breakdown`` / ``breakdown_min`` (bytes read
    + written per array), ``kernels`` (per kernel or naive pass), ``quadratic_bytes`` (the part that grows
    with Sq·Sk: K/V re-reads, Q/dO/dQ re-reads, the score matrices), ``flops_executed``, ``flops_useful``,
    ``arithmetic_intensity`` (executed FLOP per byte), ``tiles``, ``tile_pairs_visited`` /
    ``tile_pairs_total`` (per (batch, head)) and ``formula`` (the leading terms, in words).
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
    else:
        tiles = _tiles(impl, direction, headdim, block_m, block_n)
        bm, bn = tiles["block_m"], tiles["block_n"]
        total = _cdiv(seqlen_q, bm) * _cdiv(seqlen_k, bn)
        if direction == "forward":
            kernels, quadratic, visited = _flash_forward(
                f"{impl}_fwd", s, bm, bn, load_q_when_empty=impl == "fa1", reverse=impl == "fa2",
                wave_blocks=wave_blocks)
        else:
            per = 4 * tiles["d_split"] + 6 if impl == "fa1" else 10
            kernels, quadratic, visited = _flash_backward(
                f"{impl}_bwd", s, bm, bn, flops_per_pair=per, load_kv_when_empty=impl == "fa1",
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--impls", type=_impl_list, default=list(IMPLS), help="comma list (default: naive,fa1,fa2)")
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
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _predict_all(args) -> tuple[list[dict], list[str]]:
    results, notes = [], []
    for impl in args.impls:
        for n in args.seqlens:
            try:
                results.append(predict(
                    impl, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, seqlen_q=n,
                    seqlen_k=args.seqlen_k or n, headdim=args.headdim, causal=args.causal,
                    window_size=args.window, dtype_bytes=2, direction=args.direction, block_m=args.block_m,
                    block_n=args.block_n, wave_blocks=args.wave_blocks,
                    naive_matmul="cupy" if args.dtype == "fp16" else "cublas"))
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
        n = r["seqlen_q"]
        growth = "-"
        if r["impl"] in prev:
            pn, pb = prev[r["impl"]]
            growth = f"×{r['hbm_bytes'] / pb:.1f} (N² ×{(n / pn) ** 2:g})"
        prev[r["impl"]] = (n, r["hbm_bytes"])
        tiles = " ".join(f"{k.replace('block_', '')}={v}" for k, v in r["tiles"].items()) or "-"
        vs = f"{naive[n] / r['hbm_bytes']:.1f}" if n in naive and r["impl"] != "naive" else "-"
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
    for note in notes:
        console.print(f"  {note}", highlight=False)


def run(args) -> int:
    results, notes = _predict_all(args)
    if args.json:
        config = {k: getattr(args, k) for k in ("impls", "headdim", "seqlens", "seqlen_k", "batch", "heads",
                                                  "kv_heads", "causal", "direction", "dtype", "block_m", "block_n",
                                                  "wave_blocks")}
        config["window"] = list(args.window)
        json.dump({"config": config, "results": results, "notes": notes}, sys.stdout, indent=1)
        print()
    else:
        _print_table(results, notes, args)
    for note in notes:
        print(note, file=sys.stderr)
    return 0 if results else 2
