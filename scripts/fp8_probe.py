"""The FP8 forward (cuflash.fa3.forward_fp8) on its own, for kernel work: error against
cuflash.reference.attention_fp8_ref (the dequantised e4m3 inputs, float64), and TFLOP/s at FlashAttention
benchmark shapes (16k tokens, hidden 2048) next to the bf16 FA3 kernel. Bypasses the public API's validation.

    python scripts/fp8_probe.py [--headdims 64,128] [--seqlens 2048,8192] [--no-time] [--no-check]
                                [--tiles 128:128:3:0[:0],...]   # d:block_n:stages:intra_wg_overlap[:pingpong]
    python scripts/fp8_probe.py --profile 128:8192:0             # one call between cudaProfilerStart/Stop
                                                                 # (scripts/ncu_profile.sh, case fa3fp8:...)
    python scripts/fp8_probe.py --profile-cudnn 128:8192:0       # cuDNN's FP8 attention alike (case cudnnfp8:...)
"""
import argparse

import cupy
import numpy as np

from cuflash import _validate, fa3, fp8, heuristics, reference
from cuflash.bench import FP8_BLOCK, time_fn  # (the fp8 suite's descale block)


def run(b, sq, sk, h, hk, d, causal, qblock=128, kvblock=128):
    rand = lambda *s: cupy.random.standard_normal(s, dtype=cupy.float32).astype("bfloat16")
    q, k, v = rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    q8, qs = fp8.quantize(q, block=qblock, hadamard=True, seed=1)
    k8, ks = fp8.quantize(k, block=kvblock, hadamard=True, seed=1)
    v8, vs = fp8.quantize(v, block=kvblock, hadamard=False)
    qblock = min(qblock, sq) if qs.shape[2] > 1 else sq
    kvb = kvblock if ks.shape[2] > 1 else fa3.fp8_whole_sequence_kv_block(sk)
    out = cupy.empty((b, sq, h, d), dtype="bfloat16")
    out.view(cupy.uint16).fill(0x7FC0)  # NaN: every element must be written
    lse = cupy.full((b, h, sq), cupy.nan, dtype=cupy.float32)
    dims = _validate.Dims(b, sq, sk, h, hk, d, "bfloat16")
    window = _validate.window_bounds((-1, -1), causal, dims)
    scale = d ** -0.5
    call = lambda: fa3.forward_fp8(q8, k8, v8, out, lse, qs, ks, vs, qblock, kvb, dims, window, scale,
                                   cupy.cuda.get_current_stream())
    return call, (q8, qs, qblock), (k8, ks, kvb), (v8, vs, kvb), out, lse, scale


def check(b, sq, sk, h, hk, d, causal, qblock=128, kvblock=128):
    call, qq, kk, vv, out, lse, scale = run(b, sq, sk, h, hk, d, causal, qblock, kvblock)
    call()
    cupy.cuda.runtime.deviceSynchronize()
    (q8, qs, q_block), (k8, ks, kv_block), (v8, vs, _) = qq, kk, vv
    ref_o, ref_lse = reference.attention_fp8_ref(q8, k8, v8, qs, ks, vs, descale_block=(q_block, kv_block),
                                                 causal=causal, softmax_scale=scale)
    o = cupy.asnumpy(out.astype(cupy.float32))
    err = np.abs(o - cupy.asnumpy(ref_o))
    lse_err = np.abs(cupy.asnumpy(lse) - cupy.asnumpy(ref_lse))
    print(f"check b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} qblock={qblock} kvblock={kvblock}: "
          f"max|out-ref| {np.nanmax(err):.3e} rms {np.sqrt(np.nanmean(err ** 2)):.3e} nan {int(np.isnan(o).sum())} "
          f"max|lse-ref| {np.nanmax(lse_err):.3e}", flush=True)


def perf(d, n, causal, reps, peer=True, kvblock=128):
    b, h = 16384 // n, 2048 // d
    call, *_ = run(b, n, n, h, h, d, causal, kvblock=kvblock)
    ms = time_fn(call, warmup=3, reps=reps)
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    line = f"perf d={d} N={n} causal={causal}: fp8 {flops / ms / 1e9:6.0f} TF/s ({ms * 1e3:7.1f} us)"
    if peer:
        import cuflash

        q = cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype("bfloat16")
        ms16 = time_fn(lambda: cuflash.flash_attn_func(q, q, q, causal=causal, impl="fa3"), warmup=3, reps=reps)
        line += f" | bf16 fa3 {flops / ms16 / 1e9:6.0f}"
    print(line, flush=True)


def cudnn_call(d, n, causal):
    """The fp8 suite's cuDNN FP8 peer (cuflash.bench's cudnn-fp8: graph.sdpa_fp8, per-tensor descales) at the
    benchmark shape (needs torch and nvidia-cudnn-frontend)."""
    from cuflash import bench

    shape = bench.Shape(16384 // n, 2048 // d, 2048 // d, n, n, d, causal)
    return bench.PEERS["cudnn-fp8"](bench.Fp8Case(shape, "bf16")).fn


def profile_once(spec: str, peer: bool = False) -> None:
    """d:N:causal at the benchmark shape and the fp8 suite's descale blocks: compile and warm up with two calls,
    then exactly one call between cudaProfilerStart and cudaProfilerStop (ncu --profile-from-start off).
    ``peer``: cuDNN's FP8 attention instead (cudnn_call)."""
    from cupy_backends.cuda.api import runtime

    d, n, causal = (int(x) for x in spec.split(":"))
    if peer:
        call = cudnn_call(d, n, bool(causal))
    else:
        call, *_ = run(16384 // n, n, n, 2048 // d, 2048 // d, d, bool(causal), qblock=FP8_BLOCK, kvblock=FP8_BLOCK)
    for _ in range(2):
        call()
    cupy.cuda.Device().synchronize()
    runtime.profilerStart()
    call()
    cupy.cuda.Device().synchronize()
    runtime.profilerStop()


def main():
    ints = lambda s: [int(x) for x in s.split(",")]
    ap = argparse.ArgumentParser()
    ap.add_argument("--headdims", type=ints, default=[64, 128])
    ap.add_argument("--seqlens", type=ints, default=[2048, 8192])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-peer", action="store_true", help="do not time the bf16 FA3 kernel alongside")
    ap.add_argument("--per-tensor", action="store_true", help="time with one K/V descale per (batch, head)")
    ap.add_argument("--tiles", default="",
                    help="d:block_n:stages:overlap[:pingpong],... replacing FA3_FP8_TILES entries")
    ap.add_argument("--profile", default=None, help="d:N:causal: one profiled call only (under ncu)")
    ap.add_argument("--profile-cudnn", default=None, help="d:N:causal: the same for cuDNN's FP8 attention")
    args = ap.parse_args()
    for spec in filter(None, args.tiles.split(",")):
        fields = [int(x) for x in spec.split(":")]
        d, block_n, stages, overlap = fields[:4]
        pingpong = fields[4] if len(fields) > 4 else 1
        heuristics.FA3_FP8_TILES[d] = heuristics.Fa3Tiles(block_n, stages, bool(overlap), bool(pingpong))
        print("tiles", d, heuristics.FA3_FP8_TILES[d])
    if args.profile or args.profile_cudnn:
        profile_once(args.profile or args.profile_cudnn, peer=bool(args.profile_cudnn))
        return
    for d in [] if args.no_check else args.headdims:
        for causal in (False, True):
            check(2, 239, 300, 4, 2, d, causal)
            check(1, 300, 113, 4, 4, d, causal, qblock=64, kvblock=256)
        check(2, 1, 1023, 6, 1, d, False, kvblock=None)
        check(1, 1023, 1023, 2, 2, d, True, qblock=None, kvblock=None)
    if not args.no_time:
        for d in args.headdims:
            for n in args.seqlens:
                for causal in (False, True):
                    perf(d, n, causal, args.reps, peer=not args.no_peer, kvblock=None if args.per_tensor else FP8_BLOCK)


if __name__ == "__main__":
    main()
