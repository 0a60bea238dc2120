"""Time FA2 forward tile configurations against each other and the torch flash/cudnn peers in one run.

    python scripts/tune_fa2.py [64 128 256]      # head dims (default: all in CANDIDATES)

Prints one line per (head dim, N, causal, config) at the FlashAttention benchmark shape (16k tokens,
hidden 2048, bf16) for N = 2048 and 8192, with the config's registers / spill bytes from this machine's
NVRTC (the table must not take a row that spills) and "err", the largest |O - torch flash's O| over the largest
|O| (bf16 rounding: ~1e-2; WRONG marks a candidate that computes something else). Pick the fastest spill-free
row per head dim and put it in heuristics.FA2_TILES (or FA2_TILES_SM90 when it is spill-free and fastest on
sm_90 only; rows above 99 KB of shared memory need a per-arch table
first: sm_86/sm_89; and with all of softcap, ALiBi and dropout fa2.fwd_tiles gives a block one warp per 16 rows,
16 warps of at most 128 registers for 256-row tiles: compile-check those variants before taking such a row).
"""
import sys

import cupy
import numpy as np

import cuflash
from cuflash import fa2, heuristics
from cuflash._jit import compile_variant
from cuflash.bench import time_fn
from cuflash.compile_report import parse_ptxas_log

T = heuristics.Fa2Tiles
# (block_m, block_n, warps, compute_n, q_in_regs[, kv_stages]); the first of each row is the table's.
# History (bench/NOTES.md: "FA2 forward: static analysis", "Session 8: FA2 tile candidates", sessions 11 to
# 13): one K and one V buffer (kv_stages=1) taken at d = 128 and 256 in session 11; three blocks per SM at
# d = 128 (a launch bound, since removed) slower in session 12; each row's max and sum in 2 or 4 independent
# chains (session 13) level with one chain once the table row was timed again last (its first reading at the
# 8k non-causal shape was 4-9 % low: the repeat below catches that). The table rows are candidates here still,
# for the next idea to be measured against.
CANDIDATES = {
    # (d = 64: 128 x 64 with one K / V buffer, FA2's own schedule, as d = 128 took on sm_90 in session 21;
    # spill-free for sm_90a under NVRTC 13.0, 246 / 242 registers; not timed yet)
    64: [T(128, 128, 4, 64, True), T(128, 64, 4, 0, True, kv_stages=1), T(128, 64, 4, 0, False, kv_stages=1)],
    # (d = 128: the sm_90 table's row, then FA2_TILES' -- session 21 took 128 x 64 x 4 warps there: 1.05-1.10 x
    # torch flash against 0.86-1.01)
    128: [T(128, 64, 4, 0, False, kv_stages=1), T(64, 128, 4, 0, False, kv_stages=1)],
    256: [T(64, 64, 4, 0, False, kv_stages=1)],
}
SEQLENS = (2048, 8192)


def median_ms(fn):
    return time_fn(fn, warmup=3, reps=20)


def torch_ms(q, k, v, causal, backend):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(getattr(SDPBackend, backend)):
        return median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))


def torch_flash_out(q, k, v, causal):
    """torch flash's O as (batch, heads, seqlen, d)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)


def out_error(ours, ref) -> float:
    """Largest |ours - ref| over the largest |ref| (ours: cupy (b, n, h, d))."""
    import torch

    a, b = torch.from_dlpack(ours).transpose(1, 2).float(), ref.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def use(d, tiles, arch=None):
    """Make FA2 forward variants of head dim d take ``tiles``; returns (registers, spill bytes) of the plain one."""
    heuristics.FA2_TILES[d] = tiles  # the dict fa2.py reads (and no sm_90 row over it)
    heuristics.FA2_TILES_SM90.pop(d, None)
    if arch is None:
        cc = cupy.cuda.Device().compute_capability
        arch = "sm_90a" if cc == "90" else f"sm_{cc}"
    v = fa2.fwd_variant(d, "bfloat16")
    info = parse_ptxas_log(compile_variant(v, arch).log, v.kernel)
    return info["regs"], info["spill_bytes"]


def main():
    rng = np.random.default_rng(0)
    dims = [int(a) for a in sys.argv[1:]] or sorted(CANDIDATES)
    for d in dims:
        for n in SEQLENS:
            b, h = 16384 // n, 2048 // d
            q, k, v = (cupy.asarray(rng.standard_normal((b, n, h, d), dtype=np.float32)).astype("bfloat16")
                       for _ in range(3))
            for causal in (False, True):
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                peers = {name: torch_ms(q, k, v, causal, name) for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION")}
                line = " ".join(f"{name[:5].lower()} {flops / t / 1e9:5.0f}" for name, t in peers.items())
                ref = torch_flash_out(q, k, v, causal)
                # The table's row once more at the end: a first-run effect (session 13: the first candidate of
                # the 8k non-causal shape read 4-9 % under the rest twice) shows as a gap to its own repeat.
                for tiles in [*CANDIDATES[d], CANDIDATES[d][0]]:
                    regs, spill = use(d, tiles)
                    err = out_error(cuflash.flash_attn_func(q, k, v, causal=causal, impl="fa2"), ref)
                    t = median_ms(lambda: cuflash.flash_attn_func(q, k, v, causal=causal, impl="fa2"))
                    cfg = (f"({tiles.block_m},{tiles.block_n},{tiles.warps},{tiles.compute_n},{int(tiles.q_in_regs)}"
                           f",{tiles.kv_stages})")
                    print(f"d={d} N={n} causal={causal!s:5} {cfg} regs {regs} spill {spill}: fa2 {flops / t / 1e9:5.0f}"
                          f" TF/s | {line} | x{peers['FLASH_ATTENTION'] / t:.2f} vs flash | err {err:.1e}"
                          f"{' WRONG' if err > 0.1 else ''}", flush=True)


if __name__ == "__main__":
    main()
