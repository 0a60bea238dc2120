"""CPU tier for ``cuflash.iomodel`` (predicted HBM bytes and FLOPs) and ``python -m cuflash iomodel``.

Nothing here needs a GPU: the model is arithmetic over the tile tables and the mask ranges, and the
tiny cases are checked against explicit loops over thread blocks and a brute-force mask.
"""
import importlib.util
import json
import math
from pathlib import Path

import pytest

from cuflash import heuristics, iomodel
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
    t = (heuristics.FA1_TILES if impl == "fa1" else heuristics.FA2_TILES)[d]
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
# causal, FLOPs, naive vs flash
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["fa1", "fa2"])
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
        # no L2 reuse: naive moves 56 B per score, FA 4·e·d/BLOCK_M (fa1 at d = 128: 8 B -> 7x)
        assert ratio >= (5 if (impl, d) == ("fa1", 128) else 10), (impl, d, ratio)
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
    t2 = heuristics.FA2_TILES[128]
    assert fwd("fa2", 1024, 128)["tiles"] == {"block_m": t2.block_m, "block_n": t2.block_n, "warps": t2.warps}
    t1 = heuristics.FA1_TILES[256]
    assert bwd("fa1", 1024, 256)["tiles"] == {"block_m": 16 * t1.bwd_key_warps, "block_n": 16 * t1.bwd_key_warps,
                                               "d_split": t1.bwd_d_split}
    tb = heuristics.FA2_BWD_TILES[64]
    assert bwd("fa2", 1024, 64)["tiles"] == {"block_m": tb.block_m, "block_n": tb.block_n}
    assert fwd("fa2", 1024, 128, block_m=64, block_n=64)["tiles"]["block_m"] == 64
    assert fwd("fa1", 1024, 512, block_m=32, block_n=32)["tiles"] == {"block_m": 32, "block_n": 32}
    assert fwd("naive", 1024, 128)["tiles"] == {}


@pytest.mark.parametrize("kwargs, match", [
    (dict(impl="fa3"), "impl"),
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
        (impl, n) for impl in ("naive", "fa1", "fa2") for n in (256, 1024)]
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
    for word in ("naive", "fa1", "fa2", "HBM GB", "Θ(N²·d²/M)", "BLOCK_N"):
        assert word in out


def test_cli_skips_unsupported(capsys):
    assert main(["iomodel", "--json", "--headdim", "192", "--seqlens", "256", "--impls", "fa1,fa2"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert [r["impl"] for r in doc["results"]] == ["fa2"]
    assert "fa1: skipped" in captured.err


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
