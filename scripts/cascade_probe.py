"""Cascade attention against one pass over the concatenated keys, at issue 6's shape: a 32k-token prefix
shared by 64 requests with 512 suffix tokens each, one query per request, 32 query / 8 KV heads, d = 128,
bf16. Prints both times (CUDA events, median of --reps calls after warm-up) and the ratio.

    python scripts/cascade_probe.py [--prefix 32768] [--batch 64] [--suffix 512] [--reps 20]
"""
import argparse

import cupy

import cuflash
from cuflash.bench import time_fn

HEADS, KV_HEADS, D = 32, 8, 128


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--suffix", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    b, p, s = args.batch, args.prefix, args.suffix
    rng = cupy.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape, dtype=cupy.float32).astype("bfloat16")

    q = rand(b, 1, HEADS, D)
    prefix_k, prefix_v = rand(p, KV_HEADS, D), rand(p, KV_HEADS, D)
    suffix_k, suffix_v = rand(b, s, KV_HEADS, D), rand(b, s, KV_HEADS, D)
    lens = cupy.full((b,), s, dtype=cupy.int32)
    concat_k = cupy.concatenate([cupy.broadcast_to(prefix_k, (b, p, KV_HEADS, D)), suffix_k], axis=1)
    concat_v = cupy.concatenate([cupy.broadcast_to(prefix_v, (b, p, KV_HEADS, D)), suffix_v], axis=1)
    concat_lens = lens + p

    def cascade():
        return cuflash.cascade_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, cache_seqlens=lens, check=False)

    def plain():
        return cuflash.flash_attn_with_kvcache(q, concat_k, concat_v, cache_seqlens=concat_lens, check=False)

    err = float(abs(cascade().astype("float32") - plain().astype("float32")).max())
    t_cascade = time_fn(cascade, 3, args.reps)
    t_plain = time_fn(plain, 3, args.reps)
    read_plain = 2 * concat_k.nbytes
    print(f"prefix {p}, batch {b}, suffix {s}: cascade {t_cascade * 1e3:8.1f} us, concatenation {t_plain * 1e3:8.1f} us "
          f"({read_plain / t_plain / 1e9:.2f} TB/s), speedup {t_plain / t_cascade:.1f}x, max |diff| {err:.2e}")


if __name__ == "__main__":
    main()
