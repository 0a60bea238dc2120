"""A small timing probe for kernel work between full benchmark runs: cuflash vs the naive reference
and torch SDPA at a few shapes (FlashAttention benchmark shapes: 16k tokens, hidden 2048)."""
import cupy
import numpy as np

import cuflash
from cuflash import reference as ref
from cuflash.bench import time_fn


def median_ms(fn, reps=20):
    return time_fn(fn, warmup=3, reps=reps)


def main():
    rng = np.random.default_rng(0)
    for d in (64, 128, 256):
        for n in (1024, 4096):
            b, h = 16384 // n, 2048 // d
            q, k, v = (cupy.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32)).astype("bfloat16")
                       for _ in range(3))
            for causal in (False, True):
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
                dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32)).astype("bfloat16")
                t_fwd = median_ms(lambda: cuflash.flash_attn_func(q, k, v, causal=causal))
                t_bwd = median_ms(lambda: cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal))
                t_naive = median_ms(lambda: ref.attention_naive(q, k, v, causal=causal), reps=5)
                print(f"d={d:3d} N={n:5d} causal={causal!s:5}: fa1 fwd {t_fwd:7.3f} ms {flops / t_fwd / 1e9:6.1f} TF/s"
                      f" | bwd {t_bwd:7.3f} ms {2.5 * flops / t_bwd / 1e9:6.1f} TF/s | naive fwd {t_naive:7.3f} ms"
                      f" -> x{t_naive / t_fwd:.1f}")


if __name__ == "__main__":
    main()
