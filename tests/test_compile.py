"""CPU tier: every kernel variant compiles through NVRTC for sm_80 and sm_90a, with the machine code
it was written for and no register spills (what `python -m cuflash compile --json` reports)."""
import json
import subprocess
import sys

import pytest

from cuflash import compile_report, fa3, heuristics

ARCHS = ("sm_80", "sm_90a")


@pytest.fixture(scope="module", params=ARCHS)
def report(request):
    proc = subprocess.run([sys.executable, "-m", "cuflash", "compile", "--arch", request.param, "--json"],
                          capture_output=True, text=True)
    rows = json.loads(proc.stdout)
    return request.param, proc.returncode, rows, proc.stderr


def test_every_variant_compiles_without_spills(report):
    arch, rc, rows, stderr = report
    assert rows, "no variants registered"
    bad = {r["name"]: compile_report.problems(r) for r in rows if compile_report.problems(r)}
    assert not bad, f"{arch}: {bad}\n{stderr}"
    assert rc == 0, stderr


def test_json_schema(report):
    arch, _, rows, _ = report
    for r in rows:
        for key in ("name", "family", "arch", "regs", "smem", "spill_bytes", "opcodes"):
            assert key in r, key
        assert r["arch"] == arch
        assert set(compile_report.OPCODES) <= set(r["opcodes"])
        assert isinstance(r["regs"], int) and 0 < r["regs"] <= 255


def test_fa1_uses_tensor_cores(report):
    """The FA1 attention kernels run on mma.sync (HMMA) fed by ldmatrix (LDSM)."""
    arch, _, rows, _ = report
    main = [r for r in rows if r["family"] == "fa1" and r["kernel"] in ("fa1_fwd", "fa1_bwd")]
    assert len(main) == 2 * 2 * 5  # fwd + bwd, bf16 + fp16, five head dims
    for r in main:
        assert r["opcodes"]["HMMA"] > 0 and r["opcodes"]["LDSM"] > 0, r["name"]


def test_compile_error_names_variant_and_carries_log(tmp_path, monkeypatch):
    from cuflash import _jit

    bad = _jit.Variant("fa1", "fa1/fwd.cu", "fa1_fwd", (("CUFLASH_HEADDIM", 24), ("CUFLASH_BLOCK_M", 64),
                                                        ("CUFLASH_BLOCK_N", 64), ("CUFLASH_DTYPE", 0)))
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    with pytest.raises(_jit.CompileError) as info:
        _jit.compile_variant(bad, "sm_80")
    msg = str(info.value)
    assert "fa1.fa1_fwd[headdim=24" in msg and "sm_80" in msg
    assert "static assertion" in msg or "static_assert" in msg  # the NVRTC log is carried


def test_ptxas_log_parsing():
    log = """ptxas info    : Compiling entry function 'a' for 'sm_90a'
ptxas info    : Function properties for a
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'b' for 'sm_90a'
ptxas info    : Function properties for b
ptxas         .     16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
"""
    a = compile_report.parse_ptxas_log(log, "a")
    b = compile_report.parse_ptxas_log(log, "b")
    assert (a["regs"], a["static_smem"], a["spill_bytes"]) == (40, 1024, 0)
    assert (b["regs"], b["spill_bytes"], b["stack_bytes"]) == (255, 20, 16)
    row = {"ok": True, "spill_bytes": 20, "stack_bytes": 16, "advisories": []}
    assert compile_report.problems(row)
    row = {"ok": True, "spill_bytes": 0, "stack_bytes": 0,
           "advisories": ["ptxas info: (C7517) warpgroup.wait_group is injected"]}
    assert compile_report.problems(row) == ["wgmma serialised by ptxas"]


def test_fa2_uses_tensor_cores_and_cp_async(report):
    """FA2 variants: mma.sync (HMMA) fed by cp.async (LDGSTS) and ldmatrix (LDSM)."""
    arch, _, rows, _ = report
    fa2_rows = [r for r in rows if r["family"] == "fa2"]
    assert fa2_rows
    for r in fa2_rows:
        ops = r["opcodes"]
        assert ops["HMMA"] > 0 and ops["LDGSTS"] > 0 and ops["LDSM"] > 0, r["name"]


def test_fa3_uses_hopper_hardware(report):
    """FA3 attention variants (sm_90a only): wgmma (HGMMA; QGMMA, and no HGMMA, in the FP8 forward), TMA
    loads (UTMALDG), the warpgroup register split (USETMAXREG); no spills and no advisory that serialises
    wgmma (checked by problems()). The FP8 forward's V transpose pre-pass is a plain kernel."""
    arch, _, rows, _ = report
    fa3_rows = [r for r in rows if r["family"] == "fa3" and r["kernel"] != "fp8_transpose_v"]
    if arch != "sm_90a":
        assert not fa3_rows
        return
    fp8_rows = [r for r in fa3_rows if "fp8=1" in r["name"]]
    # FP8 forward: head dims 64, 128, 256, and the long-row tiles (heuristics.FA3_FP8_TILES_LONG and _WIDE)
    assert fa3_rows and len(fp8_rows) == 3 + len(heuristics.FA3_FP8_TILES_LONG) + len(heuristics.FA3_FP8_TILES_WIDE)
    for r in fa3_rows:
        ops = r["opcodes"]
        gemms = ops["QGMMA"] if r in fp8_rows else ops["HGMMA"]
        assert gemms > 0 and ops["UTMALDG"] > 0 and ops["USETMAXREG"] > 0, r["name"]
    for r in fp8_rows:
        assert r["opcodes"]["HGMMA"] == 0 and r["opcodes"]["F2FP.SATFINITE.E4M3"] > 0, r["name"]


@pytest.mark.parametrize("headdim, softcap, varlen, pack, fp8, unmasked", [
    (64, False, False, False, False, False), (96, False, False, False, False, False),
    (128, False, False, False, False, False), (128, True, False, False, False, False),
    (128, False, True, False, False, False), (128, False, False, True, False, False),
    (128, False, False, False, False, True), (128, True, True, False, False, True), (64, False, False, False, False, True),
    (192, False, False, False, False, False), (256, False, False, False, False, False),
    (256, True, False, True, False, False), (64, False, False, False, True, False),
    (128, False, False, False, True, False), (256, False, False, False, True, "long rows")])
def test_fa3_softmax_overlaps_the_pv_gemm(headdim, softcap, varlen, pack, fp8, unmasked):
    """The FA3 main loop issues S_n = Q K_n^T and O += P_{n-1} V_{n-1}, waits for S_n only
    (WARPGROUP.DEPBAR.LE gsb0, 0x1), computes the softmax (MUFU.EX2) while the P V GEMM runs, and only
    then waits for it (DEPBAR ... 0x0). ptxas is free to hoist that last wait above the exponentials (it
    did while the O rescale followed the wait; the rescale now runs under the next S GEMM), which silently
    serialises the loop. (FP8 at d = 256 runs without this overlap on purpose where its P V goes into a fresh
    accumulator, heuristics.FA3_FP8_TILES; its long rows take it with P through shared memory: "long rows",
    FA3_FP8_TILES_WIDE.)"""
    import re

    from cuflash import fa3
    from cuflash._jit import compile_variant

    tool = compile_report.find_tool("nvdisasm")
    if tool is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    if unmasked == "long rows":
        variant = fa3.fwd_variant(headdim, "bfloat16", fp8=fp8, long_rows=True, kv_block=256)
        assert "p_smem=1" in variant.name
    else:
        variant = fa3.fwd_variant(headdim, "bfloat16", softcap, varlen, pack, fp8, unmasked)
    cubin = compile_variant(variant, "sm_90a").cubin
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        sass = subprocess.run([tool, "-c", fh.name], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"(WARPGROUP\.DEPBAR\.LE gsb0, 0x[01]|MUFU\.EX2)", sass)
    # the loop is the only place with one group left in flight; its wait for S is followed by the softmax
    # before the wait for P V
    waits_for_s = [i for i, op in enumerate(ops) if op == "WARPGROUP.DEPBAR.LE gsb0, 0x1"]
    assert len(waits_for_s) == 1, f"{len(waits_for_s)} waits for S with a P V in flight"
    # The loop's GEMMs take their shared-memory descriptors from uniform registers. Where ptxas cannot tell
    # that the warps of the loop are converged it computes them in ordinary registers and moves each to a
    # uniform one (R2UR) before every wgmma: session 24's branch lost 8-10 % to that under NVRTC 13.0 alone.
    lines = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    loop_wait = max(i for i, line in enumerate(lines) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line)
    gemms = [i for i in range(loop_wait) if re.search(r"[HQ]GMMA", lines[i])]
    assert not any("R2UR" in line for line in lines[gemms[-4]: loop_wait]), (
        "R2UR among the main loop's wgmma: their descriptors are not in uniform registers")
    for first in waits_for_s:
        following = ops[first + 1:]
        wait_for_pv = following.index("WARPGROUP.DEPBAR.LE gsb0, 0x0")
        exps = following[:wait_for_pv].count("MUFU.EX2")
        assert exps >= 64 * 64 // 128, (  # at least one exponential per score of the tile a thread holds
            f"only {exps} exponentials between the wait for S and the wait for P V: the softmax does not overlap")


def test_fa3_variants_fit_in_shared_memory():
    """Every FA3 variant asks for at most the 227 KB of dynamic shared memory a block may have on sm_90 (the
    kernels' static_asserts check the other side: that the request holds their Smem), so none fails at
    launch on the H200 after compiling cleanly here."""
    from cuflash import fa3

    over = [(v.name, v.smem_bytes) for v in fa3.all_variants() if v.smem_bytes > fa3.MAX_SMEM]
    assert not over, f"over {fa3.MAX_SMEM} bytes: {over}"


def test_fa3_backward_machine_code(report):
    """FA3 backward variants (sm_90a): wgmma for all five products, TMA loads, and the dQ accumulator
    updated by TMA reduce-adds (UTMAREDG), not atomics."""
    arch, _, rows, _ = report
    bwd = [r for r in rows if r["family"] == "fa3" and r["kernel"] in ("fa3_bwd", "fa3_bwd_wide")]
    if arch != "sm_90a":
        assert not bwd
        return
    # 2 dtypes x head dims 64, 96, 128 (fa3_bwd) and 192, 256 (fa3_bwd_wide) x softcap or not x fixed or
    # variable length at 64 rows per step, and 2 dtypes x fixed or variable length at each head dim's rows
    # of heuristics.FA3_BWD_BLOCK_M (without a softcap) where those are not 64
    other_rows = sum(bm != fa3.BWD_BLOCK_M for bm in heuristics.FA3_BWD_BLOCK_M.values())
    assert len(bwd) == 40 + 4 * other_rows and sum(r["kernel"] == "fa3_bwd_wide" for r in bwd) == 16
    for r in bwd:
        ops = r["opcodes"]
        assert ops["HGMMA"] >= 5 and ops["UTMALDG"] > 0 and ops["USETMAXREG"] > 0, r["name"]
        assert ops["UTMAREDG"] > 0, r["name"]


def test_fa3_backward_rows_per_step():
    """The FA3 backward's rows per step (fa3.bwd_block_m): the table's without a softcap, 64 with one (its
    registers); every variant fits the shared memory, with two staged dQ tiles per consumer where they fit."""
    for d in fa3.BWD_HEADDIMS:
        assert fa3.bwd_block_m(d, softcap=True) == fa3.BWD_BLOCK_M
        assert fa3.bwd_block_m(d, softcap=False) == heuristics.FA3_BWD_BLOCK_M.get(d, fa3.BWD_BLOCK_M)
    for v in fa3.all_variants("sm_90a"):
        if v.kernel == "fa3_bwd":
            defines = dict(v.defines)
            assert defines["CUFLASH_BLOCK_M"] % 16 == 0 and v.smem_bytes <= fa3.MAX_SMEM, v.name
            assert defines["CUFLASH_DQ_STAGES"] in (1, 2), v.name


def test_fp8_converts_with_the_e4m3_instruction(report):
    """fp8 quantisation variants (sm_89 and newer; none for sm_80): 2 dtypes x 3 head dims x rotation on/off,
    each converting with the hardware's fp32 -> e4m3 instruction (cvt.rn.satfinite.e4m3x2.f32 ->
    F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C), not a software rounding."""
    arch, _, rows, _ = report
    fp8_rows = [r for r in rows if r["family"] == "fp8"]
    if arch == "sm_80":
        assert not fp8_rows
        return
    assert len(fp8_rows) == 12
    for r in fp8_rows:
        assert r["opcodes"]["F2FP.SATFINITE.E4M3"] > 0, r["name"]


def test_every_variant_fits_its_arch_shared_memory(report):
    """Dynamic + static shared memory of every variant within what a block of that arch may take
    (_device.ARCH_SMEM_PER_BLOCK): none fails at launch for want of it."""
    from cuflash._device import ARCH_SMEM_PER_BLOCK

    arch, _, rows, _ = report
    over = [(r["name"], r["dynamic_smem"] + r["static_smem"]) for r in rows
            if r["dynamic_smem"] + r["static_smem"] > ARCH_SMEM_PER_BLOCK[arch]]
    assert not over, f"{arch}: over {ARCH_SMEM_PER_BLOCK[arch]} bytes: {over}"


@pytest.mark.parametrize("arch", ["sm_86", "sm_89"])
def test_small_shared_memory_gpus_get_tiles_that_fit(arch):
    """sm_86 / sm_89 give a block 99 KB: the FA2 backward (FA2_BWD_TILES_SMALL_SMEM) and decode
    (DECODE_TILES_SMALL_SMEM) take smaller tiles there, so every variant those GPUs run fits (decode's
    static shared memory bounded by decode.STATIC_SMEM_BOUND; FA1 / FA2 have none), and the small rows
    compile without spills (their plain variants here; every feature variant was checked by hand)."""
    from cuflash import decode, fa2
    from cuflash._device import ARCH_SMEM_PER_BLOCK

    limit = ARCH_SMEM_PER_BLOCK[arch]
    variants = compile_report.all_variants(arch)
    over = [(v.name, v.smem_bytes) for v in variants
            if v.smem_bytes + (decode.STATIC_SMEM_BOUND if v.family == "decode" else 0) > limit]
    assert not over, f"{arch}: over {limit} bytes: {over}"
    small = [fa2.bwd_variant(d, "bfloat16", max_smem=limit) for d in heuristics.FA2_BWD_TILES_SMALL_SMEM]
    small += [decode.fwd_variant(d, "bfloat16", paged, max_smem=limit) for d in heuristics.DECODE_TILES_SMALL_SMEM
              for paged in (False, True)]
    assert all(v in variants for v in small)
    rows = compile_report.compile_variants(small, arch)
    bad = {r["name"]: compile_report.problems(r) for r in rows if compile_report.problems(r)}
    assert not bad, bad
    assert all(r["dynamic_smem"] + r["static_smem"] <= limit for r in rows)
