"""Throughput under sustained load: does a kernel slow down after the first second (power or clock limits),
and does a peer slow down as much? Runs each implementation back to back for a few seconds at a time, in
alternation, and prints its TF/s per window with the time since the start; `nvidia-smi -lms` beside it (see
the probes stage of scripts/gpu_check.sh) logs clocks, power and throttle reasons on the same clock.

    python scripts/sustain_probe.py [--headdim 128] [--seqlen 8192] [--causal] [--seconds 3]
"""
import argparse
import statistics
import time

import cupy
import numpy as np

import cuflash


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seconds", type=float, default=3.0, help="per turn")
    parser.add_argument("--window", type=int, default=40, help="calls per printed window")
    args = parser.parse_args()
    d, n = args.headdim, args.seqlen
    b, h = max(1, 16384 // n), 2048 // d
    rng = np.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32)).astype("bfloat16") for _ in range(3))
    flops = 4 * b * h * n * n * d / (2 if args.causal else 1)
    impls = {"cuflash-fa3": lambda: cuflash.flash_attn_func(q, k, v, causal=args.causal, impl="fa3")}
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal)
        impls["torch-cudnn"] = cudnn
    except Exception as exc:  # no torch or no cuDNN attention: cuflash alone
        print(f"torch-cudnn not timed: {exc}")
    for fn in impls.values():
        fn()
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.get_current_stream()
    t0 = time.time()
    print(f"d={d} N={n} causal={args.causal} start {time.strftime('%H:%M:%S', time.localtime(t0))}."
          f"{int(t0 % 1 * 1000):03d}", flush=True)
    schedule = ["idle"] + [name for _ in range(2) for name in impls] + ["idle"] + list(impls)[::-1]
    for name in schedule:
        if name == "idle":
            time.sleep(2.0)
            print(f"{time.time() - t0:6.2f}s idle 2 s", flush=True)
            continue
        end = time.time() + args.seconds
        while time.time() < end:
            events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(args.window)]
            for start, stop in events:
                start.record(stream)
                impls[name]()
                stop.record(stream)
            stream.synchronize()
            ms = statistics.median(cupy.cuda.get_elapsed_time(a, z) for a, z in events)
            print(f"{time.time() - t0:6.2f}s {name:12s} {flops / ms / 1e9:5.0f} TF/s", flush=True)


if __name__ == "__main__":
    main()
