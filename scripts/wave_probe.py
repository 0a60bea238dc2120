"""Is a kernel's time set by whole waves of blocks? The FA3 backward (one block per 128 keys of a head) and
forward (persistent, 128-row tiles) at N = 2k, d = 128, not causal, batch 1, with heads chosen so that the
blocks are just under and just over a whole number of waves of 132 SMs: 123 heads (1968 blocks, 14.9 waves),
124 (1984, 15.03) and 128 (2048, 15.5; the benchmark shape's count). If whole waves set the time, TF/s at 123
heads is ~2.5 % above 128's and 124's ~3 % below; if not, the three are level. Rounds interleave the head
counts (the H200's clocks fall under load: bench/NOTES.md, session 10).

    python scripts/wave_probe.py [--n 2048] [--d 128] [--rounds 5] [--reps 20]
"""
import argparse
import statistics

import cupy

import cuflash
from cuflash.bench import time_fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", default="123,124,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    n, d = args.n, args.d
    heads = [int(h) for h in args.heads.split(",")]
    cases = {}
    for h in heads:
        q, k, v, do = (cupy.random.standard_normal((1, n, h, d), dtype=cupy.float32).astype("bfloat16")
                       for _ in range(4))
        out, lse = cuflash.flash_attn_func(q, k, v, impl="fa3", return_lse=True)
        flops = 4 * h * n * n * d
        cases[h] = dict(
            forward=(lambda q=q, k=k, v=v: cuflash.flash_attn_func(q, k, v, impl="fa3"), flops),
            backward=(lambda q=q, k=k, v=v, do=do, out=out, lse=lse:
                      cuflash.flash_attn_backward(do, q, k, v, out, lse, impl="fa3"), 2.5 * flops))
    for direction in ("forward", "backward"):
        tf = {h: [] for h in heads}
        for r in range(args.rounds):
            for h in heads[r % len(heads):] + heads[:r % len(heads)]:
                fn, flops = cases[h][direction]
                tf[h].append(flops / time_fn(fn, 3, args.reps) / 1e9)
        base = statistics.median(tf[heads[-1]])
        cells = [f"{h} heads {statistics.median(t):5.0f} ({statistics.median(t) / base:.3f}) [{min(t):.0f}-{max(t):.0f}]"
                 for h, t in tf.items()]
        print(f"fa3 {direction} d={d} N={n}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
