"""scripts/sanitize.sh reads compute-sanitizer's summaries right (CPU tier: a stand-in sanitizer prints
canned logs, so the classification is tested without a GPU), and the CPU side of scripts/sanitize_driver.py's
decode, cascade and fp8 families: when they are listed, that their cases cover what they are meant to, are
calls the public API accepts (run on Spec records up to the kernel launch), and that their reference
checks pass the reference and fail a wrong answer (NumPy standing in for the kernels where needed)."""
import importlib.util
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

import cuflash
from cuflash import _device, api, cascade, decode, fp8, heuristics
from cuflash import reference as ref
from cuflash.heuristics import DECODE_TILES
from cascade_cases import CASES as CASCADE_CASES
from test_bad_input_table import _ReachedKernel, _SpecCall  # the same stand-ins as the decode bad-input table
from test_cascade_cpu import _combine_ref, _kvcache_ref, _varlen_ref  # the cascade glue's NumPy kernels
from test_decode_cpu import spec, vals
from test_fp8_attention_cpu import spec_env  # noqa: F401  (a fixture: flash_attn_func on Specs)

ROOT = Path(__file__).resolve().parents[1]

# What the stand-in prints for each (tool, family): real summary lines of compute-sanitizer 2025.3.
CANNED = {
    ("memcheck", "clean"): "========= ERROR SUMMARY: 0 errors",
    ("memcheck", "oob"): "========= Invalid __global__ read of size 4 bytes\n========= ERROR SUMMARY: 1 error",
    ("memcheck", "probes"): "\n".join(
        ['========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call '
         'to cuGetProcAddress_v2.'] * 3 + ["========= ERROR SUMMARY: 3 errors"]),
    ("memcheck", "probes+api"): "\n".join(
        ['========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call '
         'to cuGetProcAddress_v2.',
         '========= Program hit CUDA_ERROR_ILLEGAL_ADDRESS (error 700) on CUDA API call to cuMemcpyDtoH.',
         "========= ERROR SUMMARY: 2 errors"]),
    ("memcheck", "probes+crash"): "\n".join(
        ['========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call '
         'to cuGetProcAddress_v2.', "Traceback (most recent call last):", "RuntimeError: the driver failed",
         "========= ERROR SUMMARY: 1 error"]),
    ("racecheck", "clean"): "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)",
    ("racecheck", "race"): "========= Error: Race reported between Write access at f+0x10\n"
                           "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)",
    ("racecheck", "silent"): "nothing",
}


def _exit_code(text: str) -> int:
    """What the real sanitizer returns with --error-exitcode 1: 1 when it counted any error (cuda.bindings'
    API probes included) or the program failed."""
    return 1 if re.search(r"\(?[1-9][0-9]* error", text) or "Traceback" in text else 0


@pytest.fixture
def fake_sanitizer(tmp_path):
    script = tmp_path / "compute-sanitizer"
    lines = ["#!/usr/bin/env bash", 'if [ "$1" = --version ]; then echo "Version 2025.3.1.0"; exit 0; fi',
             'tool=$2; fam=${@: -1}', 'case "$tool $fam" in']
    for (tool, fam), text in CANNED.items():
        quoted = text.replace("'", "'\\''")
        lines.append(f"  '{tool} {fam}') printf '%s\\n' '{quoted}'; exit {_exit_code(text)} ;;")
    lines += ["esac", "exit 0"]
    script.write_text("\n".join(lines) + "\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _run(fake_sanitizer, tmp_path, tool, family):
    env = dict(os.environ, COMPUTE_SANITIZER=str(fake_sanitizer), PYTHON="true", OUT=str(tmp_path / "out"),
               SANITIZE_TOOLS=tool, SANITIZE_FAMILIES=family)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "sanitize.sh")], capture_output=True, text=True, env=env)
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith(tool))
    return res.returncode, line


@pytest.mark.parametrize("tool, family, expect, ok", [
    ("memcheck", "clean", "clean", True),
    ("memcheck", "oob", "1 ERROR(S)", False),
    ("memcheck", "probes", "clean", True),  # cuda.bindings' cuGetProcAddress probes are not errors
    ("memcheck", "probes+crash", "FAILED (exit 1)", False),
    ("memcheck", "probes+api", "1 ERROR(S) (1 CUDA API)", False),
    ("racecheck", "clean", "clean", True),
    ("racecheck", "race", "1 ERROR(S)", False),
    ("racecheck", "silent", "NO SUMMARY", False),
])
def test_sanitize_summary_parsing(fake_sanitizer, tmp_path, tool, family, expect, ok):
    rc, line = _run(fake_sanitizer, tmp_path, tool, family)
    assert expect in line, line
    assert (rc == 0) == ok, line


# ----------------------------------------------------------------------------------------------------
# scripts/sanitize_driver.py: the decode family (its GPU runs are for the GPU machine)
# ----------------------------------------------------------------------------------------------------

def _driver():
    spec_ = importlib.util.spec_from_file_location("sanitize_driver", ROOT / "scripts" / "sanitize_driver.py")
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    return mod


DRIVER = _driver()
KV_CASES = [c for c in DRIVER._decode_cases() if c["fn"] == "kvcache"]
COMBINE_CASES = [c for c in DRIVER._decode_cases() if c["fn"] == "combine"]


@pytest.mark.parametrize("impls, decode_ok, fp8_ok, fa3_ok, listed", [
    ([], True, False, False, "decode cascade"),
    ([], False, False, False, ""),
    ([], False, True, False, "fp8"),
    (["fa2"], True, True, False, "fa2-fwd fa2-bwd decode cascade fp8"),
    (["fa3"], True, True, True, "fa3-fwd fa3-bwd decode cascade fp8 fa3-fp8"),
])
def test_list_has_decode_cascade_and_fp8_when_the_gpu_runs_them(monkeypatch, capsys, impls, decode_ok, fp8_ok,
                                                                 fa3_ok, listed):
    """cascade_attention runs on the decode kernels and the prefill kernels of FA3 or FA2 (which runs on every
    GPU decode runs on), so it is listed exactly when decode is; the FP8 forward where FA3 runs."""
    monkeypatch.setattr(cuflash, "available_impls", lambda: impls)
    monkeypatch.setattr(DRIVER, "_decode_available", lambda: decode_ok)
    monkeypatch.setattr(DRIVER, "_fp8_available", lambda: fp8_ok)
    monkeypatch.setattr(DRIVER, "_fp8_attention_available", lambda: fa3_ok)
    assert DRIVER.main(["--list"]) == 0
    assert capsys.readouterr().out.strip() == listed


def test_every_family_with_cases_of_its_own_has_a_runner(monkeypatch):
    monkeypatch.setattr(cuflash, "available_impls", lambda: [])
    monkeypatch.setattr(DRIVER, "_decode_available", lambda: True)
    monkeypatch.setattr(DRIVER, "_fp8_available", lambda: True)
    monkeypatch.setattr(DRIVER, "_fp8_attention_available", lambda: True)
    assert set(DRIVER._families()) == set(DRIVER.OWN_CASES)


@pytest.mark.parametrize("gpu, cc, ok", [(False, (9, 0), False), (True, (7, 5), False), (True, decode.MIN_CC, True),
                                         (True, (9, 0), True)])
def test_decode_available_asks_what_the_api_asks(monkeypatch, gpu, cc, ok):
    monkeypatch.setattr(_device, "has_gpu", lambda: gpu)
    monkeypatch.setattr(_device, "compute_capability", lambda device=0: cc)
    assert DRIVER._decode_available() is ok


@pytest.mark.parametrize("gpu, cc, ok", [(False, (9, 0), False), (True, (8, 6), False), (True, fp8.MIN_CC, True),
                                         (True, (9, 0), True), (True, (12, 0), True)])
def test_fp8_available_asks_what_quantize_asks(monkeypatch, gpu, cc, ok):
    monkeypatch.setattr(_device, "has_gpu", lambda: gpu)
    monkeypatch.setattr(_device, "compute_capability", lambda device=0: cc)
    assert DRIVER._fp8_available() is ok


def test_run_cases_counts_mismatches_and_runs_on(capsys):
    def run(c, rng, check):
        if c == 2:
            raise AssertionError("out: too far")
        return "ok"

    assert DRIVER._run_cases("fam", lambda: [1, 2, 3], run, str, True, None) == 1
    assert capsys.readouterr().out.splitlines() == ["fam 1: ok", "fam 2: MISMATCH out: too far", "fam 3: ok"]


def test_decode_cases_cover_the_family():
    """What the cases are there for: both layouts and page sizes 1 / 16 / 64, ragged lengths with 0, 1 and
    an odd length over several tiles, GQA, every supported head dim (and only those), one query and several
    causal ones, unsplit and forced splits, the append with rotary, window, softcap, fp16, the combine."""
    assert {c["page_size"] for c in KV_CASES} == {0, 1, 16, 64}
    assert {c["d"] for c in KV_CASES} == set(decode.HEADDIMS)
    assert {c["dtype"] for c in KV_CASES} == {"bfloat16", "float16"}
    lens = {n for c in KV_CASES for n in c["lens"]}
    assert {0, 1} <= lens and any(n % 2 and n > 2 * max(t.block_n for t in DECODE_TILES.values()) for n in lens)
    assert all(c["h"] % c["hkv"] == 0 and c["h"] > c["hkv"] > 1 for c in KV_CASES)  # GQA everywhere
    assert any(c["sq"] == 1 for c in KV_CASES) and any(c["sq"] > 1 and c["causal"] for c in KV_CASES)
    assert {c["num_splits"] > 1 for c in KV_CASES} == {False, True}  # num_splits 0 (automatic) would hide it
    assert any(c["new"] and c.get("rotary_dim") for c in KV_CASES)
    assert any(c.get("window") for c in KV_CASES) and any(c.get("softcap") for c in KV_CASES)
    assert len(COMBINE_CASES) == 1


@pytest.mark.parametrize("c", KV_CASES, ids=DRIVER._describe_decode)
def test_decode_case_inputs_are_well_formed(c):
    """Float inputs fully written (initcheck then sees only the kernels' own scratch); each paged entry's
    pages distinct from every other page in use (two entries appending into one page would race) and not
    in table order; unused table entries -1, so a kernel that reads one goes out of bounds (memcheck)."""
    host = DRIVER._kvcache_inputs(c, np.random.default_rng(0))
    assert all(np.isfinite(a).all() for a in host.values() if a.dtype == np.float32)
    assert host["q"].shape == (c["b"], c["sq"], c["h"], c["d"])
    if not c["page_size"]:
        assert "page_table" not in host and host["k_cache"].shape[:2] == (c["b"], max(c["lens"]) + c["new"] + 5)
        return
    table, ps = host["page_table"], c["page_size"]
    assert host["k_cache"].shape[1] == ps
    used = [table[b, :(n + c["new"] + ps - 1) // ps] for b, n in enumerate(c["lens"])]  # the pages of its keys
    flat = np.concatenate(used)
    assert len(set(flat.tolist())) == flat.size and (flat >= 0).all() and (flat < host["k_cache"].shape[0]).all()
    assert all(np.all(table[b, len(u):] == -1) for b, u in enumerate(used))
    assert flat.size < 2 or not np.all(np.diff(flat) == 1)


@pytest.fixture
def api_on_specs(monkeypatch):
    """The public decode functions on Spec records (tests/test_decode_cpu.py's stand-ins) on a fake GPU of
    the decode family's oldest arch, without CuPy: launches are recorded, and decode.forward / decode.combine
    raise _ReachedKernel (every check passed)."""
    launches = []
    monkeypatch.setattr(api, "Call", _SpecCall)
    monkeypatch.setattr(_device, "compute_capability", lambda device=0: decode.MIN_CC)
    monkeypatch.setitem(sys.modules, "cupy", mock.MagicMock(name="cupy"))

    def record(name, last):
        def launch(*args, **kwargs):
            launches.append((name, args))
            if last:
                raise _ReachedKernel(name)
        return launch

    for name, last in (("append", False), ("forward", True), ("combine", True)):
        monkeypatch.setattr(decode, name, record(name, last))
    return launches


def _specs(host, dtype):
    """Spec records of the host arrays: int32 ones carry their values (check=True reads them)."""
    return {n: vals(a.tolist()) if a.dtype == np.int32 else spec(a.shape, dtype) for n, a in host.items()}


@pytest.mark.parametrize("c", KV_CASES, ids=DRIVER._describe_decode)
def test_decode_cases_are_calls_the_api_accepts(api_on_specs, c):
    """The driver's own call (argument names, shapes, dtypes, the values check=True reads) passes every
    check of flash_attn_with_kvcache and launches the kernels the case is for, with its split count."""
    args = _specs(DRIVER._kvcache_inputs(c, np.random.default_rng(0)), c["dtype"])
    with pytest.raises(_ReachedKernel):
        DRIVER._kvcache_call(c, args)
    names = [n for n, _ in api_on_specs]
    assert names == (["append", "forward"] if c["new"] or c.get("rotary_dim") else ["forward"])
    fwd = api_on_specs[-1][1]
    dims, num_splits = fwd[8], fwd[12]
    assert num_splits == c["num_splits"]
    assert (dims.paged, dims.page_size if dims.paged else 0) == (bool(c["page_size"]), c["page_size"])
    assert (dims.headdim, dims.dtype, dims.seqlen_new, dims.seqlen_q) == (c["d"], c["dtype"], c["new"], c["sq"])


@pytest.mark.parametrize("c", COMBINE_CASES, ids=DRIVER._describe_decode)
def test_combine_case_is_a_call_the_api_accepts(api_on_specs, c):
    args = _specs(DRIVER._combine_inputs(c, np.random.default_rng(0)), "float32")
    with pytest.raises(_ReachedKernel):
        cuflash.flash_attn_combine(args["out_partial"], args["lse_partial"])


@pytest.mark.parametrize("c", KV_CASES, ids=DRIVER._describe_decode)
def test_decode_check_passes_the_reference_and_fails_a_wrong_answer(c):
    """The driver's check (run here on host arrays: the reference takes NumPy too) accepts the reference's
    own answer and refuses a wrong output and, where the case appends, caches left as they were."""
    low = ref._as_dtype(c["dtype"])
    host = {n: a if a.dtype == np.int32 else a.astype(low)
            for n, a in DRIVER._kvcache_inputs(c, np.random.default_rng(0)).items()}
    o, lse, kc, vc = ref.kvcache_attention_ref(**host, **DRIVER._kvcache_options(c))
    appended = {"k_cache": kc, "v_cache": vc}
    DRIVER._check_kvcache(c, host, appended, o.astype(low), lse)
    with pytest.raises(AssertionError, match="out"):
        DRIVER._check_kvcache(c, host, appended, (o * 1.1 + 0.05).astype(low), lse)
    if c["new"]:
        with pytest.raises(AssertionError, match="_cache"):
            DRIVER._check_kvcache(c, host, host, o.astype(low), lse)


@pytest.mark.parametrize("c", COMBINE_CASES, ids=DRIVER._describe_decode)
def test_combine_check_passes_the_reference_and_fails_a_dropped_split(c):
    partials = DRIVER._combine_inputs(c, np.random.default_rng(0))
    assert (partials["lse_partial"][-1] == -np.inf).all()  # the split the driver leaves unwritten on the GPU
    o, lse = ref.combine_ref(partials["out_partial"], partials["lse_partial"])
    DRIVER._check_combine(partials, o.astype(np.float32), lse.astype(np.float32))
    dropped = dict(partials, lse_partial=partials["lse_partial"].copy())
    dropped["lse_partial"][0] = -np.inf
    o_wrong, lse_wrong = ref.combine_ref(dropped["out_partial"], dropped["lse_partial"])
    with pytest.raises(AssertionError):
        DRIVER._check_combine(partials, o_wrong.astype(np.float32), lse_wrong.astype(np.float32))


# ----------------------------------------------------------------------------------------------------
# scripts/sanitize_driver.py: the cascade family
# ----------------------------------------------------------------------------------------------------

CASCADE = DRIVER._cascade_cases()


def test_cascade_cases_are_the_tests_cases_and_cover_the_family():
    """Taken from tests/cascade_cases.py unchanged; one paged, one causal with 3 queries, decoding with an
    empty suffix, one whose prefix goes through the prefill kernels; head dims the decode kernels have; the
    causal precondition (every suffix >= sq - 1)."""
    assert 2 <= len(CASCADE) <= 4
    assert all(tuple(c[k] for k in DRIVER.CASCADE_KEYS) in CASCADE_CASES for c in CASCADE)
    assert any(c["paged"] for c in CASCADE) and any(not c["paged"] for c in CASCADE)
    assert any(c["causal"] and c["sq"] == 3 for c in CASCADE)
    assert any(c["sq"] == 1 and 0 in c["lens"] for c in CASCADE)
    assert any(c["b"] * c["sq"] * c["h"] // c["hkv"] >= heuristics.CASCADE_PREFILL_MIN_ROWS for c in CASCADE)
    assert all(c["d"] in decode.HEADDIMS and c["h"] % c["hkv"] == 0 and len(c["lens"]) == c["b"] for c in CASCADE)
    assert all(min(c["lens"]) >= c["sq"] - 1 for c in CASCADE if c["causal"])


@pytest.mark.parametrize("c", CASCADE, ids=DRIVER._describe_cascade)
def test_cascade_case_inputs_are_well_formed(c):
    """Shapes consistent with the case; every float element finite (written); a paged case's table names
    each page once, covering each request's suffix; the concatenation is prefix + suffix per request."""
    host = DRIVER._cascade_inputs(c, np.random.default_rng(0))
    b, sq, h, hkv, d, p = (c[k] for k in ("b", "sq", "h", "hkv", "d", "prefix_len"))
    assert host["q"].shape == (b, sq, h, d)
    assert host["prefix_k"].shape == host["prefix_v"].shape == (p, hkv, d)
    assert host["cache_seqlens"].tolist() == list(c["lens"])
    assert all(np.isfinite(host[n].astype(np.float32)).all() for n in ("q", "prefix_k", "prefix_v", "k_cache", "v_cache"))
    kc = host["k_cache"]
    if c["paged"]:
        table = host["page_table"]
        assert kc.shape[1:] == (16, hkv, d) and table.shape[0] == b and table.shape[1] * 16 >= max(c["lens"])
        assert sorted(table.ravel().tolist()) == list(range(kc.shape[0]))
    else:
        assert host["page_table"] is None and kc.shape == (b, max(c["lens"]), hkv, d)
    assert host["concat_seqlens"].tolist() == [n + p for n in c["lens"]]
    assert np.array_equal(host["concat_k"][:, :p], np.broadcast_to(host["prefix_k"], (b, p, hkv, d)))


@pytest.mark.parametrize("c", CASCADE, ids=DRIVER._describe_cascade)
def test_cascade_case_is_a_call_the_api_accepts(monkeypatch, c):
    """The driver's call passes cascade_attention's own checks (the prefix, the causal precondition, which
    reads cache_seqlens) and hands the glue the case's arrays; the glue's kernel calls (decode, prefill,
    combine) are what tests/test_cascade_cpu.py runs with NumPy stand-ins."""
    seen = {}

    def merge(*args, **kwargs):
        seen["args"] = args
        raise _ReachedKernel("cascade.merge_prefix_and_suffix")

    monkeypatch.setattr(cascade, "Call", _SpecCall)
    monkeypatch.setattr(cascade, "merge_prefix_and_suffix", merge)
    monkeypatch.setitem(sys.modules, "cupy", mock.MagicMock(name="cupy"))
    monkeypatch.setattr(_device, "device_properties", lambda device=0: {"multiProcessorCount": 132, "sharedMemPerBlockOptin": 232448})
    host = DRIVER._cascade_inputs(c, np.random.default_rng(0))
    args = {n: None if host[n] is None else vals(host[n].tolist()) if host[n].dtype == np.int32
            else spec(host[n].shape, "bfloat16") for n in DRIVER.CASCADE_ARGS}
    with pytest.raises(_ReachedKernel):
        DRIVER._cascade_call(c, args)
    q, pk, pv, kc, vc, lens, table, _, causal, check = seen["args"]
    assert (q.shape, pk.shape, kc.shape, lens.values) == (host["q"].shape, host["prefix_k"].shape,
                                                          host["k_cache"].shape, list(c["lens"]))
    assert (table is not None, causal, check) == (c["paged"], c["causal"], True)


def _cascade_glue(c, host, with_prefix=True):
    """cascade_attention's glue with the fp32 reference as its kernels (out rounded to bf16 as the combine
    writes it), on the prefix path it takes (the chunk length of a GPU of 132 SMs); with_prefix=False
    drops the prefix's partial results from the merge, keeping the suffix's, the last (a wrong answer)."""
    def combine(o_part, l_part, *, out_dtype):
        return _combine_ref(o_part if with_prefix else o_part[-1:], l_part if with_prefix else l_part[-1:],
                            out_dtype=out_dtype)

    rows = c["b"] * c["sq"] * c["h"] // c["hkv"]
    chunk = (heuristics.cascade_prefix_chunk(rows, c["hkv"], c["prefix_len"], 132)
             if rows >= heuristics.CASCADE_PREFILL_MIN_ROWS else None)
    out, lse = cascade.merge_prefix_and_suffix(
        host["q"], host["prefix_k"], host["prefix_v"], host["k_cache"], host["v_cache"], host["cache_seqlens"],
        host["page_table"], None, c["causal"], True, prefix_chunk=chunk, kvcache=_kvcache_ref, varlen=_varlen_ref,
        combine=combine, xp=np)
    return out.astype(host["q"].dtype), lse.astype(np.float32)


@pytest.mark.parametrize("c", CASCADE, ids=DRIVER._describe_cascade)
def test_cascade_check_passes_the_reference_and_fails_a_wrong_answer(c):
    """The driver's check accepts the reference over the concatenation and the glue on NumPy kernels, and
    refuses the glue without the prefix and a perturbed output."""
    host = DRIVER._cascade_inputs(c, np.random.default_rng(0))
    o, lse, _, _ = ref.kvcache_attention_ref(host["q"], host["concat_k"], host["concat_v"],
                                             cache_seqlens=host["concat_seqlens"], causal=c["causal"])
    DRIVER._check_cascade(c, host, o.astype(host["q"].dtype), lse)
    DRIVER._check_cascade(c, host, *_cascade_glue(c, host))
    with pytest.raises(AssertionError, match="out"):
        DRIVER._check_cascade(c, host, *_cascade_glue(c, host, with_prefix=False))
    with pytest.raises(AssertionError, match="out"):
        DRIVER._check_cascade(c, host, (o * 1.1 + 0.05).astype(host["q"].dtype), lse)


# ----------------------------------------------------------------------------------------------------
# scripts/sanitize_driver.py: the fp8 family
# ----------------------------------------------------------------------------------------------------

FP8 = DRIVER._fp8_cases()


def test_fp8_cases_cover_the_family():
    """Every head dim with the rotation on and off in bf16 (the six bf16 variants), each with a fused and
    a two-launch case; blocks 1, 64, 128, None and one over 128 (the two launches with an empty tile);
    groups that do not divide the sequence; seqlens 77 and 300; batch 2 x 3 heads; one strided x and one
    fp16 case."""
    for d in fp8.HEADDIMS:
        for hadamard in (True, False):
            plans = [fp8.tile_plan(c["s"], c["block"]) for c in FP8
                     if (c["d"], c["hadamard"], c["dtype"]) == (d, hadamard, "bfloat16")]
            assert {p.split for p in plans} == {False, True}, (d, hadamard)
    assert {c["block"] for c in FP8} >= {1, 64, 128, None} and any((c["block"] or 0) > fp8.TILE_ROWS for c in FP8)
    assert {c["s"] for c in FP8} == {77, 300} and {(c["b"], c["h"]) for c in FP8} == {(2, 3)}
    assert {c["hadamard"] for c in FP8} == {True, False}
    assert [c["dtype"] for c in FP8].count("float16") == 1 and sum(bool(c.get("strided")) for c in FP8) == 1
    assert any(c["s"] % fp8.tile_plan(c["s"], c["block"]).block for c in FP8)  # a short last group

    def empty_tile(c):
        plan = fp8.tile_plan(c["s"], c["block"])
        return any(begin >= end for _, _, begin, end in (fp8.tile_rows(plan, c["s"], t) for t in range(plan.tiles)))

    assert any(empty_tile(c) for c in FP8)


@pytest.mark.parametrize("c", FP8, ids=DRIVER._describe_fp8)
def test_fp8_case_inputs_are_well_formed(c):
    """A head dim and block quantize takes; x (b, s, h, d) of finite values exactly in the case's dtype;
    a strided x: not contiguous, strides in multiples of 8 elements, its last element the allocation's."""
    assert c["d"] in fp8.HEADDIMS and c["dtype"] in ("bfloat16", "float16")
    assert fp8._check_block(c["block"]) == c["block"] and isinstance(c["hadamard"], bool)
    assert fp8._check_seed(c["seed"]) == c["seed"]
    host = DRIVER._fp8_input(c, np.random.default_rng(0))
    x = DRIVER._fp8_view(c, host)
    assert x.shape == (c["b"], c["s"], c["h"], c["d"]) and np.isfinite(host).all()
    assert np.array_equal(host.astype(ref._as_dtype(c["dtype"])).astype(np.float32), host)
    if not c.get("strided"):
        assert x is host
        return
    elems = [st // x.itemsize for st in x.strides]
    assert not x.flags.c_contiguous and elems[-1] == 1 and all(e % 8 == 0 for e in elems[:-1])
    start = (x.__array_interface__["data"][0] - host.__array_interface__["data"][0]) // x.itemsize
    assert start % 8 == 0 and start + sum((n - 1) * e for n, e in zip(x.shape, elems)) == host.size - 1


@pytest.mark.parametrize("c", FP8, ids=DRIVER._describe_fp8)
def test_fp8_cases_are_calls_the_api_accepts(monkeypatch, c):
    """The driver's call (with x's strides) passes every check of fp8.quantize on a GPU of the family's
    oldest arch and launches with the case's plan, rotation and seed."""
    launches = []

    def launch(*args):
        launches.append(args)
        raise _ReachedKernel("fp8.launch_quantize")

    monkeypatch.setattr(fp8, "Call", _SpecCall)
    monkeypatch.setattr(fp8, "launch_quantize", launch)
    monkeypatch.setattr(_device, "compute_capability", lambda device=0: fp8.MIN_CC)
    monkeypatch.setitem(sys.modules, "cupy", mock.MagicMock(name="cupy"))
    x = DRIVER._fp8_view(c, DRIVER._fp8_input(c, np.random.default_rng(0)))
    with pytest.raises(_ReachedKernel):
        DRIVER._fp8_call(c, spec(x.shape, c["dtype"], strides=tuple(st // x.itemsize for st in x.strides)))
    (xa, _, _, amax, plan, hadamard, seed, _), = launches
    assert xa.shape == x.shape and plan == fp8.tile_plan(c["s"], c["block"]) and (amax is not None) == plan.split
    assert (hadamard, seed) == (c["hadamard"], c["seed"])


@pytest.mark.parametrize("c", FP8, ids=DRIVER._describe_fp8)
def test_fp8_check_passes_the_reference_and_fails_a_wrong_answer(c):
    """The driver's check accepts the reference's float32 answer (the kernel's arithmetic) and refuses one
    byte one e4m3 step off, one descale one float32 step off, and the answer of the other rotation."""
    x = DRIVER._fp8_view(c, DRIVER._fp8_input(c, np.random.default_rng(0)))
    data, descale = ref.fp8_quantize(x, c["block"], c["hadamard"], c["seed"], compute_dtype="float32")
    DRIVER._check_fp8(c, x, data, descale)
    off = data.copy()
    i = int(np.argmax((off & 0x7F) < 0x7E))  # a finite byte below the largest: one step up stays finite
    off.flat[i] += 1
    with pytest.raises(AssertionError, match="data"):
        DRIVER._check_fp8(c, x, off, descale)
    nudged = descale.copy()
    nudged.flat[-1] = np.nextafter(nudged.flat[-1], np.float32(np.inf))
    with pytest.raises(AssertionError, match="descale"):
        DRIVER._check_fp8(c, x, data, nudged)
    other = ref.fp8_quantize(x, c["block"], not c["hadamard"], c["seed"], compute_dtype="float32")
    with pytest.raises(AssertionError):
        DRIVER._check_fp8(c, x, *other)


# ----------------------------------------------------------------------------------------------------
# scripts/sanitize_driver.py: the fa3-fp8 family (the FP8 forward through flash_attn_func)
# ----------------------------------------------------------------------------------------------------

FA3_FP8 = DRIVER._fa3_fp8_cases()


def test_fa3_fp8_cases_cover_the_family():
    """Every FP8 head dim, causal and not, Sq < Sk and Sq > Sk, GQA and MQA, per-block descales whose last
    block is short and per-head ones, a single query row, and the long-row tiles."""
    from cuflash import fa3

    assert {c["d"] for c in FA3_FP8} == set(fa3.FP8_HEADDIMS)
    for d in fa3.FP8_HEADDIMS:
        assert {(c["causal"], c["sq"] < c["sk"]) for c in FA3_FP8 if c["d"] == d and c["sq"] > 1} == \
            {(False, True), (False, False), (True, True), (True, False)}
    assert {c["h"] // c["hkv"] for c in FA3_FP8} >= {2, 4} and any(c["hkv"] == 1 for c in FA3_FP8)
    assert (None, None) in {c["blocks"] for c in FA3_FP8} and any(c["sq"] == 1 for c in FA3_FP8)
    assert any(c["sk"] % c["blocks"][1] for c in FA3_FP8 if c["blocks"][1])  # a short last K/V block
    from cuflash import heuristics  # the long-row tiles too, at every head dim that has them

    long = [c for c in FA3_FP8 if c["sq"] >= heuristics.FA3_FP8_LONG_MIN_SEQLEN]
    tiles = {fa3.fwd_tiles(c["d"], fp8=True, long_rows=True, kv_block=c["blocks"][1]) for c in long}
    assert tiles >= {*heuristics.FA3_FP8_TILES_LONG.values(), *heuristics.FA3_FP8_TILES_WIDE.values()}


@pytest.mark.parametrize("c", FA3_FP8, ids=DRIVER._describe_fa3_fp8)
def test_fa3_fp8_cases_are_calls_the_api_accepts(spec_env, c):
    """The driver's call, on the shapes fp8.quantize gives it, passes every check of the FP8 path on an
    sm_90 GPU and reaches fa3.forward_fp8 with the case's blocks."""
    from cuflash import fa3

    q_block, kv_block = c["blocks"]

    def n(seqlen, block):
        return 1 if block is None else -(-seqlen // block)

    data = (spec((c["b"], c["sq"], c["h"], c["d"]), "uint8"),
            spec((c["b"], c["sk"], c["hkv"], c["d"]), "uint8"),
            spec((c["b"], c["sk"], c["hkv"], c["d"]), "uint8"))
    descales = (spec((c["b"], c["h"], n(c["sq"], q_block)), "float32"),
                spec((c["b"], c["hkv"], n(c["sk"], kv_block)), "float32"),
                spec((c["b"], c["hkv"], n(c["sk"], kv_block)), "float32"))
    with pytest.raises(_ReachedKernel):
        DRIVER._fa3_fp8_call(c, data, descales)
    (args,) = spec_env["launches"]
    launched_q_block, launched_kv_block = args[8], args[9]
    # one descale per head (the quantiser's only block covers the sequence): a block of the whole sequence
    assert launched_q_block == (q_block if n(c["sq"], q_block) > 1 else c["sq"])
    if n(c["sk"], kv_block) > 1:
        assert launched_kv_block == kv_block
    assert launched_kv_block % fa3.FP8_BLOCK_N == 0 and launched_kv_block >= min(kv_block or c["sk"], c["sk"])
