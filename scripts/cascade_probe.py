"""Cascade attention against one pass over the concatenated keys, at issue 6's shape: a 32k-token prefix
shared by 64 requests with 512 suffix tokens each, one query per request, 32 query / 8 KV heads, d = 128,
bf16. GPU time per call from CUDA-graph replays (scripts/decode_probe.replay_us), host time per eager call
apart, and the ratio.

    python scripts/cascade_probe.py [--prefix 32768] [--batch 64] [--suffix 512] [--reps 20]
"""
import argparse
import time

import cupy

import cuflash
from decode_probe import replay_us

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
    t_cascade, t_plain = replay_us(cascade, args.reps), replay_us(plain, args.reps)
    host = {}
    for name, fn in (("cascade", cascade), ("plain", plain)):  # eager calls, not synchronised: the host path
        cupy.cuda.get_current_stream().synchronize()
        start = time.perf_counter()
        for _ in range(args.reps):
            fn()
        host[name] = (time.perf_counter() - start) / args.reps * 1e6
        cupy.cuda.get_current_stream().synchronize()
    print(f"prefix {p}, batch {b}, suffix {s}: GPU cascade {t_cascade:8.1f} us, concatenation {t_plain:8.1f} us "
          f"({2 * concat_k.nbytes / t_plain / 1e6:.2f} TB/s), speedup {t_plain / t_cascade:.1f}x; host per call "
          f"{host['cascade']:.0f} / {host['plain']:.0f} us; max |diff| {err:.2e}")


if __name__ == "__main__":
    main()
