"""CPU tier for ``python -m cuflash bench``: options, FLOPs, the JSON row schema, --compare, rendering and the
no-GPU path. Nothing here touches a GPU or needs torch."""
import argparse
import json

import pytest

from cuflash import bench


def parse(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def cfg(*argv):
    return bench.resolve(parse(*argv))


ENV = {"gpu": "Test GPU", "ceilings": {"bf16_matmul_tflops": 800.0, "copy_tbps": 4.0}}


def shape(n=1024, d=128, causal=False, batch=None, heads=16):
    return bench.Shape(batch or 16384 // n, heads, heads, n, n, d, causal)


# ---------------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------------

def test_defaults():
    c = cfg()
    assert c.suite == "prefill"
    assert c.impls is None  # resolved on the GPU: cuflash impls available + peers found
    assert c.headdims == [64, 128, 256]
    assert c.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert c.causal == "both" and c.causals == [False, True]
    assert c.dtype == "bf16"
    assert c.total_tokens == 16384 and c.hidden == 2048
    assert c.warmup >= 1 and c.reps >= 10
    assert c.json is None and c.compare is None and c.svg is None
    assert not c.quick and not c.include_slow


def test_comma_lists_and_choices():
    c = cfg("--suite", "backward", "--headdims", "64,256", "--seqlens", "1024, 4096", "--causal", "true",
            "--dtype", "fp16", "--impls", "fa1,cuflash-fa3,torch-cudnn,naive", "--total-tokens", "8192",
            "--hidden", "1024", "--warmup", "2", "--reps", "7")
    assert c.suite == "backward"
    assert c.headdims == [64, 256]
    assert c.seqlens == [1024, 4096]
    assert c.causals == [True]
    assert c.dtype == "fp16"
    assert c.impls == ["cuflash-fa1", "cuflash-fa3", "torch-cudnn", "naive"]
    assert (c.total_tokens, c.hidden, c.warmup, c.reps) == (8192, 1024, 2, 7)
    assert cfg("--causal", "false").causals == [False]


@pytest.mark.parametrize("argv", [
    ["--headdims", "64,x"],
    ["--seqlens", "0"],
    ["--suite", "nope"],
    ["--dtype", "fp32"],
    ["--causal", "maybe"],
])
def test_bad_options_rejected(argv):
    with pytest.raises(SystemExit):
        parse(*argv)


def test_nonpositive_sizes_rejected():
    with pytest.raises(ValueError):
        cfg("--reps", "0")
    with pytest.raises(ValueError):
        cfg("--total-tokens", "-1")


def test_quick_is_small_and_explicit_options_win():
    q = cfg("--quick")
    assert len(q.headdims) * len(q.seqlens) <= 4 and max(q.seqlens) <= 2048
    assert q.reps <= 5 and q.total_tokens <= 4096
    q = cfg("--quick", "--headdims", "256", "--reps", "9")
    assert q.headdims == [256] and q.reps == 9


def test_suites_registry():
    assert {"prefill", "backward"} <= set(bench.SUITES)
    assert bench.SUITES["prefill"].mode == "fwd" and bench.SUITES["backward"].mode == "bwd"
    for suite in bench.SUITES.values():
        assert suite.metric in ("tflops", "tbps")


def test_impl_names_resolve():
    assert set(bench.PEERS) >= {"torch-flash", "torch-cudnn", "torch-efficient", "torch-math", "flash_attn",
                                "flashinfer", "naive"}
    for name in list(bench.PEERS) + ["cuflash-fa1"]:
        assert callable(bench.factory_for(name))
    with pytest.raises(KeyError):
        bench.factory_for("torch-nonsense")


# ---------------------------------------------------------------------------------------------------
# FLOPs and shapes
# ---------------------------------------------------------------------------------------------------

def test_flops_convention():
    full = 4 * 2 * 16 * 8192 * 8192 * 128
    assert bench.flops_attention(2, 16, 8192, 8192, 128, False) == full
    assert bench.flops_attention(2, 16, 8192, 8192, 128, True) == full / 2
    assert bench.flops_attention(2, 16, 8192, 8192, 128, False, mode="bwd") == 2.5 * full
    assert bench.flops_attention(2, 16, 8192, 8192, 128, True, mode="bwd") == 2.5 * full / 2
    # Sq != Sk, causal, bottom-right aligned: Sq=2, Sk=4 -> rows see 3 and 4 keys.
    assert bench.flops_attention(1, 1, 2, 4, 1, True) == 4 * 7
    # Sq=4 > Sk=2: rows 0, 1 see nothing, rows 2, 3 see 1 and 2 keys.
    assert bench.flops_attention(1, 1, 4, 2, 1, True) == 4 * 3
    with pytest.raises(ValueError):
        bench.flops_attention(1, 1, 4, 4, 1, False, mode="sideways")


def test_attention_shapes_follow_flashattention_benchmark():
    shapes = bench.attention_shapes(128, True, [512, 16384], 16384, 2048)
    assert [(s.batch, s.seqlen_q, s.seqlen_k, s.heads, s.kv_heads) for s in shapes] == [
        (32, 512, 512, 16, 16), (1, 16384, 16384, 16, 16)]
    assert all(s.causal and s.headdim == 128 for s in shapes)
    assert [s.heads for s in (bench.attention_shapes(d, False, [1024], 16384, 2048)[0] for d in (64, 256))] == [32, 8]
    assert bench.attention_shapes(64, False, [32768], 16384, 2048)[0].batch == 1  # never zero
    assert shapes[0].label == "32×512×16"


# ---------------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------------

def test_row_schema_and_metric():
    s = shape(n=8192, d=128)
    row = bench.make_row(bench.SUITES["prefill"], "cuflash-fa1", s, "bf16", ms=2.0, max_err=1e-3,
                         extra_mem_bytes=0, env=ENV)
    assert set(bench.REQUIRED_KEYS) <= set(row)
    flops = bench.flops_attention(s.batch, s.heads, 8192, 8192, 128, False)
    assert row["tflops"] == pytest.approx(flops / 2e-3 / 1e12)
    assert row["tbps"] is None
    assert row["pct_of_ceiling"] == pytest.approx(100 * row["tflops"] / 800.0)
    assert row["gpu"] == "Test GPU" and row["env"]["ceilings"]["bf16_matmul_tflops"] == 800.0
    assert (row["suite"], row["impl"], row["dtype"], row["causal"]) == ("prefill", "cuflash-fa1", "bf16", False)
    assert (row["batch"], row["heads"], row["kv_heads"], row["seqlen_q"], row["seqlen_k"], row["headdim"]) == (
        2, 16, 16, 8192, 8192, 128)
    assert json.loads(json.dumps(row)) == row  # plain JSON types only

    bwd = bench.make_row(bench.SUITES["backward"], "cuflash-fa1", s, "bf16", ms=2.0, env=ENV)
    assert bwd["tflops"] == pytest.approx(2.5 * row["tflops"])

    failed = bench.make_row(bench.SUITES["prefill"], "naive", s, "bf16", error="out of memory", env=ENV)
    assert set(bench.REQUIRED_KEYS) <= set(failed)
    assert failed["ms"] is None and failed["tflops"] is None and failed["pct_of_ceiling"] is None
    assert failed["error"] == "out of memory" and failed["extra_mem_bytes"] is None


def _rows_for_one_shape():
    suite, s = bench.SUITES["prefill"], shape()
    mk = lambda impl, **kw: bench.make_row(suite, impl, s, "bf16", env=ENV, **kw)  # noqa: E731
    return [mk("cuflash-fa1", ms=1.0, max_err=2e-3, extra_mem_bytes=0),
            mk("torch-cudnn", ms=0.8, max_err=1e-3, extra_mem_bytes=1 << 20),
            mk("torch-flash", ms=1.5, max_err=1e-3, extra_mem_bytes=0),
            mk("naive", error="out of memory")]


def test_speedups_only_on_cuflash_rows_and_only_vs_peers_that_ran():
    rows = _rows_for_one_shape()
    bench.add_speedups(rows)
    ours = rows[0]["speedup_vs"]
    assert ours == pytest.approx({"torch-cudnn": 0.8, "torch-flash": 1.5})
    assert all(r["speedup_vs"] == {} for r in rows[1:])


# ---------------------------------------------------------------------------------------------------
# --compare
# ---------------------------------------------------------------------------------------------------

def test_compare_deltas(tmp_path):
    suite = bench.SUITES["prefill"]
    old = [bench.make_row(suite, "cuflash-fa1", shape(), "bf16", ms=2.0, env=ENV),
           bench.make_row(suite, "torch-cudnn", shape(), "bf16", ms=1.0, env=ENV),
           bench.make_row(suite, "cuflash-fa1", shape(n=2048), "bf16", ms=1.0, env=ENV)]
    old_path = tmp_path / "old.json"
    bench.write_json(str(old_path), old)
    new = [bench.make_row(suite, "cuflash-fa1", shape(), "bf16", ms=1.0, env=ENV),      # 2x faster
           bench.make_row(suite, "torch-cudnn", shape(), "bf16", ms=1.25, env=ENV),    # slower
           bench.make_row(suite, "cuflash-fa1", shape(causal=True), "bf16", ms=1.0, env=ENV),  # no match
           bench.make_row(suite, "cuflash-fa1", shape(n=2048), "bf16", error="boom", env=ENV)]  # no number
    bench.add_deltas(new, bench.load_rows(str(old_path)))
    assert new[0]["delta_vs_old_pct"] == pytest.approx(100.0)
    assert new[1]["delta_vs_old_pct"] == pytest.approx(-20.0)
    assert new[2]["delta_vs_old_pct"] is None
    assert new[3]["delta_vs_old_pct"] is None


def test_compare_matches_on_dtype_and_suite(tmp_path):
    old = [bench.make_row(bench.SUITES["prefill"], "cuflash-fa1", shape(), "fp16", ms=2.0, env=ENV)]
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"rows": old}))  # the {"rows": [...]} form is accepted too
    new = [bench.make_row(bench.SUITES["prefill"], "cuflash-fa1", shape(), "bf16", ms=1.0, env=ENV),
           bench.make_row(bench.SUITES["backward"], "cuflash-fa1", shape(), "fp16", ms=1.0, env=ENV)]
    bench.add_deltas(new, bench.load_rows(str(path)))
    assert [r["delta_vs_old_pct"] for r in new] == [None, None]


# ---------------------------------------------------------------------------------------------------
# measuring logic without a GPU (factories and timing replaced)
# ---------------------------------------------------------------------------------------------------

class FakeCase:
    def __init__(self, s, mode="fwd"):
        self.shape, self.mode = s, mode

    def max_err(self, outs):
        return 0.0


@pytest.fixture
def no_device(monkeypatch):
    monkeypatch.setattr(bench, "free_memory", lambda: None)
    monkeypatch.setattr(bench, "measure_extra_memory", lambda timed: (123, timed.fn()))
    monkeypatch.setattr(bench, "time_fn", lambda fn, warmup, reps, before=None: 0.5)
    monkeypatch.setattr(bench, "_budgeted_reps", lambda timed, c: (c.warmup, c.reps))


def test_measure_success_and_failures(monkeypatch, no_device):
    import cupy

    suite, c = bench.SUITES["prefill"], cfg("--quick")
    factories = {
        "ok": lambda case: bench.Timed(lambda: (None,)),
        "oom": lambda case: (_ for _ in ()).throw(cupy.cuda.memory.OutOfMemoryError(1 << 40, 1 << 30)),
        "oom-text": lambda case: (_ for _ in ()).throw(RuntimeError("CUDA out of memory. Tried to allocate")),
        "bad": lambda case: (_ for _ in ()).throw(ValueError("head dim 512 unsupported\nmore detail")),
    }
    monkeypatch.setattr(bench, "factory_for", lambda name: factories[name])
    case = FakeCase(shape())
    ok = bench.measure(suite, case, "ok", c, ENV)
    assert ok["ms"] == 0.5 and ok["error"] is None and ok["extra_mem_bytes"] == 123 and ok["max_err"] == 0.0
    assert ok["reps"] == c.reps
    for name in ("oom", "oom-text"):
        row = bench.measure(suite, case, name, c, ENV)
        assert row["ms"] is None and row["error"] == "out of memory"
    bad = bench.measure(suite, case, "bad", c, ENV)
    assert bad["ms"] is None and bad["error"] == "ValueError: head dim 512 unsupported"


def test_slow_calls_get_fewer_reps(monkeypatch):
    timed = bench.Timed(lambda: (None,))
    monkeypatch.setattr(bench, "time_fn", lambda fn, warmup, reps, before=None: 0.1)
    assert bench._budgeted_reps(timed, cfg("--warmup", "5", "--reps", "30")) == (5, 30)
    monkeypatch.setattr(bench, "time_fn", lambda fn, warmup, reps, before=None: 1000.0)  # 1 s a call
    warmup, reps = bench._budgeted_reps(timed, cfg("--warmup", "5", "--reps", "30"))
    assert warmup <= 1 and reps == bench.MIN_REPS
    monkeypatch.setattr(bench, "time_fn", lambda fn, warmup, reps, before=None: 200.0)
    assert bench._budgeted_reps(timed, cfg("--reps", "30"))[1] == max(bench.MIN_REPS, int(1e3 * bench.TIME_BUDGET_S / 200))
    assert bench._budgeted_reps(timed, cfg("--quick"))[1] <= cfg("--quick").reps  # never more than asked


def test_torch_math_skipped_at_long_sequences(monkeypatch, no_device):
    suite = bench.SUITES["prefill"]
    monkeypatch.setattr(bench, "factory_for", lambda name: lambda case: bench.Timed(lambda: (None,)))
    long_case, short_case = FakeCase(shape(n=8192)), FakeCase(shape(n=4096))
    assert bench.measure(suite, long_case, "torch-math", cfg(), ENV)["error"] == "skipped: too slow"
    assert bench.measure(suite, short_case, "torch-math", cfg(), ENV)["ms"] == 0.5
    assert bench.measure(suite, long_case, "torch-math", cfg("--include-slow"), ENV)["ms"] == 0.5


def test_unsupported_is_not_a_failure():
    assert bench._is_unsupported("ValueError: impl='fa2': it has no backward kernel yet")
    assert bench._is_unsupported("NotImplementedError: flashinfer has no attention backward")
    assert bench._is_unsupported("skipped: too slow")
    assert not bench._is_unsupported("out of memory")
    assert not bench._is_unsupported("output has NaN or inf")
    assert not bench._is_unsupported("CUDARuntimeError: cudaErrorIllegalAddress: an illegal memory access")


def test_fatal_errors_recognised():
    assert bench._is_fatal("CUDARuntimeError: cudaErrorIllegalAddress: an illegal memory access was encountered")
    assert not bench._is_fatal("out of memory")
    assert not bench._is_fatal(None)


# ---------------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------------

def test_table_and_svg(tmp_path):
    from rich.console import Console

    rows = _rows_for_one_shape()
    bench.add_speedups(rows)
    bench.add_deltas(rows, [dict(rows[0], tflops=rows[0]["tflops"] / 2)])
    table = bench.render_table(bench.SUITES["prefill"], rows, "prefill · d=128", ["torch-cudnn", "torch-flash", "naive"])
    console = Console(record=True, width=220, file=open(tmp_path / "out.txt", "w"))
    console.print(table)
    text = console.export_text()
    for needle in ("vs torch-cudnn", "vs torch-flash", "×0.80", "×1.50", "out of memory", "Δ vs old", "+100.0%",
                   "1.0 MiB", "16×1024×16"):
        assert needle in text, needle
    svg = tmp_path / "report.svg"
    bench.save_svg([table], str(svg))
    assert svg.read_text().lstrip().startswith("<svg")


# ---------------------------------------------------------------------------------------------------
# no GPU: one sentence, then the offline compile check
# ---------------------------------------------------------------------------------------------------

def test_no_gpu_runs_offline_check(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(bench, "has_gpu", lambda: False)
    monkeypatch.setattr(bench, "_offline_check", lambda arch: calls.append(arch) or 0)
    assert bench.run(parse()) == 0
    assert calls == ["sm_90a"]
    out = capsys.readouterr().out.strip()
    assert out == bench.OFFLINE_SENTENCE
    assert "\n" not in out and out.startswith("No CUDA GPU")


def test_no_gpu_propagates_offline_failure(monkeypatch, capsys):
    monkeypatch.setattr(bench, "has_gpu", lambda: False)
    monkeypatch.setattr(bench, "_offline_check", lambda arch: 1)
    assert bench.run(parse("--suite", "backward")) == 1


def test_module_entry_point_defaults_to_bench(monkeypatch, capsys):
    pytest.importorskip("cuflash.compile_report")
    from cuflash import __main__ as cli

    monkeypatch.setattr(bench, "has_gpu", lambda: False)
    monkeypatch.setattr(bench, "_offline_check", lambda arch: 0)
    monkeypatch.setattr("sys.argv", ["cuflash"])
    assert cli.main([]) == 0
    assert capsys.readouterr().out.strip() == bench.OFFLINE_SENTENCE
