"""Host-side cost of one cuflash call: Python time per call (the launch is asynchronous, so a loop of
calls without synchronising measures the host path alone), per implementation, the decode call's split
into Python and launches, a planned decode step (plan_kvcache / run), the FP8 forward, and a cProfile of
the FA3 forward's, the FP8 forward's and the decode call's host paths. Small shapes, so the GPU never holds the loop back.

    python scripts/host_overhead.py [--calls 2000] [--top 18]
"""
import argparse
import cProfile
import pstats
import time

import cupy
import numpy as np

import cuflash
from cuflash import fp8
from cuflash.api import kvcache_num_splits, kvcache_workspace_bytes


def per_call_us(fn, calls):
    fn()
    cupy.cuda.get_current_stream().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    cupy.cuda.get_current_stream().synchronize()
    return host


def decode_breakdown(decode_call, kq, kc, vc, seqlens, kout, ws, calls):
    """Where a decode call's host time goes: the call with its two launches replaced by no-ops (the Python
    around them), the array conversion (Call) alone, and each launch alone."""
    from cuflash import _interop, decode

    saved = decode.launch, decode.launch_dependent
    issued = []
    decode.launch = decode.launch_dependent = lambda *a: issued.append(a)
    try:
        python_us = per_call_us(decode_call, calls)
    finally:
        decode.launch, decode.launch_dependent = saved
    named = [("q", kq), ("k_cache", kc), ("v_cache", vc), ("cache_seqlens", seqlens), ("out", kout), ("workspace", ws)]
    call_us = per_call_us(lambda: _interop.Call(named), calls)
    print(f"  decode without its launches: {python_us:6.1f} us; Call() of its 6 arrays alone: {call_us:6.1f} us")
    stream = cupy.cuda.get_current_stream()
    for (variant, grid, args, _), how in zip(issued[:2], (decode.launch, decode.launch_dependent)):
        us = per_call_us(lambda: how(variant, grid, args, stream), calls)
        print(f"  {how.__name__} of {variant.kernel} alone: {us:6.1f} us")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--top", type=int, default=18, help="functions per cProfile listing")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal((1, 128, 2, 128), dtype=np.float32)).astype("bfloat16")
               for _ in range(3))
    out, lse = cuflash.flash_attn_func(q, k, v, return_lse=True)
    print(f"empty kernel launch (cupy ElementwiseKernel): "
          f"{per_call_us(lambda: cupy.add(lse, 0, out=lse), args.calls):6.1f} us per call")
    for impl in cuflash.available_impls("forward"):
        us = per_call_us(lambda: cuflash.flash_attn_func(q, k, v, causal=True, impl=impl), args.calls)
        print(f"{impl} forward: {us:6.1f} us per call (host)")
    for impl in cuflash.available_impls("backward"):
        us = per_call_us(lambda: cuflash.flash_attn_backward(q, q, k, v, out, lse, causal=True, impl=impl), args.calls)
        print(f"{impl} backward: {us:6.1f} us per call (host)")
    # decode as a serving loop calls it: no host reads (check=False), its own out and workspace
    kq = cupy.asarray(rng.standard_normal((1, 1, 32, 128), dtype=np.float32)).astype("bfloat16")
    kc, vc = (cupy.asarray(rng.standard_normal((1, 4096, 8, 128), dtype=np.float32)).astype("bfloat16")
              for _ in range(2))
    seqlens = cupy.full((1,), 4096, dtype=cupy.int32)
    splits = kvcache_num_splits(1, 32, 8, 1, 128, 4096)
    ws = cupy.empty(kvcache_workspace_bytes(1, 32, 1, 128, splits), dtype=cupy.uint8)
    kout = cupy.empty_like(kq)

    def decode_call():
        return cuflash.flash_attn_with_kvcache(kq, kc, vc, cache_seqlens=seqlens, check=False, out=kout, workspace=ws)
    print(f"decode (check=False, out, workspace; {splits} splits): {per_call_us(decode_call, args.calls):6.1f} us "
          f"per call (host)")
    print(f"decode (defaults: check=True): "
          f"{per_call_us(lambda: cuflash.flash_attn_with_kvcache(kq, kc, vc, cache_seqlens=seqlens), args.calls):6.1f}"
          f" us per call (host, with its copy of cache_seqlens to the host)")
    decode_breakdown(decode_call, kq, kc, vc, seqlens, kout, ws, args.calls)
    plan = cuflash.plan_kvcache(kq, kc, vc, cache_seqlens=seqlens, out=kout)
    print(f"decode plan.run (the same call, planned once): "
          f"{per_call_us(lambda: plan.run(kq, kc, vc, cache_seqlens=seqlens, out=kout), args.calls):6.1f} us per call")
    # FP8 (the fp8 suite's call: e4m3 bytes from cuflash.fp8.quantize with their descales, blocks of 256)
    (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize(x, hadamard=False) for x in (q, k, v))

    def fp8_call():
        return cuflash.flash_attn_func(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs, fp8_format="e4m3",
                                       causal=True)
    print(f"fp8 forward: {per_call_us(fp8_call, args.calls):6.1f} us per call (host)")
    impl = cuflash.available_impls("forward")[-1]
    for name, fn in ((f"{impl} forward", lambda: cuflash.flash_attn_func(q, k, v, causal=True, impl=impl)),
                     ("fp8 forward", fp8_call), ("decode", decode_call)):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        cupy.cuda.get_current_stream().synchronize()
        print(f"--- cProfile of {args.calls} {name} calls (by own time)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
