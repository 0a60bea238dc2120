"""A/B of the FA3 forward's exponentials on the FMA pipe (Fa3Tiles.exp2_emu: one group of 8 key columns in k
through common/poly_exp2.cuh, the rest on the SFU), in one process: for each head dim, bf16 and FP8, causal
and not, the table's tiles with exp2_emu = 0 and each k asked for. Prints TF/s and each output's largest
difference from the exp2_emu = 0 output (the cubic's 1e-4 relative error should not show in bf16).

    python scripts/fa3_exp2_probe.py [--headdims 64,128] [--seqlens 2048,8192] [--emu 0,8,4,2] [--reps 10]
    python scripts/fa3_exp2_probe.py --compile-only     # no GPU: registers, spills, MUFU / FFMA counts (sm_90a)
    python scripts/fa3_exp2_probe.py --precompile-only  # the variants into the disk cache, in parallel

Hypothesis (bench/NOTES.md, session 8): where the softmax bounds a tile (d = 64, FP8 at d = 128) the SFU's
16 exponentials per clock per SM are the narrowest unit; moving a quarter of them to the FMA pipe
balances the two.
"""
import argparse
import dataclasses

from ab_probe import tables_edited  # (scripts/: the directory a script runs from is on the path)
from cuflash import fa3, heuristics

# the forward's tile tables (fa3 imports some of them by name: the same dicts, so edits in place reach it)
TABLES = heuristics.FA3_FORWARD_TABLES


def exp2_emu(k: int):
    """Every forward tile table's rows with exp2_emu = k (undone when the context ends)."""
    return tables_edited(TABLES, lambda table: table.update(
        {d: dataclasses.replace(t, exp2_emu=k) for d, t in table.items()}))


def compile_only(headdims, emus):
    from cuflash import compile_report
    from cuflash._jit import compile_variant

    for d in headdims:
        for fp8 in (False, True):
            if fp8 and d not in fa3.FP8_HEADDIMS:
                continue
            for unmasked in (True, False):
                for k in emus:
                    with exp2_emu(k):
                        v = fa3.fwd_variant(d, "bfloat16", fp8=fp8, unmasked=unmasked)
                        row = compile_report.report_variant(v, "sm_90a")
                        ops = compile_report.count_opcodes(compile_variant(v, "sm_90a").cubin,
                                                           ("MUFU", "FFMA", "FADD", "FMNMX")) or {}
                    print(f"d={d:3d} {'fp8 ' if fp8 else 'bf16'} {'unmasked' if unmasked else 'masked  '} "
                          f"emu={k}: regs {row['regs']} spill {row['spill_bytes']} "
                          f"problems {compile_report.problems(row) or '-'} | "
                          + " ".join(f"{op} {n}" for op, n in ops.items()), flush=True)


def probe_variants(headdims, emus) -> set:
    """Every variant the timings and the GPU tests of the switch take (scripts/cache_pack.py packs them too)."""
    variants = set()
    for d in headdims:
        for k in emus:
            with exp2_emu(k):
                for fp8 in (False, True) if d in fa3.FP8_HEADDIMS else (False,):
                    # no mask, a mask over long rows, a mask over short rows (fa3.fwd_tiles)
                    variants.update(fa3.fwd_variant(d, "bfloat16", fp8=fp8, unmasked=u, short_masked=s)
                                    for u, s in ((True, False), (False, False), (False, True)))
    return variants


def precompile(headdims, emus):
    """Every variant the timings take, compiled in parallel into the disk cache first (NVRTC compiles one
    program per thread: ~20 s apiece on the H200 machine, one at a time inside the timing loop)."""
    import os

    from cuflash import compile_report

    rows = compile_report.compile_variants(probe_variants(headdims, emus), "sm_90a", os.cpu_count())
    bad = [f"{r['name']}: {compile_report.problems(r)}" for r in rows if compile_report.problems(r)]
    print(f"compiled {len(rows)} variants" + (f"; problems: {bad}" if bad else ""), flush=True)


def timed(headdims, seqlens, emus, reps):
    import cupy
    import numpy as np

    import cuflash
    from cuflash.bench import time_fn

    import fp8_probe  # scripts/: the FP8 forward's direct call (bypasses the API's quantisation)

    rng = np.random.default_rng(0)
    for d in headdims:
        for n in seqlens:
            b, h = max(1, 16384 // n), 2048 // d
            q, k, v = (cupy.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32)).astype("bfloat16")
                       for _ in range(3))
            for fp8 in (False, True):
                if fp8 and d not in fa3.FP8_HEADDIMS:
                    continue
                for causal in (False, True):
                    flops = 4 * b * h * n * n * d / (2 if causal else 1)
                    cells, ref = [], None
                    for emu in emus:
                        with exp2_emu(emu):
                            if fp8:
                                cupy.random.seed(0)  # the same inputs for every emu
                                call, *_, out, _lse, _ = fp8_probe.run(b, n, n, h, h, d, causal)
                            else:
                                out = None

                                def call():
                                    nonlocal out
                                    out = cuflash.flash_attn_func(q, k, v, causal=causal, impl="fa3")
                            call()
                            got = out.astype(cupy.float32)
                            ms = time_fn(call, 3, reps)
                        if ref is None:
                            ref, diff = got, 0.0
                        else:
                            diff = float(cupy.abs(got - ref).max())
                        cells.append(f"emu={emu} {flops / ms / 1e9:5.0f}" + (f" (diff {diff:.1e})" if emu else ""))
                    print(f"d={d:3d} N={n:5d} {'fp8 ' if fp8 else 'bf16'} causal={causal!s:5} " + " | ".join(cells),
                          flush=True)


def main():
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headdims", type=ints, default=[64, 128])
    parser.add_argument("--seqlens", type=ints, default=[2048, 8192])
    parser.add_argument("--emu", type=ints, default=[0, 8, 4, 2])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--precompile-only", action="store_true",
                        help="fill the disk cache with the variants (all cores) and stop: the GPU tests of the "
                             "switch (test_forward_exponentials_on_the_fma_pipe) then find them compiled")
    args = parser.parse_args()
    if args.compile_only:
        compile_only(args.headdims, args.emu)
    elif args.precompile_only:
        precompile(args.headdims, args.emu)
    else:
        precompile(args.headdims, args.emu)
        timed(args.headdims, args.seqlens, args.emu, args.reps)


if __name__ == "__main__":
    main()
