"""CPU tier for ``cuflash.iomodel`` (predicted HBM bytes and FLOPs) and ``python -m cuflash iomodel``.

Nothing here needs a GPU: the model is arithmetic over the tile tables and the mask ranges, and the
tiny cases are checked against explicit loops over thread blocks and a brute-force mask.
"""
import importlib.util
import json
import math
from pathlib import Path

import pytest

from cuflash import fa2, fa3, heuristics, iomodel
from cuflash.__main__ import main
from cuflash.reference import mask_matrix

ROOT = Path(__file__).resolve().parents[1]


def fwd(impl, n, d=64, **kw):
    kw.setdefault("batch", 1)
    kw.setdefault("heads", 16)
    return iomodel.predict(impl, seqlen_q=n, seqlen_k=kw.pop("seqlen_k", n), headdim=d, **kw)


def bwd(impl, n, d=64, **kw):
    return fwd(impl, n, d, direction="backward", **kw)


# ---------------------------------------------------------------------------------------------------
# scaling with N
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("causal", [False, True])
def test_naive_bytes_grow_as_n_squared(direction, causal):
    a = fwd("naive", 2048, causal=causal, direction=direction)
    b = fwd("naive", 4096, causal=causal, direction=direction)
    # the score-matrix passes grow exactly as N^2, everything else exactly as N
    assert b["quadratic_bytes"] == 4 * a["quadratic_bytes"]
    assert b["hbm_bytes"] - b["quadratic_bytes"] == 2 * (a["hbm_bytes"] - a["quadratic_bytes"])
    assert 3.9 < b["hbm_bytes"] / a["hbm_bytes"] <= 4.0
    assert a["quadratic_bytes"] > 0.95 * a["hbm_bytes"]


def test_naive_bytes_per_score():
    """Forward: S written by the GEMM and cast (2e), 6 fp32 read/write passes + the cast back (44 + 4),
    P written and read (2e): 4e + 48 bytes per score; the causal mask pass adds 9."""
    for causal, per_score in ((False, 56), (True, 65)):
        r = fwd("naive", 4096, causal=causal)
        mask_build = 7 * 4096 * 4096 if causal else 0
        assert (r["quadratic_bytes"] - mask_build) == per_score * 16 * 4096 * 4096
        assert f"{per_score}·B·H·Sq·Sk" in r["formula"]
    # the fp16 path (cupy.matmul) copies the transposed Pᵀ and dSᵀ in the backward: 4e more per score
    a = bwd("naive", 1024)
    b = bwd("naive", 1024, naive_matmul="cupy")
    assert b["quadratic_bytes"] - a["quadratic_bytes"] == 8 * 16 * 1024 * 1024


@pytest.mark.parametrize("impl", ["fa1", "fa2"])
def test_flash_forward_is_quadratic_only_through_kv(impl):
    d = 128
    t = heuristics.FA1_TILES[d] if impl == "fa1" else fa2.fwd_tiles(d, sm90=True)  # (the model's default: hopper)
    a, b = fwd(impl, 2048, d), fwd(impl, 4096, d)
    for arr in ("q", "o", "lse"):  # read / written once: linear in N
        assert b["breakdown"][arr] == 2 * a["breakdown"][arr]
    for arr in ("k", "v"):  # re-read by every Q block: N^2
        assert b["breakdown"][arr] == 4 * a["breakdown"][arr]
        # = B·H·⌈N/BLOCK_M⌉·N·d·e exactly (no mask, N a multiple of the tiles)
        assert a["breakdown"][arr] == 16 * (2048 // t.block_m) * 2048 * d * 2
        # the compulsory bound reads each K/V row once
        assert a["breakdown_min"][arr] == 16 * 2048 * d * 2
    assert a["quadratic_bytes"] == a["breakdown"]["k"] + a["breakdown"]["v"]
    # Θ(N² d² / M): doubling BLOCK_M (M ∝ BLOCK_M·d) halves the K/V traffic
    c = fwd(impl, 4096, d, block_m=2 * t.block_m, block_n=t.block_n)
    assert c["breakdown"]["k"] * 2 == b["breakdown"]["k"]


@pytest.mark.parametrize("impl", ["fa1", "fa2"])
def test_flash_backward_is_quadratic_only_through_q_side(impl):
    d = 64
    a, b = bwd(impl, 2048, d), bwd(impl, 4096, d)
    bn = a["tiles"]["block_n"]
    for arr in ("k", "v", "dk", "dv", "o", "dq"):  # read / written once: linear in N
        assert b["breakdown"][arr] == 2 * a["breakdown"][arr]
    for arr in ("q", "lse"):  # re-read by every K block: N^2
        assert b["breakdown"][arr] == 4 * a["breakdown"][arr]
    # main kernel: Q and dO re-read by every K block: B·H·⌈N/BLOCK_N⌉·N·d·e each
    assert a["breakdown"]["q"] == 16 * (2048 // bn) * 2048 * d * 2
    assert b["breakdown"]["q"] == 4 * a["breakdown"]["q"]
    # fp32 dQ accumulator: zeroed (preprocess), read+written per visit (atomics), read (conversion)
    rows = 16 * 2048
    assert a["breakdown"]["dq_accum"] == rows * d * 4 * (2 + 2 * (2048 // bn))
    assert [k["name"] for k in a["kernels"]] == ["bwd_preprocess", f"{impl}_bwd", "bwd_convert_dq"]


# ---------------------------------------------------------------------------------------------------
# explicit loops over thread blocks in tiny cases
# ---------------------------------------------------------------------------------------------------

TINY = [
    dict(seqlen_q=37, seqlen_k=53, causal=False, window_size=(-1, -1)),
    dict(seqlen_q=37, seqlen_k=53, causal=True, window_size=(-1, -1)),
    dict(seqlen_q=53, seqlen_k=37, causal=True, window_size=(-1, -1)),  # top rows see nothing
    dict(seqlen_q=45, seqlen_k=45, causal=False, window_size=(7, 3)),
    dict(seqlen_q=30, seqlen_k=61, causal=True, window_size=(5, -1)),
]


def _tile_visible(vis, m, n, bm, bn):
    return vis[m * bm:(m + 1) * bm, n * bn:(n + 1) * bn].any()


def _waves(blocks, wave):
    """Group per-block lists of (key, row) into waves; distinct rows per wave summed."""
    total, seen = 0, set()
    for i, items in enumerate(blocks):
        if wave and i and i % wave == 0:
            total += len(seen)
            seen = set()
        seen.update(items)
    return total + len(seen)


@pytest.mark.parametrize("case", TINY)
@pytest.mark.parametrize("impl", ["fa1", "fa2"])
@pytest.mark.parametrize("wave", [None, 1, 5])
def test_forward_equals_explicit_block_loop(case, impl, wave):
    B, H, HKV, d, e, bm, bn = 2, 4, 2, 32, 2, 16, 8
    sq, sk = case["seqlen_q"], case["seqlen_k"]
    vis = mask_matrix(sq, sk, causal=case["causal"], window_size=case["window_size"])
    n_m, n_n = math.ceil(sq / bm), math.ceil(sk / bn)
    q = k = o = flops = pairs = 0
    kv_blocks = []
    for b in range(B):
        for h in range(H):
            for x in range(n_m):
                m = n_m - 1 - x if impl == "fa2" else x  # FA2 launches the last Q blocks first
                tiles = [n for n in range(n_n) if _tile_visible(vis, m, n, bm, bn)]
                rows = min(bm, sq - m * bm)
                if tiles or impl == "fa1":  # FA1 loads its Q tile even when it has nothing to do
                    q += rows * d * e
                o += rows * d * e
                kv_rows = []
                for n in tiles:
                    real = min(bn, sk - n * bn)
                    k += real * d * e
                    kv_rows += [(b, h // (H // HKV), n * bn + r) for r in range(real)]
                    flops += 4 * bm * bn * d
                    pairs += b == 0 and h == 0
                kv_blocks.append(kv_rows)
    r = iomodel.predict(impl, batch=B, heads=H, kv_heads=HKV, headdim=d, dtype_bytes=e, block_m=bm, block_n=bn,
                        wave_blocks=wave, **case)
    assert r["breakdown"].get("q", 0) == q
    assert r["breakdown"]["k"] == r["breakdown"]["v"] == k
    assert r["breakdown"]["o"] == o
    assert r["breakdown"]["lse"] == B * H * sq * 4
    assert r["flops_executed"] == flops
    assert r["tile_pairs_visited"] == pairs
    assert r["flops_useful"] == 4 * d * B * H * int(vis.sum())
    assert r["breakdown_min"]["k"] == _waves(kv_blocks, wave) * d * e
    assert r["hbm_bytes"] == r["hbm_read_bytes"] + r["hbm_write_bytes"] == sum(r["breakdown"].values())


@pytest.mark.parametrize("case", TINY)
@pytest.mark.parametrize("impl", ["fa1", "fa2"])
@pytest.mark.parametrize("wave", [None, 3])
def test_backward_equals_explicit_block_loop(case, impl, wave):
    B, H, HKV, d, e = 2, 4, 2, 32, 2
    bm, bn = (16, 16) if impl == "fa1" else (16, 8)
    sq, sk = case["seqlen_q"], case["seqlen_k"]
    g = H // HKV
    vis = mask_matrix(sq, sk, causal=case["causal"], window_size=case["window_size"])
    n_m, n_n = math.ceil(sq / bm), math.ceil(sk / bn)
    kv = q = pairs = 0
    q_blocks = []
    for b in range(B):
        for kvh in range(HKV):
            for n in range(n_n):  # one thread block per K block
                ms = [m for m in range(n_m) if _tile_visible(vis, m, n, bm, bn)]
                if ms or impl == "fa1":  # FA1 loads K/V even when no query sees them
                    kv += min(bn, sk - n * bn) * d * e
                rows = []
                for hq in range(kvh * g, (kvh + 1) * g):
                    for m in ms:
                        real = min(bm, sq - m * bm)
                        q += real * d * e
                        rows += [(b, hq, m * bm + r) for r in range(real)]
                        pairs += b == 0 and hq == 0
                q_blocks.append(rows)
    r = iomodel.predict(impl, batch=B, heads=H, kv_heads=HKV, headdim=d, dtype_bytes=e, block_m=bm, block_n=bn,
                        direction="backward", wave_blocks=wave, **case)
    main_k = r["kernels"][1]
    rows_all = B * H * sq
    assert r["breakdown"].get("k", 0) == r["breakdown"].get("v", 0) == kv
    assert r["breakdown"]["q"] == q
    assert r["breakdown"]["do"] == q + rows_all * d * e  # main kernel + preprocess
    assert r["breakdown"]["lse"] == q // (d * e) * 4
    assert r["breakdown"]["dk"] == r["breakdown"]["dv"] == B * HKV * sk * d * e
    assert r["breakdown"]["dq"] == rows_all * d * e
    assert r["tile_pairs_visited"] == pairs
    per_pair = 4 * 1 + 6 if impl == "fa1" else 10  # d = 32 is not in the table: d_split = 1
    assert main_k["flops_executed"] == r["flops_executed"] == per_pair * bm * bn * d * B * H * pairs
    distinct = _waves(q_blocks, wave)
    assert r["breakdown_min"]["q"] == distinct * d * e
    assert r["breakdown_min"]["dq_accum"] == rows_all * d * 4 * 2 + distinct * d * 4 * 2


@pytest.mark.parametrize("case", TINY)
def test_q_block_range_is_the_inverse_of_kv_block_range(case):
    from cuflash.reference import kv_block_range

    sq, sk = case["seqlen_q"], case["seqlen_k"]
    for bm, bn in ((16, 16), (16, 8), (8, 32)):
        kv = {(m, n) for m in range(math.ceil(sq / bm))
              for n in range(*kv_block_range(m, block_m=bm, block_n=bn, **case))}
        qq = {(m, n) for n in range(math.ceil(sk / bn))
              for m in range(*iomodel.q_block_range(n, block_m=bm, block_n=bn, **case))}
        assert kv == qq


# ---------------------------------------------------------------------------------------------------
# FA3 and decode
# ---------------------------------------------------------------------------------------------------

def _fa3_order(tile_heads, batch, n_m):
    """The scheduler's order when all (head, batch) pairs form one section: last query block first, the
    pairs fastest (kernels_cu/common/tile_scheduler.cuh)."""
    return [(m, pair % tile_heads, pair // tile_heads) for m in reversed(range(n_m))
            for pair in range(tile_heads * batch)]


@pytest.mark.parametrize("case", TINY)
@pytest.mark.parametrize("kv_heads", [4, 2])  # 2: groups of two, packed into shared tiles at these lengths
@pytest.mark.parametrize("wave", [None, 3])
def test_fa3_forward_equals_explicit_tile_loop(case, kv_heads, wave):
    B, H, d, e, bm, bn = 2, 4, 32, 2, 16, 8
    g = H // kv_heads
    sq, sk = case["seqlen_q"], case["seqlen_k"]
    vis = mask_matrix(sq, sk, causal=case["causal"], window_size=case["window_size"])
    r = iomodel.predict("fa3", batch=B, heads=H, kv_heads=kv_heads, headdim=d, dtype_bytes=e, block_m=bm,
                        block_n=bn, wave_blocks=wave, **case)
    pack = r["tiles"]["pack_gqa"]
    assert pack == (g > 1)
    rows = bm // g if pack else bm  # queries per tile
    tile_heads = kv_heads if pack else H
    n_m, n_n = math.ceil(sq / rows), math.ceil(sk / bn)
    q = k = flops = 0
    kv_rows = {}
    for m, h, b in _fa3_order(tile_heads, B, n_m):
        queries = list(range(m * rows, min(sq, (m + 1) * rows)))
        tiles = [n for n in range(n_n) if vis[queries, n * bn:(n + 1) * bn].any()]
        if tiles:  # Q for the g heads of a packed tile
            q += len(queries) * (g if pack else 1) * d * e
        keys = [(b, h if pack else h // g, n * bn + j) for n in tiles for j in range(min(bn, sk - n * bn))]
        k += len(keys) * d * e
        flops += len(tiles) * 2 * bm * bn * (d + 64)  # P V over d padded to a 64-column atom
        kv_rows[(m, h, b)] = keys
    assert r["breakdown"].get("q", 0) == q
    assert r["breakdown"]["k"] == r["breakdown"]["v"] == k
    assert r["breakdown"]["o"] == B * H * sq * d * e and r["breakdown"]["lse"] == B * H * sq * 4
    assert r["flops_executed"] == flops
    assert r["quadratic_bytes"] == 2 * k
    order = _fa3_order(tile_heads, B, n_m)
    grid = None if wave is None else min(wave, len(order))  # the persistent grid: rounds of `grid` tiles
    assert r["breakdown_min"]["k"] == _waves([kv_rows[t] for t in order], grid) * d * e


def test_fa3_tile_order_sections():
    """TileScheduler's order: one section (causal, pairs fewer than half the grid, or K/V that fit the
    section budget together: heuristics.fa3_l2_section_kib) runs last query blocks first across all pairs;
    long K/V (64k keys x d = 128: 32 MB per head) make one-pair sections, each pair's blocks in a row."""
    def order(seqlen, causal, heads, grid):
        s = iomodel._Shape(1, heads, heads, seqlen, seqlen, 128, causal, (-1, -1), 2)
        return list(iomodel._fa3_tile_order(s, seqlen // 128, heads, grid, False, 128, 128))

    assert order(1024, True, 4, 132) == _fa3_order(4, 1, 8)
    assert order(1024, False, 4, 132) == _fa3_order(4, 1, 8)  # all 4 heads' K/V fit in 32 MB
    long = order(65536, False, 2, 132)
    assert long == [(m, h, 0) for h in range(2) for m in reversed(range(512))]
    r = iomodel.predict("fa3", batch=1, heads=2, seqlen_q=65536, headdim=128, wave_blocks=132)
    # 1024 tiles in 8 rounds of 132, each reading all the keys of the heads it covers: rounds 0-2 head 0,
    # round 3 (tiles 396-527) both heads, rounds 4-7 head 1: 9 reads of a head's K
    assert r["breakdown_min"]["k"] == 9 * 65536 * 128 * 2


def test_fa3_forward_by_hand():
    """B = 1, H = 2, d = 64, 300 queries and keys, 128 x 128 tiles: Q blocks of 128, 128, 44 rows."""
    kw = dict(batch=1, heads=2, seqlen_q=300, headdim=64, block_m=128, block_n=128)
    r = iomodel.predict("fa3", **kw)
    row = 64 * 2  # bytes of a row of q, k, v or o
    assert r["breakdown"]["k"] == 2 * 3 * 300 * row  # every Q block reads all 300 keys
    assert r["breakdown"]["q"] == r["breakdown"]["o"] == 2 * 300 * row
    assert r["hbm_bytes"] == 2 * (2 * 3 * 300 * row) + 2 * 2 * 300 * row + 2 * 300 * 4
    c = iomodel.predict("fa3", causal=True, **kw)
    # causal: Q block 0 (rows 0-127) sees key tile 0, block 1 tiles 0-1, block 2 (rows 256-299) all of 0-2
    assert c["breakdown"]["k"] == 2 * (128 + 256 + 300) * row
    assert c["tile_pairs_visited"] == 1 + 2 + 3 and c["tile_pairs_total"] == 9
    # odd lengths, Sq < Sk, causal bottom-right: 100 queries see keys up to 250 + i
    o = iomodel.predict("fa3", batch=1, heads=2, seqlen_q=100, seqlen_k=350, headdim=64, causal=True,
                        block_m=64, block_n=128)
    # Q block 0 (rows 0-63): keys 0..313 (tiles 0-2: 350 rows); block 1 (64-99): keys 0..349, the same tiles
    assert o["breakdown"]["k"] == 2 * (350 + 350) * row


def test_fa3_tiles_are_the_launchers():
    for d in fa3.HEADDIMS:
        for causal in (False, True):
            t = fa3.fwd_tiles(d, unmasked=not causal, short_masked=causal)  # N = 512: short
            assert fwd("fa3", 512, d, causal=causal)["tiles"] == {
                "block_m": fa3.fwd_block_m(t), "block_n": t.block_n, "pack_gqa": False}
    for d in fa3.BWD_HEADDIMS:
        assert bwd("fa3", 1024, d)["tiles"] == {"block_m": fa3.bwd_block_m(d, False), "block_n": fa3.bwd_block_n(d)}
        assert [k["name"] for k in bwd("fa3", 1024, d)["kernels"]] == [
            "bwd_preprocess", "fa3_bwd_wide" if d > 128 else "fa3_bwd", "bwd_convert_dq"]


def test_fa3_forward_is_theta_n2_d2_over_m():
    d = 128
    bn = fwd("fa3", 4096, d)["tiles"]["block_n"]
    a = fwd("fa3", 4096, d, block_m=128, block_n=bn)
    b = fwd("fa3", 4096, d, block_m=256, block_n=bn)
    assert a["quadratic_bytes"] == 2 * b["quadratic_bytes"] == 2 * 2 * 16 * (4096 // 256) * 4096 * d * 2
    assert a["hbm_bytes"] - a["quadratic_bytes"] == b["hbm_bytes"] - b["quadratic_bytes"]  # Q, O, LSE
    c = fwd("fa3", 8192, d, block_m=128, block_n=bn)
    assert c["quadratic_bytes"] == 4 * a["quadratic_bytes"]


def test_fa3_gqa_packing_shares_kv_tiles():
    # 64 queries, 8 heads per KV head: 512 packed rows = 4 tiles per KV head instead of 8 heads x 1 tile
    r = iomodel.predict("fa3", batch=1, heads=32, kv_heads=4, seqlen_q=64, seqlen_k=4096, headdim=128)
    assert r["tiles"]["pack_gqa"] and r["tiles"]["block_m"] == 128
    assert r["breakdown"]["k"] == 4 * 4 * 4096 * 128 * 2
    assert r["breakdown"]["q"] == 32 * 64 * 128 * 2
    unpacked = iomodel.predict("fa3", batch=1, heads=32, kv_heads=4, seqlen_q=128, seqlen_k=4096, headdim=128)
    assert not unpacked["tiles"]["pack_gqa"] and unpacked["breakdown"]["k"] == 32 * 4096 * 128 * 2


@pytest.mark.parametrize("case", TINY)
@pytest.mark.parametrize("impl", ["fa2", "fa3"])
@pytest.mark.parametrize("wave", [None, 3])
def test_backward_lse_and_d_rows(case, impl, wave):
    """FA3 reads the LSE and D from the preprocess's copies in rows padded to whole blocks, a whole block
    per visit; FA2 reads the real rows of the originals."""
    B, H, HKV, d, e, bm, bn = 2, 4, 2, 32, 2, 16, 8
    sq, sk = case["seqlen_q"], case["seqlen_k"]
    vis = mask_matrix(sq, sk, causal=case["causal"], window_size=case["window_size"])
    n_m, n_n = math.ceil(sq / bm), math.ceil(sk / bn)
    visits, rows = 0, []
    for b in range(B):
        for kvh in range(HKV):
            for n in range(n_n):
                ms = [m for m in range(n_m) if _tile_visible(vis, m, n, bm, bn)]
                visits += len(ms) * (H // HKV)
                rows.append([(b, hq, m * bm + i) for hq in range(kvh * 2, kvh * 2 + 2) for m in ms
                             for i in range(bm if impl == "fa3" else min(bm, sq - m * bm))])
    r = iomodel.predict(impl, batch=B, heads=H, kv_heads=HKV, headdim=d, dtype_bytes=e, block_m=bm, block_n=bn,
                        direction="backward", wave_blocks=wave, **case)
    stat = r["breakdown"]["lse_rows" if impl == "fa3" else "lse"]
    read = sum(len(x) for x in rows) * 4
    if impl == "fa3":
        assert read == visits * bm * 4
        assert stat == read + B * H * sq * 4  # + the preprocess's copy
        assert r["breakdown"]["lse"] == B * H * sq * 4  # read by the preprocess
        assert r["breakdown"]["dsum"] == stat
        assert r["flops_executed"] == 10 * bm * bn * 64 * B * H * r["tile_pairs_visited"]  # d = 32 -> 64 columns
    else:
        assert stat == read
    assert r["breakdown_min"]["dsum"] == _waves(rows, wave) * 4 + B * H * sq * 4


def test_fa3_backward_dq_accumulator_traffic():
    d, n = 128, 4096
    r = bwd("fa3", n, d)
    bn = r["tiles"]["block_n"]
    rows = 16 * n
    # zeroed (preprocess), a TMA reduce-add per K block (read + write), read by the conversion
    assert r["breakdown"]["dq_accum"] == rows * d * 4 * (2 + 2 * (n // bn))
    main_kernel = r["kernels"][1]
    assert main_kernel["write_bytes"] == rows * d * 4 * (n // bn) + 2 * 16 * n * d * 2  # + dK, dV
    assert r["breakdown"]["q"] == r["breakdown"]["do"] - rows * d * 2 == 16 * (n // bn) * n * d * 2


def test_fa3_flops_over_padded_atoms():
    for d, cols in ((96, 128), (128, 128)):
        f, b = fwd("fa3", 1024, d), bwd("fa3", 1024, d)
        tf, tb = f["tiles"], b["tiles"]
        assert f["flops_executed"] == 16 * f["tile_pairs_visited"] * 2 * tf["block_m"] * tf["block_n"] * (d + cols)
        assert b["flops_executed"] == 16 * b["tile_pairs_visited"] * 10 * tb["block_m"] * tb["block_n"] * cols
    w = bwd("fa3", 1024, 192)  # bwd_wide.cu runs d = 192 as 256
    assert w["flops_executed"] == 16 * w["tile_pairs_visited"] * 10 * 64 * w["tiles"]["block_n"] * 256
    assert fwd("fa3", 4096, 128)["flops_executed"] == fwd("fa3", 4096, 128)["flops_useful"]


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_fa3_against_fa2_by_tile_size(direction):
    """FA3 moves fewer bytes than FA2 where its tiles are larger (forward BLOCK_M, backward BLOCK_N), and
    about as many where both tiles are equal (the backward's padded LSE / D copy: 8 bytes a row more)."""
    key = "block_m" if direction == "forward" else "block_n"
    table = fa3.HEADDIMS if direction == "forward" else fa3.BWD_HEADDIMS
    fewer = 0
    for d in sorted(set(table) & set(heuristics.FA2_TILES)):
        for causal in (False, True):
            a = fwd("fa2", 4096, d, direction=direction, causal=causal)
            b = fwd("fa3", 4096, d, direction=direction, causal=causal)
            if b["tiles"][key] > a["tiles"][key]:
                assert b["hbm_bytes"] < a["hbm_bytes"], (d, causal)
                fewer += 1
            elif all(b["tiles"][k] == a["tiles"][k] for k in ("block_m", "block_n")):
                assert b["hbm_bytes"] == pytest.approx(a["hbm_bytes"], rel=0.01), (d, causal)
    assert fewer


DECODE_CASES = [
    dict(seqlen_q=1, seqlen_k=50, causal=False, window_size=(-1, -1)),
    dict(seqlen_q=5, seqlen_k=50, causal=True, window_size=(-1, -1)),
    dict(seqlen_q=4, seqlen_k=61, causal=False, window_size=(9, 0)),
    dict(seqlen_q=7, seqlen_k=40, causal=True, window_size=(5, -1)),
]


@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("wave", [None, 2])
def test_decode_equals_explicit_block_loop(case, splits, wave):
    B, H, HKV, d, e, bm, bn = 2, 6, 2, 64, 2, 16, 8  # g = 3: a 16-row block ends inside a query's heads
    g, sq, sk = H // HKV, case["seqlen_q"], case["seqlen_k"]
    vis = mask_matrix(sq, sk, causal=case["causal"], window_size=case["window_size"])
    rows = g * sq
    q = k = pairs = partial = 0
    kv_blocks, q_blocks = [], []
    for b in range(B):
        for kvh in range(HKV):
            for m in range(math.ceil(rows / bm)):
                real = range(m * bm, min(rows, (m + 1) * bm))
                seen = vis[sorted({r // g for r in real})].any(axis=0).nonzero()[0]
                t_lo, t_hi = (seen[0] // bn, seen[-1] // bn + 1) if len(seen) else (0, 0)
                per = math.ceil((t_hi - t_lo) / splits)
                for split in range(splits):  # contiguous runs of per tiles
                    lo, hi = t_lo + split * per, min(t_lo + (split + 1) * per, t_hi)
                    tiles = range(lo, hi) if lo < hi else range(0)
                    q += len(real) * d * e
                    keys = [(b, kvh, j) for n in tiles for j in range(n * bn, min(sk, (n + 1) * bn))]
                    k += len(keys) * d * e
                    pairs += len(tiles) * (b == 0 and kvh == 0)
                    kv_blocks.append(keys)
                    q_blocks.append([(b, kvh, r) for r in real])
                    if tiles:
                        partial += sum(vis[r // g, lo * bn:hi * bn].any() for r in real)
    r = iomodel.predict("decode", batch=B, heads=H, kv_heads=HKV, headdim=d, num_splits=splits, block_n=bn,
                        wave_blocks=wave, **case)
    assert r["tiles"] == {"block_m": 16, "block_n": bn, "num_splits": splits}
    assert r["breakdown"]["q"] == q
    assert r["breakdown"]["k"] == r["breakdown"]["v"] == k
    assert r["breakdown_min"]["k"] == _waves(kv_blocks, wave) * d * e
    assert r["breakdown_min"]["q"] == _waves(q_blocks, wave) * d * e
    assert r["tile_pairs_visited"] == pairs
    assert r["flops_executed"] == B * HKV * pairs * 4 * bm * bn * d
    out = B * H * sq
    assert r["breakdown"]["o"] == out * d * e and r["breakdown"]["lse"] == out * 4
    if splits == 1:
        assert [x["name"] for x in r["kernels"]] == ["decode_fwd"]
        assert "o_partial" not in r["breakdown"]
    else:
        assert [x["name"] for x in r["kernels"]] == ["decode_fwd", "attn_combine"]
        assert r["breakdown"]["o_partial"] == splits * out * d * 4 + partial * d * 4
        assert r["breakdown"]["lse_partial"] == 2 * splits * out * 4


def test_decode_reads_the_cache_once():
    kw = dict(batch=1, seqlen_q=1, seqlen_k=32768, headdim=128)
    r = iomodel.predict("decode", heads=32, kv_heads=8, **kw)
    cache = 2 * 8 * 32768 * 128 * 2  # K and V
    assert r["breakdown"]["k"] + r["breakdown"]["v"] == r["quadratic_bytes"] == cache
    assert cache < r["hbm_bytes"] < 1.01 * cache
    bn = heuristics.DECODE_TILES[128].block_n
    assert r["tiles"]["num_splits"] == heuristics.decode_num_splits(1, 8, 1, 32768, bn, 132) > 1
    assert iomodel.predict("decode", heads=32, kv_heads=8, num_sms=16, **kw)["tiles"]["num_splits"] == 2
    # 32 heads per KV head: two 16-row blocks, each reading the cache
    mqa = iomodel.predict("decode", heads=32, kv_heads=1, num_splits=1, **kw)
    assert mqa["breakdown"]["k"] == 2 * 32768 * 128 * 2
    # the bytes grow linearly with the cache, as the prefill kernels' with N², naive's with N² too
    half = iomodel.predict("decode", heads=32, kv_heads=8, batch=1, seqlen_q=1, seqlen_k=16384, headdim=128,
                           num_splits=r["tiles"]["num_splits"])
    assert half["breakdown"]["k"] * 2 == r["breakdown"]["k"]


# ---------------------------------------------------------------------------------------------------
# causal, FLOPs, naive vs flash
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["fa1", "fa2", "fa3"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_causal_visits_about_half_the_tiles(impl, direction):
    n = 4096
    full = fwd(impl, n, 128, direction=direction)
    causal = fwd(impl, n, 128, direction=direction, causal=True)
    assert full["tile_pairs_visited"] == full["tile_pairs_total"]
    frac = causal["tile_pairs_visited"] / causal["tile_pairs_total"]
    blocks = min(n // causal["tiles"]["block_m"], n // causal["tiles"]["block_n"])
    assert 0.5 < frac <= 0.5 + 1.0 / blocks
    assert causal["flops_useful"] * 2 == pytest.approx(full["flops_useful"], rel=1.0 / n)
    assert causal["flops_executed"] / full["flops_executed"] == pytest.approx(frac)
    assert 0.5 < causal["quadratic_bytes"] / full["quadratic_bytes"] <= 0.5 + 1.0 / blocks


def test_flops_forward_and_backward():
    n, d = 4096, 128
    f = fwd("fa2", n, d)
    assert f["flops_executed"] == f["flops_useful"] == 4 * 16 * n * n * d
    b = bwd("fa2", n, d)
    assert b["flops_executed"] == b["flops_useful"] == 2.5 * f["flops_executed"]
    # FA1 at d = 128 splits the head dim over 2 warps that each recompute S and dP: 14/10 of the useful
    b1 = bwd("fa1", n, d)
    assert heuristics.FA1_TILES[d].bwd_d_split == 2
    assert b1["flops_executed"] == 14 * 16 * n * n * d
    for impl in ("naive", "fa1", "fa2"):
        r = fwd(impl, n, d)
        assert r["arithmetic_intensity"] == pytest.approx(r["flops_executed"] / r["hbm_bytes"])
    assert fwd("naive", n, d, causal=True)["flops_executed"] == f["flops_executed"]  # computes the whole matrix


@pytest.mark.parametrize("d", [64, 128])
def test_flash_forward_far_below_naive_at_16k(d):
    n = 16384
    naive = fwd("naive", n, d)
    for impl in ("fa1", "fa2"):
        r = fwd(impl, n, d)
        ratio = naive["hbm_bytes"] / r["hbm_bytes"]
        # no L2 reuse: naive moves 56 B per score, FA 4·e·d/BLOCK_M (64-row Q blocks at d = 128, fa1's and
        # fa2's: 8 B -> 7x)
        block_m = (heuristics.FA1_TILES[d] if impl == "fa1" else fa2.fwd_tiles(d, sm90=True)).block_m
        assert ratio >= (5 if (d, block_m) == (128, 64) else 10), (impl, d, ratio)
        # compulsory traffic: linear in N against naive's N^2
        assert naive["hbm_bytes_min"] / r["hbm_bytes_min"] >= 100
        assert r["hbm_bytes_min"] <= r["hbm_bytes"]


def test_flash_backward_below_naive():
    for d in (64, 128):
        naive = bwd("naive", 16384, d)
        for impl in ("fa1", "fa2"):
            assert naive["hbm_bytes"] / bwd(impl, 16384, d)["hbm_bytes"] >= 4


def test_gqa_rereads_kv_per_query_head():
    a = fwd("fa2", 4096, 128, heads=16, kv_heads=16)
    b = fwd("fa2", 4096, 128, heads=16, kv_heads=2)
    assert a["breakdown"]["k"] == b["breakdown"]["k"]  # every query head's blocks read it again
    assert b["breakdown_min"]["k"] * 8 == a["breakdown_min"]["k"]  # but only 2 distinct KV heads
    c = bwd("fa1", 4096, 128, heads=16, kv_heads=2)
    assert c["breakdown"]["dk"] == 2 * 4096 * 128 * 2  # written once per KV head, summed over the group
    assert c["breakdown"]["k"] == 2 * 4096 * 128 * 2  # read once per K block


def test_wave_bound_between_compulsory_and_no_reuse():
    kw = dict(heads=16, causal=True)
    lo = fwd("fa1", 4096, 128, **kw)
    hi = fwd("fa1", 4096, 128, wave_blocks=1, **kw)  # one block per wave: no reuse at all
    assert hi["hbm_bytes_min"] == hi["hbm_bytes"]
    mid = fwd("fa1", 4096, 128, wave_blocks=132, **kw)
    assert lo["hbm_bytes_min"] < mid["hbm_bytes_min"] < mid["hbm_bytes"]
    assert mid["hbm_bytes"] == lo["hbm_bytes"]


def test_tiles_from_tables_and_overrides():
    assert fwd("fa1", 1024, 128)["tiles"] == {"block_m": 64, "block_n": 64}
    t2 = fa2.fwd_tiles(128, sm90=True)  # (predict's default: hopper=True)
    assert fwd("fa2", 1024, 128)["tiles"] == {"block_m": t2.block_m, "block_n": t2.block_n, "warps": t2.warps}
    t1 = heuristics.FA1_TILES[256]
    assert bwd("fa1", 1024, 256)["tiles"] == {"block_m": 16 * t1.bwd_key_warps, "block_n": 16 * t1.bwd_key_warps,
                                               "d_split": t1.bwd_d_split}
    tb = fa2.bwd_tiles(64, sm90=True)  # the plain variant's row on sm_90 (predict's default: hopper=True)
    assert bwd("fa2", 1024, 64)["tiles"] == {"block_m": tb.block_m, "block_n": tb.block_n}
    tb = fa2.bwd_tiles(64)
    assert bwd("fa2", 1024, 64, hopper=False)["tiles"] == {"block_m": tb.block_m, "block_n": tb.block_n}
    assert fwd("fa2", 1024, 128, block_m=64, block_n=64)["tiles"]["block_m"] == 64
    assert fwd("fa1", 1024, 512, block_m=32, block_n=32)["tiles"] == {"block_m": 32, "block_n": 32}
    assert fwd("naive", 1024, 128)["tiles"] == {}


@pytest.mark.parametrize("kwargs, match", [
    (dict(impl="fa4"), "impl"),
    (dict(impl="fa3", dtype_bytes=1), "16-bit"),
    (dict(impl="fa3", headdim=512), "head dim"),
    (dict(impl="fa3", direction="backward", headdim=512), "head dim"),
    (dict(impl="fa3", heads=8, kv_heads=2, seqlen_q=16, block_m=66, block_n=64), "multiple of"),  # packed
    (dict(impl="decode", direction="backward"), "no backward"),
    (dict(impl="decode", headdim=96), "head dim"),
    (dict(impl="decode", num_splits=0), "num_splits"),
    (dict(direction="sideways"), "direction"),
    (dict(heads=6, kv_heads=4), "multiple"),
    (dict(impl="naive", window_size=(8, 0)), "window"),
    (dict(impl="fa1", headdim=512), "head dim"),
    (dict(impl="fa1", direction="backward", block_m=32, block_n=64), "BLOCK_M = BLOCK_N"),
    (dict(batch=0), "batch"),
    (dict(wave_blocks=0), "wave_blocks"),
])
def test_bad_arguments(kwargs, match):
    args = dict(impl="fa2", batch=1, heads=4, seqlen_q=128, headdim=64)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        iomodel.predict(args.pop("impl"), **args)


# ---------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------

def test_cli_json_schema(capsys):
    assert main(["iomodel", "--json", "--headdim", "64", "--seqlens", "256,1024", "--heads", "4",
                 "--kv-heads", "2", "--causal"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["seqlens"] == [256, 1024] and doc["config"]["causal"] is True
    assert [(r["impl"], r["seqlen_q"]) for r in doc["results"]] == [
        (impl, n) for impl in ("naive", "fa1", "fa2", "fa3") for n in (256, 1024)]  # decode when asked
    for r in doc["results"]:
        assert set(iomodel.RESULT_KEYS) <= set(r)
        assert r["kv_heads"] == 2 and r["headdim"] == 64 and r["direction"] == "forward"
        assert isinstance(r["breakdown"], dict) and r["hbm_bytes"] == sum(r["breakdown"].values())
        assert r["hbm_bytes_min"] <= r["hbm_bytes"]
        for k in r["kernels"]:
            assert {"name", "read_bytes", "write_bytes", "read_bytes_min", "write_bytes_min",
                    "flops_executed"} <= set(k)


def test_cli_table(capsys):
    assert main(["iomodel", "--headdim", "128", "--seqlens", "1024,4096", "--direction", "backward"]) == 0
    out = capsys.readouterr().out
    for word in ("naive", "fa1", "fa2", "fa3", "HBM GB", "Θ(N²·d²/M)", "BLOCK_N", "padded block"):
        assert word in out


def test_cli_skips_unsupported(capsys):
    assert main(["iomodel", "--json", "--headdim", "192", "--seqlens", "256", "--impls", "fa1,fa2"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert [r["impl"] for r in doc["results"]] == ["fa2"]
    assert "fa1: skipped" in captured.err


def test_cli_fa3_and_decode(capsys):
    assert main(["iomodel", "--json", "--impls", "fa3,decode", "--headdim", "128", "--seqlens", "1024,4096",
                 "--heads", "32", "--kv-heads", "8", "--decode-queries", "2", "--num-splits", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["impls"] == ["fa3", "decode"] and doc["config"]["num_splits"] == 3
    rows = [(r["impl"], r["seqlen_q"], r["seqlen_k"]) for r in doc["results"]]
    # decode: N is the cache, with --decode-queries new queries
    assert rows == [("fa3", 1024, 1024), ("fa3", 4096, 4096), ("decode", 2, 1024), ("decode", 2, 4096)]
    decode = doc["results"][2]
    assert decode["tiles"]["num_splits"] == 3 and [k["name"] for k in decode["kernels"]] == ["decode_fwd",
                                                                                             "attn_combine"]
    assert main(["iomodel", "--impls", "fa3,decode", "--seqlens", "1024,4096"]) == 0
    out = capsys.readouterr().out
    assert "N = keys in the cache" in out and "(N ×4)" in out
    # decode has no backward: skipped with a note, the rest still printed
    assert main(["iomodel", "--json", "--impls", "fa3,decode", "--seqlens", "1024", "--direction", "backward"]) == 0
    captured = capsys.readouterr()
    assert [r["impl"] for r in json.loads(captured.out)["results"]] == ["fa3"]
    assert "decode: skipped" in captured.err


def test_cli_rejects_unknown_impl(capsys):
    with pytest.raises(SystemExit):
        main(["iomodel", "--impls", "fa3,fa4"])
    assert "implementations are naive, fa1, fa2, fa3, decode" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# scripts/iomodel_ncu.py: CSV parsing and the dry run (the ncu run itself is for the GPU machine)
# ---------------------------------------------------------------------------------------------------

def _ncu_script():
    spec = importlib.util.spec_from_file_location("iomodel_ncu", ROOT / "scripts" / "iomodel_ncu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


NCU_CSV = '''==PROF== Connected to process 123 (/usr/bin/python3.11)
==PROF== Profiling "bwd_preprocess": 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","123","python3.11","127.0.0.1","bwd_preprocess","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,048,576"
"0","123","python3.11","127.0.0.1","bwd_preprocess","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Kbyte","2.5"
"1","123","python3.11","127.0.0.1","fa1_bwd","1","7","(256, 1, 1)","(16, 16, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","3"
"1","123","python3.11","127.0.0.1","fa1_bwd","1","7","(256, 1, 1)","(16, 16, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
==PROF== Disconnected from process 123
'''


def test_ncu_csv_parsing():
    mod = _ncu_script()
    kernels = mod.parse_ncu_csv(NCU_CSV)
    assert kernels == [
        {"id": 0, "name": "bwd_preprocess", "read_bytes": 1048576.0, "write_bytes": 2500.0},
        {"id": 1, "name": "fa1_bwd", "read_bytes": 3e6, "write_bytes": 0.0},
    ]


def test_ncu_dry_run(tmp_path, capsys):
    mod = _ncu_script()
    assert mod.main(["--dry-run", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ncu" in out and "--profile-from-start off" in out and "dram__bytes_read.sum" in out
    doc = json.loads((tmp_path / "iomodel_ncu.json").read_text())
    assert doc["cases"] and all(c["measured"] is None for c in doc["cases"])
    assert (tmp_path / "iomodel_ncu.md").read_text().startswith("#")
    for impl in ("fa3", "decode"):
        assert f"--impl {impl}" in out
    assert "--seqlen-q 1 --num-splits" in out  # decode's split count from the model, passed to the call


def test_ncu_render_reproduces_the_committed_table(tmp_path):
    """--render rewrites the markdown from a run's JSON: the committed H200 table is that rendering (its
    numbers are the run's), and the check column takes the reads."""
    mod = _ncu_script()
    committed = ROOT / "bench" / "results" / "h200-iomodel-ncu.json"
    assert mod.main(["--render", str(committed), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "iomodel_ncu.md").read_text()
    assert md == (ROOT / "bench" / "results" / "h200-iomodel-ncu.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and "GB" not in line and "---" not in line]
    cases = json.loads(committed.read_text())["cases"]
    assert len([r for r in rows if r.count("|") == 11]) == len(cases)
    inside = [c["predicted"]["hbm_read_bytes_min"] * 0.95 <= c["measured"]["read_bytes"]
              <= c["predicted"]["hbm_read_bytes"] * 1.05 for c in cases]
    assert md.count("| yes |") == sum(inside) and md.count("| no |") == len(inside) - sum(inside)


def test_ncu_default_cases():
    mod = _ncu_script()
    cases = mod._cases(mod.parse_args([]))
    pairs = {(c["impl"], c["direction"]) for c in cases}
    assert {("fa3", "forward"), ("fa3", "backward"), ("decode", "forward")} <= pairs
    assert len(cases) <= 30  # one ncu run each: the default run must stay within a few minutes
    for c in cases:
        p = mod._predict(c, "bf16")
        assert p["hbm_bytes"] > 0 and p["seqlen_k"] == c["seqlen"]
        if c["impl"] == "decode":  # one query; causal or not is the same call, measured once
            assert c["seqlen_q"] == 1 and not c["causal"]
            assert p["tiles"]["num_splits"] == c["num_splits"]
            assert "1 query" in mod._label(c)


def test_fa2_backward_takes_the_launchers_tiles_per_arch():
    """On sm_90 the plain FA2 backward runs FA2_BWD_TILES_PLAIN_SM90's rows (64 x 128 at d = 128), elsewhere
    the general table's (or FA2_BWD_TILES_PLAIN's): the model's tiles are the launcher's either way."""
    from cuflash import fa2

    for d in sorted(heuristics.FA2_BWD_TILES):
        for hopper in (True, False):
            row = fa2.bwd_tiles(d, sm90=hopper)
            got = iomodel.predict("fa2", batch=1, heads=4, seqlen_q=1024, headdim=d, direction="backward",
                                  hopper=hopper)["tiles"]
            assert got == {"block_m": row.block_m, "block_n": row.block_n}, (d, hopper)
    h = iomodel.predict("fa2", batch=1, heads=4, seqlen_q=4096, headdim=128, direction="backward")
    a = iomodel.predict("fa2", batch=1, heads=4, seqlen_q=4096, headdim=128, direction="backward", hopper=False)
    assert h["tiles"]["block_n"] == 2 * a["tiles"]["block_n"] and h["quadratic_bytes"] < 0.6 * a["quadratic_bytes"]
