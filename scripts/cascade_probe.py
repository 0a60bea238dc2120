"""Cascade attention against one pass over the concatenated keys, at issue 6's shape: a 32k-token prefix
shared by 64 requests with 512 suffix tokens each, one query per request, 32 query / 8 KV heads, d = 128,
bf16. GPU time per call from CUDA-graph replays (scripts/decode_probe.replay_us), host time per eager call
apart, and the ratio. The prefix path cascade_attention takes (the prefill kernels in chunks from 64 query
rows per KV head, the decode kernel below) is timed against the other one through the same glue
(cuflash.cascade.merge_prefix_and_suffix), to check the threshold: --batch 16 is 64 rows, --batch 8 is 32.

    python scripts/cascade_probe.py [--prefix 32768] [--batch 64] [--suffix 512] [--reps 20]
"""
import argparse
import time

import cupy

import cuflash
from cuflash import api
from cuflash._device import device_properties
from cuflash.bench import DECODE_HEADS as HEADS
from cuflash.bench import DECODE_KV_HEADS as KV_HEADS
from cuflash.bench import cascade_inputs
from cuflash.cascade import merge_prefix_and_suffix
from cuflash.heuristics import CASCADE_PREFILL_MIN_ROWS, cascade_prefix_chunk
from decode_probe import replay_us


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--suffix", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    b, p, s = args.batch, args.prefix, args.suffix
    x = cascade_inputs(b, p, s)
    q, prefix_k, prefix_v, suffix_k, suffix_v, lens = (x[k] for k in ("q", "prefix_k", "prefix_v", "suffix_k",
                                                                      "suffix_v", "lens"))
    concat_k, concat_v, concat_lens = x["concat_k"], x["concat_v"], x["concat_lens"]

    def cascade():
        return cuflash.cascade_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, cache_seqlens=lens, check=False)

    def plain():
        return cuflash.flash_attn_with_kvcache(q, concat_k, concat_v, cache_seqlens=concat_lens, check=False)

    rows = b * HEADS // KV_HEADS
    chunk = cascade_prefix_chunk(rows, KV_HEADS, p, device_properties(cupy.cuda.Device().id)["multiProcessorCount"])
    taken = chunk if rows >= CASCADE_PREFILL_MIN_ROWS else None
    other = None if taken is not None else chunk

    def cascade_other_path():
        return merge_prefix_and_suffix(
            q, prefix_k, prefix_v, suffix_k, suffix_v, lens, None, None, False, False, prefix_chunk=other,
            kvcache=cuflash.flash_attn_with_kvcache, varlen=api.flash_attn_varlen_func,
            combine=cuflash.flash_attn_combine, xp=cupy)[0]

    def path(c):
        return "decode kernel" if c is None else f"{-(-p // c)} chunks of {c} keys"

    err = float(abs(cascade().astype("float32") - plain().astype("float32")).max())
    t_cascade, t_plain = replay_us(cascade, args.reps), replay_us(plain, args.reps)
    t_other = replay_us(cascade_other_path, args.reps)
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
    print(f"  {rows} query rows per KV head: prefix through the {path(taken)} {t_cascade:8.1f} us; "
          f"through the {path(other)} {t_other:8.1f} us")


if __name__ == "__main__":
    main()
