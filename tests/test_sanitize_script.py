"""scripts/sanitize.sh reads compute-sanitizer's summaries right (CPU tier: a stand-in sanitizer prints
canned logs, so the classification is tested without a GPU), and the CPU side of scripts/sanitize_driver.py's
decode family: when it is listed, that its cases cover what they are meant to, are calls the public API
accepts (run on Spec records up to the kernel launch), and that their reference check passes the
reference and fails a wrong answer."""
import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

import cuflash
from cuflash import _device, api, decode
from cuflash import reference as ref
from cuflash.heuristics import DECODE_TILES
from test_bad_input_table import _ReachedKernel, _SpecCall  # the same stand-ins as the decode bad-input table
from test_decode_cpu import spec, vals

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
    ("racecheck", "clean"): "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)",
    ("racecheck", "race"): "========= Error: Race reported between Write access at f+0x10\n"
                           "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)",
    ("racecheck", "silent"): "nothing",
}


@pytest.fixture
def fake_sanitizer(tmp_path):
    script = tmp_path / "compute-sanitizer"
    lines = ["#!/usr/bin/env bash", 'if [ "$1" = --version ]; then echo "Version 2025.3.1.0"; exit 0; fi',
             'tool=$2; fam=${@: -1}', 'case "$tool $fam" in']
    for (tool, fam), text in CANNED.items():
        quoted = text.replace("'", "'\\''")
        lines.append(f"  '{tool} {fam}') printf '%s\\n' '{quoted}' ;;")
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


@pytest.mark.parametrize("impls, decode_ok, listed", [
    ([], True, "decode"),
    ([], False, ""),
    (["fa2"], True, "fa2-fwd fa2-bwd decode"),
])
def test_list_has_decode_when_the_gpu_runs_it(monkeypatch, capsys, impls, decode_ok, listed):
    monkeypatch.setattr(cuflash, "available_impls", lambda: impls)
    monkeypatch.setattr(DRIVER, "_decode_available", lambda: decode_ok)
    assert DRIVER.main(["--list"]) == 0
    assert capsys.readouterr().out.strip() == listed


@pytest.mark.parametrize("gpu, cc, ok", [(False, (9, 0), False), (True, (7, 5), False), (True, decode.MIN_CC, True),
                                         (True, (9, 0), True)])
def test_decode_available_asks_what_the_api_asks(monkeypatch, gpu, cc, ok):
    monkeypatch.setattr(_device, "has_gpu", lambda: gpu)
    monkeypatch.setattr(_device, "compute_capability", lambda device=0: cc)
    assert DRIVER._decode_available() is ok


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
