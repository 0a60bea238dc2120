"""GPU tier for ``python -m cuflash bench``: a --quick prefill, backward and decode sweep end to end (peers
included, whatever this machine has), its JSON, --compare against the first file, and --svg; the fp8 suite
on one tiny shape (sm_90)."""
import argparse
import json
import math

import pytest

from cuflash import bench

pytestmark = pytest.mark.gpu


def run_bench(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(list(argv)))


def check_rows(rows, suite):
    assert isinstance(rows, list) and rows
    for row in rows:
        missing = set(bench.REQUIRED_KEYS) - set(row)
        assert not missing, (row["impl"], missing)
        assert row["suite"] == suite and row["dtype"] == "bf16"
        assert row["gpu"] and row["env"]["ceilings"]["bf16_matmul_tflops"] > 0
    impls = {row["impl"] for row in rows}
    assert {"cuflash-fa1", "naive"} <= impls, impls

    ours = [r for r in rows if r["impl"] == "cuflash-fa1"]
    for row in ours:
        label = (row["seqlen_q"], row["headdim"], row["causal"])
        assert row["error"] is None, (label, row["error"])
        assert row["ms"] is not None and math.isfinite(row["ms"]) and row["ms"] > 0, label
        assert row["tflops"] is not None and row["tflops"] > 0, label
        assert row["max_err"] is not None and row["max_err"] < 0.05, (label, row["max_err"])
        assert row["extra_mem_bytes"] is not None, label
    # At these tiny sizes the naive attention always fits: the speed-up vs naive must be there.
    assert all("naive" in r["speedup_vs"] for r in ours)
    for row in rows:
        if row["impl"] == "naive":
            assert row["ms"] is not None and row["max_err"] < 0.05, row
    # Every shape of the sweep appears for cuflash.
    shapes = {(r["seqlen_q"], r["headdim"], r["causal"]) for r in rows}
    assert shapes == {(r["seqlen_q"], r["headdim"], r["causal"]) for r in ours}


@pytest.mark.parametrize("suite", ["prefill", "backward"])
def test_quick_sweep_writes_json(tmp_path, suite):
    path = tmp_path / f"{suite}.json"
    assert run_bench("--quick", "--suite", suite, "--json", str(path)) == 0
    check_rows(json.loads(path.read_text()), suite)


def test_compare_and_svg(tmp_path):
    first, second, svg = tmp_path / "first.json", tmp_path / "second.json", tmp_path / "report.svg"
    argv = ["--quick", "--impls", "cuflash-fa1,naive", "--headdims", "64", "--seqlens", "512"]
    assert run_bench(*argv, "--json", str(first)) == 0
    assert run_bench(*argv, "--json", str(second), "--compare", str(first), "--svg", str(svg)) == 0
    rows = json.loads(second.read_text())
    assert {r["impl"] for r in rows} == {"cuflash-fa1", "naive"}
    assert all(r["delta_vs_old_pct"] is not None and math.isfinite(r["delta_vs_old_pct"]) for r in rows)
    assert svg.read_text().lstrip().startswith("<svg")


def test_time_fn_measures_gpu_work():
    import cupy

    a = cupy.random.default_rng(0).standard_normal((2048, 2048), dtype=cupy.float32)
    small = bench.time_fn(lambda: a @ a, warmup=2, reps=5)
    big_a = cupy.random.default_rng(0).standard_normal((4096, 4096), dtype=cupy.float32)
    big = bench.time_fn(lambda: big_a @ big_a, warmup=2, reps=5)
    assert 0 < small < big  # 8x the work takes longer


def test_decode_quick_writes_json(tmp_path):
    """--suite decode --quick end to end: cuflash on the contiguous cache and every page size, each peer found
    here on the contiguous cache; the decode keys (page_size, num_splits, host_us, note) in every row; the
    cascade case (a shared prefix against each request's own copy of it) after them."""
    path = tmp_path / "decode.json"
    assert run_bench("--quick", "--suite", "decode", "--json", str(path)) == 0
    rows = json.loads(path.read_text())
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    quick = bench.resolve(parser.parse_args(["--quick", "--suite", "decode"]))
    cascade = [r for r in rows if (r["note"] or "").startswith("cascade case")]
    rows = [r for r in rows if r not in cascade]
    batch, prefix, suffix = quick.cascade
    assert [r["impl"] for r in cascade] == ["cuflash-cascade", "cuflash-decode"]
    for row in cascade:
        assert (row["batch"], row["seqlen_k"], row["heads"], row["kv_heads"]) == (batch, prefix + suffix, 32, 8)
        assert row["error"] is None and row["ms"] > 0 and row["tbps"] > 0 and row["host_us"] > 0, row
    assert cascade[0]["max_err"] is not None and cascade[0]["max_err"] < 0.02, cascade[0]
    assert cascade[0]["speedup_vs"]["cuflash-decode"] == pytest.approx(cascade[1]["ms"] / cascade[0]["ms"])
    for row in rows:
        missing = set(bench.REQUIRED_KEYS) - set(row)
        assert not missing, (row["impl"], missing)
        assert row["suite"] == "decode" and row["dtype"] == "bf16" and row["seqlen_q"] == 1
        assert (row["heads"], row["kv_heads"], row["headdim"]) == (32, 8, 128)
        assert row["env"]["ceilings"]["copy_tbps"] > 0
        if row["impl"] != "cuflash-decode":
            assert row["page_size"] == 0 and row["num_splits"] is None
    ours = [r for r in rows if r["impl"] == "cuflash-decode"]
    want = {(b, n, p) for b, n in quick.decode_shapes for p in [0] + quick.page_sizes}
    assert {(r["batch"], r["seqlen_k"], r["page_size"]) for r in ours} == want
    for row in ours:
        label = (row["batch"], row["seqlen_k"], row["page_size"])
        assert row["error"] is None, (label, row["error"])
        assert row["ms"] is not None and math.isfinite(row["ms"]) and row["ms"] > 0, label
        assert row["tbps"] is not None and row["tbps"] > 0 and row["pct_of_ceiling"] > 0, label
        assert row["max_err"] is not None and row["max_err"] < 0.02, (label, row["max_err"])
        assert isinstance(row["num_splits"], int) and row["num_splits"] >= 1, label
        assert row["host_us"] is not None and row["host_us"] > 0, label
        assert row["note"] is None, (label, row["note"])  # captured in a graph (no eager fallback)
    # batch 1 at the longest quick cache leaves the GPU mostly idle unsplit: the heuristic splits it
    assert max(r["num_splits"] for r in ours if r["batch"] == 1) > 1
    for row in rows:  # peers: where they ran, they computed the same thing
        if row["impl"] != "cuflash-decode" and row["ms"] is not None:
            assert row["max_err"] is not None and row["max_err"] < 0.02, row


def test_fp8_suite_one_tiny_shape(tmp_path):
    """--suite fp8 on one causal shape (d = 128, N = 512): the FP8 row measured and checked against its
    dequantised inputs, the bf16 FA3 row beside it, the speed-up over it, the e4m3 matmul ceiling where
    torch has one."""
    from cuflash._device import compute_capability

    if compute_capability() < (9, 0):
        pytest.skip("the fp8 suite needs an sm_90 GPU")
    path = tmp_path / "fp8.json"
    rc = run_bench("--suite", "fp8", "--headdims", "128", "--seqlens", "512", "--total-tokens", "1024",
                   "--causal", "true", "--warmup", "1", "--reps", "3", "--json", str(path))
    rows = json.loads(path.read_text())
    by_impl = {row["impl"]: row for row in rows}
    assert rc == 0, {impl: row["error"] for impl, row in by_impl.items()}
    assert len(rows) == len(by_impl)  # one shape: one row per implementation
    for row in rows:
        missing = set(bench.REQUIRED_KEYS) - set(row)
        assert not missing, (row["impl"], missing)
        assert row["suite"] == "fp8" and (row["batch"], row["seqlen_q"], row["headdim"], row["causal"]) == (
            2, 512, 128, True)
        assert row["dtype"] == ("e4m3" if row["impl"] in bench.FP8_IMPLS else "bf16")
    ours = by_impl["cuflash-fa3-fp8"]
    assert ours["error"] is None and ours["ms"] > 0 and ours["tflops"] > 0
    # P rounded to e4m3 (2^-4 relative) over |v| up to about 4: a broken kernel is off by O(1)
    assert ours["max_err"] is not None and ours["max_err"] < 0.25, ours["max_err"]
    ceilings = ours["env"]["ceilings"]
    if ours["env"]["torch"]:
        assert ceilings["fp8_matmul_tflops"] > 0, ceilings.get("fp8_matmul_error")
        assert ours["pct_of_ceiling"] > 0
    else:
        assert ceilings["fp8_matmul_tflops"] is None and ceilings["fp8_matmul_error"]
    bf16 = by_impl.get("cuflash-fa3")
    if bf16 is not None and bf16["ms"]:
        assert bf16["max_err"] < 0.05
        assert ours["speedup_vs"]["cuflash-fa3"] == pytest.approx(bf16["ms"] / ours["ms"])
