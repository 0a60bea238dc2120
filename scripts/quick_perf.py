"""A small timing probe for kernel work between full benchmark runs: every cuflash family, forward and
backward, next to torch's flash and cuDNN SDPA backends, at FlashAttention benchmark shapes (16k tokens,
hidden 2048), bf16. Prints TF/s per (d, N, causal) and, with --json PATH, writes the rows.

    python scripts/quick_perf.py [--headdims 64,128,256] [--seqlens 2048,8192] [--json out.json]
"""
import argparse
import json

import cupy
import numpy as np

import cuflash
from cuflash.bench import time_fn


def _torch_sdpa(backend_name):
    """A callable (q, k, v, causal) -> out on torch SDPA with one backend, or None without torch/CUDA."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def probe(headdims, seqlens, reps, impls=None, backward=True, deterministic=False):
    rng = np.random.default_rng(0)
    rows = []
    fwd_impls = [i for i in cuflash.available_impls("forward") if impls is None or i in impls]
    bwd_impls = [i for i in cuflash.available_impls("backward") if backward and (impls is None or i in impls)]
    peers = {name: _torch_sdpa(backend) for name, backend in
             (("torch-flash", "FLASH_ATTENTION"), ("torch-cudnn", "CUDNN_ATTENTION"))}
    peers = {k: v for k, v in peers.items() if v is not None}
    for d in headdims:
        for n in seqlens:
            b, h = max(1, 16384 // n), 2048 // d
            q, k, v, dout = (cupy.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32)).astype("bfloat16")
                             for _ in range(4))
            for causal in (False, True):
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                row = {"headdim": d, "seqlen": n, "causal": causal}
                for impl in fwd_impls:
                    out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, impl=impl)
                    ms = time_fn(lambda: cuflash.flash_attn_func(q, k, v, causal=causal, impl=impl), 3, reps)
                    row[f"{impl} fwd"] = flops / ms / 1e9
                    if impl in bwd_impls:
                        try:
                            ms = time_fn(lambda: cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal,
                                                                             impl=impl), 3, reps)
                            row[f"{impl} bwd"] = 2.5 * flops / ms / 1e9
                            if deterministic:
                                ms = time_fn(lambda: cuflash.flash_attn_backward(
                                    dout, q, k, v, out, lse, causal=causal, impl=impl, deterministic=True), 3, reps)
                                row[f"{impl} det bwd"] = 2.5 * flops / ms / 1e9
                        except ValueError as exc:  # a head dim this family's backward does not have
                            print(f"{impl} bwd d={d}: {str(exc).splitlines()[0][:100]}")
                if peers:
                    import torch

                    tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v, dout))
                    tq, tk, tv = (x.detach().requires_grad_() for x in (tq, tk, tv))
                    for name, sdpa in peers.items():
                        try:
                            ms = time_fn(lambda: sdpa(tq, tk, tv, causal), 3, reps)
                            row[f"{name} fwd"] = flops / ms / 1e9
                            if backward:
                                o = sdpa(tq, tk, tv, causal)
                                ms = time_fn(lambda: torch.autograd.grad(o, (tq, tk, tv), tdo, retain_graph=True),
                                             3, reps)
                                row[f"{name} bwd"] = 2.5 * flops / ms / 1e9
                        except RuntimeError as exc:  # a backend that refuses this shape
                            row[f"{name} fwd"] = None
                            print(f"{name} d={d} N={n}: {str(exc).splitlines()[0][:120]}")
                rows.append(row)
                print(f"d={d:3d} N={n:5d} causal={causal!s:5} " + " | ".join(
                    f"{key} {val:5.0f}" for key, val in row.items()
                    if key not in ("headdim", "seqlen", "causal") and val is not None), flush=True)
    return rows


def main():
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headdims", type=ints, default=[64, 128, 256])
    parser.add_argument("--seqlens", type=ints, default=[2048, 8192])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--impls", default=None, help="cuflash families to time, e.g. fa3 (default: all)")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--deterministic", action="store_true",
                        help="also time each family's backward with deterministic=True")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    impls = args.impls.split(",") if args.impls else None
    rows = probe(args.headdims, args.seqlens, args.reps, impls, backward=not args.forward_only,
                 deterministic=args.deterministic)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
