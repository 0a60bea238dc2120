"""CPU tier for ``python -m cuflash bench``: options, FLOPs, the JSON row schema, --compare, rendering and the
no-GPU path; the decode suite (its shapes, keys, measuring order and a whole run with the GPU steps replaced).
Nothing here touches a GPU or needs torch."""
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


def test_decode_suite_registered_with_its_defaults():
    suite = bench.SUITES["decode"]
    assert suite.metric == "tbps" and suite.ceiling == "copy_tbps"
    c = cfg("--suite", "decode")
    assert c.decode_shapes == [(1, 32768), (16, 8192), (64, 4096), (128, 2048)]
    assert c.page_sizes == [1, 16, 64, 256] and c.headdims == [128]
    assert c.reps >= 30
    q = cfg("--suite", "decode", "--quick")
    assert q.page_sizes == [1, 16, 64, 256] and q.headdims == [128] and q.reps <= 10
    assert max(b * n for b, n in q.decode_shapes) <= 8192  # K/V of a few MB: a smoke run
    assert all(n % p == 0 for _, n in q.decode_shapes for p in q.page_sizes)
    shapes = bench.decode_shapes(128, c.decode_shapes)
    assert [(s.batch, s.seqlen_k) for s in shapes] == c.decode_shapes
    assert all((s.heads, s.kv_heads, s.seqlen_q, s.headdim, s.causal, s.page_size) == (32, 8, 1, 128, False, 0)
               for s in shapes)
    # every full shape's K/V is beyond a 50 MB L2 (so the timed replays stream from HBM without a flush)
    assert min(bench.decode_bytes(s) for s in shapes) >= 128 * 2 ** 20
    # the other suites keep their own defaults
    assert cfg("--suite", "prefill").headdims == [64, 128, 256] and cfg().decode_shapes is None


def test_decode_options():
    c = cfg("--suite", "decode", "--decode-shapes", "2x4096, 3×512", "--page-sizes", "16,128", "--headdims", "64")
    assert c.decode_shapes == [(2, 4096), (3, 512)] and c.page_sizes == [16, 128] and c.headdims == [64]
    for bad in (["--decode-shapes", "2x"], ["--decode-shapes", "0x512"], ["--decode-shapes", "4096"],
                ["--page-sizes", "0"]):
        with pytest.raises(SystemExit):
            parse("--suite", "decode", *bad)
    with pytest.raises(ValueError, match="page size 16 does not divide the cache length 1000"):
        cfg("--suite", "decode", "--decode-shapes", "1x1000")
    assert cfg("--suite", "decode", "--impls", "decode,torch-flash").impls == ["cuflash-decode", "torch-flash"]


def test_decode_bytes_and_row():
    s = bench.Shape(16, 32, 8, 1, 8192, 128, False, page_size=64)
    assert bench.decode_bytes(s) == 16 * 8192 * 8 * 128 * 2 * 2
    assert s.label == "16×8192 page 64" and bench.Shape(1, 32, 8, 1, 4096, 128, False, page_size=0).label == "1×4096"
    row = bench.make_row(bench.SUITES["decode"], "cuflash-decode", s, "bf16", ms=0.25, max_err=1e-3, env=ENV,
                         num_splits=3, host_us=17.5, note=None)
    assert set(bench.REQUIRED_KEYS) <= set(row)
    assert {"page_size", "num_splits", "host_us", "note"} <= set(bench.REQUIRED_KEYS)
    assert row["tbps"] == pytest.approx(bench.decode_bytes(s) / 0.25e-3 / 1e12) and row["tflops"] is None
    assert row["pct_of_ceiling"] == pytest.approx(100 * row["tbps"] / 4.0)  # the copy ceiling
    assert (row["page_size"], row["num_splits"], row["host_us"]) == (64, 3, 17.5)
    assert json.loads(json.dumps(row)) == row
    prefill = bench.make_row(bench.SUITES["prefill"], "cuflash-fa1", shape(), "bf16", ms=1.0, env=ENV)
    assert prefill["page_size"] is None and prefill["num_splits"] is None and prefill["host_us"] is None
    # page_size tells rows apart in --compare (old files without the key still match prefill rows)
    assert "page_size" in bench.MATCH_KEYS
    old = dict(prefill)
    del old["page_size"]
    assert bench.row_key(old) == bench.row_key(prefill)
    assert bench.row_key(row) != bench.row_key(dict(row, page_size=0))


def test_decode_impls(monkeypatch):
    assert set(bench.DECODE_FACTORIES) == {"cuflash-decode", *bench.DECODE_PEERS}
    assert set(bench.DECODE_PEERS) == {"torch-cudnn", "torch-flash", "flash_attn", "flashinfer"}
    with pytest.raises(ValueError, match="no decode benchmark"):
        bench.decode_factory_for("naive")
    monkeypatch.setattr(bench, "detect_peers", lambda: ["torch-flash", "torch-cudnn", "torch-math", "naive"])
    assert bench.default_impls("decode") == ["cuflash-decode", "torch-cudnn", "torch-flash"]


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


class _Progress:  # rich.progress.Progress's two calls that _Sweep makes
    def update(self, task, **kw):
        pass

    def advance(self, task):
        pass


def test_rounds_interleave_and_report_the_median(monkeypatch, no_device):
    """--rounds 3: each implementation timed three times per shape, in turn (backwards in the second round),
    its row the median of the rounds with each round's milliseconds kept; a row that failed is not retimed,
    and a round that fails keeps the earlier ones and says so in the note."""
    calls, made = [], []
    times = {"cuflash-fa3": [1.0, 3.0, 2.0], "torch-cudnn": [2.0, 2.0, 5.0], "torch-flash": [4.0]}

    def factory(name):
        def make(case):
            if name == "cuflash-fa2" or (name == "torch-flash" and name in calls):
                raise (ValueError("not here") if name == "cuflash-fa2" else RuntimeError("gone"))
            made.append(name)
            return bench.Timed(lambda: (None,))
        return make

    def fake_time(fn, warmup, reps, before=None):  # the implementation set up last is the one timed
        calls.append(made[-1])
        return times[made[-1]][calls.count(made[-1]) - 1]

    monkeypatch.setattr(bench, "factory_for", factory)
    monkeypatch.setattr(bench, "time_fn", fake_time)
    monkeypatch.setattr(bench, "Case", lambda s, dtype, mode, seed: FakeCase(s, mode))
    impls = ["cuflash-fa3", "cuflash-fa2", "torch-cudnn", "torch-flash"]
    c = cfg("--quick", "--rounds", "3")
    sweep = bench._Sweep(bench.SUITES["prefill"], c, impls, ENV, None, _Progress(), 0)
    rows = {r["impl"]: r for r in sweep.shape_rows(shape(n=2048))}
    assert calls == ["cuflash-fa3", "torch-cudnn", "torch-flash",  # round 1 (cuflash-fa2 failed: no timing)
                     "torch-cudnn", "cuflash-fa3",                 # round 2, backwards (torch-flash fails)
                     "cuflash-fa3", "torch-cudnn"]                 # round 3 (torch-flash fails again)
    fa3, cudnn, flash = rows["cuflash-fa3"], rows["torch-cudnn"], rows["torch-flash"]
    assert fa3["ms_rounds"] == [1.0, 3.0, 2.0] and fa3["ms"] == 2.0
    assert cudnn["ms_rounds"] == [2.0, 2.0, 5.0] and cudnn["ms"] == 2.0
    assert fa3["tflops"] == pytest.approx(bench.SUITES["prefill"].work(shape(n=2048)) / 2e-3 / 1e12)
    assert fa3["speedup_vs"]["torch-cudnn"] == pytest.approx(1.0)
    assert flash["ms"] == 4.0 and "round 2 failed: RuntimeError: gone" in flash["note"]
    assert rows["cuflash-fa2"]["ms"] is None and "ms_rounds" not in rows["cuflash-fa2"]
    assert "median of 3 interleaved rounds" in bench._suite_line(bench.SUITES["prefill"], c)
    with pytest.raises(ValueError, match="rounds"):
        cfg("--rounds", "0")


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


# ----------------------------------------------------------------------------------------------------
# the decode suite without a GPU (factories, capture and timing replaced)
# ----------------------------------------------------------------------------------------------------

class FakeDecodeCase(FakeCase):
    def __init__(self, s, dtype="bf16", seed=0):
        super().__init__(s)


@pytest.fixture
def decode_no_device(monkeypatch, no_device):
    """measure_decode's GPU steps replaced; ``calls`` records what ran, in order."""
    calls = []

    def capture(timed):
        calls.append("capture")
        return (lambda: calls.append("replay")), timed.fn(), None

    def timed_queue(fn, warmup, reps):
        calls.append(("time_queued", warmup, reps))
        fn()
        return 0.02

    monkeypatch.setattr(bench, "capture_graph", capture)
    monkeypatch.setattr(bench, "time_queued", timed_queue)
    monkeypatch.setattr(bench, "host_overhead_us", lambda fn, warmup, calls_: calls.append("host") or 12.5)
    monkeypatch.setattr(bench, "_sync", lambda: None)
    return calls


def _decode_factories(monkeypatch, calls):
    def cuflash(case, page):
        return bench.DecodeTimed(lambda: (None,), "cupy", None, 4 if page == 0 else 2, scratch_bytes=1000)

    def peer(case, page):
        assert page == 0
        return bench.DecodeTimed(lambda: (None,), "torch", "K/V expanded to 32 heads")

    def broken(case, page):
        raise ValueError("head dim 96 is not supported\nmore")

    factories = {"cuflash-decode": cuflash, "torch-flash": peer, "flash_attn": broken}
    monkeypatch.setattr(bench, "decode_factory_for", lambda name: factories[name])


def test_measure_decode(monkeypatch, decode_no_device):
    _decode_factories(monkeypatch, decode_no_device)
    suite, c = bench.SUITES["decode"], cfg("--suite", "decode", "--quick")
    case = FakeDecodeCase(bench.Shape(8, 32, 8, 1, 1024, 128, False, page_size=0))
    row = bench.measure_decode(suite, case, "cuflash-decode", 16, c, ENV)
    assert row["error"] is None and row["ms"] == 0.02 and row["host_us"] == 12.5 and row["num_splits"] == 2
    assert row["page_size"] == 16 and row["extra_mem_bytes"] == 123 + 1000 and row["max_err"] == 0.0
    assert row["tbps"] == pytest.approx(8 * 1024 * 8 * 128 * 4 / 0.02e-3 / 1e12)
    # order: host overhead of eager calls, then capture, then timed replays (the replay is what is timed)
    assert decode_no_device == ["host", "capture", ("time_queued", c.warmup, c.reps), "replay"]
    peer = bench.measure_decode(suite, case, "torch-flash", 0, c, ENV)
    assert peer["num_splits"] is None and peer["note"] == "K/V expanded to 32 heads" and peer["page_size"] == 0
    bad = bench.measure_decode(suite, case, "flash_attn", 0, c, ENV)
    assert bad["ms"] is None and bad["error"] == "ValueError: head dim 96 is not supported"


def test_measure_decode_falls_back_to_eager_timing(monkeypatch, decode_no_device):
    _decode_factories(monkeypatch, decode_no_device)

    def no_capture(timed):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(bench, "capture_graph", no_capture)
    case = FakeDecodeCase(bench.Shape(1, 32, 8, 1, 4096, 128, False, page_size=0))
    row = bench.measure_decode(bench.SUITES["decode"], case, "torch-flash", 0, cfg("--suite", "decode"), ENV)
    assert row["ms"] == 0.02 and row["error"] is None
    assert row["note"].startswith("K/V expanded to 32 heads; timed eagerly: graph capture failed (RuntimeError")


def test_measure_decode_graph_output_checked(monkeypatch, decode_no_device):
    """max_err covers the graph replays' output too: NaN there fails the row."""
    _decode_factories(monkeypatch, decode_no_device)

    class Case(FakeDecodeCase):
        seen = 0

        def max_err(self, outs):
            Case.seen += 1
            return 1e-3 if Case.seen == 1 else float("nan")

    case = Case(bench.Shape(1, 32, 8, 1, 4096, 128, False, page_size=0))
    row = bench.measure_decode(bench.SUITES["decode"], case, "cuflash-decode", 0, cfg("--suite", "decode"), ENV)
    assert Case.seen == 2 and row["max_err"] is None and row["error"] == "output has NaN or inf"


FAKE_ENV = dict(ENV, sms=132, compute_capability="9.0", driver="1", cuda_driver_api="13.0", cuda_runtime="13.0",
                nvrtc="13.0", cuflash="0", cupy="14", torch=None, cudnn=None, flash_attn=None, flashinfer=None)


def test_decode_run_end_to_end_without_a_gpu(monkeypatch, tmp_path, decode_no_device):
    """``bench --suite decode --quick --json`` through run() with the GPU parts replaced: one row per shape x
    (cuflash on the contiguous cache and each page size, each peer), the decode keys filled, the table and
    the SVG rendered, the JSON written."""
    _decode_factories(monkeypatch, decode_no_device)
    monkeypatch.setattr(bench, "has_gpu", lambda: True)
    monkeypatch.setattr(bench, "default_impls", lambda suite: ["cuflash-decode", "torch-flash"])
    monkeypatch.setattr(bench, "collect_env", lambda: dict(FAKE_ENV))
    monkeypatch.setattr(bench, "measure_ceilings", lambda: dict(ENV["ceilings"]))
    monkeypatch.setattr(bench, "DecodeCase", FakeDecodeCase)

    def fake_cascade(suite, cfg_, env):  # the cascade case's two rows, as measure_cascade makes them
        batch, prefix, suffix = cfg_.cascade
        shape = bench.Shape(batch, 32, 8, 1, prefix + suffix, 128, False, page_size=0)
        rows = [bench.make_row(suite, impl, shape, cfg_.dtype, ms=ms, env=env, host_us=12.5, note="cascade case: x")
                for impl, ms in (("cuflash-cascade", 0.1), ("cuflash-decode", 1.2))]
        rows[0]["speedup_vs"]["cuflash-decode"] = 12.0
        return rows

    monkeypatch.setattr(bench, "measure_cascade", fake_cascade)
    path, svg = tmp_path / "decode.json", tmp_path / "decode.svg"
    assert bench.run(parse("--suite", "decode", "--quick", "--json", str(path), "--svg", str(svg))) == 0
    rows = json.loads(path.read_text())
    quick = cfg("--suite", "decode", "--quick")
    cascade = rows[-2:]  # after the sweep
    assert [r["impl"] for r in cascade] == ["cuflash-cascade", "cuflash-decode"]
    assert cascade[0]["speedup_vs"] == {"cuflash-decode": 12.0}
    rows = rows[:-2]
    assert len(rows) == len(quick.decode_shapes) * (1 + len(quick.page_sizes) + 1)
    for row in rows:
        assert set(bench.REQUIRED_KEYS) <= set(row)
        assert row["suite"] == "decode" and row["seqlen_q"] == 1 and (row["heads"], row["kv_heads"]) == (32, 8)
        assert row["tbps"] > 0 and row["pct_of_ceiling"] > 0 and row["host_us"] == 12.5
    ours = [r for r in rows if r["impl"] == "cuflash-decode"]
    assert sorted({r["page_size"] for r in ours}) == [0] + quick.page_sizes
    assert all(r["num_splits"] in (2, 4) and "torch-flash" in r["speedup_vs"] for r in ours)
    assert {(r["batch"], r["seqlen_k"]) for r in rows} == set(quick.decode_shapes)
    assert all(r["num_splits"] is None and r["page_size"] == 0 for r in rows if r["impl"] == "torch-flash")
    assert svg.read_text().lstrip().startswith("<svg")


def test_decode_table():
    from rich.console import Console

    suite = bench.SUITES["decode"]
    mk = lambda impl, page, **kw: bench.make_row(  # noqa: E731
        suite, impl, bench.Shape(16, 32, 8, 1, 8192, 128, False, page_size=page), "bf16", env=ENV, **kw)
    rows = [mk("cuflash-decode", 0, ms=0.1, num_splits=1, host_us=15.0),
            mk("cuflash-decode", 64, ms=0.11, num_splits=1, host_us=16.0),
            mk("torch-cudnn", 0, ms=0.2, host_us=40.0, note="K/V expanded to 32 heads [no GQA]"),
            mk("flashinfer", 0, error="ModuleNotFoundError: no [flashinfer]")]
    bench.add_speedups(rows)
    console = Console(record=True, width=250, file=open("/dev/null", "w"))
    console.print(bench.render_table(suite, rows, "decode · d=128", ["torch-cudnn"]))
    text = console.export_text()
    for needle in ("shape (B×cache)", "16×8192", "page", "contig", "splits", "host µs", "15.0", "TB/s", "×2.00",
                   "K/V expanded to 32 heads [no GQA]", "no [flashinfer]", "0.1000"):
        assert needle in text, needle


def test_decode_no_gpu_path(monkeypatch, capsys):
    """--suite decode --quick without a GPU: the one sentence, then the offline compile check."""
    calls = []
    monkeypatch.setattr(bench, "has_gpu", lambda: False)
    monkeypatch.setattr(bench, "_offline_check", lambda arch: calls.append(arch) or 0)
    assert bench.run(parse("--suite", "decode", "--quick", "--json", "/nonexistent/x.json")) == 0
    assert calls == ["sm_90a"] and capsys.readouterr().out.strip() == bench.OFFLINE_SENTENCE


def test_spin_kernel_compiles():
    """The spin kernel queued ahead of the timed decode replays compiles (NVRTC, no GPU needed)."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(bench._SPIN_SRC, "spin.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=compute_80"])
        assert b"globaltimer" in nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


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


# ---------------------------------------------------------------------------------------------------
# the fp8 suite without a GPU (quantisation, factories and timing replaced)
# ---------------------------------------------------------------------------------------------------

FP8_ENV = dict(ENV, ceilings=dict(ENV["ceilings"], fp8_matmul_tflops=1250.0))


def test_fp8_suite_registered_with_prefill_shapes():
    suite = bench.SUITES["fp8"]
    assert (suite.mode, suite.metric, suite.ceiling) == ("fwd", "tflops", "fp8_matmul_tflops")
    assert suite.ratio_peers[0] == "cuflash-fa3" and suite.cuflash_peers == ("cuflash-fa3",)
    assert {"cudnn-fp8", "torch-cudnn", "torch-flash"} <= set(suite.ratio_peers)
    c, p = cfg("--suite", "fp8"), cfg()
    assert (c.headdims, c.seqlens, c.causals, c.total_tokens, c.hidden) == (
        p.headdims, p.seqlens, p.causals, p.total_tokens, p.hidden)
    assert c.headdims == [64, 128, 256] and {8192, 16384} <= set(c.seqlens) and c.causals == [False, True]
    assert c.dtype == "bf16" and c.decode_shapes is None
    q = cfg("--suite", "fp8", "--quick")
    assert q.seqlens == cfg("--quick").seqlens and q.reps <= 5
    c = cfg("--suite", "fp8", "--headdims", "128,256", "--seqlens", "8192,16384", "--causal", "false")
    assert (c.headdims, c.seqlens, c.causals) == ([128, 256], [8192, 16384], [False])
    shapes = bench.attention_shapes(256, True, c.seqlens, c.total_tokens, c.hidden)
    assert [(s.batch, s.heads, s.seqlen_q) for s in shapes] == [(2, 8, 8192), (1, 8, 16384)]


def test_fp8_flops_counted_like_prefill():
    s = shape(n=8192, d=128)
    work = bench.SUITES["fp8"].work
    assert work(s) == bench.SUITES["prefill"].work(s) == 4 * 2 * 16 * 8192 * 8192 * 128
    assert work(shape(n=8192, d=128, causal=True)) == work(s) / 2


def test_fp8_impl_names():
    c = cfg("--suite", "fp8", "--impls", "fa3-fp8,fa3,cudnn-fp8,torch-cudnn")
    assert c.impls == ["cuflash-fa3-fp8", "cuflash-fa3", "cudnn-fp8", "torch-cudnn"]
    assert bench.factory_for("cuflash-fa3-fp8") is bench._cuflash_fp8
    assert bench.factory_for("cudnn-fp8") is bench._cudnn_fp8
    assert bench.row_dtype("cuflash-fa3-fp8", "bf16") == bench.row_dtype("cudnn-fp8", "fp16") == "e4m3"
    assert bench.row_dtype("cuflash-fa3", "bf16") == "bf16"
    for impl in ("cuflash-fa3-fp8", "cudnn-fp8"):  # FP8 inputs exist only in an Fp8Case
        with pytest.raises(ValueError, match="--suite fp8"):
            bench.factory_for(impl)(FakeCase(shape()))


def test_deterministic_backward_impls(monkeypatch):
    """fa3-det / fa2-det: the backward with deterministic=True, named only on request (the default list
    keeps one row per kernel family); a forward suite refuses them with the reason."""
    import cuflash.api

    c = cfg("--suite", "backward", "--impls", "fa3,fa3-det,fa2-det")
    assert c.impls == ["cuflash-fa3", "cuflash-fa3-det", "cuflash-fa2-det"]
    monkeypatch.setattr(cuflash.api, "available_impls", lambda direction=None: ["fa1", "fa2", "fa3"])
    monkeypatch.setattr(bench, "detect_peers", lambda: ["naive"])
    assert not any(i.endswith("-det") for i in bench.default_impls("backward"))
    with pytest.raises(ValueError, match="--suite backward"):
        bench.factory_for("cuflash-fa3-det")(FakeCase(shape()))
    calls = []

    class Case(FakeCase):
        q = k = v = dout = "x"
        scale = 0.125

    def forward(q, k, v, *, causal, softmax_scale, impl, return_lse=False):  # (no deterministic: the forward has none)
        return "out", "lse"

    monkeypatch.setattr(cuflash.api, "flash_attn_func", forward)
    monkeypatch.setattr(cuflash.api, "flash_attn_backward", lambda *a, **kw: calls.append(kw) or ("dq", "dk", "dv"))
    for name, impl in (("cuflash-fa3-det", "fa3"), ("cuflash-fa2-det", "fa2")):
        bench.factory_for(name)(Case(shape(), mode="bwd")).fn()
        assert calls[-1]["deterministic"] is True and calls[-1]["impl"] == impl
    bench.factory_for("cuflash-fa3")(Case(shape(), mode="bwd")).fn()
    assert "deterministic" not in calls[-1]


def test_fp8_default_impls(monkeypatch):
    import cuflash.api

    monkeypatch.setattr(cuflash.api, "available_impls", lambda direction=None: ["fa1", "fa2", "fa3"])
    monkeypatch.setattr(bench, "detect_peers", lambda: ["torch-flash", "torch-cudnn", "torch-math", "naive"])
    monkeypatch.setattr(bench, "_importable", lambda module: False)  # no cudnn frontend
    found, missing = bench.fp8_peers()
    assert found == ["cuflash-fa3", "torch-cudnn", "torch-flash"]
    assert set(missing) == {"cudnn-fp8"} and "nvidia-cudnn-frontend" in missing["cudnn-fp8"]
    assert bench.default_impls("fp8") == ["cuflash-fa3-fp8", "cuflash-fa3", "torch-cudnn", "torch-flash"]
    # no torch, no FA3 on this GPU: the FP8 kernel alone, every peer left out with its reason
    monkeypatch.setattr(cuflash.api, "available_impls", lambda direction=None: ["fa1"])
    monkeypatch.setattr(bench, "detect_peers", lambda: ["naive"])
    found, missing = bench.fp8_peers()
    assert found == [] and set(missing) == set(bench.FP8_PEERS)
    assert "torch" in missing["cudnn-fp8"] and "torch" in missing["torch-flash"]
    assert bench.default_impls("fp8") == ["cuflash-fa3-fp8"]


def test_fp8_rows_against_the_fp8_ceiling():
    suite, s = bench.SUITES["fp8"], shape(n=8192, d=128, causal=True)
    row = bench.make_row(suite, "cuflash-fa3-fp8", s, "e4m3", ms=1.0, max_err=1e-2, env=FP8_ENV)
    assert set(bench.REQUIRED_KEYS) <= set(row)
    assert row["suite"] == "fp8" and row["dtype"] == "e4m3" and row["causal"]
    flops = 4 * s.batch * s.heads * 8192 * 8192 * 128 / 2
    assert row["tflops"] == pytest.approx(flops / 1e-3 / 1e12)
    assert row["pct_of_ceiling"] == pytest.approx(100 * row["tflops"] / 1250.0)  # not the bf16 ceiling
    assert json.loads(json.dumps(row)) == row
    # without an fp8 ceiling (no torch), no percentage
    assert bench.make_row(suite, "cuflash-fa3-fp8", s, "e4m3", ms=1.0, env=ENV)["pct_of_ceiling"] is None


def test_fp8_speedups_include_the_bf16_kernel():
    suite, s = bench.SUITES["fp8"], shape(n=8192)
    mk = lambda impl, **kw: bench.make_row(suite, impl, s, bench.row_dtype(impl, "bf16"), env=FP8_ENV, **kw)  # noqa: E731
    rows = [mk("cuflash-fa3-fp8", ms=1.0), mk("cuflash-fa3", ms=1.8), mk("cudnn-fp8", ms=1.1),
            mk("torch-cudnn", ms=2.0), mk("torch-flash", error="RuntimeError: no kernel")]
    bench.add_speedups(rows, suite.cuflash_peers)
    assert rows[0]["speedup_vs"] == pytest.approx({"cuflash-fa3": 1.8, "cudnn-fp8": 1.1, "torch-cudnn": 2.0})
    assert rows[1]["speedup_vs"] == pytest.approx({"cudnn-fp8": 1.1 / 1.8, "torch-cudnn": 2.0 / 1.8})
    assert all(r["speedup_vs"] == {} for r in rows[2:])
    # the other suites: a cuflash row is never a peer
    rows = [mk("cuflash-fa3-fp8", ms=1.0), mk("cuflash-fa3", ms=1.8)]
    bench.add_speedups(rows)
    assert rows[0]["speedup_vs"] == {} and rows[1]["speedup_vs"] == {}


def test_fp8_max_err_against_the_dequantised_inputs():
    """The check of FP8 rows: exact attention of the dequantised inputs, q and k rotated alike (no un-rotation
    needed); the kernel's own error is what shows, not the inputs' quantisation error."""
    import numpy as np

    from cuflash import reference

    rng = np.random.default_rng(1)
    b, n, h, d = 2, 256, 4, 64
    q, k, v = (rng.standard_normal((b, n, h, d)).astype(np.float32) for _ in range(3))
    (q8, qs), (k8, ks), (v8, vs) = (reference.fp8_quantize(q, 128, True, 7), reference.fp8_quantize(k, 128, True, 7),
                                    reference.fp8_quantize(v, 128, False))
    inputs = bench.Fp8Inputs(q8, k8, v8, qs, ks, vs, 128)
    deq = [reference.fp8_dequantize(q8, qs, 128, True, 7), reference.fp8_dequantize(k8, ks, 128, True, 7),
           reference.fp8_dequantize(v8, vs, 128, False)]
    scale = 1 / np.sqrt(d)
    for causal in (False, True):
        exact = reference.attention_ref(*deq, causal=causal, softmax_scale=scale, compute_dtype="float64")[0]
        kw = dict(causal=causal, softmax_scale=scale)
        assert bench.fp8_max_err(exact, inputs, 2, 2, **kw) < 1e-5
        wrong = exact.copy()
        wrong[0, 5, 1, 3] += 0.25
        assert bench.fp8_max_err(wrong, inputs, 2, 2, **kw) == pytest.approx(0.25, abs=1e-5)
        wrong[1, 5, 1, 3] += 9.0  # outside the slice (batch 0, first 2 heads)
        wrong[0, 5, 3, 3] += 9.0
        assert bench.fp8_max_err(wrong, inputs, 2, 2, **kw) == pytest.approx(0.25, abs=1e-5)
        # against the unquantised inputs the error is the quantisation's: larger (causal row 0 is v[0] itself,
        # rounded to e4m3 by up to 2^-4 relative: about 0.3 at |v| = 5)
        plain = reference.attention_ref(q, k, v, causal=causal, softmax_scale=scale)[0]
        assert 1e-3 < bench.fp8_max_err(plain, inputs, 2, 2, **kw) < 0.35
    nan = exact.copy()
    nan[0, 0, 0, 0] = np.nan
    assert np.isnan(bench.fp8_max_err(nan, inputs, 2, 2, causal=True, softmax_scale=scale))
    # one descale per (batch, head), as the cuDNN peer's per-tensor scales are passed
    per_head = bench.Fp8Inputs(q8, k8, v8, *(np.full((b, h, 1), 2.0 ** -7, np.float32) for _ in range(3)), 128)
    deq = [reference.e4m3_values(x).astype(np.float64) * 2.0 ** -7 for x in (q8, k8, v8)]
    exact = reference.attention_ref(*deq, causal=False, softmax_scale=scale, compute_dtype="float64")[0]
    assert bench.fp8_max_err(exact, per_head, 2, 2, causal=False, softmax_scale=scale) < 1e-6


def test_measure_fp8_row(monkeypatch, no_device):
    """The fp8 row: dtype e4m3, checked by its own max_err (not the case's bf16 reference), its note kept."""
    checked = []

    def fp8_factory(case):
        return bench.Timed(lambda: ("out",), max_err=lambda outs: checked.append(outs) or 0.0125, note="how")

    monkeypatch.setattr(bench, "factory_for", lambda name: fp8_factory)

    class Case(FakeCase):
        def max_err(self, outs):
            raise AssertionError("the bf16 reference must not check an fp8 row")

    c = cfg("--suite", "fp8", "--quick")
    row = bench.measure(bench.SUITES["fp8"], Case(shape()), "cuflash-fa3-fp8", c, FP8_ENV)
    assert checked == [("out",)] and row["max_err"] == 0.0125 and row["note"] == "how"
    assert row["dtype"] == "e4m3" and row["ms"] == 0.5 and row["error"] is None
    assert row["pct_of_ceiling"] == pytest.approx(100 * row["tflops"] / 1250.0)


class FakeFp8Case(FakeCase):
    def __init__(self, s, dtype="bf16", mode="fwd", seed=0):
        super().__init__(s, mode)


def _fp8_stand_ins(monkeypatch):
    """Factories whose calls "take" a fixed time per implementation (time_fn reads it off the function)."""
    ms = {"cuflash-fa3-fp8": 0.25, "cuflash-fa3": 0.5, "torch-cudnn": 0.6}

    def factory(name):
        def make(case):
            fn = lambda: (None,)  # noqa: E731
            fn.ms = ms[name]
            return bench.Timed(fn, max_err=(lambda outs: 0.02) if name in bench.FP8_IMPLS else None)
        return make

    monkeypatch.setattr(bench, "factory_for", factory)
    monkeypatch.setattr(bench, "time_fn", lambda fn, warmup, reps, before=None: fn.ms)
    return ms


def test_fp8_run_end_to_end_without_a_gpu(monkeypatch, tmp_path, capsys, no_device):
    """``bench --suite fp8 --quick --json`` through run() with the GPU parts replaced: rows per shape x impl,
    the fp8 row in e4m3 against the fp8 ceiling with its speed-ups over the bf16 kernel and the peer, the
    missing cuDNN FP8 peer named in the header and in env, the tables rendered."""
    ms = _fp8_stand_ins(monkeypatch)
    monkeypatch.setenv("COLUMNS", "250")  # rich: every table column unabridged in the captured output
    monkeypatch.setattr(bench, "has_gpu", lambda: True)
    monkeypatch.setattr(bench, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(bench, "default_impls", lambda suite: list(ms))
    monkeypatch.setattr(bench, "fp8_peers", lambda: (["cuflash-fa3", "torch-cudnn"],
                                                     {"cudnn-fp8": "the cudnn package is not importable here"}))
    monkeypatch.setattr(bench, "collect_env", lambda: dict(FAKE_ENV))
    monkeypatch.setattr(bench, "measure_ceilings", lambda: dict(ENV["ceilings"]))
    monkeypatch.setattr(bench, "measure_fp8_ceiling", lambda: {"fp8_matmul_tflops": 1250.0,
                                                               "fp8_matmul_promoted_tflops": 1000.0,
                                                               "fp8_matmul_via": "torch._scaled_mm"})
    monkeypatch.setattr(bench, "Fp8Case", FakeFp8Case)
    path, svg = tmp_path / "fp8.json", tmp_path / "fp8.svg"
    assert bench.run(parse("--suite", "fp8", "--quick", "--json", str(path), "--svg", str(svg))) == 0
    rows = json.loads(path.read_text())
    quick = cfg("--suite", "fp8", "--quick")
    assert len(rows) == len(quick.headdims) * len(quick.causals) * len(quick.seqlens) * len(ms)
    for row in rows:
        assert set(bench.REQUIRED_KEYS) <= set(row)
        assert row["suite"] == "fp8" and row["error"] is None
        assert row["env"]["ceilings"]["fp8_matmul_tflops"] == 1250.0
        assert row["env"]["skipped_peers"] == {"cudnn-fp8": "the cudnn package is not importable here"}
        s = bench.Shape(row["batch"], row["heads"], row["kv_heads"], row["seqlen_q"], row["seqlen_k"], row["headdim"],
                        row["causal"])
        assert row["tflops"] == pytest.approx(bench.SUITES["prefill"].work(s) / (ms[row["impl"]] * 1e-3) / 1e12)
        assert row["pct_of_ceiling"] == pytest.approx(100 * row["tflops"] / 1250.0)
    fp8 = [r for r in rows if r["impl"] == "cuflash-fa3-fp8"]
    assert {(r["headdim"], r["causal"], r["seqlen_q"]) for r in fp8} == {
        (d, c, n) for d in quick.headdims for c in quick.causals for n in quick.seqlens}
    assert all(r["dtype"] == "e4m3" and r["max_err"] == 0.02 for r in fp8)
    assert all(r["speedup_vs"] == pytest.approx({"cuflash-fa3": 2.0, "torch-cudnn": 2.4}) for r in fp8)
    assert all(r["dtype"] == "bf16" for r in rows if r["impl"] != "cuflash-fa3-fp8")
    out = capsys.readouterr().out
    for needle in ("e4m3 matmul 8192³ 1250 TFLOP/s", "cudnn-fp8: the cudnn package is not importable here",
                   "% of the fp8 matmul ceiling", "e4m3, peers bf16", "vs cuflash-fa3", "×2.00", "×2.40"):
        assert needle in out, needle
    assert svg.read_text().lstrip().startswith("<svg")


def test_fp8_suite_says_so_before_hopper(monkeypatch, capsys):
    monkeypatch.setattr(bench, "has_gpu", lambda: True)
    monkeypatch.setattr(bench, "compute_capability", lambda: (8, 9))
    monkeypatch.setattr(bench, "measure_ceilings", lambda: pytest.fail("nothing may be measured"))
    assert bench.run(parse("--suite", "fp8")) == 2
    out = capsys.readouterr().out
    assert "needs a Hopper GPU (sm_90" in out and "sm_89" in out and "Nothing measured" in out


def test_fp8_no_gpu_path(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(bench, "has_gpu", lambda: False)
    monkeypatch.setattr(bench, "_offline_check", lambda arch: calls.append(arch) or 0)
    assert bench.run(parse("--suite", "fp8")) == 0
    assert calls == ["sm_90a"] and capsys.readouterr().out.strip() == bench.OFFLINE_SENTENCE


def test_fp8_ceiling_without_torch(monkeypatch):
    monkeypatch.setattr(bench, "_importable", lambda module: False)
    ceil = bench.measure_fp8_ceiling()
    assert ceil["fp8_matmul_tflops"] is None and ceil["fp8_matmul_promoted_tflops"] is None
    assert "torch" in ceil["fp8_matmul_error"]


def test_header_shows_the_fp8_ceiling_only_when_measured():
    from rich.console import Console

    def header(env, suite):
        console = Console(record=True, width=400, file=open("/dev/null", "w"))
        console.print(bench.render_header(env, bench.SUITES[suite], cfg("--suite", suite)))
        return console.export_text()

    fp8 = header(dict(FAKE_ENV, ceilings={**ENV["ceilings"], "fp8_matmul_tflops": None,
                                          "fp8_matmul_error": "RuntimeError: torch has no _scaled_mm"},
                      skipped_peers={"cudnn-fp8": "not importable"}), "fp8")
    for needle in ("e4m3 matmul 8192³ — TFLOP/s (RuntimeError: torch has no _scaled_mm", "cudnn-fp8: not importable",
                   "cuflash-fa3-fp8 on e4m3 inputs", f"block {bench.FP8_BLOCK}", "Hadamard"):
        assert needle in fp8, needle
    prefill = header(dict(FAKE_ENV, ceilings=ENV["ceilings"]), "prefill")
    assert "e4m3" not in prefill and "skipped" not in prefill


def test_cascade_case_option():
    """--cascade BATCHxPREFIXxSUFFIX (decode suite; 0 leaves the case out), defaults full and --quick."""
    assert cfg("--suite", "decode").cascade == (64, 32768, 512)
    assert cfg("--suite", "decode", "--quick").cascade == (4, 1024, 64)
    assert cfg("--suite", "decode", "--cascade", "8x2048x128").cascade == (8, 2048, 128)
    assert cfg("--suite", "decode", "--cascade", "0").cascade == ()
    for bad in ("64x32768", "0x10x10", "axbxc"):
        with pytest.raises(SystemExit):
            parse("--suite", "decode", "--cascade", bad)
