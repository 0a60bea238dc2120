"""FA3 family (Hopper, sm_90a): variant keys, tensor maps and launches of kernels_cu/fa3/.

Q, K and V reach the kernel as TMA tensor maps (cuflash/_tma.py) over their (batch, seqlen, heads, d)
layout, so any strides that TMA accepts (16-byte aligned) work without copies.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os

import numpy as np

from . import _tma
from ._interop import dtype_name
from . import _bwd_aux, heuristics, tile_order
from ._device import device_id
from ._jit import PreparedLaunch, Variant
from ._params import (DIMS_FIELDS, DTYPE_CODES, fill_dims, fill_row_strides, fill_strides, logit_scales,
                      pointer_fields, stride_fields)
from ._validate import Dims
from .heuristics import FA3_FP8_TILES, FA3_TILES

FAMILY = "fa3"
HEADDIMS = tuple(sorted(FA3_TILES))
MIN_CC = (9, 0)
ARCHS = ("sm_90a",)  # wgmma, setmaxnreg: the arch-specific Hopper target only
FWD_FEATURES = frozenset({"causal", "window", "gqa", "softcap", "varlen"})
BWD_FEATURES = frozenset({"causal", "window", "gqa", "softcap", "varlen", "deterministic"})
# dK and dV in registers next to the five products: up to 128 the consumers split the keys (kernels_cu/fa3/
# bwd.cu), above it the head dim (bwd_wide.cu)
BWD_HEADDIMS = (64, 96, 128, 192, 256)
# Forward only, bf16 / fp16: V (and O) with another head dim than Q and K, q/k head dim -> v head dims.
# DeepSeek-V3's prefill (192 / 128) and the halves of the others; the tiles are Q and K's head dim's, and a
# narrower O leaves registers to spare. The backward and the other families need v's head dim to be q's.
FWD_HEADDIM_V = {128: (64,), 192: (128,), 256: (128,)}
THREADS = 384  # producer + two consumer warpgroups (the backward; the forward's: fwd_threads)
FP8_HEADDIMS = tuple(sorted(FA3_FP8_TILES))
# keys per K/V tile of the FP8 forward (one V^T swizzle atom): K/V descale blocks are whole multiples of it;
# FA3_FP8_TILES_WIDE's tiles (a multiple of it) where they divide the block
FP8_BLOCK_N = 128
FP8_TRANSPOSE_THREADS = 256


def fp8_whole_sequence_kv_block(seqlen_k: int) -> int:
    """The K/V descale block of a per-tensor descale (one block covering the whole sequence): seqlen_k rounded
    up to a multiple of every FP8 key tile, so that any of them divides it."""
    tables = (heuristics.FA3_FP8_TILES, heuristics.FA3_FP8_TILES_LONG, heuristics.FA3_FP8_TILES_WIDE)
    unit = math.lcm(FP8_BLOCK_N, *(t.block_n for table in tables for t in table.values()))
    return max(1, -(-seqlen_k // unit)) * unit

# common/fast_divmod.cuh's FastDivmod and common/tile_scheduler.cuh's TileOrderDivisors
FAST_DIVMOD = np.dtype([("divisor", np.uint32), ("multiplier", np.uint32), ("shift", np.uint32)], align=True)
TILE_ORDER_DIVISORS = np.dtype([(n, FAST_DIVMOD) for n in ("section_tiles", "section", "last_section", "heads")],
                               align=True)


def fast_divmod(d: int) -> tuple[int, int, int]:
    """FastDivmod(d)'s (divisor, multiplier, shift) (common/fast_divmod.cuh): n / d = (umulhi(n, m) + n) >> s."""
    shift = (d - 1).bit_length()
    return d, ((1 << 32) * ((1 << shift) - d) // d + 1) & 0xFFFFFFFF, shift


def tile_order_divisors(m_blocks: int, heads: int, batch: int, section: int) -> tuple:
    """The persistent scheduler's divisors for a call (common/tile_scheduler.cuh tile_order_divisors)."""
    pairs = heads * batch
    last_first_pair = (pairs - 1) // section * section
    return tuple(fast_divmod(d) for d in (min(section, pairs) * m_blocks, section, pairs - last_first_pair, heads))


PARAMS = np.dtype(
    pointer_fields("o", "lse", "cu_seqlens_q", "cu_seqlens_k")
    + [(f"o_{s}_stride", np.int64) for s in ("batch", "row", "head")]
    + [("row_batch_stride", np.int64), ("row_head_stride", np.int64)]
    + DIMS_FIELDS + [("scale_log2", np.float32), ("softcap_pre", np.float32)]
    + pointer_fields("q_descale", "k_descale", "v_descale")
    + [(n, np.int32) for n in ("q_descale_blocks", "q_descale_rows", "kv_descale_blocks", "kv_descale_tiles")]
    + [("sched_section", np.int32), ("sched_serpentine", np.int32), ("sched_div", TILE_ORDER_DIVISORS),
       ("row_shift", np.int32)]
    + [(n, np.int32) for n in ("tail_start", "tail_units", "tail_k_blocks", "tail_slots")]
    + pointer_fields("tail_partials", "tail_flags") + [("tail_tag", np.uint64)],
    align=True,
)
FP8_TRANSPOSE_PARAMS = np.dtype(
    pointer_fields("v", "vt") + [(f"v_{s}_stride", np.int64) for s in ("batch", "row", "head")]
    + [(n, np.int32) for n in ("seqlen_k", "keys_padded", "kv_heads")],
    align=True,
)


MAX_SMEM = 227 * 1024  # dynamic shared memory one block may have on sm_90


def _unmasked(window, dims: Dims) -> bool:
    """No causal mask or window bounds the rows: every query row sees every key (``window`` as
    _validate.window_bounds gives it, "unbounded" = the sequence length)."""
    return window[0] >= dims.seqlen_k and window[1] >= dims.seqlen_q


def _short_masked(window: tuple[int, int], dims: Dims) -> bool:
    """A mask bounds the rows and they are fewer than heuristics.FA3_3WG_MIN_MASKED_SEQLEN (fwd_tiles)."""
    return not _unmasked(window, dims) and dims.seqlen_q < heuristics.FA3_3WG_MIN_MASKED_SEQLEN


def fwd_tiles(headdim: int, fp8: bool = False, unmasked: bool = False, softcap: bool = False,
              pack_gqa: bool = False, short_masked: bool = False, long_rows: bool = False,
              kv_block: int | None = None, many_keys: bool = False) -> heuristics.Fa3Tiles:
    """The forward's tiles: for FP8 with long rows (``long_rows``: at least FA3_FP8_LONG_MIN_SEQLEN),
    FA3_FP8_TILES_WIDE where it has the head dim, its key tile divides the K/V descale block (``kv_block``;
    None: any; the kernel reads one K and one V descale per tile) and, for its P_SMEM tiles, the keys are at
    most FA3_FP8_P_SMEM_MAX_SEQLEN_K (``many_keys``: more); else FA3_FP8_TILES_LONG where it has the head
    dim; else FA3_FP8_TILES. For bf16 / fp16: FA3_TILES_3WG where it has the head dim and neither
    softcap nor GQA packing asks for registers nor the rows are short and masked (``short_masked``:
    _short_masked); else, for such short masked rows without softcap or packing, FA3_TILES_SHORT_MASKED where it
    has the head dim; else, for long rows (``long_rows``: at least FA3_LONG_MIN_SEQLEN query rows) without
    softcap or packing, FA3_TILES_LONG where it has the head dim; else FA3_TILES_UNMASKED where it has the
    head dim and no mask bounds the rows (``unmasked``); FA3_TILES otherwise."""
    if fp8:
        wide = heuristics.FA3_FP8_TILES_WIDE.get(headdim) if long_rows else None
        if wide is not None and (kv_block is None or kv_block % wide.block_n == 0) and not (wide.p_smem and many_keys):
            return wide
        if long_rows and headdim in heuristics.FA3_FP8_TILES_LONG:
            return heuristics.FA3_FP8_TILES_LONG[headdim]
        return FA3_FP8_TILES[headdim]
    if not (softcap or pack_gqa or short_masked) and headdim in heuristics.FA3_TILES_3WG:
        return heuristics.FA3_TILES_3WG[headdim]
    if short_masked and not (softcap or pack_gqa) and headdim in heuristics.FA3_TILES_SHORT_MASKED:
        return heuristics.FA3_TILES_SHORT_MASKED[headdim]
    if long_rows and not (softcap or pack_gqa) and headdim in heuristics.FA3_TILES_LONG:
        return heuristics.FA3_TILES_LONG[headdim]
    if unmasked and headdim in heuristics.FA3_TILES_UNMASKED:
        return heuristics.FA3_TILES_UNMASKED[headdim]
    return FA3_TILES[headdim]


def fp8_call_kind(dims: Dims, kv_block: int) -> dict:
    """fwd_tiles' (and fwd_variant's) FP8 arguments for a call of these dims on K/V descale blocks of
    ``kv_block`` keys."""
    return dict(long_rows=dims.seqlen_q >= heuristics.FA3_FP8_LONG_MIN_SEQLEN, kv_block=kv_block,
                many_keys=dims.seqlen_k > heuristics.FA3_FP8_P_SMEM_MAX_SEQLEN_K)


def fwd_block_m(tiles: heuristics.Fa3Tiles) -> int:
    """Query rows per forward tile: 64 per consumer warpgroup."""
    return 64 * tiles.consumers


def atom_padded(d: int, elem_bytes: int) -> int:
    """d elements of elem_bytes in whole 128-byte atom rows, as the forward's tiles hold them (d = 96 in
    bf16 as 128)."""
    return -(-d * elem_bytes // 128) * 128 // elem_bytes


def fwd_variant(headdim: int, dtype: str, softcap: bool = False, varlen: bool = False, pack_gqa: bool = False,
                fp8: bool = False, unmasked: bool = False, headdim_v: int | None = None,
                short_masked: bool = False, long_rows: bool = False, kv_block: int | None = None,
                many_keys: bool = False) -> Variant:
    """A forward variant. ``fp8``: e4m3 Q, K, V (FA3_FP8_TILES, _LONG, _WIDE) and ``dtype`` the
    output's (bf16). ``unmasked``: no causal mask or window; ``short_masked``: a mask and short rows;
    ``long_rows``: long rows (FP8's threshold or bf16 / fp16's, fwd_tiles); ``kv_block``, ``many_keys``: FP8
    with that K/V descale block and more keys than FA3_FP8_P_SMEM_MAX_SEQLEN_K (fwd_tiles).
    ``headdim_v``: V's (and O's) head dim where it differs from Q and K's (FWD_HEADDIM_V); the tiles are
    Q and K's head dim's."""
    t = fwd_tiles(headdim, fp8, unmasked, softcap, pack_gqa, short_masked, long_rows, kv_block, many_keys)
    headdim_v = headdim if headdim_v is None else headdim_v
    elem = 1 if fp8 else 2

    def padded(d):
        return atom_padded(d, elem)

    block_m = fwd_block_m(t)
    # the stream-K tail's code (fill_tail) only in the variants that calls without a mask take: d = 256's
    # 64-key tiles (causal) spill 180-280 bytes with it
    tail = not (fp8 or varlen or pack_gqa) and t in (fwd_tiles(headdim, unmasked=True, softcap=softcap, long_rows=long)
                                                     for long in (False, True))
    q_bytes, k_bytes = block_m * padded(headdim) * elem, t.block_n * padded(headdim) * elem
    v_bytes = headdim * t.block_n if fp8 else t.block_n * padded(headdim_v) * elem  # FP8: a V^T tile, d x keys
    smem = t.q_stages * q_bytes + t.stages * (k_bytes + v_bytes) + 8 * (2 * t.q_stages + 4 * t.stages) + 2048
    # (+ barriers, + 1 KB slack)
    if t.p_smem:  # FP8's P tiles (P_SMEM), 1024-aligned; without them a 16-byte placeholder, in the slack
        smem += block_m * t.block_n + 1024
    # O (16-bit) staged in shared memory for a TMA store when it fits (not at d = 256) and rows past a
    # sequence's end fall out of the tensor map (not in packed batches); see kernels_cu/fa3/fwd.cu.
    o_bytes = block_m * (headdim if fp8 else padded(headdim_v)) * 2
    store_o_tma = not varlen and not pack_gqa and smem + o_bytes <= MAX_SMEM
    if store_o_tma:
        smem += o_bytes
    else:
        smem += 16  # the unused 16-byte placeholder
    return Variant(
        FAMILY, "fa3/fwd.cu", "fa3_fwd",
        (("CUFLASH_HEADDIM", headdim),) + ((("CUFLASH_HEADDIM_V", headdim_v),) if headdim_v != headdim else ())
        + (("CUFLASH_BLOCK_N", t.block_n), ("CUFLASH_STAGES", t.stages),
           ("CUFLASH_DTYPE", DTYPE_CODES[dtype]), ("CUFLASH_SOFTCAP", int(softcap)), ("CUFLASH_VARLEN", int(varlen)),
           ("CUFLASH_STORE_O_TMA", int(store_o_tma)), ("CUFLASH_PACK_GQA", int(pack_gqa)), ("CUFLASH_FP8", int(fp8)),
           ("CUFLASH_INTRA_WG_OVERLAP", int(t.intra_wg_overlap)), ("CUFLASH_PINGPONG", int(t.pingpong)),
           ("CUFLASH_CONSUMERS", t.consumers), ("CUFLASH_TAIL_SPLIT", int(tail)), ("CUFLASH_SMEM_BYTES", smem))
        + ((("CUFLASH_EXP2_EMU", t.exp2_emu),) if t.exp2_emu else ())
        + ((("CUFLASH_SPECULATIVE_MAX", 1),) if t.speculative_max else ())
        + ((("CUFLASH_P_SMEM", 1),) if t.p_smem else ())
        + ((("CUFLASH_TURN_FENCE", 1),) if t.turn_fence and not t.pingpong else ())
        + ((("CUFLASH_FAST_TILE_DIV", 0),) if not (t.fast_tile_div or fp8) else ())
        + ((("CUFLASH_Q_STAGES", t.q_stages),) if t.q_stages != 1 else ()),
        threads=128 * (1 + t.consumers), smem_bytes=smem,
    )


def fp8_transpose_variant(headdim: int) -> Variant:
    return Variant(FAMILY, "fa3/fp8_transpose_v.cu", "fp8_transpose_v", (("CUFLASH_HEADDIM", headdim),),
                   threads=FP8_TRANSPOSE_THREADS)


BWD_PARAMS = np.dtype(
    pointer_fields("cu_seqlens_q", "cu_seqlens_k", "dk", "dv") + stride_fields("dk", "dv")
    + [("row_batch_stride", np.int64), ("row_head_stride", np.int64)]
    + DIMS_FIELDS + [("scale_log2", np.float32), ("softcap_pre", np.float32), ("scale", np.float32)]
    + pointer_fields("dq_semaphore") + [("dq_plane_shift", np.int32), ("dq_plane_flags", np.int32),
                                        ("dq_plane_heads", np.int32), ("highest_first", np.int32),
                                        ("rotate_q_blocks", np.int32),
                                        ("row_shift", np.int32)],
    align=True,
)
BWD_BLOCK_M = 64


def bwd_block_m(headdim: int, softcap: bool) -> int:
    """Query rows per step of the backward (bwd.cu): heuristics.FA3_BWD_BLOCK_M where it has the head dim and
    no softcap asks for the 64-row arrangement (registers), else BWD_BLOCK_M."""
    return BWD_BLOCK_M if softcap else heuristics.FA3_BWD_BLOCK_M.get(headdim, BWD_BLOCK_M)


def bwd_block_n(headdim: int) -> int:
    """Keys per thread block of the backward: 128 (bwd.cu, two consumers of 64 keys), 64 above d = 128
    (bwd_wide.cu, both consumers on the same keys, half the head dim each)."""
    return 128 if headdim <= 128 else 64


def bwd_variant(headdim: int, dtype: str, softcap: bool = False, varlen: bool = False,
                block_m: int = BWD_BLOCK_M) -> Variant:
    defines = (("CUFLASH_HEADDIM", headdim), ("CUFLASH_DTYPE", DTYPE_CODES[dtype]), ("CUFLASH_SOFTCAP", int(softcap)),
               ("CUFLASH_VARLEN", int(varlen)))
    if headdim > 128:  # bwd_wide.cu: every tile 256 columns wide, a one-slot ring, one dQ tile per consumer
        bn, cols = bwd_block_n(headdim), 256
        kv_bytes, qd_bytes, pds_bytes = bn * cols * 2, BWD_BLOCK_M * cols * 2, bn * BWD_BLOCK_M * 2
        dq_bytes = 2 * BWD_BLOCK_M * (cols // 2) * 4  # per consumer: its 128 columns of dQ in fp32
        p_bytes = 4 * bn * BWD_BLOCK_M if not softcap else 16 * 128  # P^T in fp32 between the consumers
        smem = (2 * kv_bytes + 2 * qd_bytes + 2 * pds_bytes + dq_bytes + p_bytes + 2 * BWD_BLOCK_M * 4 + 2 * 2 * 5 * 4
                + 8 * 7)
        smem += 2048  # + 1 KB alignment slack
        return Variant(FAMILY, "fa3/bwd_wide.cu", "fa3_bwd_wide", defines + (("CUFLASH_SMEM_BYTES", smem),),
                       threads=THREADS, smem_bytes=smem)
    padded = -(-headdim // 64) * 64  # tiles hold whole 64-column atoms (d = 96 is stored as 128)
    bn = bwd_block_n(headdim)
    kv_bytes, qd_bytes = bn * padded * 2, block_m * padded * 2
    ds_bytes = -(-block_m // 64) * bn * 128  # dS^T [keys][queries] in atoms of 64 queries
    lse_bytes = 2 * 2 * -(-block_m // 32) * 32 * 4  # LSE and D rows per stage (128-byte aligned: TMA)

    def smem_bytes(dq_stages):  # per consumer dq_stages dQ tiles (two 64-column fp32 atoms) staged for its writer
        dq_bytes = 2 * dq_stages * 2 * block_m * 32 * 4
        records = 2 * 2 * dq_stages * 5 * 4  # where each staged dQ tile goes (bwd.cu: DqTile)
        barriers = 8 * (5 + 4 * dq_stages)
        return 2 * kv_bytes + 4 * qd_bytes + ds_bytes + dq_bytes + lse_bytes + records + barriers + 2048  # + alignment

    dq_stages = 2 if smem_bytes(2) <= MAX_SMEM else 1
    smem = smem_bytes(dq_stages)
    return Variant(FAMILY, "fa3/bwd.cu", "fa3_bwd",
                   defines + (("CUFLASH_BLOCK_M", block_m), ("CUFLASH_DQ_STAGES", dq_stages),
                              ("CUFLASH_SMEM_BYTES", smem)), threads=THREADS, smem_bytes=smem)


def _row_kinds(headdim: int) -> list[tuple[bool, bool, bool]]:
    """(unmasked, short_masked, long_rows) whose tiles may differ at this head dim (fwd_tiles)."""
    kinds = [(False, False, False)]
    if headdim in heuristics.FA3_TILES_UNMASKED:
        kinds.append((True, False, False))
    if headdim in heuristics.FA3_TILES_3WG:
        kinds.append((False, True, False))
    if headdim in heuristics.FA3_TILES_LONG:
        kinds += [(False, False, True), (True, False, True)]
    return kinds


def all_variants(arch: str = "sm_90a") -> list[Variant]:
    if arch not in ARCHS:
        return []
    fwd = [fwd_variant(d, dtype, softcap, varlen, pack, unmasked=unmasked, headdim_v=dv, short_masked=short_masked,
                       long_rows=long_rows)
           for dtype in DTYPE_CODES
           for d in HEADDIMS for dv in (d,) + FWD_HEADDIM_V.get(d, ()) for softcap in (False, True)
           for varlen, pack in ((False, False), (True, False), (False, True))
           for unmasked, short_masked, long_rows in _row_kinds(d)]
    fwd = list(dict.fromkeys(fwd))  # calls with and without a mask may share a variant (FA3_TILES_3WG)
    # (kv_block None: any block, the widest tiles; FP8_BLOCK_N: the blocks the widest tiles do not divide)
    fp8 = list({fwd_variant(d, "bfloat16", fp8=True, long_rows=long, kv_block=kv, many_keys=many): None
                for d in FP8_HEADDIMS for long in (False, True) for kv in (None, FP8_BLOCK_N)
                for many in (False, True)})
    fp8 += [fp8_transpose_variant(d) for d in FP8_HEADDIMS]
    bwd = [bwd_variant(d, dtype, softcap, varlen) for dtype in DTYPE_CODES for d in BWD_HEADDIMS
           for softcap in (False, True) for varlen in (False, True)]
    bwd += [bwd_variant(d, dtype, varlen=varlen, block_m=bm) for dtype in DTYPE_CODES for varlen in (False, True)
            for d, bm in heuristics.FA3_BWD_BLOCK_M.items() if bm != BWD_BLOCK_M]
    return fwd + bwd + fp8


def pack_gqa(dims: Dims, varlen: bool) -> bool:
    """Whether the forward packs the query heads of each GQA group into shared tiles: when that takes
    fewer tiles (few query rows, e.g. speculative decoding or short chunks), for fixed-length batches and
    groups that divide the 64 rows of a consumer warpgroup. Packed tiles have two consumer warpgroups
    (fwd_tiles): 128 rows."""
    group = dims.heads // dims.kv_heads
    if varlen or group < 2 or 64 % group:
        return False
    return -(-dims.seqlen_q * group // 128) < group * -(-dims.seqlen_q // 128)


def _packed_q_layout(q, group: int, block_m: int) -> _tma.MapLayout:
    """Q as (d, heads, seqlen, batch), innermost first, with (64, group, block_m / group) boxes: one box
    is a tile of block_m (query, head) rows, the group's heads fastest."""
    b, s, h, d = q.shape
    strides = (q.strides[2], q.strides[1], q.strides[0])  # bytes: head, row, batch
    return _tma.MapLayout(dtype_name(q.dtype), (d, h, s, b), strides, (64, group, block_m // group, 1))


def _map_layout(a, rows_per_box: int) -> _tma.MapLayout:
    """A 4-D map over (d, seqlen, heads, batch), innermost first, loading boxes of one 128-byte atom row
    (64 16-bit or 128 8-bit elements; past d TMA fills zeros) x rows_per_box. A packed (total, heads, d)
    array is one batch entry of ``total`` rows (the kernel adds each sequence's start)."""
    if a.ndim == 3:
        (s, h, d), b = a.shape, 1
        strides = (a.strides[0], a.strides[1], a.strides[0] * max(1, s))  # the batch stride is never used
    else:
        b, s, h, d = a.shape
        strides = (a.strides[1], a.strides[2], a.strides[0])  # bytes: row, head, batch
    return _tma.MapLayout(dtype_name(a.dtype), (d, s, h, b), strides, (128 // a.dtype.itemsize, rows_per_box, 1, 1))


# Planned launches by call layout (device, dims, options, the arrays' shapes and strides): a forward call
# whose layout was seen before costs a dictionary lookup, the tensor maps at its arrays' addresses and one
# launch. The plans read the heuristics tables when they are made: clear_plans() after editing those.
_PLANS: dict = {}
_MAX_PLANS = 1024  # (variable-length batches make one per total length: forget them all past this many)


def clear_plans() -> None:
    """Forget every planned forward launch (after an edit of cuflash.heuristics' tables, or of this module's
    planning functions, so that the next call plans again)."""
    _PLANS.clear()


def _planned(key, make):
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = make()
    return plan


def _layout_key(*arrays) -> tuple:
    return tuple((a.shape, a.strides) for a in arrays)


@dataclasses.dataclass(frozen=True)
class _ForwardPlan:
    """A bf16 / fp16 forward of one layout: the kernel's launch, its four maps' layouts (Q, K, V, O) and
    the stream-K tail's split (None without one)."""

    kernel: PreparedLaunch
    maps: tuple[_tma.MapLayout, ...]
    tail: "TailSplit | None"

    def launch(self, q, k, v, out, lse, stream, cu_seqlens) -> None:
        maps = [_tma.encoded(a.data.ptr, layout) for a, layout in zip((q, k, v, out), self.maps)]
        cu_q, cu_k = cu_seqlens or (None, None)
        values = [out.data.ptr, lse.data.ptr, 0 if cu_q is None else cu_q.data.ptr,
                  0 if cu_k is None else cu_k.data.ptr]
        tail = self.tail.buffers() if self.tail is not None else None
        if tail is not None:
            values += [tail[0].data.ptr, tail[1].data.ptr, tail[2]]
        self.kernel([address for _, address in maps], values, stream)
        del tail  # its slots go back to the pool once queued: later work on the stream runs after the kernel


_FORWARD_PER_CALL = ("o", "lse", "cu_seqlens_q", "cu_seqlens_k")
_TAIL_PER_CALL = ("tail_partials", "tail_flags", "tail_tag")


def forward(q, k, v, out, lse, dims: Dims, window: tuple[int, int], scale: float, stream, softcap: float = 0.0,
            cu_seqlens=None) -> None:
    """Launch the forward on ``stream``: writes ``out`` (like q, with v's head dim) and ``lse`` ((batch, heads, seqlen_q), or
    (heads, total_q) for packed variable-length inputs: ``cu_seqlens`` = (cu_seqlens_q, cu_seqlens_k) and
    ``dims`` carrying the longest lengths).

    Packed K/V are read by TMA a whole tile at a time: the last tile of a sequence reads rows past its end
    (the next sequence's, weighted by exactly zero), and for the last sequence the rows after
    cu_seqlens_k[-1] if the arrays have any — those must hold finite numbers (0 × NaN is NaN).
    """
    varlen = cu_seqlens is not None
    key = ("forward", device_id(), dims, window, scale, softcap, varlen, _layout_key(q, k, v, out))
    plan = _planned(key, lambda: _plan_forward(q, k, v, out, dims, window, scale, softcap, varlen))
    plan.launch(q, k, v, out, lse, stream, cu_seqlens)


def _plan_forward(q, k, v, out, dims: Dims, window, scale: float, softcap: float, varlen: bool) -> _ForwardPlan:
    unmasked = _unmasked(window, dims)
    pack = pack_gqa(dims, varlen)
    short = _short_masked(window, dims)
    long = dims.seqlen_q >= heuristics.FA3_LONG_MIN_SEQLEN
    t = fwd_tiles(dims.headdim, unmasked=unmasked, softcap=softcap > 0, pack_gqa=pack, short_masked=short,
                  long_rows=long)
    block_m = fwd_block_m(t)
    group = dims.heads // dims.kv_heads
    variant = fwd_variant(dims.headdim, dims.dtype, softcap > 0, varlen, pack, unmasked=unmasked,
                          headdim_v=dims.headdim_v, short_masked=short, long_rows=long)
    map_q = _packed_q_layout(q, group, block_m) if pack else _map_layout(q, block_m)
    # each consumer warpgroup stores its 64 rows of O (STORE_O_TMA variants)
    maps = (map_q, _map_layout(k, t.block_n), _map_layout(v, t.block_n), _map_layout(out, 64))
    p = np.zeros(1, PARAMS)
    fill_strides(p, "o", out)
    fill_row_strides(p, dims, q.shape[0] if varlen else None)
    fill_dims(p, dims, window)
    p["scale_log2"], p["softcap_pre"] = logit_scales(scale, softcap)
    budget = heuristics.fa3_l2_section_kib(dims.headdim, dims.seqlen_k)
    grid = fill_schedule(p, dims, window, block_m, t.block_n, 2, budget, pack, shift_rows=not varlen and not pack)
    tail = fill_tail(p, dims, block_m, t, grid) if unmasked and not varlen and not pack else None
    per_call = _FORWARD_PER_CALL + (_TAIL_PER_CALL if tail is not None else ())
    return _ForwardPlan(PreparedLaunch(variant, (grid,), p, per_call), maps, tail)


# Tags of the stream-K tail's flags (TailSplit.buffers): 64-bit, from a random start per process, never 0 (a
# flag's reset value), one per call.
_TAIL_TAGS = itertools.count(int.from_bytes(os.urandom(8), "little") >> 1 | 1)


@dataclasses.dataclass(frozen=True)
class TailSplit:
    """The stream-K tail's buffers of one layout: ``entries`` partials of ``partial_floats`` floats each
    and their flags, allocated per call (a call's tag marks its own flags, so nothing is zeroed)."""

    entries: int
    partial_floats: int

    def buffers(self):
        """(partials, flags, this call's tag)."""
        import cupy

        partials = cupy.empty(self.entries * self.partial_floats, dtype=cupy.float32)
        flags = cupy.empty(self.entries, dtype=cupy.uint64)
        return partials, flags, next(_TAIL_TAGS) & (2 ** 64 - 1) or 1


def fill_tail(p, dims: Dims, block_m: int, tiles: heuristics.Fa3Tiles, grid: int) -> TailSplit | None:
    """The stream-K tail of an unmasked fixed-length bf16 / fp16 forward into ``p`` (tail_*: kernels_cu/
    common/tile_scheduler.cuh TailSplit) where tile_order.tail_split takes one; returns its buffers' sizes
    (None without a tail). Every tile sees all ceil(seqlen_k / block_n) K tiles."""
    m_blocks, pairs = _tile_counts(dims, block_m, False)
    k_blocks = -(-dims.seqlen_k // tiles.block_n)
    split = tile_order.tail_split(m_blocks * pairs, grid, k_blocks)
    if split is None:
        return None
    start, units, slots = split
    tail_tiles = m_blocks * pairs - start
    # O's columns in a bf16 / fp16 forward (fa3/fwd.cu OD); a partial holds OD / 8 + 1 float4 per thread
    od = atom_padded(dims.headdim_v or dims.headdim, 2)
    p["tail_start"], p["tail_units"], p["tail_k_blocks"], p["tail_slots"] = start, units, k_blocks, slots
    return TailSplit(tail_tiles * slots * tiles.consumers, (od // 8 + 1) * 128 * 4)


def fill_schedule(p, dims: Dims, window, block_m: int, block_n: int, elem_bytes: int, budget_kib: int,
                  pack: bool = False, shift_rows: bool = False) -> int:
    """The persistent forward's tile order into ``p`` (sched_section, sched_serpentine, row_shift:
    ``schedule``) for tiles of block_m query rows and block_n keys; returns the grid (one block per SM, at
    most one per tile). ``pack``: GQA packing (a tile's rows are the (query, head) pairs of a KV head's
    group); ``shift_rows``: the variant takes a row_shift."""
    m_blocks, pairs = _tile_counts(dims, block_m, pack)
    grid = min(m_blocks * pairs, _sm_count())  # persistent: each block walks tiles blockIdx.x, + gridDim.x, ...
    p["sched_section"], p["sched_serpentine"], p["row_shift"] = schedule(
        dims, window, block_m, block_n, elem_bytes, budget_kib, pack, grid, shift_rows)
    p["sched_div"] = tile_order_divisors(m_blocks, pairs // dims.batch, dims.batch, int(p["sched_section"][0]))
    return grid


def _tile_counts(dims: Dims, block_m: int, pack: bool) -> tuple[int, int]:
    """(query blocks, (head, batch) pairs) of the forward's tiles; packed, a tile's rows are the (query,
    head) pairs of a KV head's group."""
    m_blocks = -(-dims.seqlen_q * (dims.heads // dims.kv_heads if pack else 1) // block_m)
    return m_blocks, (dims.kv_heads if pack else dims.heads) * dims.batch


def schedule(dims: Dims, window, block_m: int, block_n: int, elem_bytes: int, budget_kib: int, pack: bool,
             grid: int, shift_rows: bool = False) -> tuple[int, bool, int]:
    """(pairs per L2 section, serpentine, row_shift) of the forward's tiles on ``grid`` persistent blocks, as
    cuflash/tile_order.py chooses them within ``budget_kib`` of K/V per section; the row shift only with
    ``shift_rows`` (tile_order.row_shift decides). Also cuflash.iomodel's."""
    group = dims.heads // dims.kv_heads
    m_blocks, pairs = _tile_counts(dims, block_m, pack)
    # K and V of a (head, batch) pair, rows of whole 128-byte atoms; a GQA group's query heads share them
    kv_bytes = dims.seqlen_k * atom_padded(dims.headdim, elem_bytes) * elem_bytes * 2 // (1 if pack else group)
    fit = tile_order.section_fit(kv_bytes, budget_kib << 10)
    if shift_rows:
        shift, costs = tile_order.row_shift(m_blocks, block_m, block_n, dims.seqlen_q, dims.seqlen_k, window)
    else:
        shift, costs = 0, tile_order.tile_costs(m_blocks, block_m, block_n, dims.seqlen_q, dims.seqlen_k, window,
                                                group if pack else 1)
    kv_tile_bytes = kv_bytes // dims.seqlen_k * block_n if dims.seqlen_k else 0  # K and V of one tile of keys
    wide_ok = tile_order.wide_section_ok(pairs, grid, kv_tile_bytes, heuristics.FA3_WIDE_SECTION_MAX_STREAM_BYTES)
    return (*tile_order.choose(m_blocks, pairs, grid, fit, costs, wide_ok), shift)


@dataclasses.dataclass(frozen=True)
class _Fp8ForwardPlan:
    """An FP8 forward of one layout: V's transpose into a scratch V^T of ``vt_shape``, then the kernel on
    the maps of Q, K, V^T and O."""

    transpose: PreparedLaunch
    kernel: PreparedLaunch
    maps: tuple[_tma.MapLayout, ...]
    vt_shape: tuple[int, ...]

    def launch(self, q, k, v, out, lse, q_descale, k_descale, v_descale, stream) -> None:
        import cupy

        vt = cupy.empty(self.vt_shape, dtype=cupy.uint8)
        self.transpose([], [v.data.ptr, vt.data.ptr], stream)
        maps = [_tma.encoded(a.data.ptr, layout) for a, layout in zip((q, k, vt, out), self.maps)]
        self.kernel([address for _, address in maps],
                    [out.data.ptr, lse.data.ptr, q_descale.data.ptr, k_descale.data.ptr, v_descale.data.ptr], stream)


def forward_fp8(q, k, v, out, lse, q_descale, k_descale, v_descale, q_block: int, kv_block: int, dims: Dims,
                window: tuple[int, int], scale: float, stream) -> None:
    """The FP8 forward on ``stream``: V transposed into a scratch V^T by fa3/fp8_transpose_v.cu, then the
    kernel (kernels_cu/fa3/fwd.cu with CUFLASH_FP8).

    q, k, v: uint8 (batch, seqlen, heads or kv_heads, d) e4m3 bytes, last dim contiguous, 16-byte aligned
    base and strides. out: bf16 (batch, seqlen_q, heads, d); lse: fp32 (batch, heads, seqlen_q).
    q_descale: contiguous fp32 (batch, heads, nq), query row i using [b, h, i // q_block]; k_descale,
    v_descale: contiguous fp32 (batch, kv_heads, nk), key j using [b, hk, j // kv_block], kv_block a
    multiple of FP8_BLOCK_N. ``dims.dtype`` is the output's ("bfloat16").
    """
    if kv_block % FP8_BLOCK_N:
        raise ValueError(f"the FP8 kernel takes K/V descale blocks of a multiple of {FP8_BLOCK_N} keys; got {kv_block}")
    key = ("fp8 forward", device_id(), dims, window, scale, q_block, kv_block, q_descale.shape[2], k_descale.shape[2],
           _layout_key(q, k, v, out))
    plan = _planned(key, lambda: _plan_forward_fp8(q, k, v, out, q_descale, k_descale, q_block, kv_block, dims, window,
                                                   scale))
    plan.launch(q, k, v, out, lse, q_descale, k_descale, v_descale, stream)


def _plan_forward_fp8(q, k, v, out, q_descale, k_descale, q_block: int, kv_block: int, dims: Dims, window,
                      scale: float) -> _Fp8ForwardPlan:
    kind = fp8_call_kind(dims, kv_block)
    t = fwd_tiles(dims.headdim, fp8=True, **kind)
    keys_padded = -(-dims.seqlen_k // 16) * 16
    vt_shape = (dims.batch, dims.kv_heads, dims.headdim, keys_padded)
    tp = np.zeros(1, FP8_TRANSPOSE_PARAMS)
    for axis, name in enumerate(("batch", "row", "head")):
        tp[f"v_{name}_stride"] = v.strides[axis]
    tp["seqlen_k"], tp["keys_padded"], tp["kv_heads"] = dims.seqlen_k, keys_padded, dims.kv_heads
    transpose = PreparedLaunch(fp8_transpose_variant(dims.headdim), (-(-keys_padded // 64), dims.kv_heads, dims.batch),
                               tp, ("v", "vt"))

    variant = fwd_variant(dims.headdim, dtype_name(out.dtype), fp8=True, **kind)
    block_m = fwd_block_m(t)
    # V^T (keys, d, kv_heads, batch), innermost first: boxes of 128 keys (one swizzle atom) x d rows, block_n /
    # 128 of them per tile (vt is contiguous: its byte strides are its element strides)
    vt_strides = (keys_padded, dims.headdim * keys_padded, dims.kv_heads * dims.headdim * keys_padded)
    map_vt = _tma.MapLayout("uint8", (keys_padded, dims.headdim, dims.kv_heads, dims.batch), vt_strides,
                            (FP8_BLOCK_N, dims.headdim, 1, 1))
    maps = (_map_layout(q, block_m), _map_layout(k, t.block_n), map_vt, _map_layout(out, 64))
    p = np.zeros(1, PARAMS)
    fill_strides(p, "o", out)
    fill_row_strides(p, dims, None)
    fill_dims(p, dims, window)
    p["scale_log2"], p["softcap_pre"] = logit_scales(scale, 0.0)
    p["q_descale_blocks"], p["q_descale_rows"] = q_descale.shape[2], q_block
    p["kv_descale_blocks"], p["kv_descale_tiles"] = k_descale.shape[2], kv_block // t.block_n
    grid = fill_schedule(p, dims, window, block_m, t.block_n, 1, heuristics.FA3_FP8_L2_SECTION_KIB)
    kernel = PreparedLaunch(variant, (grid,), p, ("o", "lse", "q_descale", "k_descale", "v_descale"))
    return _Fp8ForwardPlan(transpose, kernel, maps, vt_shape)


def _sm_count() -> int:
    from ._device import device_id, device_properties

    return int(device_properties(device_id())["multiProcessorCount"])


def backward(dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, dims: Dims, window, scale: float, stream,
             softcap: float = 0.0, deterministic: bool = False, cu_seqlens=None) -> None:
    """Launch preprocess (D and a copy of the LSE in padded rows, dQ accumulator zeroed), the main kernel
    and the dQ conversion on ``stream`` (the row passes are common/bwd_aux.cu's, shared with the other
    families). ``dsum`` (the caller's unpadded D buffer) is not used: the kernel's TMA loads of LSE and D
    rows need each block to start at a 16-byte aligned offset (a load at row 113 of a head faulted with an
    illegal instruction on the H200), so both live in rows padded to a multiple of the kernel's rows per step
    (bwd_block_m) here:
    (batch, heads, pitch), or for packed batches (``cu_seqlens`` = (cu_seqlens_q, cu_seqlens_k), ``dims``
    with the longest lengths) (heads, pitch) with each sequence from a 64-aligned row (bwd.cu: lse_row0).
    ``deterministic``: the K blocks add their dQ shares of each Q block in a fixed order (zeroed counters per
    (batch, head, Q block, 64-column dQ atom)), so dQ is bit-identical run to run; with few heads in the grid
    into several accumulator planes (bwd_dq_accumulators) that the conversion sums in order. Fixed-length calls of
    bwd.cu (d <= 128) may put the last Q block's spare rows before row 0 (tile_order.bwd_row_shift): the
    padded rows and a dQ accumulator of this function's own then start with them (fa3/bwd_roles.cuh)."""
    varlen = cu_seqlens is not None
    key = ("backward", device_id(), dims, window, scale, softcap, deterministic, varlen,
           _layout_key(dout, q, k, v, out, lse, dq, dk, dv, dq_accum))
    plan = _planned(key, lambda: _plan_backward(dout, q, k, v, out, dq, dk, dv, dq_accum, dims, window, scale, softcap,
                                                deterministic, varlen))
    plan.launch(dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, stream, cu_seqlens)


@dataclasses.dataclass(frozen=True)
class _BackwardPlan:
    """An FA3 backward of one layout: the preprocess, the kernel and the dQ conversion, the kernel's nine
    maps' layouts (Q, K, V, dO, the dQ accumulator, the LSE and D rows, dK, dV), the padded rows (2, rows)
    per call, a dQ accumulator of its own (``own_accum``: its shape, with several planes) and the
    deterministic mode's counters (``semaphore``: their shape)."""

    preprocess: PreparedLaunch | None
    kernel: PreparedLaunch
    convert: PreparedLaunch | None
    maps: tuple[_tma.MapLayout, ...]
    rows: int
    own_accum: tuple[int, ...] | None
    semaphore: tuple[int, ...] | None

    def launch(self, dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dsum, stream, cu_seqlens) -> None:
        import cupy

        cu_q, cu_k = cu_seqlens or (None, None)
        rows = cupy.empty((2, self.rows), dtype=cupy.float32)  # the LSE's and D's padded rows
        lse_rows, dsum_rows = rows.data.ptr, rows.data.ptr + self.rows * 4
        if self.own_accum is not None:
            dq_accum = cupy.empty(self.own_accum, dtype=cupy.float32)
        cu_q_ptr = 0 if cu_q is None else cu_q.data.ptr
        # (bwd_aux PER_CALL: o, dout, dq_accum, dq, dsum, lse, lse_rows, cu_seqlens_q)
        if self.preprocess is not None:
            self.preprocess([], [out.data.ptr, dout.data.ptr, dq_accum.data.ptr, dq.data.ptr, dsum_rows, lse.data.ptr,
                                 lse_rows, cu_q_ptr], stream)
        maps = [_tma.encoded(ptr, layout) for ptr, layout in zip(
            (q.data.ptr, k.data.ptr, v.data.ptr, dout.data.ptr, dq_accum.data.ptr, lse_rows, dsum_rows, dk.data.ptr,
             dv.data.ptr), self.maps)]
        semaphore = None if self.semaphore is None else cupy.zeros(self.semaphore, dtype=cupy.int32)
        self.kernel([address for _, address in maps],
                    [dk.data.ptr, dv.data.ptr, cu_q_ptr, 0 if cu_k is None else cu_k.data.ptr,
                     0 if semaphore is None else semaphore.data.ptr], stream)
        if self.convert is not None:
            self.convert([], [out.data.ptr, dout.data.ptr, dq_accum.data.ptr, dq.data.ptr, dsum.data.ptr, 0, 0, 0],
                         stream)
        del rows, semaphore  # back to the pool once queued: later work on the stream runs after the kernels


def _plan_backward(dout, q, k, v, out, dq, dk, dv, dq_accum, dims: Dims, window, scale: float, softcap: float,
                   deterministic: bool, varlen: bool) -> _BackwardPlan:
    block_m = bwd_block_m(dims.headdim, softcap > 0)
    shift = 0 if varlen else bwd_row_shift(dims, window, softcap)  # the padded rows and dq_accum start with them
    if not varlen and dq_accum.shape[-2] != shift + dims.seqlen_q:
        raise ValueError(f"dq_accum has {dq_accum.shape[-2]} rows per head; this call needs {shift} + "
                         f"{dims.seqlen_q} (fa3.bwd_row_shift)")
    q_pitch = (shift + dims.seqlen_q + block_m - 1) // block_m * block_m  # Q blocks x block_m of the longest
    if varlen:  # per head: every sequence's rows from a 64-aligned start (common/padded_rows.cuh)
        pitch = varlen_row_pitch(q.shape[0], dims.batch)
        total = dims.heads * pitch
    else:
        pitch = q_pitch
        total = dims.batch * dims.heads * pitch
    if total >= 2 ** 31:
        raise ValueError(f"the FA3 backward indexes the LSE with 32-bit TMA coordinates: its padded rows (heads x "
                         f"batch x seqlen_q, or heads x total_q, padded per {block_m}) must be below 2^31; "
                         f"got {total}")
    aux_dims = dataclasses.replace(dims, batch=1, seqlen_q=q.shape[0]) if varlen else dims
    # Deterministic mode with few heads in the grid: several dQ accumulator planes (bwd_dq_accumulators), in
    # a buffer of this call's own instead of the caller's one plane.
    accum_bytes = int(np.prod(dq_accum.shape)) * 4
    planes = bwd_dq_accumulators(dims, window, accum_bytes, deterministic)
    accum_shape = tuple(dq_accum.shape)
    own_accum = None
    if planes > 1:
        own_accum = accum_shape = (planes * accum_shape[0], *accum_shape[1:])
    accum_size = int(np.prod(accum_shape))
    preprocess = _bwd_aux.prepared("bwd_preprocess", out, dout, dq, accum_size, aux_dims, scale, row_pitch=pitch,
                                   varlen_batch=dims.batch if varlen else 0, row_shift=shift, planes=planes)
    convert = _bwd_aux.prepared("bwd_convert_dq", out, dout, dq, accum_size, aux_dims, scale, row_shift=shift,
                                planes=planes)
    variant = bwd_variant(dims.headdim, dims.dtype, softcap > 0, varlen, block_m)
    block_n = bwd_block_n(dims.headdim)
    rows_map = _rows_layout(total, block_m)
    maps = (_map_layout(q, block_m), _map_layout(k, block_n), _map_layout(v, block_n), _map_layout(dout, block_m),
            _dq_accum_layout(accum_shape, block_m), rows_map, rows_map,
            _map_layout(dk, 64), _map_layout(dv, 64))  # (the kernels store dK, dV through them in 64-row boxes)
    p = np.zeros(1, BWD_PARAMS)
    semaphore = None
    if deterministic:
        atoms = -(-dims.headdim // 64)
        flags = dims.batch * dims.heads * (q_pitch // block_m) * atoms  # counters per accumulator plane
        if planes * flags >= 2 ** 31:
            raise ValueError(f"deterministic FA3 backward: dQ planes x batch x heads x Q blocks x dQ atoms must be "
                             f"below 2^31 (32-bit counter indices); got {planes} x {dims.batch} x {dims.heads} x "
                             f"{q_pitch // block_m} x {atoms}")
        semaphore = (planes, dims.batch, dims.heads, q_pitch // block_m, atoms)
        p["dq_plane_shift"], p["dq_plane_flags"] = planes.bit_length() - 1, flags
        p["dq_plane_heads"] = dims.heads if varlen else dims.batch * dims.heads  # one plane along the dQ map
    fill_strides(p, "dk", dk)
    fill_strides(p, "dv", dv)
    p["row_batch_stride"], p["row_head_stride"] = (0 if varlen else dims.heads * pitch), pitch
    fill_dims(p, dims, window)
    p["scale_log2"], p["softcap_pre"] = logit_scales(scale, softcap)
    p["scale"] = scale
    # Block order: deterministic mode needs the highest K block first (bwd.cu). The default launches the
    # lowest first: highest first under a causal mask (the shortest blocks first) measured 0.97-1.00 of it
    # on the H200 (d = 64 and 128, N = 2k and 8k; bench/NOTES.md, session 6).
    p["highest_first"] = int(deterministic)
    grid = ((dims.seqlen_k + block_n - 1) // block_n, dims.kv_heads, dims.batch)
    p["rotate_q_blocks"] = int(deterministic and bwd_rotates(window, dims, grid[0], _sm_count()))
    p["row_shift"] = shift
    kernel = PreparedLaunch(variant, grid, p, ("dk", "dv", "cu_seqlens_q", "cu_seqlens_k", "dq_semaphore"))
    return _BackwardPlan(preprocess, kernel, convert, maps, total, own_accum, semaphore)


def bwd_row_shift(dims: Dims, window, softcap: float = 0.0, cu_seqlens=None, **_) -> int:
    """Rows of padding before row 0 in the backward's first Q block (fa3/bwd_roles.cuh row_shift_of): the
    last Q block's spare rows moved there where that saves steps (tile_order.bwd_row_shift); bwd.cu only
    (fixed length, d <= 128), else 0. The caller's dq_accum holds that many rows before each head's first
    (cuflash.api sizes it by this)."""
    if cu_seqlens is not None or dims.headdim > 128:
        return 0
    return tile_order.bwd_row_shift(dims.seqlen_q, dims.seqlen_k, tuple(window),
                                    bwd_block_m(dims.headdim, softcap > 0), bwd_block_n(dims.headdim))


def bwd_dq_accumulators(dims: Dims, window, plane_bytes: int, deterministic: bool) -> int:
    """dQ accumulator planes of the backward (a power of two, one after another in one buffer, each
    ``plane_bytes`` long: the fp32 dQ accumulator's size). 1 but in deterministic mode without a mask
    bounding the rows, in the descending order (not rotated): there every K block starts at Q block 0, so
    each Q block's adds are a chain of hand-offs, one per K block above (fa3/bwd_roles.cuh dq_turn). The
    chain hides behind other heads' work when the grid has many (batch x KV heads) columns; with few, K
    block n adds into plane n mod planes, which makes each chain that many times shorter, and the
    conversion sums the planes in order (common/bwd_aux.cu): planes x batch x KV heads up to
    heuristics.FA3_DET_DQ_GRID_HEADS, at most FA3_DET_MAX_DQ_ACCUMULATORS planes and
    FA3_DET_DQ_ACCUM_MAX_BYTES of them in all. Under a causal mask or a window the K blocks reach a Q block
    one step apart and there is no chain to cut: planes only cost there (heuristics)."""
    if not deterministic or not _unmasked(window, dims):
        return 1
    k_blocks = -(-dims.seqlen_k // bwd_block_n(dims.headdim))
    if bwd_rotates(window, dims, k_blocks, _sm_count()):
        return 1
    pairs = max(1, dims.batch * dims.kv_heads)
    planes = 1
    while (2 * planes <= heuristics.FA3_DET_MAX_DQ_ACCUMULATORS
           and 2 * planes * pairs <= heuristics.FA3_DET_DQ_GRID_HEADS
           and 2 * planes * plane_bytes <= heuristics.FA3_DET_DQ_ACCUM_MAX_BYTES):
        planes *= 2
    return planes


def bwd_rotates(window, dims: Dims, k_blocks: int, num_sms: int) -> bool:
    """Whether the deterministic FA3 backward takes the rotated dQ order (common/dq_order.cuh): no mask
    bounding the rows (not causal, no window: every K block touches every Q block), and the ``k_blocks`` K
    blocks of a head (of the longest sequence) few enough to be resident at once with room to spare (one
    block per SM; a block in the rotated order may wait for blocks launched after it, so a head whose K
    blocks do not all fit could wait forever, and kernels running beside this one, e.g. NCCL's, hold SMs
    too: heuristics.FA3_BWD_ROTATE_SM_FRACTION of them)."""
    return _unmasked(window, dims) and k_blocks <= num_sms * heuristics.FA3_BWD_ROTATE_SM_FRACTION


def varlen_row_pitch(total_q: int, batch: int) -> int:
    """Rows per head of the FA3 backward's padded LSE / D rows for a packed batch: sequence b starts at
    padded_seq_start(cu_q[b], b) = round_up(cu_q[b], 64) + 64 b (common/padded_rows.cuh) and the producer
    loads whole 64-row blocks from there, so the last block ends before round_up(total_q, 64) + 64 batch (a
    block of BM > 64 rows may reach up to BM - 64 rows further, into the next sequence's rows or past the
    buffer, where TMA fills zeros: rows the kernel never uses)."""
    return (total_q + BWD_BLOCK_M - 1) // BWD_BLOCK_M * BWD_BLOCK_M + BWD_BLOCK_M * batch


def _rows_layout(size: int, block_m: int) -> _tma.MapLayout:
    """A flat fp32 array of ``size`` padded (batch, heads, pitch) rows (LSE, D) as one row of block_m-element
    boxes, which the producer loads with each (Q, dO) block. The map has a second dimension of size 1: a
    rank-1 map failed to encode on the H200 (CUDA_ERROR_INVALID_VALUE, with the empty stride list); that
    dimension's stride is never stepped and only has to be a multiple of 16."""
    row_bytes = (size * 4 + 15) // 16 * 16
    return _tma.MapLayout("float32", (size, 1), (row_bytes,), (block_m, 1), swizzle=0)


def _dq_accum_layout(shape: tuple[int, ...], block_m: int) -> _tma.MapLayout:
    """The fp32 dQ accumulator, (batch, heads, seqlen_q, d) or packed (heads, total_q, d), as a 3-D map
    (d, rows, batch x heads or heads) with block_m-row x 32-column boxes in the 128-byte swizzle, for the
    backward's reduce-adds."""
    *lead, rows, d = shape
    entries = int(np.prod(lead))
    return _tma.MapLayout("float32", (d, rows, entries), (d * 4, rows * d * 4), (32, block_m, 1), swizzle=128)
