"""Time FA2 forward tile configurations against each other and the torch flash/cudnn peers in one run.

    python scripts/tune_fa2.py            # the candidate table below
Prints one line per (head dim, config, causal) at the FlashAttention benchmark shape (16k tokens,
hidden 2048) for N = 4096 and 8192.
"""
import sys

import cupy
import numpy as np

import cuflash
from cuflash import heuristics
from cuflash.bench import time_fn

# (block_m, block_n, warps, compute_n): all compile without spills for sm_90a (NVRTC 13.5). Session 1
# measured the first three of each row; the compute_n ones (K/V tiles loaded block_n at a time, S and
# the softmax computed compute_n keys at a time) are new.
CANDIDATES = {
    64: [(128, 64, 4, 0), (128, 64, 8, 0), (128, 128, 8, 0), (128, 128, 4, 64)],
    128: [(128, 64, 8, 0), (128, 32, 4, 0), (128, 128, 8, 0)],
    256: [(64, 64, 4, 0), (64, 32, 4, 0), (128, 64, 8, 0), (128, 64, 8, 32), (64, 64, 4, 32)],
}


def median_ms(fn):
    return time_fn(fn, warmup=3, reps=20)


def torch_ms(q, k, v, causal, backend):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(getattr(SDPBackend, backend)):
        return median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))


def main():
    rng = np.random.default_rng(0)
    dims = [int(a) for a in sys.argv[1:]] or sorted(CANDIDATES)
    for d in dims:
        for n in (4096, 8192):
            b, h = 16384 // n, 2048 // d
            q, k, v = (cupy.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32)).astype("bfloat16")
                       for _ in range(3))
            for causal in (False, True):
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                peers = {name: torch_ms(q, k, v, causal, name) for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION")}
                line = " ".join(f"{name[:5].lower()} {flops / t / 1e9:5.0f}" for name, t in peers.items())
                for cfg in CANDIDATES[d]:
                    heuristics.FA2_TILES[d] = heuristics.Fa2Tiles(*cfg)
                    t = median_ms(lambda: cuflash.flash_attn_func(q, k, v, causal=causal, impl="fa2"))
                    print(f"d={d} N={n} causal={causal!s:5} {cfg}: fa2 {flops / t / 1e9:5.0f} TF/s | {line}"
                          f" | x{peers['FLASH_ATTENTION'] / t:.2f} vs flash", flush=True)


if __name__ == "__main__":
    main()
