"""Where a decode step's time goes: the split-KV kernel for several num_splits (its combine included and
alone), next to a plain read of the same K/V bytes, on CUDA-graph replays. For tuning
heuristics.decode_num_splits and the decode kernel between full `python -m cuflash bench --suite decode` runs.

    python scripts/decode_probe.py [--shapes 1x32768,16x8192] [--splits 1,8,16,33,66,132] [--page-sizes 0,1]
        [--head-major]
    python scripts/decode_probe.py --ab ROUNDS [--shapes ...] [--page-sizes ...] [--pages-in-order]

--head-major also times a contiguous cache stored head by head ((batch, kv_heads, seqlen, d) in memory, passed
as its (batch, seqlen, kv_heads, d) view): a block then streams one contiguous run instead of 256-byte rows
2 KB apart shared with the other heads' blocks -- whether DRAM locality is what the decode kernel loses. Each
shape also times a plain read of the K/V bytes (16-byte loads, no writes; the best of a few launch shapes): the
ceiling.
"""
import argparse
import dataclasses
from contextlib import contextmanager

import cupy
import numpy as np

import cuflash
from cuflash import decode, heuristics
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


_READ = r"""
// Each thread keeps UNROLL independent 16-byte loads in flight per step (a grid-stride walk over n chunks).
template <int UNROLL>
__device__ void read_all(const uint4* __restrict__ a, long long n, unsigned* sink) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
        uint4 x[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) x[u] = __ldcs(a + i + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc.x ^= x[u].x, acc.y ^= x[u].y, acc.z ^= x[u].z, acc.w ^= x[u].w;
    }
    for (; i < n; i += stride) {
        const uint4 x = a[i];
        acc.x ^= x.x, acc.y ^= x.y, acc.z ^= x.z, acc.w ^= x.w;
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) sink[0] = 1;  // keeps the loads; never true in practice
}
extern "C" __global__ void read_1(const uint4* a, long long n, unsigned* sink) { read_all<1>(a, n, sink); }
extern "C" __global__ void read_4(const uint4* a, long long n, unsigned* sink) { read_all<4>(a, n, sink); }
"""


def read_us(arrays):
    """Microseconds to read the arrays once with a plain grid-stride kernel of 512-thread blocks, for 1 or 4
    loads in flight per thread and 1, 2 or 4 blocks per SM: {(loads, blocks per SM): us}. The least is
    the ceiling for these bytes."""
    module = cupy.RawModule(code=_READ, options=("-std=c++17",))
    sink = cupy.zeros(1, dtype=cupy.uint32)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    times = {}
    for loads in (1, 4):
        kernel = module.get_function(f"read_{loads}")
        for per_sm in (1, 2, 4):
            def run():
                for a in arrays:
                    kernel((per_sm * sms,), (512,), (a, np.int64(a.nbytes // 16), sink))
            times[loads, per_sm] = replay_us(run)
    return times


def make_cache(batch, cache_len, page_size=0, head_major=False, in_order=False):
    """q, k, v, cache_seqlens, page_table (None unless paged: the pages in a random order, or in order with
    ``in_order``), the plain-read times {(loads, blocks per SM): us} of the K/V bytes, and their count."""
    rng = cupy.random.default_rng(0)
    q = rng.standard_normal((batch, 1, HEADS, D), dtype=cupy.float32).astype("bfloat16")
    shape = (batch, KV_HEADS, cache_len, D) if head_major else (batch, cache_len, KV_HEADS, D)
    k = rng.standard_normal(shape, dtype=cupy.float32).astype("bfloat16")
    v = rng.standard_normal(shape, dtype=cupy.float32).astype("bfloat16")
    reads = read_us((k, v))
    if head_major:
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    seqlens = cupy.full((batch,), cache_len, dtype=cupy.int32)
    nbytes = 2 * k.nbytes
    table = None
    if page_size:  # entry b's page j is physical page table[b, j]
        per_entry = cache_len // page_size
        order = np.arange(batch * per_entry) if in_order else np.random.default_rng(1).permutation(batch * per_entry)
        perm = cupy.asarray(order.astype(np.int32))
        paged = []
        for x in (k, v):
            y = cupy.empty((batch * per_entry, page_size, KV_HEADS, D), dtype=x.dtype)
            y.view(cupy.uint16)[perm] = x.view(cupy.uint16).reshape(batch * per_entry, page_size, KV_HEADS, D)
            paged.append(y)
        k, v, table = paged[0], paged[1], perm.reshape(batch, per_entry)
    return q, k, v, seqlens, table, reads, nbytes


def probe(batch, cache_len, splits_list, page_size=0, head_major=False):
    rng = cupy.random.default_rng(0)
    q, k, v, seqlens, table, reads, nbytes = make_cache(batch, cache_len, page_size, head_major)
    read = min(reads.values())
    auto = kvcache_num_splits(batch, HEADS, KV_HEADS, 1, D, cache_len, paged=bool(page_size))
    cache = f"page size {page_size}" if page_size else "contiguous, head-major" if head_major else "contiguous"
    print(f"{batch}x{cache_len} {cache}: K+V {nbytes / 2**20:.0f} MiB; plain read {read:6.1f} us "
          f"({nbytes / read / 1e6:5.2f} TB/s); heuristic num_splits {auto}", flush=True)
    print("  plain reads (loads in flight per thread, blocks per SM): "
          + ", ".join(f"{loads}/{per_sm} {t:.1f} us" for (loads, per_sm), t in reads.items()), flush=True)
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


@contextmanager
def decode_config(block_n=None, stages=None, no_compute=False, splits=None, copy_chunks=None, no_combine=False):
    """Decode calls at head dim D take ``block_n`` keys per tile (one warp per 16) in ``stages`` ring
    slots, each thread copying ``copy_chunks`` 16-byte chunks of a row, contiguous or paged (the table's where
    not given), and
    with ``no_compute`` the timing-only variant without the attention math, with ``no_combine`` the split
    kernel alone (timing only: out is not written). (``splits`` is ab()'s:
    "contiguous" splits a paged cache by the contiguous rule instead of the paged one.)"""
    saved, built, combine = heuristics.DECODE_TILES[D], decode.fwd_variant, decode.combine
    if no_combine:
        decode.combine = lambda *args, **kwargs: None
    if block_n or stages or copy_chunks:
        chunks = dict(copy_chunks=copy_chunks, paged_copy_chunks=copy_chunks) if copy_chunks else {}
        heuristics.DECODE_TILES[D] = dataclasses.replace(saved, block_n=block_n or saved.block_n,
                                                         stages=stages or saved.stages, **chunks)
    if no_compute:
        def variant(*args, **kwargs):
            v = built(*args, **kwargs)
            return dataclasses.replace(v, defines=v.defines + (("CUFLASH_PROBE_NO_COMPUTE", 1),))
        decode.fwd_variant = variant
    try:
        yield
    finally:
        heuristics.DECODE_TILES[D], decode.fwd_variant, decode.combine = saved, built, combine


# name -> decode_config's arguments. Session 17 on the H200 (us; plain read of the K/V bytes 31.5-32.2 at
# 1 x 32k, 117 at 16 x 8k): 1 x 32k contiguous table 39.1, no math 36.9, 128 keys x 2 / x 3 (8 warps)
# 41.1 / 39.6; page size 1 table 43.9-44.3, no math 40.1-41.0, 8-warp tiles 50+, 16 splits 45.8; page 16
# 43.3 / 40.1, 16 splits 43.7; 16 x 8k page 1 128.3 / 126.7, page 16 128.4 / 125.4. A paged tile's page
# table read 2 or 3 tiles ahead of its copies (not one) was slower everywhere (1 x 32k page 1 45.5 / 45.8,
# 16 x 8k 133.5 / 134.4): the lookups' latency is not what the paged rows lose. Session 18 (plain read
# 32.4 / 119.4, contiguous): no math with 2 / 3 (table) / 6 stages 43.3 / 37.2 / 37.6 at 1 x 32k, 142.8 /
# 121.4 / 122.3 at 16 x 8k -- three stages keep enough bytes in flight.
AB_CONFIGS = {
    "table": {},
    "no math (timing only)": dict(no_compute=True),
    # what a combine inside the split kernel could save at most (session 19: merged by each query block's
    # last split after an atomic arrival count, the 1 x 32k call took 43.4 us against 39.4 with the
    # combine kernel as the split kernel's programmatic dependent -- the fence, atomic and L2 round trips
    # on the critical path cost more than the dependent launch)
    "split kernel alone (timing only)": dict(no_combine=True),
    "no math, split kernel alone": dict(no_compute=True, no_combine=True),
    # a row's address (paged: its page lookup and 64-bit math) once per 2 / 4 chunks of the row a thread
    # copies instead of once per chunk. Session 19 (before the table took 2 / 4 chunks for paged caches
    # at d = 128 / 256 and dropped the paged split rule there; heuristics.DECODE_TILES has the numbers): 4
    # chunks slower everywhere at d = 128 (1 x 32k contiguous 40.4 vs 38.3, 16 x 8k paged +15 us at the
    # paged rule's 2 splits), 2 chunks level contiguous and ~2 us faster paged; split like a contiguous
    # cache, 2 chunks gained 2-4 us on every paged 1 x 32k row.
    "4 chunks per thread": dict(copy_chunks=4),
    "contiguous splits": dict(splits="contiguous"),  # (where the table keeps the paged rule: d = 64)
    # more bytes in flight per block: whether small pages (whose rows are spread over the whole cache:
    # more address-translation misses than in a contiguous cache) want deeper rings than contiguous ones
    "4 stages": dict(stages=4),
    "5 stages": dict(stages=5),
}


def ab(batch, cache_len, page_size, rounds, in_order=False):
    """The AB_CONFIGS in interleaved rounds at the heuristic's split count: median us [range] each."""
    q, k, v, seqlens, table, reads, nbytes = make_cache(batch, cache_len, page_size, in_order=in_order)
    out = cupy.empty_like(q)
    times = {name: [] for name in AB_CONFIGS}
    for _ in range(rounds):
        for name, config in AB_CONFIGS.items():
            with decode_config(**config):
                paged_rule = bool(page_size) and config.get("splits") != "contiguous"
                ns = kvcache_num_splits(batch, HEADS, KV_HEADS, 1, D, cache_len, paged=paged_rule)
                ws = cupy.empty(kvcache_workspace_bytes(batch, HEADS, 1, D, ns), dtype=cupy.uint8)
                times[name].append(replay_us(lambda: cuflash.flash_attn_with_kvcache(
                    q, k, v, cache_seqlens=seqlens, page_table=table, num_splits=ns, check=False, out=out,
                    workspace=ws), reps=100))
    cache = f"page size {page_size}{', pages in order' if in_order else ''}" if page_size else "contiguous"
    print(f"{batch}x{cache_len} {cache} (plain read {min(reads.values()):.1f} us): " + " | ".join(
        f"{name} {np.median(t):.1f} [{min(t):.1f}-{max(t):.1f}]" for name, t in times.items()), flush=True)


def main():
    global D
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x32768,16x8192")
    ap.add_argument("--headdim", type=int, default=D, help="head dim (32 query heads, 8 KV heads)")
    ap.add_argument("--splits", default="1,8,16,33,66,132")
    ap.add_argument("--page-sizes", default="0", help="0 = contiguous cache, else paged with that page size")
    ap.add_argument("--head-major", action="store_true", help="also a contiguous cache stored head by head")
    ap.add_argument("--ab", type=int, default=0, metavar="ROUNDS",
                    help="instead: the decode tile configurations (AB_CONFIGS) in ROUNDS interleaved rounds")
    ap.add_argument("--pages-in-order", action="store_true",
                    help="with --ab: paged caches also with their pages in order (DRAM locality against lookups)")
    args = ap.parse_args()
    D = args.headdim
    splits = [int(x) for x in args.splits.split(",")]
    for shape in args.shapes.split(","):
        b, n = (int(x) for x in shape.lower().split("x"))
        for page_size in (int(x) for x in args.page_sizes.split(",")):
            if args.ab:
                ab(b, n, page_size, args.ab)
                if page_size and args.pages_in_order:
                    ab(b, n, page_size, args.ab, in_order=True)
            else:
                probe(b, n, splits, page_size)
        if args.head_major:
            probe(b, n, splits, head_major=True)


if __name__ == "__main__":
    main()
