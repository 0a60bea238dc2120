"""Time FA2 backward tile configurations against each other and torch's flash backward in one run.

    python scripts/tune_fa2_bwd.py [64 128 256]      # head dims (default: all in CANDIDATES)

For each head dim, N = 2048 and 8192 (16k tokens, hidden 2048, bf16), causal and not: torch flash's
backward (SDPA FLASH_ATTENTION backend, autograd.grad) once, then cuflash's FA2 backward for every
candidate Fa2BwdTiles, each line with its registers / spill bytes from this machine's NVRTC (a candidate
that spills still runs; the table must not take it). TF/s by the bwd convention (2.5 x 4 B H N^2 d, halved
when causal), and "err": the largest |dq, dk, dv - torch's| over torch's largest |gradient| (bf16 rounding
gives ~1e-2; a candidate marked WRONG computes something else and must not be taken, however fast). Pick
the fastest spill-free row per head dim and put it in heuristics.FA2_BWD_TILES (or FA2_BWD_TILES_PLAIN /
FA2_BWD_TILES_PLAIN_SM90 when only the plain variant fits in registers, or only on sm_90: every candidate
above 99 KB of shared memory is sm_90-only).
"""
import sys

import cupy
import numpy as np

import cuflash
from cuflash import fa2, heuristics
from cuflash._jit import compile_variant
from cuflash.bench import time_fn
from cuflash.compile_report import parse_ptxas_log

T = heuristics.Fa2BwdTiles
# (block_m, block_n, warps, q_stages, warps_s_m, warps_kv_n, warps_q_m, s_split, q_split); first = the table's
# on sm_90 (FA2_BWD_TILES_PLAIN at d = 64, FA2_BWD_TILES_PLAIN_SM90 at d = 128 and 256), second = the general
# row (what sm_80 and the softcap / ALiBi / dropout variants run). Every row compiles without spills for sm_90a
# (plain variant, bf16 and fp16) under NVRTC 13.0 and 13.5; registers, shared memory, the reasoning and a
# prediction for each: bench/NOTES.md, "Session 8: FA2 tile candidates (compile-checked, not measured)".
# Session 12 (the ldmatrix addresses precomputed: ~20 fewer registers in the loop) re-checks FlashAttention-2's
# own layouts, which spilled before and compile clean now under NVRTC 13.0 and 13.5 except where noted:
# d = 64 128 x 128 (S / dP 32 x 64 per warp; 48 bytes spilled under 13.5, so only a measurement); d = 128
# 64 x 128 with dQ 32 x 32 per warp in one chunk (warps_q_m = 2), and dQ 16 x 64 in one chunk; d = 256
# S / dP 16 x 32 per warp (warps_s_m = 4, dQ 32 x 32 in two chunks), and dQ 16 x 128 in one chunk.
CANDIDATES = {
    64: [T(64, 256, 8, 2, 2, 4, 4, 2, 1), T(128, 128, 8, 2, 4, 4, 4, 1, 1)],
    128: [T(64, 128, 8, 2, 2, 4, 4, 1, 2), T(64, 128, 8, 2, 2, 4, 2, 1, 1), T(64, 128, 8, 2, 2, 4, 4, 1, 1)],
    256: [T(64, 64, 8, 2, 2, 2, 4, 1, 2), T(64, 64, 8, 2, 4, 2, 2, 1, 2), T(64, 64, 8, 2, 2, 2, 4, 1, 1)],
}
SEQLENS = (2048, 8192)
REPS = 20


def torch_flash_bwd(q, k, v, dout, causal):
    """(milliseconds of torch flash's backward, its (dq, dk, dv) as (batch, heads, seqlen, d) tensors)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v, dout))
    tq, tk, tv = (x.detach().requires_grad_() for x in (tq, tk, tv))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        ms = time_fn(lambda: torch.autograd.grad(o, (tq, tk, tv), tdo, retain_graph=True), 3, REPS)
        return ms, torch.autograd.grad(o, (tq, tk, tv), tdo)


def grad_error(ours, ref) -> float:
    """Largest |ours - ref| over the largest |ref|, the worst of dq, dk, dv (ours: cupy (b, n, h, d))."""
    import torch

    worst = 0.0
    for a, b in zip(ours, ref):
        a = torch.from_dlpack(a).transpose(1, 2).float()
        b = b.float()
        worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    return worst


def use(d, tiles):
    """Make every FA2 backward variant of head dim d take ``tiles``; returns (registers, spill bytes)."""
    heuristics.FA2_BWD_TILES[d] = tiles  # the same dicts fa2.py reads
    heuristics.FA2_BWD_TILES_PLAIN.pop(d, None)
    heuristics.FA2_BWD_TILES_PLAIN_SM90.pop(d, None)
    cc = cupy.cuda.Device().compute_capability
    v = fa2.bwd_variant(d, "bfloat16")
    info = parse_ptxas_log(compile_variant(v, "sm_90a" if cc == "90" else f"sm_{cc}").log, v.kernel)
    return info["regs"], info["spill_bytes"]


def main():
    rng = np.random.default_rng(0)
    dims = [int(a) for a in sys.argv[1:]] or sorted(CANDIDATES)
    for d in dims:
        for n in SEQLENS:
            b, h = 16384 // n, 2048 // d
            q, k, v, dout = (cupy.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32)).astype("bfloat16")
                             for _ in range(4))
            for causal in (False, True):
                flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                torch_ms, ref = torch_flash_bwd(q, k, v, dout, causal)
                out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, impl="fa2")
                for tiles in CANDIDATES[d]:
                    regs, spill = use(d, tiles)
                    err = grad_error(cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, impl="fa2"),
                                     ref)
                    ms = time_fn(lambda: cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal,
                                                                     impl="fa2"), 3, REPS)
                    cfg = ",".join(str(x) for x in (tiles.block_m, tiles.block_n, tiles.warps, tiles.q_stages,
                                                    tiles.warps_s_m, tiles.warps_kv_n, tiles.warps_q_m,
                                                    tiles.s_split, tiles.q_split))
                    print(f"d={d} N={n} causal={causal!s:5} ({cfg}) regs {regs} spill {spill}: "
                          f"fa2 bwd {flops / ms / 1e9:5.0f} TF/s | torch flash {flops / torch_ms / 1e9:5.0f}"
                          f" | x{torch_ms / ms:.2f} | err {err:.1e}{' WRONG' if err > 0.1 else ''}", flush=True)


if __name__ == "__main__":
    main()
