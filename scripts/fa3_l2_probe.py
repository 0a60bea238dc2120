"""A/B of the FA3 forward's L2 section budget (heuristics.FA3_L2_SECTION_KIB, per head dim: how much K/V the
persistent scheduler's concurrently running (head, batch) pairs share in L2), in one process: bf16, FlashAttention
benchmark shapes (16k tokens, hidden 2048), causal and not, torch's cuDNN backend beside. Prints TF/s per
budget and the heads per section each budget gives (a budget changes the timing only where it changes that).

Budgets are timed in interleaved rounds (the order rotates each round) and the first budget once more at
the end of each round (an A/A pair: the spread between its two columns is the noise floor). A probe that
timed each budget once, in a fixed order, saw the first one fastest by up to 13 % where two budgets gave
the same sections (session 10).

    python scripts/fa3_l2_probe.py [--headdims 128] [--seqlens 8192,16384] [--mib 2,4,8,32] [--rounds 5]
"""
import argparse

import cupy
import numpy as np

import cuflash
from cuflash import heuristics, tile_order
from cuflash.bench import time_fn


def main():
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headdims", type=ints, default=[128])
    parser.add_argument("--seqlens", type=ints, default=[8192, 16384])
    parser.add_argument("--mib", type=ints, default=[2, 4, 8, 32])
    parser.add_argument("--reps", type=int, default=10, help="timed calls per budget per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    table, long = heuristics.FA3_L2_SECTION_KIB, heuristics.FA3_L2_SECTION_KIB_LONG
    rng = np.random.default_rng(0)
    try:
        for d in args.headdims:
            for n in args.seqlens:
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v = (cupy.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32)).astype("bfloat16")
                           for _ in range(3))
                kv_bytes = n * ((d + 63) // 64 * 64) * 2 * 2  # K and V of one head, rows padded to 64 columns
                for causal in (False, True):
                    flops = 4 * b * h * n * n * d / (2 if causal else 1)
                    budgets = list(args.mib) + [args.mib[0]]  # the last: the first again (A/A)
                    times = [[] for _ in budgets]
                    for r in range(args.rounds):
                        order = list(range(len(budgets) - 1))
                        order = order[r % len(order):] + order[:r % len(order)] + [len(budgets) - 1]
                        for i in order:
                            # (cuflash.fa3 reads the tables when it plans a layout: forget the plans)
                            heuristics.FA3_L2_SECTION_KIB, heuristics.FA3_L2_SECTION_KIB_LONG = {}, budgets[i] * 1024
                            cuflash.clear_plans()
                            times[i].append(time_fn(
                                lambda: cuflash.flash_attn_func(q, k, v, causal=causal, impl="fa3"), 2, args.reps))
                    cells = []
                    for mib, ms in zip(budgets, times):
                        ms = sorted(ms)
                        tf = [flops / t / 1e9 for t in (ms[len(ms) // 2], ms[-1], ms[0])]
                        cells.append(f"{mib} MiB ({tile_order.section_fit(kv_bytes, mib << 20)}h) {tf[0]:4.0f} [{tf[1]:.0f}-{tf[2]:.0f}]")
                    try:
                        import torch
                        from torch.nn.attention import SDPBackend, sdpa_kernel

                        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
                        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                            ms = time_fn(lambda: torch.nn.functional.scaled_dot_product_attention(
                                tq, tk, tv, is_causal=causal), 3, args.reps)
                        cells.append(f"torch-cudnn {flops / ms / 1e9:5.0f}")
                    except Exception as exc:  # no torch, or no cuDNN attention on this GPU / build
                        cells.append(f"(torch-cudnn not timed: {exc})")
                    print(f"d={d:3d} N={n:5d} causal={causal!s:5} " + " | ".join(cells), flush=True)
    finally:
        heuristics.FA3_L2_SECTION_KIB, heuristics.FA3_L2_SECTION_KIB_LONG = table, long
        cuflash.clear_plans()


if __name__ == "__main__":
    main()
