"""Where a decode step's time goes: the split-KV kernel for several num_splits (its combine included and
alone), next to a plain device copy of the same K/V bytes, on CUDA-graph replays. For tuning
heuristics.decode_num_splits and the decode kernel between full `python -m cuflash bench --suite decode` runs.

    python scripts/decode_probe.py [--shapes 1x32768,16x8192] [--splits 1,8,16,33,66,132] [--page-sizes 0,1]
"""
import argparse

import cupy
import numpy as np

import cuflash
from cuflash.api import kvcache_num_splits, kvcache_workspace_bytes
from cuflash.bench import capture_on_stream

HEADS, KV_HEADS, D = 32, 8, 128


def replay_us(fn, reps=200):
    """Microseconds per replay of a graph holding fn's kernels (median of 5 batches of reps)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # compile and warm outside the capture
        graph, _ = capture_on_stream(stream, fn)
        graph.launch(stream)
        times = []
        for _ in range(5):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(reps):
                graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / reps)
    return float(np.median(times))


def probe(batch, cache_len, splits_list, page_size=0):
    rng = cupy.random.default_rng(0)
    q = rng.standard_normal((batch, 1, HEADS, D), dtype=cupy.float32).astype("bfloat16")
    k = rng.standard_normal((batch, cache_len, KV_HEADS, D), dtype=cupy.float32).astype("bfloat16")
    v = rng.standard_normal((batch, cache_len, KV_HEADS, D), dtype=cupy.float32).astype("bfloat16")
    seqlens = cupy.full((batch,), cache_len, dtype=cupy.int32)
    nbytes = 2 * k.nbytes
    table = None
    if page_size:  # entry b's page j is physical page table[b, j]; the pages in a random order
        per_entry = cache_len // page_size
        perm = cupy.asarray(np.random.default_rng(1).permutation(batch * per_entry).astype(np.int32))
        paged = []
        for x in (k, v):
            y = cupy.empty((batch * per_entry, page_size, KV_HEADS, D), dtype=x.dtype)
            y.view(cupy.uint16)[perm] = x.view(cupy.uint16).reshape(batch * per_entry, page_size, KV_HEADS, D)
            paged.append(y)
        k, v, table = paged[0], paged[1], perm.reshape(batch, per_entry)
    dst = cupy.empty_like(k)
    copy_us = replay_us(lambda: (cupy.copyto(dst, k), cupy.copyto(dst, v)))
    auto = kvcache_num_splits(batch, HEADS, KV_HEADS, 1, D, cache_len, paged=bool(page_size))
    cache = f"page size {page_size}" if page_size else "contiguous"
    print(f"{batch}x{cache_len} {cache}: K+V {nbytes / 2**20:.0f} MiB; copy (read+write) {copy_us:6.1f} us; "
          f"heuristic num_splits {auto}", flush=True)
    out = cupy.empty_like(q)
    for ns in sorted(set(splits_list) | {auto}):
        ws = cupy.empty(kvcache_workspace_bytes(batch, HEADS, 1, D, ns), dtype=cupy.uint8)
        us = replay_us(lambda: cuflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, page_table=table, num_splits=ns,
                                                                check=False, out=out, workspace=ws))
        line = f"  num_splits {ns:4d}: {us:6.1f} us  {nbytes / us / 1e6:5.2f} TB/s"
        if ns > 1:
            op = rng.standard_normal((ns, batch, 1, HEADS, D), dtype=cupy.float32)
            lp = rng.standard_normal((ns, batch, HEADS, 1), dtype=cupy.float32)
            try:  # the public combine allocates its outputs: a capture may refuse that
                line += f"   (combine alone {replay_us(lambda: cuflash.flash_attn_combine(op, lp)):5.1f} us)"
            except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
                line += f"   (combine alone: {type(exc).__name__})"
        print(line, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x32768,16x8192")
    ap.add_argument("--splits", default="1,8,16,33,66,132")
    ap.add_argument("--page-sizes", default="0", help="0 = contiguous cache, else paged with that page size")
    args = ap.parse_args()
    splits = [int(x) for x in args.splits.split(",")]
    for shape in args.shapes.split(","):
        b, n = (int(x) for x in shape.lower().split("x"))
        for page_size in (int(x) for x in args.page_sizes.split(",")):
            probe(b, n, splits, page_size)


if __name__ == "__main__":
    main()
