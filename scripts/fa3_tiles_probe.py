"""A/B of the FA3 forward's tiles, in one process: FA3_TILES alone, then with heuristics.FA3_TILES_UNMASKED
(wider K tiles for calls without a mask; causal calls take FA3_TILES either way: a check on the noise),
then with FA3_TILES_3WG too (three consumer warpgroups); times ``flash_attn_func(impl="fa3")`` causal and
not, torch's cuDNN backend beside, bf16, FlashAttention benchmark shapes (16k tokens, hidden 2048).
Prints TF/s per (d, N, causal).

    python scripts/fa3_tiles_probe.py [--headdims 64,128,256] [--seqlens 2048,4096,8192,16384] [--reps 20]
"""
import argparse

import cupy
import numpy as np

import cuflash
from cuflash import fa3, heuristics
from cuflash.bench import time_fn


def main():
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headdims", type=ints, default=[64, 128, 256])
    parser.add_argument("--seqlens", type=ints, default=[2048, 4096, 8192, 16384])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    tables = (heuristics.FA3_TILES, heuristics.FA3_TILES_UNMASKED, heuristics.FA3_TILES_3WG)
    full = tuple(dict(t) for t in tables)
    configs = (("FA3_TILES", (full[0], {}, {})), ("+UNMASKED", (full[0], full[1], {})), ("+3WG", full))
    rng = np.random.default_rng(0)
    for d in args.headdims:
        for n in args.seqlens:
            b, h = max(1, 16384 // n), 2048 // d
            q, k, v = (cupy.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32)).astype("bfloat16")
                       for _ in range(3))
            for causal in (False, True):
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                row = {}
                for name, contents in configs:
                    for table, content in zip(tables, contents):
                        table.clear()
                        table.update(content)
                    t = fa3.fwd_tiles(d, unmasked=not causal)
                    ms = time_fn(lambda: cuflash.flash_attn_func(q, k, v, causal=causal, impl="fa3"), 3, args.reps)
                    row[f"{name} ({fa3.fwd_block_m(t)} x {t.block_n})"] = flops / ms / 1e9
                try:
                    import torch
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        ms = time_fn(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv,
                                                                                              is_causal=causal),
                                     3, args.reps)
                    row["torch-cudnn"] = flops / ms / 1e9
                except Exception as exc:  # no torch, or no cuDNN attention on this GPU / build
                    print(f"(torch-cudnn not timed: {exc})")
                print(f"d={d:3d} N={n:5d} causal={causal!s:5} " + " | ".join(f"{k} {v:5.0f}" for k, v in row.items()),
                      flush=True)

if __name__ == "__main__":
    main()
