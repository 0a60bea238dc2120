"""A/B of the FA3 backward's K-block launch order (heuristics.FA3_BWD_HIGHEST_FIRST_BOUNDED): times
``flash_attn_backward(impl="fa3")`` with the causal mask, lowest block first and highest first, and
the deterministic mode (always highest first) beside them, bf16, FlashAttention benchmark shapes (16k
tokens, hidden 2048). Prints TF/s per (d, N) and the ratio.

    python scripts/bwd_order_probe.py [--headdims 64,128] [--seqlens 2048,8192] [--reps 20]
"""
import argparse

import cupy
import numpy as np

import cuflash
from cuflash import heuristics
from cuflash.bench import time_fn


def main():
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headdims", type=ints, default=[64, 128])
    parser.add_argument("--seqlens", type=ints, default=[2048, 8192])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for d in args.headdims:
        for n in args.seqlens:
            b, h = max(1, 16384 // n), 2048 // d
            q, k, v, dout = (cupy.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32)).astype("bfloat16")
                             for _ in range(4))
            out, lse = cuflash.flash_attn_func(q, k, v, causal=True, return_lse=True, impl="fa3")
            flops = 2.5 * 4 * b * h * n * n * d / 2
            row = {}
            for name, first, det in (("lowest first", False, False), ("highest first", True, False),
                                     ("deterministic", True, True)):
                heuristics.FA3_BWD_HIGHEST_FIRST_BOUNDED = first
                ms = time_fn(lambda: cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, impl="fa3",
                                                                 deterministic=det), 3, args.reps)
                row[name] = flops / ms / 1e9
            print(f"d={d:3d} N={n:5d} causal " + " | ".join(f"{k} {v:5.0f}" for k, v in row.items())
                  + f" | highest/lowest {row['highest first'] / row['lowest first']:.3f}", flush=True)


if __name__ == "__main__":
    main()
