#!/usr/bin/env python
"""End-to-end: train a GPT-2-small-shaped model with three attention implementations and compare them.

    python bench/e2e_gpt.py                                   # H200: cuflash, sdpa, naive at 1k..8k
    python bench/e2e_gpt.py --attn cuflash,sdpa --seqlens 2048,8192 --json e2e.json
    python bench/e2e_gpt.py --cpu-smoke                       # tiny model on the CPU, sdpa + naive only

The model (random weights, no checkpoint): GPT-2 small's shape — 12 layers, width 768, 12 heads of
d = 64, pre-LayerNorm blocks, causal self-attention, GELU (tanh) MLP of 4x width, learned position
embeddings, tied input/output embeddings (``--untied`` gives a separate LM head). The vocabulary
defaults to 8192 rather than GPT-2's 50257 so that the LM head and the cross-entropy do not drown
the attention in the timings; ``--vocab 50257`` gives the real size.

Precision: bf16 autocast with fp32 master weights. Parameters, gradients and the AdamW state are fp32;
the forward runs under ``torch.autocast(dtype=torch.bfloat16)``, so the linear layers and the
attention see bf16 tensors (cuflash takes fp16/bf16 only), LayerNorm / softmax statistics / the
loss run in fp32. AdamW (betas 0.9/0.95, weight decay 0.1 on every parameter, fused on CUDA),
constant learning rate ``--lr``, gradient norm clipped to 1.0.

Attention, selected by ``--attn`` (comma separated; every one gets the same initial weights and the
same batches, so their loss curves should agree to bf16 noise):

* ``cuflash``: ``cuflash.torch.flash_attn_func(q, k, v, causal=True)`` on the (batch, seq, heads, d)
  views of the fused QKV projection (strided, no copies); ``--impl`` picks the kernel family;
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)`` (torch picks
  its fastest backend);
* ``naive``: softmax(q kᵀ / sqrt(d) + causal mask) v materialised in torch (scores in bf16, softmax
  in fp32, probabilities back to bf16) — the "standard attention" of the FlashAttention paper. It
  stores O(seqlen²) per layer and runs out of memory at long sequences; that is caught and reported
  as OOM.

Data: random tokens from a fixed seed (``--seed``), generated on the CPU, identical for every attention
variant. Each sequence is a random segment of ``--period`` tokens repeated to the sequence length,
so that attention can lower the loss (``--period 0``: i.i.d. uniform tokens, where the loss stays at
about ln(vocab) whatever the attention does). Batch = ``--tokens`` // seqlen (16k tokens per step).

Measured per (attn, seqlen): tokens/s over the ``--steps`` steps after ``--warmup`` warm-up steps
(CUDA events around the timed steps; the first cuflash call of a kernel variant compiles it with
NVRTC, inside the warm-up), the loss of every step (warm-up included), and peak memory:
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (weights, gradients, AdamW
state and activations that torch allocated) plus, for cuflash, the bytes held by CuPy's default
memory pool (``cupy.get_default_memory_pool().total_bytes()`` after the run, the pool emptied before
it): cuflash allocates its outputs, LSEs, gradients and scratch there and torch does not see them.
The pool only grows while it runs, so its final size is its peak; "peak GB" in the table is the sum
of the two peaks (an upper bound: they need not coincide).

The report: a table attn × seqlen (tokens/s, speed-up against naive and against sdpa, peak GB, first
and last loss), then the loss check: for every attention other than sdpa, and every seqlen where
both ran, max over steps of |loss - loss_sdpa| / |loss_sdpa| must be <= ``--rtol`` (2e-2); a failure
exits with status 1 unless ``--no-check``. ``--json PATH`` writes everything (config, environment,
per-run results with the loss curves, the check); ``--out-dir DIR`` also draws the loss curves and
the throughput (needs matplotlib; skipped with a note without it).

``--cpu-smoke`` runs a tiny configuration on the CPU (2 layers, width 64, 2 heads, vocab 512,
seqlen 64, sdpa and naive only) so that the model, data, training loop, report and check run without
a GPU; tests/test_e2e_cpu.py runs it.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import platform
import sys
import time
from pathlib import Path

ATTN_CHOICES = ("cuflash", "sdpa", "naive")
REFERENCE_ATTN = "sdpa"

GPU_DEFAULTS = dict(layers=12, width=768, heads=12, vocab=8192, seqlens="1024,2048,4096,8192", tokens=16384,
                    warmup=3, steps=10, attn="cuflash,sdpa,naive", lr=6e-4)
CPU_SMOKE = dict(layers=2, width=64, heads=2, vocab=512, seqlens="64", tokens=256, warmup=1, steps=3,
                 attn="sdpa,naive", lr=1e-3)


# ----------------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn", help=f"comma-separated subset of {','.join(ATTN_CHOICES)} "
                                  f"(default {GPU_DEFAULTS['attn']}; --cpu-smoke: {CPU_SMOKE['attn']})")
    p.add_argument("--seqlens", help=f"comma-separated sequence lengths (default {GPU_DEFAULTS['seqlens']})")
    p.add_argument("--tokens", type=int, help="tokens per step; batch = tokens // seqlen (default 16384)")
    p.add_argument("--steps", type=int, help="timed steps after the warm-up (default 10)")
    p.add_argument("--warmup", type=int, help="warm-up steps, not timed (default 3)")
    p.add_argument("--layers", type=int, help="transformer blocks (default 12)")
    p.add_argument("--width", type=int, help="model width (default 768)")
    p.add_argument("--heads", type=int, help="attention heads (default 12, d = width / heads)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default 8192; GPT-2's is 50257)")
    p.add_argument("--untied", action="store_true", help="separate LM head instead of the tied embedding")
    p.add_argument("--lr", type=float, help="AdamW learning rate (default 6e-4)")
    p.add_argument("--period", type=int, default=64,
                   help="length of the random segment each sequence repeats (0: i.i.d. tokens; default 64)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the initial weights and the data")
    p.add_argument("--impl", default="auto", help="cuflash kernel family: auto, fa1 or fa2 (default auto)")
    p.add_argument("--rtol", type=float, default=2e-2,
                   help="allowed max relative difference of the per-step losses against sdpa (default 2e-2)")
    p.add_argument("--no-check", action="store_true", help="report the loss comparison but do not fail on it")
    p.add_argument("--json", metavar="PATH", help="write config, environment, results and the check as JSON")
    p.add_argument("--out-dir", metavar="DIR", help="also draw loss curves and throughput there (matplotlib)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny model on the CPU with sdpa and naive only (exercises the code without a GPU)")
    args = p.parse_args(argv)

    defaults = CPU_SMOKE if args.cpu_smoke else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.attn = [a.strip() for a in str(args.attn).split(",") if a.strip()]
    bad = [a for a in args.attn if a not in ATTN_CHOICES]
    if bad or not args.attn:
        p.error(f"--attn takes a comma-separated subset of {ATTN_CHOICES}; got {bad or args.attn}")
    if args.cpu_smoke and "cuflash" in args.attn:
        p.error("--cpu-smoke runs on the CPU: cuflash needs a CUDA GPU (use --attn sdpa,naive)")
    try:
        args.seqlens = [int(s) for s in str(args.seqlens).split(",") if s.strip()]
    except ValueError:
        p.error(f"--seqlens takes comma-separated integers; got {args.seqlens!r}")
    if not args.seqlens or min(args.seqlens) < 2:
        p.error("--seqlens must list lengths >= 2")
    if args.width % args.heads:
        p.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")
    for name in ("tokens", "steps", "layers", "width", "heads", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.warmup < 0 or args.period < 0:
        p.error("--warmup and --period must be >= 0")
    return args


# ----------------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GPTConfig:
    layers: int
    width: int
    heads: int
    vocab: int
    max_seqlen: int
    tied: bool = True

    @property
    def headdim(self) -> int:
        return self.width // self.heads


def build_model_classes():
    """The model classes (defined here so that importing this file does not import torch)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

        def __init__(self, cfg: GPTConfig, attention):
            super().__init__()
            w = cfg.width
            self.heads = cfg.heads
            self.attention = attention  # (B, S, H, D) q, k, v -> (B, S, H, D), causal
            self.ln_1 = nn.LayerNorm(w)
            self.c_attn = nn.Linear(w, 3 * w)
            self.c_proj = nn.Linear(w, w)
            self.ln_2 = nn.LayerNorm(w)
            self.c_fc = nn.Linear(w, 4 * w)
            self.c_out = nn.Linear(4 * w, w)

        def forward(self, x):
            b, s, w = x.shape
            qkv = self.c_attn(self.ln_1(x)).view(b, s, 3, self.heads, w // self.heads)
            q, k, v = qkv.unbind(2)  # strided (B, S, H, D) views: last dim contiguous, no copy
            y = self.attention(q, k, v)
            x = x + self.c_proj(y.reshape(b, s, w))
            return x + self.c_out(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self, cfg: GPTConfig, attention=None):
            super().__init__()
            self.cfg = cfg
            self.wte = nn.Embedding(cfg.vocab, cfg.width)
            self.wpe = nn.Embedding(cfg.max_seqlen, cfg.width)
            self.blocks = nn.ModuleList(Block(cfg, attention) for _ in range(cfg.layers))
            self.ln_f = nn.LayerNorm(cfg.width)
            self.lm_head = None if cfg.tied else nn.Linear(cfg.width, cfg.vocab, bias=False)

        def init_weights(self, seed: int) -> None:
            """GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)."""
            gen = torch.Generator().manual_seed(seed)
            resid_std = 0.02 / math.sqrt(2 * self.cfg.layers)
            with torch.no_grad():
                for name, prm in self.named_parameters():
                    if name.endswith("bias"):
                        prm.zero_()
                    elif ".ln_" in name or name.startswith("ln_"):
                        prm.fill_(1.0)
                    else:
                        std = resid_std if name.endswith(("c_proj.weight", "c_out.weight")) else 0.02
                        prm.copy_(torch.randn(prm.shape, generator=gen) * std)

        def forward(self, idx, targets):
            _, s = idx.shape
            pos = torch.arange(s, device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.blocks:
                x = block(x)
            x = self.ln_f(x)
            head = self.wte.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(x, head)
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    return GPT


# ----------------------------------------------------------------------------------------------------
# attention implementations: (B, S, H, D) q, k, v -> (B, S, H, D), causal
# ----------------------------------------------------------------------------------------------------

def make_attention(name: str, impl: str = "auto"):
    import torch
    import torch.nn.functional as F

    if name == "cuflash":
        import cuflash.torch as ct

        def cuflash_attention(q, k, v):
            return ct.flash_attn_func(q, k, v, causal=True, impl=impl)

        return cuflash_attention

    if name == "sdpa":
        def sdpa_attention(q, k, v):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            return o.transpose(1, 2)

        return sdpa_attention

    if name == "naive":
        masks = {}

        def naive_attention(q, k, v):
            s, d = q.shape[1], q.shape[3]
            key = (s, q.device)
            if key not in masks:
                masks[key] = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)  # True = hidden
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D)
            scores = torch.matmul(qt, kt.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            scores = scores.masked_fill(masks[key], float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            return torch.matmul(probs, vt).transpose(1, 2)

        return naive_attention

    raise ValueError(f"unknown attention {name!r}")


# ----------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------

def make_tokens(vocab: int, seqlen: int, batch: int, steps: int, period: int, seed: int):
    """(steps, batch, seqlen + 1) int64 tokens on the CPU, a function of the arguments only."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + seqlen)
    if period <= 0:
        return torch.randint(vocab, (steps, batch, seqlen + 1), generator=gen)
    segment = torch.randint(vocab, (steps, batch, period), generator=gen)
    reps = (seqlen + 1 + period - 1) // period
    return segment.repeat(1, 1, reps)[:, :, : seqlen + 1].contiguous()


# ----------------------------------------------------------------------------------------------------
# one training run
# ----------------------------------------------------------------------------------------------------

def _is_oom(exc: BaseException) -> bool:
    import torch

    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    if isinstance(exc, oom_types) or isinstance(exc, MemoryError):  # CuPy's OutOfMemoryError is a MemoryError
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "ALLOC_FAILED" in text)


def _cupy_pool():
    """CuPy's default memory pool when CuPy (and a GPU) is there, else None."""
    try:
        import cupy

        return cupy.get_default_memory_pool()
    except Exception:
        return None


def _free_memory(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        pool = _cupy_pool()
        if pool is not None:
            pool.free_all_blocks()


def _train(args, cfg: GPTConfig, GPT, init_state, attention, tokens, device: str, uses_cupy: bool) -> dict:
    import torch

    model = None
    with torch.device(device):
        model = GPT(cfg, attention)
    model.load_state_dict(init_state)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if device == "cuda" else {}))
    losses = []

    def step(i):
        x, y = tokens[i, :, :-1], tokens[i, :, 1:]
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    for i in range(args.warmup):
        step(i)
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(args.warmup, args.warmup + args.steps):
            step(i)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for i in range(args.warmup, args.warmup + args.steps):
            step(i)
        seconds = time.perf_counter() - t0

    loss_values = [float(x) for x in torch.stack(losses).float().cpu().tolist()]
    batch, seqlen = tokens.shape[1], tokens.shape[2] - 1
    out = {"status": "ok", "seconds": seconds, "step_ms": 1e3 * seconds / args.steps,
           "tokens_per_s": args.steps * batch * seqlen / seconds, "losses": loss_values,
           "finite": all(math.isfinite(x) for x in loss_values)}
    if device == "cuda":
        out["peak_torch_bytes"] = int(torch.cuda.max_memory_allocated())
        pool = _cupy_pool() if uses_cupy else None
        out["peak_cupy_pool_bytes"] = int(pool.total_bytes()) if pool is not None else 0
        out["peak_bytes"] = out["peak_torch_bytes"] + out["peak_cupy_pool_bytes"]
    return out


def run_one(args, cfg: GPTConfig, GPT, init_state, attn: str, seqlen: int, device: str) -> dict:
    import torch

    batch = max(1, args.tokens // seqlen)
    result = {"attn": attn, "seqlen": seqlen, "batch": batch, "tokens_per_step": batch * seqlen,
              "impl": args.impl if attn == "cuflash" else None}
    tokens = make_tokens(cfg.vocab, seqlen, batch, args.warmup + args.steps, args.period, args.seed).to(device)
    _free_memory(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    error = None
    try:
        result.update(_train(args, cfg, GPT, init_state, make_attention(attn, args.impl), tokens, device,
                             uses_cupy=(attn == "cuflash")))
    except Exception as exc:  # noqa: BLE001 - OOM is reported, anything else re-raised
        if not _is_oom(exc):
            raise
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    # Out of the except block: the traceback (and the model it holds) is gone, memory can be freed.
    if error is not None:
        result.update({"status": "oom", "error": error, "tokens_per_s": None, "losses": None})
    del tokens
    _free_memory(device)
    return result


# ----------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------

def _find(results, attn, seqlen):
    for r in results:
        if r["attn"] == attn and r["seqlen"] == seqlen and r["status"] == "ok":
            return r
    return None


def add_speedups(results) -> None:
    for r in results:
        r["speedup_vs"] = {}
        if r["status"] != "ok":
            continue
        for peer in ATTN_CHOICES:
            other = _find(results, peer, r["seqlen"])
            if other is not None and peer != r["attn"]:
                r["speedup_vs"][peer] = r["tokens_per_s"] / other["tokens_per_s"]


def loss_check(results, rtol: float) -> dict:
    """Per-step losses of every attention against sdpa's, where both ran."""
    rows, ok = [], True
    for r in results:
        if r["attn"] == REFERENCE_ATTN or r["status"] != "ok":
            continue
        ref = _find(results, REFERENCE_ATTN, r["seqlen"])
        if ref is None:
            continue
        rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref["losses"]))
        passed = r["finite"] and ref["finite"] and rel <= rtol
        ok &= passed
        rows.append({"attn": r["attn"], "reference": REFERENCE_ATTN, "seqlen": r["seqlen"],
                     "max_rel_diff": rel, "passed": passed})
    return {"rtol": rtol, "rows": rows, "passed": ok, "compared": len(rows)}


def _fmt_gb(n):
    return "-" if n is None else f"{n / 1e9:.2f}"


def print_report(args, results, check) -> None:
    cols = ["attn", "seqlen", "batch", "tokens/s", "vs naive", "vs sdpa", "peak GB (torch + cupy)",
            "loss first → last"]
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append([r["attn"], str(r["seqlen"]), str(r["batch"]), r["status"].upper(), "-", "-", "-", "-"])
            continue
        sp = r.get("speedup_vs", {})
        peak = "-"
        if "peak_bytes" in r:
            peak = f"{_fmt_gb(r['peak_bytes'])} ({_fmt_gb(r['peak_torch_bytes'])} + " \
                   f"{_fmt_gb(r['peak_cupy_pool_bytes'])})"
        rows.append([r["attn"], str(r["seqlen"]), str(r["batch"]), f"{r['tokens_per_s']:,.0f}",
                     f"{sp['naive']:.2f}x" if "naive" in sp else "-",
                     f"{sp['sdpa']:.2f}x" if "sdpa" in sp else "-", peak,
                     f"{r['losses'][0]:.4f} → {r['losses'][-1]:.4f}"])
    title = (f"GPT {args.layers}L x {args.width}w x {args.heads}h (d={args.width // args.heads}), vocab {args.vocab}, "
             f"{args.tokens} tokens/step, {args.steps} timed steps after {args.warmup} warm-up"
             + (" [cpu smoke]" if args.cpu_smoke else ""))
    check_rows = [[c["attn"], c["reference"], str(c["seqlen"]), f"{c['max_rel_diff']:.2e}",
                   "ok" if c["passed"] else "FAIL"] for c in check["rows"]]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for row in [cols] + rows:
            print(" | ".join(row))
        print(f"loss check (max relative difference per step, rtol {check['rtol']:g}):")
        for row in check_rows:
            print(" | ".join(row))
        return
    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title=title, title_justify="left")
    for c in cols:
        table.add_column(c, justify="left" if c == "attn" else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    ct = Table(title=f"loss curves against {REFERENCE_ATTN} (max |loss - ref| / |ref| over steps, rtol "
                     f"{check['rtol']:g})", title_justify="left")
    for c in ("attn", "reference", "seqlen", "max rel diff", "check"):
        ct.add_column(c, justify="left" if c in ("attn", "reference") else "right")
    for row in check_rows:
        ct.add_row(*row)
    console.print(ct if check_rows else "loss check: nothing to compare (sdpa and another attention must both run)")


def write_plots(out_dir: str, results) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--out-dir {out_dir}: matplotlib is not installed; no plots drawn")
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seqlens = sorted({r["seqlen"] for r in results})
    fig, axes = plt.subplots(1, len(seqlens), figsize=(4 * len(seqlens), 3.2), squeeze=False)
    for ax, s in zip(axes[0], seqlens):
        for r in results:
            if r["seqlen"] == s and r["status"] == "ok":
                ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["attn"], marker=".")
        ax.set_title(f"seqlen {s}")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "e2e_loss_curves.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for attn in ATTN_CHOICES:
        pts = [(r["seqlen"], r["tokens_per_s"]) for r in results if r["attn"] == attn and r["status"] == "ok"]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=attn)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("tokens / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "e2e_throughput.png", dpi=120)
    plt.close(fig)
    print(f"plots written to {out}/e2e_loss_curves.png and {out}/e2e_throughput.png")


def environment(device: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "device": device}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["torch_cuda"] = torch.version.cuda
    try:
        import cupy

        import cuflash

        env["cupy"] = cupy.__version__
        env["cuflash"] = cuflash.__version__
    except Exception:
        pass
    return env


# ----------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench/e2e_gpt.py needs PyTorch (pip install torch)", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible to torch; run with --cpu-smoke to exercise the code on the CPU", file=sys.stderr)
        return 2
    if args.cpu_smoke:
        torch.set_num_threads(min(4, torch.get_num_threads()))

    cfg = GPTConfig(args.layers, args.width, args.heads, args.vocab, max(args.seqlens), tied=not args.untied)
    GPT = build_model_classes()
    template = GPT(cfg)
    template.init_weights(args.seed)
    init_state = {k: v.detach().clone() for k, v in template.state_dict().items()}
    n_params = sum(p.numel() for p in template.parameters())
    del template
    print(f"model: {cfg.layers} layers, width {cfg.width}, {cfg.heads} heads (d = {cfg.headdim}), vocab {cfg.vocab}, "
          f"{'tied' if cfg.tied else 'untied'} embeddings, {n_params / 1e6:.1f}M parameters; device {device}; "
          f"bf16 autocast, fp32 master weights, AdamW lr {args.lr:g}", flush=True)

    results = []
    for seqlen in args.seqlens:
        for attn in args.attn:
            r = run_one(args, cfg, GPT, init_state, attn, seqlen, device)
            results.append(r)
            if r["status"] == "ok":
                peak = f", peak {_fmt_gb(r['peak_bytes'])} GB" if "peak_bytes" in r else ""
                print(f"  {attn:8s} seqlen {seqlen:6d} batch {r['batch']:4d}: {r['tokens_per_s']:12,.0f} tokens/s, "
                      f"{r['step_ms']:8.1f} ms/step{peak}, loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
                      flush=True)
            else:
                print(f"  {attn:8s} seqlen {seqlen:6d} batch {r['batch']:4d}: {r['status'].upper()} ({r['error']})",
                      flush=True)

    add_speedups(results)
    check = loss_check(results, args.rtol)
    print_report(args, results, check)

    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "out_dir")}
        config.update(dataclasses.asdict(cfg), n_params=n_params, precision="bf16 autocast, fp32 master weights",
                      optimizer="AdamW(betas=(0.9, 0.95), weight_decay=0.1), grad clip 1.0")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": config, "env": environment(device), "results": results,
                                               "loss_check": check}, indent=1) + "\n")
        print(f"results written to {args.json}")
    if args.out_dir:
        write_plots(args.out_dir, results)

    failed = [c for c in check["rows"] if not c["passed"]]
    if failed:
        msg = ", ".join(f"{c['attn']}@{c['seqlen']}: {c['max_rel_diff']:.2e}" for c in failed)
        print(f"loss check FAILED (rtol {args.rtol:g}): {msg}", file=sys.stderr)
        if not args.no_check:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
