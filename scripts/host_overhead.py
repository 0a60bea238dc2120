"""Host-side cost of one cuflash call: Python time per call (the launch is asynchronous, so a loop of
calls without synchronising measures the host path alone), per implementation, and a cProfile of the
FA3 forward's host path. Small shapes, so the GPU never holds the loop back.

    python scripts/host_overhead.py [--calls 2000]
"""
import argparse
import cProfile
import pstats
import time

import cupy
import numpy as np

import cuflash


def per_call_us(fn, calls):
    fn()
    cupy.cuda.get_current_stream().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    cupy.cuda.get_current_stream().synchronize()
    return host


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
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
    impl = cuflash.available_impls("forward")[-1]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        cuflash.flash_attn_func(q, k, v, causal=True, impl=impl)
    prof.disable()
    cupy.cuda.get_current_stream().synchronize()
    print(f"--- cProfile of {args.calls} {impl} forward calls (by own time)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
