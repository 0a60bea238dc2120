"""Which order of tiles makes the FA3 forward's L2 serve fewer read sectors (bench/NOTES.md, session 24: at
d = 128 N = 2k the same bytes reach cuDNN's SMs and ours from the same TMA loads, but its L2 slices serve
42 % fewer read sectors). One FA3 forward per tile order on a benchmark shape, each bracketed by
cudaProfilerStart / Stop so that Nsight Compute, started with --profile-from-start off, profiles exactly
those kernels, in the order printed here; without ncu it prints each order's TF/s instead.

    ncu --profile-from-start off --clock-control none \\
        --metrics lts__t_sectors_op_read.sum,lts__t_sector_op_read_hit_rate.pct,gpu__time_duration.sum \\
        python scripts/l2_order_probe.py [--headdim 128] [--seqlen 2048] [--causal]
    python scripts/l2_order_probe.py --time        # TF/s per order (interleaved rounds), no profiler

Orders: the host's choice (cuflash/tile_order.py), and sections of 1, 2, 4, 8, 16 and every (head, batch)
pair, each with and without the serpentine deal (scripts/ab_probe.py fixed_sections).
"""
import argparse
import sys
from pathlib import Path

import cupy

sys.path.insert(0, str(Path(__file__).parent))
import ab_probe  # noqa: E402  (the probes' shapes and table edits)

import cuflash  # noqa: E402


def orders(pairs):
    out = {"as built": ab_probe.as_is}
    for section in (1, 2, 4, 8, 16, pairs):
        for serpentine in (False, True):
            if section <= pairs:
                out[f"{section} pairs{' serpentine' if serpentine else ''}"] = (
                    lambda s=section, z=serpentine: ab_probe.fixed_sections(s, z))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--time", action="store_true", help="TF/s per order instead of profiled calls")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    d, n, causal = args.headdim, args.seqlen, args.causal
    b, h, (q, k, v) = ab_probe.bench_shape(d, n, 3)
    configs = orders(b * h)
    if args.time:
        ab_probe.fwd_interleaved(d, n, causal, configs, args.rounds, 10)
        return
    from cupy.cuda import runtime

    for name, config in configs.items():
        with config():
            for _ in range(3):  # compile, load, warm the clocks
                cuflash.flash_attn_func(q, k, v, causal=causal, impl="fa3")
            cupy.cuda.Device().synchronize()
            runtime.profilerStart()
            cuflash.flash_attn_func(q, k, v, causal=causal, impl="fa3")
            cupy.cuda.Device().synchronize()
            runtime.profilerStop()
        print(f"profiled: fa3 d={d} N={n} causal={causal} order={name}", flush=True)


if __name__ == "__main__":
    main()
