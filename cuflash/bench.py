"""``python -m cuflash bench``: the benchmark report on the local GPU.

One run measures, on the same GPU and in the same process:

* the ceilings: a bf16 dense matmul 8192^3 through cuBLAS (TFLOP/s) and a device-to-device copy of
  2 GiB (bytes read + written, TB/s);
* every cuflash implementation usable on this GPU (``cuflash-fa1``, ``cuflash-fa2``, ...); on request
  (``--impls``) also ``cuflash-fa2-det`` / ``cuflash-fa3-det``, the backward in deterministic mode;
* the peers found here: torch SDPA backends (``torch-flash``, ``torch-cudnn``, ``torch-efficient``,
  ``torch-math``), ``flash_attn``, ``flashinfer`` and the materialised ``naive`` attention.

``--suite fp8`` measures the FP8 forward (``cuflash-fa3-fp8``: e4m3 inputs quantised once outside the timing by
``cuflash.fp8.quantize``, block 256, Hadamard rotation on q and k) against the bf16 FA3 kernel and the bf16 SDPA
backends on the same shapes, cuDNN's FP8 attention where the ``cudnn`` frontend package is importable, and an
e4m3 matmul ceiling (``torch._scaled_mm``) measured in the same run.

``--suite decode`` measures one decoding step instead (``flash_attn_with_kvcache``, Sq = 1, 32 query / 8
KV heads): TB/s of K/V read against the copy ceiling, GPU time from CUDA-graph replays, the host cost of
an eager call separately (``host_us``), contiguous and paged caches (see ``DecodeCase``).

Shapes follow the FlashAttention benchmark: ``total_tokens`` tokens in total (batch = total // N) and a
model width ``hidden`` (heads = hidden // d). Each (headdim, causal) sweep gives one table: median time,
TFLOP/s, % of the matmul ceiling, speed-up of the cuflash rows over each peer, max error against an exact
fp32 reference (on a cheap slice: batch 0, the first query heads) and the peak memory beyond inputs and
outputs. ``--json`` writes one row per (shape, impl); ``--compare`` adds the change against an older file.

Without a GPU the command says so and runs the offline compile check instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import io
import json
import math
import statistics
import subprocess
import sys
import warnings
from typing import Callable, NamedTuple

from ._device import compute_capability, device_properties, has_gpu

# ----------------------------------------------------------------------------------------------------
# schema and constants
# ----------------------------------------------------------------------------------------------------

#: Keys every JSON row carries (null where a value does not apply or could not be measured).
REQUIRED_KEYS = (
    "suite", "impl", "dtype", "batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "headdim", "causal",
    "ms", "tflops", "tbps", "pct_of_ceiling", "speedup_vs", "max_err", "error", "extra_mem_bytes",
    "gpu", "env",
    # decode suite (null elsewhere): page_size 0 = contiguous cache; num_splits: the KV splits cuflash's
    # heuristic chose (null for peers); host_us: host wall time of one eager call (calls not synchronised);
    # note: how a row was measured when it differs (K/V expanded for GQA, timed without a graph, ...)
    "page_size", "num_splits", "host_us", "note",
)

#: Implementations whose rows carry dtype "e4m3" (their inputs are FP8; the other rows of the fp8 suite run on
#: the --dtype inputs the FP8 ones were quantised from).
FP8_IMPLS = ("cuflash-fa3-fp8", "cudnn-fp8")

#: Keys that identify the same measurement across two runs (``--compare``).
MATCH_KEYS = ("suite", "impl", "dtype", "batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "headdim", "causal",
              "page_size")

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}

#: Peers that get a "vs <peer>" column in the tables (the JSON carries the ratio to every peer).
TABLE_RATIO_PEERS = ("torch-cudnn", "torch-flash", "flash_attn", "flashinfer", "naive")

#: The fp8 suite's peers (when present), in table order; ``cuflash-fa3`` is the bf16 kernel on the same shapes.
FP8_PEERS = ("cuflash-fa3", "cudnn-fp8", "torch-cudnn", "torch-flash")

#: Rows of the sequence per descale of q, k and v in the fp8 suite (``cuflash.fp8.quantize(block=...)``): 256,
#: so that d = 128 takes the 256-key tiles (heuristics.FA3_FP8_TILES_WIDE: one K and one V descale per tile).
FP8_BLOCK = 256

#: What each ceiling is called in titles and the header.
CEILING_NAMES = {"bf16_matmul_tflops": "matmul", "fp8_matmul_tflops": "fp8 matmul", "copy_tbps": "copy"}

#: Peers so slow that they are skipped above this sequence length unless ``--include-slow``.
SLOW_PEERS = {"torch-math": 4096}

# Full sweep and the tiny --quick one. Options given on the command line win over both.
FULL_DEFAULTS = dict(headdims=[64, 128, 256], seqlens=[512, 1024, 2048, 4096, 8192, 16384],
                     total_tokens=16384, hidden=2048, warmup=5, reps=30, rounds=1)
QUICK_DEFAULTS = dict(headdims=[64, 128], seqlens=[256, 1024], total_tokens=2048, hidden=2048, warmup=1, reps=3,
                      rounds=1)

# Decode suite: (batch, cache length) pairs at Sq = 1, bf16, 32 query heads over 8 KV heads (GQA 4), d = 128;
# every cuflash shape also on paged caches of these page sizes. K/V of the full shapes is 128 MB (1 x 32k)
# to 1 GiB (128 x 2k); --quick is a smoke run whose caches (16 MB) stay in L2.
DECODE_HEADS, DECODE_KV_HEADS = 32, 8
# The cascade case (issue 6): BATCH requests sharing a PREFIX-key prefix, each with SUFFIX keys of its own.
DECODE_FULL_DEFAULTS = dict(headdims=[128], decode_shapes=[(1, 32768), (16, 8192), (64, 4096), (128, 2048)],
                            page_sizes=[1, 16, 64, 256], warmup=10, reps=100, cascade=(64, 32768, 512))
DECODE_QUICK_DEFAULTS = dict(headdims=[128], decode_shapes=[(1, 4096), (8, 1024)], page_sizes=[1, 16, 64, 256],
                             warmup=2, reps=5, cascade=(4, 1024, 64))
#: Peers of the decode suite (when importable), in table order.
DECODE_PEERS = ("torch-cudnn", "torch-flash", "flash_attn", "flashinfer")
#: The spin kernel queued ahead of the timed decode calls (see ``time_queued``), in milliseconds.
SPIN_MS = 20.0

#: Seconds of timed calls one measurement may take before its repetitions are cut (to at least MIN_REPS).
TIME_BUDGET_S = 3.0
MIN_REPS = 5

OFFLINE_SENTENCE = "No CUDA GPU found on this machine: running the offline compile check (sm_90a) instead."


# ----------------------------------------------------------------------------------------------------
# FLOPs and timing (reused by other suites)
# ----------------------------------------------------------------------------------------------------

def flops_attention(batch, heads, seqlen_q, seqlen_k, headdim, causal, mode="fwd") -> float:
    """FLOPs of attention by the FlashAttention convention: fwd = 4·B·H·Sq·Sk·d (two GEMMs), halved when
    causal with Sq = Sk; bwd = 2.5 × fwd (five GEMMs instead of two). Causal with Sq ≠ Sk counts the
    visible (query, key) pairs of the bottom-right aligned mask exactly."""
    if causal and seqlen_q == seqlen_k:
        pairs = seqlen_q * seqlen_k / 2
    elif causal:
        offset = seqlen_k - seqlen_q  # row i sees keys j <= i + offset
        pairs = sum(min(seqlen_k, max(0, i + offset + 1)) for i in range(seqlen_q))
    else:
        pairs = seqlen_q * seqlen_k
    fwd = 4.0 * batch * heads * pairs * headdim
    if mode == "fwd":
        return fwd
    if mode == "bwd":
        return 2.5 * fwd
    raise ValueError(f"mode must be 'fwd' or 'bwd', got {mode!r}")


def time_fn(fn, warmup=5, reps=30, *, before=None) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` after ``warmup`` calls, timed by CUDA events.

    ``before`` (optional) runs before each call outside the timed interval (e.g. dropping torch grads).
    Events are recorded on CuPy's current stream; torch uses its current stream, which by default is the
    same legacy default stream, and the device is synchronised around the timed batch so that nothing
    queued earlier leaks into the first interval.
    """
    import cupy

    device = cupy.cuda.Device()
    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    device.synchronize()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(max(1, reps))]
    for start, end in events:
        if before is not None:
            before()
        start.record(stream)
        fn()
        end.record(stream)
    device.synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(start, end) for start, end in events)


# ----------------------------------------------------------------------------------------------------
# shapes, suites, cases
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    causal: bool
    page_size: int | None = None  # decode suite: 0 = contiguous cache, else the page size; None elsewhere

    @property
    def label(self) -> str:
        if self.page_size is not None:  # decode: batch x cache length
            return f"{self.batch}×{self.seqlen_k}" + (f" page {self.page_size}" if self.page_size else "")
        return f"{self.batch}×{self.seqlen_q}×{self.heads}"


def attention_shapes(headdim, causal, seqlens, total_tokens, hidden) -> list[Shape]:
    """The FlashAttention benchmark shapes: batch = total_tokens // N, heads = hidden // d, MHA."""
    heads = max(1, hidden // headdim)
    return [Shape(max(1, total_tokens // n), heads, heads, n, n, headdim, causal) for n in seqlens]


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    mode: str                       # which pass is timed: "fwd" or "bwd"
    metric: str                     # "tflops" (compute-bound) or "tbps" (memory-bound)
    ceiling: str                    # key of env["ceilings"] the metric is compared with
    work: Callable[[Shape], float]  # FLOPs (or bytes) of one call
    ratio_peers: tuple = TABLE_RATIO_PEERS  # peers with a "vs" column in the tables (when in the run), in order
    cuflash_peers: tuple = ()       # cuflash rows that are also peers of the other cuflash rows (fp8: the bf16 FA3)


def _fwd_flops(s: Shape) -> float:
    return flops_attention(s.batch, s.heads, s.seqlen_q, s.seqlen_k, s.headdim, s.causal, "fwd")


SUITES = {
    "prefill": Suite("prefill", "fwd", "tflops", "bf16_matmul_tflops", _fwd_flops),
    "backward": Suite("backward", "bwd", "tflops", "bf16_matmul_tflops",
                      lambda s: flops_attention(s.batch, s.heads, s.seqlen_q, s.seqlen_k, s.headdim, s.causal, "bwd")),
    # FLOPs counted as for prefill (the same two GEMMs, whatever their precision), against the e4m3 GEMM's rate
    "fp8": Suite("fp8", "fwd", "tflops", "fp8_matmul_tflops", _fwd_flops, ratio_peers=FP8_PEERS,
                 cuflash_peers=("cuflash-fa3",)),
    "decode": Suite("decode", "decode", "tbps", "copy_tbps", lambda s: decode_bytes(s)),
}


def decode_bytes(shape: Shape, itemsize: int = 2) -> float:
    """Bytes of K and V one decode step must read: batch x cache length x kv_heads x d x 2 bytes, for K and
    for V (q, out and the page table are negligible next to it). The same count for every implementation,
    so TB/s ratios are time ratios even where a peer reads more (K/V expanded for GQA)."""
    return float(shape.batch * shape.seqlen_k * shape.kv_heads * shape.headdim * itemsize * 2)


def decode_shapes(headdim: int, pairs) -> list[Shape]:
    """The decode suite's shapes for one head dim: (batch, cache length) pairs, Sq = 1, GQA 32/8."""
    return [Shape(b, DECODE_HEADS, DECODE_KV_HEADS, 1, n, headdim, False, page_size=0) for b, n in pairs]


class Case:
    """Inputs of one shape, shared by every implementation measured on it, and the lazily computed
    exact reference on a slice (batch 0, the first query heads) that is cheap even at N = 16k."""

    def __init__(self, shape: Shape, dtype: str, mode: str, seed: int = 0):
        import cupy

        self.shape, self.dtype, self.mode = shape, dtype, mode
        self.scale = 1.0 / math.sqrt(shape.headdim)
        rng = cupy.random.default_rng(seed)
        cdt = DTYPES[dtype]

        def randn(*dims):  # N(0, 1): never time or check on zeros
            return rng.standard_normal(dims, dtype=cupy.float32).astype(cdt)

        s = shape
        self.q = randn(s.batch, s.seqlen_q, s.heads, s.headdim)
        self.k = randn(s.batch, s.seqlen_k, s.kv_heads, s.headdim)
        self.v = randn(s.batch, s.seqlen_k, s.kv_heads, s.headdim)
        self.dout = randn(s.batch, s.seqlen_q, s.heads, s.headdim) if mode == "bwd" else None
        # Slice: the first 2 query heads, widened to whole GQA groups so that dk/dv of the sliced KV heads
        # get every contribution.
        group = s.heads // s.kv_heads
        self.kv_slice = max(1, -(-min(2, s.heads) // group))
        self.q_slice = self.kv_slice * group
        self._ref = None

    def slice_q(self, x):
        return x[0:1, :, : self.q_slice]

    def slice_kv(self, x):
        return x[0:1, :, : self.kv_slice]

    def reference(self):
        """fp32 (out,) for fwd or (dq, dk, dv) for bwd, on the slice."""
        if self._ref is None:
            from . import reference

            q, k, v = self.slice_q(self.q), self.slice_kv(self.k), self.slice_kv(self.v)
            kw = dict(causal=self.shape.causal, softmax_scale=self.scale, compute_dtype="float32")
            if self.mode == "fwd":
                self._ref = (reference.attention_ref(q, k, v, **kw)[0],)
            else:
                self._ref = tuple(reference.attention_ref_backward(self.slice_q(self.dout), q, k, v, **kw))
        return self._ref

    def max_err(self, outs) -> float:
        """Max |impl - ref| over the slice (fwd: out; bwd: max over dq, dk, dv)."""
        slicers = (self.slice_q,) if self.mode == "fwd" else (self.slice_q, self.slice_kv, self.slice_kv)
        err = 0.0
        for ref, out, cut in zip(self.reference(), outs, slicers):
            this = max_abs_diff(cut(_to_cupy(out)), ref)
            if not math.isfinite(this):  # max() would silently drop a NaN
                return this
            err = max(err, this)
        return err


def max_abs_diff(got, ref) -> float:
    """max |got - ref| in float32 (NaN when either has one); NumPy or CuPy arrays, both of one kind."""
    xp = _array_module(got)
    diff = xp.abs(got.astype(xp.float32) - ref.astype(xp.float32))
    return float(xp.max(diff)) if diff.size else 0.0


def _array_module(x):
    import numpy

    if isinstance(x, numpy.ndarray):
        return numpy
    import cupy

    return cupy


class DecodeCase(Case):
    """One decode shape: q (batch, 1, heads, d) and a contiguous cache K, V (batch, cache_len, kv_heads, d)
    holding cache_len keys in every entry (``seqlens``, int32 on the GPU: no new tokens are appended, so
    every implementation does the same read-only attention). Paged copies of the same keys are built on
    demand (``paged``), with the pages in a random order, so all rows share one reference: the exact fp32
    attention of batch entry 0, first GQA group (``Case.reference``).

    L2: the timed replays read the same cache again and again, but the full shapes' K/V (128 MB at 1 x 32k,
    up to 1 GiB at 128 x 2k) is well beyond the H200's 50 MB L2, so each replay streams it from HBM and no
    flush or rotation is needed; only --quick (16 MB) runs from L2, and it is a smoke test, not a number.
    """

    def __init__(self, shape: Shape, dtype: str, seed: int = 0):
        import cupy

        super().__init__(dataclasses.replace(shape, page_size=0), dtype, "fwd", seed)
        self.seed = seed
        self.seqlens = cupy.full((shape.batch,), shape.seqlen_k, dtype=cupy.int32)

    def paged(self, page_size: int):
        """(k_pages, v_pages, page_table) with the keys of ``k``/``v``: entry b's page j (keys j·P .. j·P + P - 1)
        is page page_table[b, j] of (num_pages, P, kv_heads, d), the pages a random permutation."""
        import cupy
        import numpy

        s = self.shape
        if s.seqlen_k % page_size:
            raise ValueError(f"page size {page_size} does not divide the cache length {s.seqlen_k}")
        per_entry = s.seqlen_k // page_size
        pages = s.batch * per_entry
        # numpy's generator: cupy's Generator has no permutation
        perm = cupy.asarray(numpy.random.default_rng(self.seed + page_size).permutation(pages).astype(numpy.int32))
        out = []
        for x in (self.k, self.v):  # moved as 16-bit words: the scatter needs no bf16 arithmetic
            paged = cupy.empty((pages, page_size, s.kv_heads, s.headdim), dtype=x.dtype)
            paged.view(cupy.uint16)[perm] = x.view(cupy.uint16).reshape(pages, page_size, s.kv_heads, s.headdim)
            out.append(paged)
        return out[0], out[1], perm.reshape(s.batch, per_entry)


class Fp8Inputs(NamedTuple):
    """FP8 attention inputs: e4m3 bit patterns (uint8, (batch, seqlen, heads, d)) and fp32 descales (batch,
    heads, ceil(seqlen / block)), or (batch, heads, 1) for one scale per head: row r of head h holds
    e4m3(data) * descale[b, h, r // block]."""
    q: object
    k: object
    v: object
    q_descale: object
    k_descale: object
    v_descale: object
    block: int


class Fp8Case(Case):
    """One shape of the fp8 suite: the bf16 (--dtype) inputs of ``Case``, on which the bf16 peers run, and
    their FP8 form, made once on demand outside any timing (``fp8_inputs``): ``cuflash.fp8.quantize`` with
    one descale per FP8_BLOCK rows, q and k rotated by the same randomised Hadamard transform (QK^T is
    unchanged), v not rotated (so the output needs no un-rotation).

    FP8 rows are checked by ``fp8_max_err``: against the exact fp32 attention of their own dequantised
    inputs on the usual slice (batch 0, the first heads), so the column shows the kernel's error (P rounded
    to e4m3, accumulation) and not the inputs' quantisation error, which the accuracy tests measure."""

    def __init__(self, shape: Shape, dtype: str, mode: str = "fwd", seed: int = 0):
        if mode != "fwd":
            raise ValueError("the fp8 suite measures the forward pass only")
        super().__init__(shape, dtype, mode, seed)
        self.seed = seed
        self._fp8 = None

    def fp8_inputs(self) -> Fp8Inputs:
        if self._fp8 is None:
            from .fp8 import quantize

            q8, qs = quantize(self.q, block=FP8_BLOCK, hadamard=True, seed=self.seed)
            k8, ks = quantize(self.k, block=FP8_BLOCK, hadamard=True, seed=self.seed)
            v8, vs = quantize(self.v, block=FP8_BLOCK, hadamard=False)
            self._fp8 = Fp8Inputs(q8, k8, v8, qs, ks, vs, FP8_BLOCK)
        return self._fp8

    def fp8_max_err(self, outs, inputs: Fp8Inputs) -> float:
        return fp8_max_err(outs[0], inputs, self.q_slice, self.kv_slice, causal=self.shape.causal,
                           softmax_scale=self.scale)


def fp8_max_err(out, inputs: Fp8Inputs, q_heads: int, kv_heads: int, *, causal: bool, softmax_scale: float) -> float:
    """Max |out - ref| over batch 0 and the first ``q_heads`` query heads, ref the exact fp32 attention of
    ``inputs`` dequantised (``reference.attention_fp8_ref``, on their first ``kv_heads`` KV heads). q and k
    may be rotated alike (Hadamard): QK^T does not change, so neither does ref. NumPy arrays stay on the
    host; anything else goes through CuPy (DLPack)."""
    from .reference import attention_fp8_ref

    cut = lambda x, heads: _as_array(x)[0:1, :, :heads]  # noqa: E731 - (batch 0, all rows, first heads)
    cut_descale = lambda x, heads: _as_array(x)[0:1, :heads]  # noqa: E731
    ref = attention_fp8_ref(cut(inputs.q, q_heads), cut(inputs.k, kv_heads), cut(inputs.v, kv_heads),
                            cut_descale(inputs.q_descale, q_heads), cut_descale(inputs.k_descale, kv_heads),
                            cut_descale(inputs.v_descale, kv_heads), descale_block=(inputs.block, inputs.block),
                            causal=causal, softmax_scale=softmax_scale, compute_dtype="float32")[0]
    return max_abs_diff(cut(out, q_heads), ref)


def _as_array(x):
    import numpy

    return x if isinstance(x, numpy.ndarray) else _to_cupy(x)


# ----------------------------------------------------------------------------------------------------
# implementations: name -> factory(case) -> Timed (a zero-arg fn to time, returning its outputs)
# ----------------------------------------------------------------------------------------------------

class Timed(NamedTuple):
    fn: Callable[[], tuple]                 # returns (out,) for fwd, (dq, dk, dv) for bwd, layout (B, S, H, D)
    before: Callable[[], None] | None = None  # untimed per-call preparation
    max_err: Callable[[tuple], float] | None = None  # checks fn's outputs when Case.max_err does not apply (fp8)
    note: str | None = None                 # goes to the row (how this implementation was fed or checked)


def _cuflash_factory(impl: str, deterministic: bool = False):
    def make(case: Case) -> Timed:
        from .api import flash_attn_backward, flash_attn_func

        if deterministic and case.mode == "fwd":
            raise ValueError("deterministic mode is a property of the backward (--suite backward)")
        kw = dict(causal=case.shape.causal, softmax_scale=case.scale, impl=impl)
        if case.mode == "fwd":
            return Timed(lambda: (flash_attn_func(case.q, case.k, case.v, **kw),))
        out, lse = flash_attn_func(case.q, case.k, case.v, return_lse=True, **kw)
        bwd_kw = dict(kw, deterministic=True) if deterministic else kw
        return Timed(lambda: tuple(flash_attn_backward(case.dout, case.q, case.k, case.v, out, lse, **bwd_kw)))

    return make


def _naive(case: Case) -> Timed:
    from .reference import attention_naive, attention_naive_backward

    kw = dict(causal=case.shape.causal, softmax_scale=case.scale)
    if case.mode == "fwd":
        return Timed(lambda: (attention_naive(case.q, case.k, case.v, **kw),))
    out = attention_naive(case.q, case.k, case.v, **kw)
    return Timed(lambda: tuple(attention_naive_backward(case.dout, case.q, case.k, case.v, out, **kw)))


def _torch_inputs(case: Case, requires_grad: bool):
    """Zero-copy torch views of the case's CuPy arrays, (B, S, H, D) like cuflash."""
    import torch

    tensors = [torch.from_dlpack(x) for x in (case.q, case.k, case.v)]
    if requires_grad:
        tensors = [t.detach().requires_grad_(True) for t in tensors]
    return tensors


def _torch_backward(case: Case, forward) -> Timed:
    """Time only ``out.backward``: the forward runs once here; grads are dropped (untimed) before each call."""
    import torch

    q, k, v = _torch_inputs(case, requires_grad=True)
    out = forward(q, k, v)
    dout = torch.from_dlpack(case.dout)

    def fn():
        out.backward(dout, retain_graph=True)
        return q.grad, k.grad, v.grad

    def before():
        q.grad = k.grad = v.grad = None

    return Timed(fn, before)


def _sdpa_factory(backend: str):
    def make(case: Case) -> Timed:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = getattr(SDPBackend, backend)
        kw = dict(is_causal=case.shape.causal, scale=case.scale)
        if case.shape.kv_heads != case.shape.heads:
            kw["enable_gqa"] = True

        def forward(q, k, v):
            # SDPA wants (B, H, S, D): transposed views, no copy; the result goes back to (B, S, H, D).
            with sdpa_kernel(chosen):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
            return o.transpose(1, 2)

        if case.mode == "fwd":
            q, k, v = _torch_inputs(case, requires_grad=False)
            return Timed(lambda: (forward(q, k, v),))
        return _torch_backward(case, forward)

    return make


def _flash_attn(case: Case) -> Timed:
    from flash_attn import flash_attn_func

    def forward(q, k, v):
        return flash_attn_func(q, k, v, causal=case.shape.causal, softmax_scale=case.scale)

    if case.mode == "fwd":
        q, k, v = _torch_inputs(case, requires_grad=False)
        return Timed(lambda: (forward(q, k, v),))
    return _torch_backward(case, forward)


def _flashinfer(case: Case) -> Timed:
    if case.mode != "fwd":
        raise NotImplementedError("flashinfer has no attention backward")
    import flashinfer
    import torch

    s = case.shape
    q, k, v = (t.reshape(-1, t.shape[2], t.shape[3]) for t in _torch_inputs(case, requires_grad=False))
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout="NHD")
    arange = torch.arange(s.batch + 1, dtype=torch.int32, device=q.device)
    wrapper.plan(arange * s.seqlen_q, arange * s.seqlen_k, s.heads, s.kv_heads, s.headdim,
                 causal=s.causal, sm_scale=case.scale, q_data_type=q.dtype)
    shape = (s.batch, s.seqlen_q, s.heads, s.headdim)
    return Timed(lambda: (wrapper.run(q, k, v).view(shape),))


def _fp8_case(case: Case, impl: str) -> Fp8Case:
    if not isinstance(case, Fp8Case):
        raise ValueError(f"{impl} has FP8 inputs: it runs in the fp8 suite only (--suite fp8)")
    return case


def _cuflash_fp8(case: Case) -> Timed:
    """flash_attn_func on the case's e4m3 inputs (quantised before, untimed); the V transpose that FP8 wgmma
    needs runs inside the call, so its cost is in the timing. Output bf16."""
    from .api import flash_attn_func

    case = _fp8_case(case, "cuflash-fa3-fp8")
    x = case.fp8_inputs()
    kw = dict(q_descale=x.q_descale, k_descale=x.k_descale, v_descale=x.v_descale, fp8_format="e4m3",
              descale_block=(x.block, x.block), causal=case.shape.causal, softmax_scale=case.scale)
    return Timed(lambda: (flash_attn_func(x.q, x.k, x.v, **kw),), max_err=lambda outs: case.fp8_max_err(outs, x))


#: cuDNN's FP8 attention: P is scaled by this before its e4m3 cast (P <= 1, so 448 uses the whole range).
CUDNN_FP8_SCALE_S = 448.0


def _cudnn_fp8(case: Case) -> Timed:
    """cuDNN's FP8 attention forward (``graph.sdpa_fp8`` of the cudnn frontend package, nvidia-cudnn-frontend)
    with its own scaling: one descale per tensor (amax / 448, inputs quantised by torch before, untimed), P
    scaled by 448 before its e4m3 cast, output e4m3 (cuDNN's FP8 forward writes e4m3 on Hopper) with scale 1
    (|out| <= max |v| stays far below 448). Same (B, S, H, D) memory as cuflash, described as (B, H, S, D)."""
    case = _fp8_case(case, "cudnn-fp8")
    import cudnn
    import torch

    s = case.shape
    dev = torch.device("cuda", torch.cuda.current_device())
    scalar = lambda value: torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=dev)  # noqa: E731

    def quantise(t):
        descale = (t.abs().amax().float() / 448.0).clamp_min(1e-30).reshape(1, 1, 1, 1)
        return (t.float() / descale).to(torch.float8_e4m3fn), descale

    (q8, qd), (k8, kd), (v8, vd) = (quantise(t) for t in _torch_inputs(case, requires_grad=False))
    out = torch.empty_like(q8)
    amax_o = scalar(0.0)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    dims = (s.batch, s.heads, s.seqlen_q, s.headdim)
    strides = (s.seqlen_q * s.heads * s.headdim, s.headdim, s.heads * s.headdim, 1)
    tq, tk, tv = (graph.tensor(name=n, dim=dims, stride=strides, data_type=e4m3) for n in ("q", "k", "v"))
    names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    scale_t = {n: graph.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32) for n in names}
    kw = dict(q=tq, k=tk, v=tv, attn_scale=case.scale, use_causal_mask=s.causal, name="sdpa_fp8", **scale_t)
    try:
        o_t, _, _amax_s, amax_o_t = graph.sdpa_fp8(generate_stats=False, **kw)
    except TypeError:  # older frontends: is_inference instead of generate_stats
        o_t, _, _amax_s, amax_o_t = graph.sdpa_fp8(is_inference=True, **kw)
    o_t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
    # amax_s stays virtual: newer frontends (1.32) say declaring it an output restricts the graph to the
    # backend engines; scale_s is set from P's bound (448) instead
    amax_o_t.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=dev)
    values = dict(descale_q=qd, descale_k=kd, descale_v=vd, descale_s=scalar(1.0 / CUDNN_FP8_SCALE_S),
                  scale_s=scalar(CUDNN_FP8_SCALE_S), scale_o=scalar(1.0))
    pack = {tq: q8, tk: k8, tv: v8, o_t: out, amax_o_t: amax_o,
            **{scale_t[n]: values[n] for n in names}}

    def fn():
        graph.execute(pack, workspace, handle=handle)
        return (out,)

    inputs = Fp8Inputs(*(t.view(torch.uint8) for t in (q8, k8, v8)),
                       *(d.reshape(1, 1, 1).expand(s.batch, s.heads, 1).contiguous() for d in (qd, kd, vd)),
                       block=FP8_BLOCK)  # one descale per (batch, head): n == 1, whatever the block
    return Timed(fn, max_err=lambda outs: case.fp8_max_err((outs[0].float(),), inputs),
                 note="per-tensor scales (cuDNN's), e4m3 output")


PEERS: dict[str, Callable[[Case], Timed]] = {
    "torch-flash": _sdpa_factory("FLASH_ATTENTION"),
    "torch-cudnn": _sdpa_factory("CUDNN_ATTENTION"),
    "torch-efficient": _sdpa_factory("EFFICIENT_ATTENTION"),
    "torch-math": _sdpa_factory("MATH"),
    "flash_attn": _flash_attn,
    "flashinfer": _flashinfer,
    "naive": _naive,
    "cudnn-fp8": _cudnn_fp8,
}

#: cuflash rows that are not ``flash_attn_func(..., impl=<name>)`` on the case's inputs; ``-det``: the
#: backward in deterministic mode (bit-identical gradients), only when asked for with --impls.
CUFLASH_FACTORIES: dict[str, Callable[[Case], Timed]] = {
    "cuflash-fa3-fp8": _cuflash_fp8,
    "cuflash-fa2-det": _cuflash_factory("fa2", deterministic=True),
    "cuflash-fa3-det": _cuflash_factory("fa3", deterministic=True),
}


def factory_for(name: str) -> Callable[[Case], Timed]:
    if name in CUFLASH_FACTORIES:
        return CUFLASH_FACTORIES[name]
    if name.startswith("cuflash-"):
        return _cuflash_factory(name[len("cuflash-"):])
    if name in PEERS:
        return PEERS[name]
    raise KeyError(f"unknown implementation {name!r}: use cuflash-<impl> or one of {', '.join(PEERS)}")


def _importable(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:  # missing, or installed but broken (ABI mismatch): not a peer here
        return False


def detect_peers() -> list[str]:
    """Peers usable in this process, in table order."""
    peers = []
    if _importable("torch"):
        import torch

        if torch.cuda.is_available():
            peers += ["torch-flash", "torch-cudnn", "torch-efficient", "torch-math"]
            if _importable("flash_attn"):
                peers.append("flash_attn")
            if _importable("flashinfer"):
                peers.append("flashinfer")
    return peers + ["naive"]


def fp8_peers() -> tuple[list[str], dict[str, str]]:
    """(the fp8 suite's peers usable here in table order, {peer left out: why})."""
    from .api import available_impls

    found, missing = [], {}
    torch_peers = [p for p in detect_peers() if p.startswith("torch-")]
    for peer in FP8_PEERS:
        if peer == "cuflash-fa3":
            ok, why = "fa3" in available_impls(), "the FA3 kernel does not run on this GPU"
        elif peer == "cudnn-fp8":
            ok = bool(torch_peers) and _importable("cudnn") and hasattr(sys.modules["cudnn"], "pygraph")
            why = ("the cudnn Python package (nvidia-cudnn-frontend) is not importable here" if torch_peers
                   else "it needs torch with CUDA, not importable here")
        else:
            ok, why = peer in torch_peers, "torch with CUDA is not importable here"
        if ok:
            found.append(peer)
        else:
            missing[peer] = why
    return found, missing


def default_impls(suite: str = "prefill") -> list[str]:
    if suite == "decode":
        return ["cuflash-decode"] + [p for p in DECODE_PEERS if p in detect_peers()]
    if suite == "fp8":
        return ["cuflash-fa3-fp8"] + fp8_peers()[0]
    from .api import available_impls

    return [f"cuflash-{impl}" for impl in available_impls()] + detect_peers()


def row_dtype(impl: str, dtype: str) -> str:
    """The dtype a row reports: "e4m3" for the FP8 implementations, else the inputs' --dtype."""
    return "e4m3" if impl in FP8_IMPLS else dtype


# ----------------------------------------------------------------------------------------------------
# decode implementations: name -> factory(case, page_size) -> DecodeTimed
# ----------------------------------------------------------------------------------------------------

class DecodeTimed(NamedTuple):
    fn: Callable[[], tuple]      # one eager decode call; returns (out,) as (batch, 1, heads, d)
    graph: str                   # how to capture it: "cupy" (stream capture) or "torch" (torch.cuda.graph)
    note: str | None = None      # goes to the row (e.g. K/V expanded for GQA)
    num_splits: int | None = None  # cuflash: the KV splits its heuristic chose
    scratch_bytes: int = 0       # caller-owned scratch (cuflash's workspace), counted as extra memory
    before: None = None          # (measure_extra_memory reads it)


def _cuflash_decode(case: DecodeCase, page_size: int) -> DecodeTimed:
    """flash_attn_with_kvcache as a serving engine calls it inside a graph: check=False (no host reads),
    out= and workspace= allocated once here (the captured call allocates nothing), num_splits=0 (the
    heuristic, from the shapes: the cache is full, so capacity = cache_len = the longest entry)."""
    import cupy

    from .api import flash_attn_with_kvcache, kvcache_num_splits, kvcache_workspace_bytes

    s = case.shape
    kc, vc, table = case.paged(page_size) if page_size else (case.k, case.v, None)
    splits = kvcache_num_splits(s.batch, s.heads, s.kv_heads, s.seqlen_q, s.headdim, s.seqlen_k, paged=bool(page_size),
                                page_size=page_size or None)
    out = cupy.empty_like(case.q)
    workspace = cupy.empty(kvcache_workspace_bytes(s.batch, s.heads, s.seqlen_q, s.headdim, splits), dtype=cupy.uint8)

    def fn():
        return (flash_attn_with_kvcache(case.q, kc, vc, cache_seqlens=case.seqlens, page_table=table,
                                        softmax_scale=case.scale, check=False, out=out, workspace=workspace),)

    return DecodeTimed(fn, "cupy", None, splits, workspace.nbytes)


def _sdpa_decode_factory(backend: str):
    def make(case: DecodeCase, page_size: int) -> DecodeTimed:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        s = case.shape
        chosen = getattr(SDPBackend, backend)
        q, k, v = (t.transpose(1, 2) for t in _torch_inputs(case, requires_grad=False))  # (B, H, S, D) views

        def call(kk, vv, **kw):
            with sdpa_kernel(chosen):
                o = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, scale=case.scale, **kw)
            return (o.transpose(1, 2),)

        if s.heads == s.kv_heads:
            return DecodeTimed(lambda: call(k, v), "torch")
        try:  # GQA in the backend itself when it can (torch >= 2.5: enable_gqa)
            with warnings.catch_warnings():  # "... kernel not used because ...": the fallback below says it
                warnings.simplefilter("ignore")
                call(k, v, enable_gqa=True)
            return DecodeTimed(lambda: call(k, v, enable_gqa=True), "torch")
        except Exception as exc:  # noqa: BLE001 - "No available kernel", or an older torch without enable_gqa
            why = _error_text(exc)
        group = s.heads // s.kv_heads
        ke, ve = (x.repeat_interleave(group, dim=1) for x in (k, v))  # materialised once, outside the timing
        return DecodeTimed(lambda: call(ke, ve), "torch",
                           f"K/V expanded to {s.heads} heads (no GQA in this backend: {why[:80]}); reads {group}x the bytes")

    return make


def _flash_attn_decode(case: DecodeCase, page_size: int) -> DecodeTimed:
    from flash_attn import flash_attn_with_kvcache
    import torch

    q, k, v = _torch_inputs(case, requires_grad=False)
    seqlens = torch.from_dlpack(case.seqlens)
    return DecodeTimed(lambda: (flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, softmax_scale=case.scale),),
                       "torch")


def _flashinfer_decode(case: DecodeCase, page_size: int) -> DecodeTimed:
    """BatchDecodeWithPagedKVCacheWrapper on the contiguous cache seen as one page of cache_len rows per
    entry (NHD, K and V as a tuple: zero-copy); planned once, in its CUDA-graph mode (fixed buffers)."""
    import flashinfer
    import torch

    s = case.shape
    q, k, v = _torch_inputs(case, requires_grad=False)
    q = q.reshape(s.batch, s.heads, s.headdim)
    dev = q.device
    indptr = torch.arange(s.batch + 1, dtype=torch.int32, device=dev)
    indices = torch.arange(s.batch, dtype=torch.int32, device=dev)
    last_len = torch.full((s.batch,), s.seqlen_k, dtype=torch.int32, device=dev)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    graph_kw = dict(use_cuda_graph=True, paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                    paged_kv_last_page_len_buffer=last_len)
    try:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=s.heads // s.kv_heads >= 4,
                                                                **graph_kw)
    except TypeError:  # older flashinfer without use_tensor_cores
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **graph_kw)
    plan = (indptr, indices, last_len, s.heads, s.kv_heads, s.headdim, s.seqlen_k)
    try:
        wrapper.plan(*plan, pos_encoding_mode="NONE", sm_scale=case.scale, q_data_type=q.dtype, kv_data_type=k.dtype)
    except TypeError:  # older flashinfer: one data_type
        wrapper.plan(*plan, pos_encoding_mode="NONE", sm_scale=case.scale, data_type=q.dtype)
    shape = (s.batch, 1, s.heads, s.headdim)
    return DecodeTimed(lambda: (wrapper.run(q, (k, v)).view(shape),), "torch",
                       f"paged API, one page of {s.seqlen_k} rows per entry (the contiguous cache)")


DECODE_FACTORIES: dict[str, Callable[[DecodeCase, int], DecodeTimed]] = {
    "cuflash-decode": _cuflash_decode,
    "torch-cudnn": _sdpa_decode_factory("CUDNN_ATTENTION"),
    "torch-flash": _sdpa_decode_factory("FLASH_ATTENTION"),
    "flash_attn": _flash_attn_decode,
    "flashinfer": _flashinfer_decode,
}


def decode_factory_for(name: str) -> Callable[[DecodeCase, int], DecodeTimed]:
    if name not in DECODE_FACTORIES:
        raise ValueError(f"{name} has no decode benchmark (decode implementations: {', '.join(DECODE_FACTORIES)})")
    return DECODE_FACTORIES[name]


# ----------------------------------------------------------------------------------------------------
# measuring one (shape, impl)
# ----------------------------------------------------------------------------------------------------

def _to_cupy(x):
    import cupy

    return x if isinstance(x, cupy.ndarray) else cupy.from_dlpack(x)


def _nbytes(arrays) -> int:
    total = 0
    for a in arrays:
        nbytes = getattr(a, "nbytes", None)
        total += int(nbytes) if nbytes is not None else a.numel() * a.element_size()
    return total


def _torch_if_loaded():
    """torch only when a peer already imported it: the bench never imports torch just to free memory."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and torch.cuda.is_available() else None


def _sync():
    import cupy

    cupy.cuda.Device().synchronize()


def free_memory():
    """Return cached blocks of both allocators (CuPy's pool, torch's cache) to the driver, so that one
    implementation's cache never makes the next one run out of memory."""
    import cupy

    gc.collect()
    _sync()
    cupy.get_default_memory_pool().free_all_blocks()
    torch = _torch_if_loaded()
    if torch is not None:
        torch.cuda.empty_cache()


def measure_extra_memory(timed: Timed):
    """Run one call and return (peak bytes allocated beyond inputs and outputs, the outputs).

    CuPy's pool never gives memory back on its own, so after emptying it its growth over one call is that
    call's high-water mark; torch's allocator reports its own high-water mark. Memory taken outside both
    (e.g. a library's private workspace) is not seen.
    """
    import cupy

    pool = cupy.get_default_memory_pool()
    free_memory()
    torch = _torch_if_loaded()
    before_cupy = pool.total_bytes()
    if torch is not None:
        torch.cuda.reset_peak_memory_stats()
        before_torch = torch.cuda.memory_allocated()
    if timed.before is not None:
        timed.before()
    outs = timed.fn()
    _sync()
    grown = pool.total_bytes() - before_cupy
    if torch is not None:
        grown += torch.cuda.max_memory_allocated() - before_torch
    return max(0, grown - _nbytes(outs)), outs


def _is_oom(exc: BaseException) -> bool:
    import cupy

    if isinstance(exc, cupy.cuda.memory.OutOfMemoryError):
        return True
    torch = sys.modules.get("torch")
    if torch is not None:
        oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                      getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
        if oom_types and isinstance(exc, oom_types):
            return True
    text = str(exc)
    return "out of memory" in text.lower() or "ALLOC_FAILED" in text or "cudaErrorMemoryAllocation" in text


def _is_fatal(error: str | None) -> bool:
    """A kernel fault leaves the CUDA context unusable for the rest of the process."""
    markers = ("illegal memory access", "illegal instruction", "IllegalAddress", "IllegalInstruction",
               "unspecified launch failure", "LaunchFailure", "misaligned address")
    return bool(error) and any(m in error for m in markers)


def _is_unsupported(error: str) -> bool:
    """Errors that mean "this implementation does not do that" (the API raises ValueError or
    NotImplementedError for an unsupported shape or a missing kernel) rather than a bug."""
    return error.startswith(("ValueError:", "NotImplementedError:", "skipped:"))


def _error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text[:200]


def make_row(suite: Suite, impl: str, shape: Shape, dtype: str, *, ms=None, max_err=None, error=None,
             extra_mem_bytes=None, env=None, reps=None, num_splits=None, host_us=None, note=None) -> dict:
    """One JSON row. The metric comes from the suite's work count and ``ms``; ratios are filled later."""
    env = env or {}
    value = None
    if ms is not None and ms > 0:
        work = suite.work(shape)
        value = work / (ms * 1e-3) / 1e12  # TFLOP/s or TB/s
    ceiling = (env.get("ceilings") or {}).get(suite.ceiling)
    return {
        "suite": suite.name,
        "impl": impl,
        "dtype": dtype,
        "batch": shape.batch,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "seqlen_q": shape.seqlen_q,
        "seqlen_k": shape.seqlen_k,
        "headdim": shape.headdim,
        "causal": shape.causal,
        "ms": ms,
        "reps": reps,
        "tflops": value if suite.metric == "tflops" else None,
        "tbps": value if suite.metric == "tbps" else None,
        "pct_of_ceiling": 100.0 * value / ceiling if value is not None and ceiling else None,
        "speedup_vs": {},
        "max_err": max_err,
        "error": error,
        "extra_mem_bytes": extra_mem_bytes,
        "gpu": env.get("gpu"),
        "env": env,
        "page_size": shape.page_size,
        "num_splits": num_splits,
        "host_us": host_us,
        "note": note,
    }


def _budgeted_reps(timed: Timed, cfg) -> tuple[int, int]:
    """(warmup, reps) for one measurement: as asked, unless one call is so slow (the naive attention at
    16k, a portable kernel) that they would take more than TIME_BUDGET_S; then fewer, but at least
    MIN_REPS. One probe call decides (the first call, which compiled, has already run)."""
    probe_ms = time_fn(timed.fn, 0, 1, before=timed.before)
    if probe_ms * (cfg.warmup + cfg.reps) <= 1e3 * TIME_BUDGET_S:
        return cfg.warmup, cfg.reps
    return min(cfg.warmup, 1), min(cfg.reps, max(MIN_REPS, int(1e3 * TIME_BUDGET_S / probe_ms)))


def measure(suite: Suite, case: Case, impl: str, cfg, env: dict) -> dict:
    """Time one implementation on one case; failures become a row with ``ms: null`` and an ``error``.
    The first of ``cfg.rounds`` timings (``retime`` takes the others)."""
    shape = case.shape
    dtype = row_dtype(impl, cfg.dtype)
    limit = SLOW_PEERS.get(impl)
    if limit is not None and shape.seqlen_q > limit and not cfg.include_slow:
        return make_row(suite, impl, shape, dtype, error="skipped: too slow", env=env)
    ms = max_err = extra = error = reps = note = None
    timed = outs = None
    try:
        timed = factory_for(impl)(case)
        note = timed.note
        extra, outs = measure_extra_memory(timed)  # also the first call: compiles, fills caches
        try:
            max_err = (timed.max_err or case.max_err)(outs)
        except Exception as exc:  # the reference failing is not the implementation's fault
            if _is_oom(exc):
                free_memory()
            max_err = None
        outs = None
        warmup, reps = _budgeted_reps(timed, cfg)
        ms = time_fn(timed.fn, warmup, reps, before=timed.before)
    except Exception as exc:
        error = "out of memory" if _is_oom(exc) else _error_text(exc)
        ms = reps = None
    finally:
        timed = outs = None
        try:
            free_memory()
        except Exception:  # a dead context fails even here; the row already says why
            pass
    if max_err is not None and not math.isfinite(max_err):
        max_err = None
        error = error or "output has NaN or inf"
    return make_row(suite, impl, shape, dtype, ms=ms, max_err=max_err, error=error,
                    extra_mem_bytes=extra, env=env, reps=reps, note=note)


def retime(case: Case, impl: str, row: dict, cfg) -> None:
    """Another timing round of a row that ``measure`` timed: the implementation set up again, warmed up and
    timed with the row's repetitions. The round's median joins ``row["ms_rounds"]``, and ``row["ms"]`` becomes
    the median of the rounds (``finish_rounds``). A failure here keeps the earlier rounds and says so."""
    if row["ms"] is None or row["error"]:
        return
    timed = None
    try:
        timed = factory_for(impl)(case)
        row.setdefault("ms_rounds", [row["ms"]]).append(time_fn(timed.fn, cfg.warmup, row["reps"], before=timed.before))
    except Exception as exc:
        row["note"] = "; ".join(filter(None, [row["note"], f"round {len(row.get('ms_rounds', [1])) + 1} failed: "
                                                          f"{_error_text(exc)}"]))
    finally:
        timed = None
        free_memory()


def finish_rounds(suite: Suite, row: dict) -> None:
    """``row["ms"]`` (and the metric) from the median of its timing rounds, when there were several."""
    rounds = row.get("ms_rounds")
    if not rounds or len(rounds) < 2:
        return
    ms = statistics.median(rounds)
    again = make_row(suite, row["impl"], Shape(row["batch"], row["heads"], row["kv_heads"], row["seqlen_q"],
                                               row["seqlen_k"], row["headdim"], row["causal"]),
                     row["dtype"], ms=ms, env=row["env"])
    row.update(ms=ms, tflops=again["tflops"], tbps=again["tbps"], pct_of_ceiling=again["pct_of_ceiling"])


# ----------------------------------------------------------------------------------------------------
# decode: CUDA-graph replays queued behind a spin kernel, host overhead of eager calls
# ----------------------------------------------------------------------------------------------------

_SPIN_SRC = r"""
extern "C" __global__ void cuflash_bench_spin(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while ((long long)(t - t0) < ns);
}
"""
_spin_kernel = None


def spin(ms: float) -> None:
    """Keep the current CuPy stream busy for ``ms`` milliseconds (one thread reading the global timer)."""
    global _spin_kernel
    import cupy
    import numpy

    if _spin_kernel is None:
        _spin_kernel = cupy.RawKernel(_SPIN_SRC, "cuflash_bench_spin")
    _spin_kernel((1,), (1,), (numpy.int64(ms * 1e6),))


def time_queued(fn, warmup=10, reps=100, spin_ms=SPIN_MS) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` by CUDA events, like ``time_fn``, except that the
    timed calls are queued behind a ``spin_ms`` spin kernel: the host enqueues every (event, call, event)
    while the GPU spins, so the calls then run back to back and each interval is the GPU time of one
    call, not the host's launch latency (a decode step of a few µs is shorter than its launch).
    Launches go to CuPy's current stream (``with stream:`` for a graph replayed on a side stream)."""
    import cupy

    device = cupy.cuda.Device()
    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    device.synchronize()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(max(1, reps))]
    spin(spin_ms)
    for start, end in events:
        start.record(stream)
        fn()
        end.record(stream)
    device.synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(start, end) for start, end in events)


def host_overhead_us(fn, warmup=3, calls=100) -> float:
    """Host wall time of one eager call in µs: ``calls`` calls back to back, the GPU never waited for in
    between (that is what a serving loop pays in Python and launches per step when it does not use graphs)."""
    import time

    for _ in range(warmup):
        fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    _sync()
    return 1e6 * elapsed / max(1, calls)


def capture_graph(timed: DecodeTimed):
    """Capture one call of ``timed.fn`` in a CUDA graph: ``(replay, outputs, stream)``. ``replay()`` launches
    the graph on ``stream`` (a CuPy side stream; None for torch graphs, which replay on torch's current
    stream, the default one that CuPy's default stream also is); ``outputs`` are the captured call's results,
    rewritten by every replay."""
    if timed.graph == "torch":
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # torch's recipe: warm up on a side stream before capturing
            for _ in range(2):
                timed.fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = timed.fn()
        return graph.replay, outs, None
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        graph, outs = capture_on_stream(stream, timed.fn)
    return (lambda: graph.launch(stream)), outs, stream


def capture_on_stream(stream, fn):
    """(graph, fn()) with fn's CuPy work captured into a CUDA graph on ``stream``, which the caller has made
    the current stream. The capture is ended even when fn raises, so the stream stays usable."""
    stream.begin_capture()
    try:
        result = fn()
    except BaseException:
        try:
            stream.end_capture()
        except Exception:  # noqa: BLE001 - the original error matters
            pass
        raise
    return stream.end_capture(), result


def _join(*notes) -> str | None:
    text = "; ".join(n for n in notes if n)
    return text or None


def measure_decode(suite: Suite, case: DecodeCase, impl: str, page_size: int, cfg, env: dict) -> dict:
    """One decode row: max_err of the eager call and of the graph's output, host_us of eager calls, then
    ms = median GPU time of graph replays (``time_queued``); when capture fails, eager calls are timed the
    same way and the note says so. Failures become a row with ``ms: null`` and an ``error``."""
    import contextlib

    shape = dataclasses.replace(case.shape, page_size=page_size)
    ms = max_err = extra = error = host_us = splits = note = None
    timed = outs = replay = None
    try:
        timed = decode_factory_for(impl)(case, page_size)
        splits, note = timed.num_splits, timed.note
        extra, outs = measure_extra_memory(timed)  # also the first call: compiles, fills caches
        extra += timed.scratch_bytes
        try:
            max_err = case.max_err(outs)
        except Exception as exc:  # the reference failing is not the implementation's fault
            if _is_oom(exc):
                free_memory()
        outs = None
        host_us = host_overhead_us(timed.fn, min(cfg.warmup, 3), cfg.reps)
        try:
            replay, outs, stream = capture_graph(timed)
        except Exception as exc:
            if _is_fatal(_error_text(exc)):
                raise
            note = _join(note, f"timed eagerly: graph capture failed ({_error_text(exc)[:80]})")
            replay, outs, stream = timed.fn, None, None
        with stream if stream is not None else contextlib.nullcontext():
            ms = time_queued(replay, cfg.warmup, cfg.reps)
        if outs is not None and max_err is not None:  # the replays' output must be as good as the eager one
            _sync()
            graph_err = case.max_err(outs)
            max_err = max(max_err, graph_err) if math.isfinite(graph_err) else graph_err
    except Exception as exc:
        error = "out of memory" if _is_oom(exc) else _error_text(exc)
        ms = None
    finally:
        timed = outs = replay = None
        try:
            free_memory()
        except Exception:  # a dead context fails even here; the row already says why
            pass
    if max_err is not None and not math.isfinite(max_err):
        max_err = None
        error = error or "output has NaN or inf"
    return make_row(suite, impl, shape, cfg.dtype, ms=ms, max_err=max_err, error=error, extra_mem_bytes=extra,
                    env=env, reps=cfg.reps if ms is not None else None, num_splits=splits, host_us=host_us, note=note)


CASCADE_HEADDIM = 128


def cascade_inputs(batch: int, prefix: int, suffix: int, dtype: str = "bfloat16", seed: int = 0) -> dict:
    """The cascade case's arrays (d = 128, the decode suite's heads, Sq = 1): q, the shared prefix_k /
    prefix_v (prefix, kv_heads, d), each request's suffix_k / suffix_v and their lengths ``lens``, and the
    unshared form: concat_k / concat_v (batch, prefix + suffix, kv_heads, d), each request's own copy of
    the prefix followed by its suffix, with concat_lens."""
    import cupy

    rng = cupy.random.default_rng(seed)
    h, hkv, d = DECODE_HEADS, DECODE_KV_HEADS, CASCADE_HEADDIM

    def rand(*dims):
        return rng.standard_normal(dims, dtype=cupy.float32).astype(dtype)

    x = {"q": rand(batch, 1, h, d), "prefix_k": rand(prefix, hkv, d), "prefix_v": rand(prefix, hkv, d),
         "suffix_k": rand(batch, suffix, hkv, d), "suffix_v": rand(batch, suffix, hkv, d),
         "lens": cupy.full((batch,), suffix, dtype=cupy.int32)}
    for name in ("k", "v"):
        shared = cupy.broadcast_to(x[f"prefix_{name}"], (batch, prefix, hkv, d))
        x[f"concat_{name}"] = cupy.concatenate([shared, x[f"suffix_{name}"]], axis=1)
    x["concat_lens"] = x["lens"] + prefix
    return x


def measure_cascade(suite: Suite, cfg, env: dict) -> list[dict]:
    """The cascade case (``cfg.cascade`` = batch, prefix, suffix; d = 128, Sq = 1, the decode suite's heads):
    ``cuflash.cascade_attention`` over a prefix shared by the batch and each request's suffix, against
    ``flash_attn_with_kvcache`` over each request's own copy of prefix + suffix (no sharing). Two rows,
    GPU time of graph replays and host µs of eager calls as for the decode rows; TB/s counts the K/V
    bytes of the unshared call for both (the cascade's is an effective rate); the cascade row's
    speedup_vs["cuflash-decode"] is the ratio, its max_err the largest difference from the unshared
    call's output."""
    import cupy

    from .api import flash_attn_with_kvcache
    from .cascade import cascade_attention

    batch, prefix, suffix = cfg.cascade
    h, hkv, d = DECODE_HEADS, DECODE_KV_HEADS, CASCADE_HEADDIM
    shape = Shape(batch, h, hkv, 1, prefix + suffix, d, False, page_size=0)
    case = f"cascade case: a {prefix}-key prefix shared by {batch} requests, {suffix} keys each of their own"
    notes = {"cuflash-cascade": f"{case}; TB/s of the unshared K/V bytes",
             "cuflash-decode": f"{case}, each request's prefix copied into its cache (no sharing)"}
    rows, times, error, diff = [], {}, None, None
    try:
        x = cascade_inputs(batch, prefix, suffix, DTYPES.get(cfg.dtype, cfg.dtype), cfg.seed)
        calls = {
            "cuflash-cascade": lambda: (cascade_attention(x["q"], x["prefix_k"], x["prefix_v"], x["suffix_k"],
                                                          x["suffix_v"], cache_seqlens=x["lens"], check=False),),
            "cuflash-decode": lambda: (flash_attn_with_kvcache(x["q"], x["concat_k"], x["concat_v"],
                                                               cache_seqlens=x["concat_lens"], check=False),),
        }
        outs = {name: fn()[0].astype(cupy.float32) for name, fn in calls.items()}
        diff = float(abs(outs["cuflash-cascade"] - outs["cuflash-decode"]).max())
        outs = None
        for name, fn in calls.items():
            host_us = host_overhead_us(fn, min(cfg.warmup, 3), cfg.reps)
            replay, _, stream = capture_graph(DecodeTimed(fn, "cupy"))
            with stream:
                times[name] = (time_queued(replay, cfg.warmup, cfg.reps), host_us)
    except Exception as exc:
        error = "out of memory" if _is_oom(exc) else _error_text(exc)
    finally:
        x = calls = None
        free_memory()
    if diff is not None and not math.isfinite(diff):
        error, diff = "output has NaN or inf", None
    for name in ("cuflash-cascade", "cuflash-decode"):
        ms, host_us = times.get(name, (None, None))
        rows.append(make_row(suite, name, shape, cfg.dtype, ms=ms, env=env, error=None if ms else error or "not run",
                             max_err=diff if name == "cuflash-cascade" else None, reps=cfg.reps if ms else None,
                             host_us=host_us, note=notes[name]))
    if all(r["ms"] for r in rows):
        rows[0]["speedup_vs"]["cuflash-decode"] = rows[1]["ms"] / rows[0]["ms"]
    return rows


def add_speedups(rows: list[dict], cuflash_peers=()) -> None:
    """On the cuflash rows of one shape: speed-up over each peer that ran (peer ms / cuflash ms). Peers are
    the other implementations and the cuflash rows named in ``cuflash_peers`` (never a row over itself)."""
    peers = {r["impl"]: r["ms"] for r in rows
             if (not r["impl"].startswith("cuflash-") or r["impl"] in cuflash_peers) and r["ms"]}
    for row in rows:
        if row["impl"].startswith("cuflash-") and row["ms"]:
            row["speedup_vs"] = {name: peer_ms / row["ms"] for name, peer_ms in peers.items() if name != row["impl"]}


# ----------------------------------------------------------------------------------------------------
# --compare
# ----------------------------------------------------------------------------------------------------

def row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in MATCH_KEYS)


def _metric(row: dict):
    return row.get("tflops") if row.get("tflops") is not None else row.get("tbps")


def load_rows(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):  # tolerate {"rows": [...]}
        data = data.get("rows", [])
    return [r for r in data if isinstance(r, dict)]


def add_deltas(rows: list[dict], old_rows: list[dict]) -> None:
    """Set ``delta_vs_old_pct`` on each row: percent change of TFLOP/s (or TB/s) against the old row of the
    same (suite, impl, dtype, shape, causal); null when either side has no number."""
    old = {row_key(r): r for r in old_rows}
    for row in rows:
        match = old.get(row_key(row))
        new_value, old_value = _metric(row), _metric(match) if match else None
        row["delta_vs_old_pct"] = (100.0 * (new_value / old_value - 1.0)
                                   if new_value is not None and old_value else None)


# ----------------------------------------------------------------------------------------------------
# environment and ceilings
# ----------------------------------------------------------------------------------------------------

def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _driver_version() -> str | None:
    """The display-driver version (e.g. 580.65.06); CUDA's API only knows the CUDA version it supports."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:
        return None


def _module_version(name: str) -> str | None:
    module = sys.modules.get(name)
    return getattr(module, "__version__", None) if module is not None else None


def collect_env() -> dict:
    import cupy

    from . import __version__

    props = device_properties()
    name = props.get("name", b"?")
    major, minor = compute_capability()
    env = {
        "gpu": name.decode() if isinstance(name, bytes) else str(name),
        "sms": props.get("multiProcessorCount"),
        "compute_capability": f"{major}.{minor}",
        "driver": _driver_version(),
        "cuda_driver_api": _cuda_version(cupy.cuda.runtime.driverGetVersion()),
        "cuda_runtime": _cuda_version(cupy.cuda.runtime.runtimeGetVersion()),
        "nvrtc": ".".join(str(x) for x in cupy.cuda.nvrtc.getVersion()),
        "cupy": cupy.__version__,
        "cuflash": __version__,
        "torch": _module_version("torch"),
        "cudnn": None,
        "flash_attn": _module_version("flash_attn"),
        "flashinfer": _module_version("flashinfer"),
        "cudnn_frontend": _module_version("cudnn"),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            v = torch.backends.cudnn.version()
            env["cudnn"] = f"{v // 10000}.{(v % 10000) // 100}.{v % 100}" if v else None
        except Exception:
            pass
    return env


def measure_ceilings(warmup=3, reps=10) -> dict:
    """The roofs the table is read against, measured now on this GPU: a bf16 GEMM 8192^3 through cuBLAS
    (cupy.matmul; torch.matmul if this CuPy has no bf16 GEMM) and a 2 GiB device-to-device copy."""
    import cupy

    ceilings = {"bf16_matmul_tflops": None, "matmul_via": None, "copy_tbps": None, "copy_bytes": None}
    n = 8192
    try:
        a = cupy.random.default_rng(1).standard_normal((n, n), dtype=cupy.float32).astype("bfloat16")
        b = a.T.copy()
        try:
            c = cupy.empty((n, n), dtype=a.dtype)
            ms = time_fn(lambda: cupy.matmul(a, b, out=c), warmup, reps)
            ceilings["matmul_via"] = "cupy.matmul"
        except Exception:
            torch = _torch_if_loaded()
            if torch is None:
                raise
            ta, tb = torch.from_dlpack(a), torch.from_dlpack(b)
            ms = time_fn(lambda: torch.matmul(ta, tb), warmup, reps)
            ceilings["matmul_via"] = "torch.matmul"
        ceilings["bf16_matmul_tflops"] = 2.0 * n ** 3 / (ms * 1e-3) / 1e12
    except Exception as exc:
        ceilings["matmul_error"] = _error_text(exc)
    a = b = c = None
    free_memory()
    nbytes = 2 << 30
    try:
        src = cupy.empty(nbytes, dtype=cupy.uint8)
        src.fill(7)
        dst = cupy.empty_like(src)
        ms = time_fn(lambda: dst.data.copy_from_device_async(src.data, nbytes), warmup, reps)
        ceilings["copy_tbps"] = 2.0 * nbytes / (ms * 1e-3) / 1e12  # bytes read + bytes written
        ceilings["copy_bytes"] = nbytes
    except Exception as exc:
        ceilings["copy_error"] = _error_text(exc)
    src = dst = None
    free_memory()
    return ceilings


def measure_fp8_ceiling(warmup=3, reps=10) -> dict:
    """The fp8 suite's roof, measured now on this GPU: an e4m3 x e4m3 -> bf16 GEMM 8192^3 through
    ``torch._scaled_mm`` (cuBLASLt), unit scales, the second operand column-major (the transpose of a
    row-major (N, K) tensor), as FP8 wgmma wants. ``fp8_matmul_tflops`` uses cuBLAS's fast accumulation
    (the tensor cores' own, as an FP8 attention kernel accumulates); ``fp8_matmul_promoted_tflops`` the
    slower mode that promotes partial sums to fp32 now and then. None with ``fp8_matmul_error`` where torch,
    its FP8 types or an sm_89+ GPU are missing."""
    out = {"fp8_matmul_tflops": None, "fp8_matmul_promoted_tflops": None, "fp8_matmul_via": None}
    if not _importable("torch"):
        out["fp8_matmul_error"] = "torch is not importable: no FP8 GEMM to measure the ceiling with"
        return out
    import torch

    n = 8192
    a = bt = None
    try:
        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
        if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
            raise RuntimeError(f"torch {torch.__version__} has no _scaled_mm / float8_e4m3fn")
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise RuntimeError(f"FP8 GEMMs need sm_89 or newer; this GPU is sm_{major}{minor}")
        gen = torch.Generator(device="cuda").manual_seed(1)
        a, bt = (torch.randn(n, n, device="cuda", generator=gen).to(torch.float8_e4m3fn) for _ in range(2))
        one = torch.ones((), dtype=torch.float32, device="cuda")
        for key, fast in (("fp8_matmul_tflops", True), ("fp8_matmul_promoted_tflops", False)):
            def mm(fast=fast):
                return torch._scaled_mm(a, bt.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)
            ms = time_fn(mm, warmup, reps)
            out[key] = 2.0 * n ** 3 / (ms * 1e-3) / 1e12
        out["fp8_matmul_via"] = "torch._scaled_mm"
    except Exception as exc:
        out["fp8_matmul_error"] = _error_text(exc)
    a = bt = None
    free_memory()
    return out


# ----------------------------------------------------------------------------------------------------
# rendering
# ----------------------------------------------------------------------------------------------------

def _fmt(value, spec: str, missing: str = "—") -> str:
    return missing if value is None else format(value, spec)


def _fmt_bytes(n) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def render_header(env: dict, suite: Suite, cfg):
    from rich.panel import Panel
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    ceil = env.get("ceilings", {})
    peers = ", ".join(f"{k} {env[k]}" for k in ("torch", "cudnn", "cudnn_frontend", "flash_attn", "flashinfer")
                      if env.get(k))
    ceilings = (f"bf16 matmul 8192³ {_fmt(ceil.get('bf16_matmul_tflops'), '.0f')} TFLOP/s "
                f"({ceil.get('matmul_via') or ceil.get('matmul_error', '?')}); "
                f"D2D copy {_fmt(ceil.get('copy_tbps'), '.2f')} TB/s (read + write)")
    if "fp8_matmul_tflops" in ceil:
        ceilings += (f"; e4m3 matmul 8192³ {_fmt(ceil['fp8_matmul_tflops'], '.0f')} TFLOP/s "
                     f"({ceil.get('fp8_matmul_via') or ceil.get('fp8_matmul_error', '?')}; fast accumulation, "
                     f"{_fmt(ceil.get('fp8_matmul_promoted_tflops'), '.0f')} promoted)")
    rows = [
        ("GPU", f"{env['gpu']} (sm_{env['compute_capability'].replace('.', '')}, {env['sms']} SMs)"),
        ("driver / CUDA", f"{env['driver'] or '?'} / driver API {env['cuda_driver_api']}, "
                          f"runtime {env['cuda_runtime']}, NVRTC {env['nvrtc']}"),
        ("cuflash / CuPy", f"{env['cuflash']} / {env['cupy']}"),
        ("peers", peers or "none importable (only naive)"),
        ("ceilings", ceilings),
        ("suite", _suite_line(suite, cfg)),
    ]
    for peer, why in (env.get("skipped_peers") or {}).items():
        rows.append(("skipped", f"{peer}: {why}"))
    for key, value in rows:
        grid.add_row(key, value)
    return Panel(grid, title="cuflash bench", expand=False)


def _suite_line(suite: Suite, cfg) -> str:
    if suite.name == "decode":
        shapes = ", ".join(f"{b}×{n}" for b, n in cfg.decode_shapes)
        return (f"decode (flash_attn_with_kvcache, Sq = 1, {DECODE_HEADS} query / {DECODE_KV_HEADS} KV heads), "
                f"{cfg.dtype}, batch×cache {shapes}; cuflash also paged (pages {', '.join(map(str, cfg.page_sizes))}, "
                f"random order); ms: median of {cfg.reps} CUDA-graph replays after {cfg.warmup}; host µs: eager calls")
    if suite.name == "fp8":
        return (f"fp8 (forward): cuflash-fa3-fp8 on e4m3 inputs quantised once, untimed (cuflash.fp8.quantize from "
                f"the {cfg.dtype} inputs, block {FP8_BLOCK}, Hadamard rotation on q and k), the V transpose inside "
                f"the timed call; peers on the {cfg.dtype} inputs; max err of e4m3 rows against exact attention of "
                f"their dequantised inputs; {cfg.total_tokens} tokens, hidden {cfg.hidden}, "
                f"{_timing_phrase(cfg)}")
    return (f"{suite.name} ({'forward' if suite.mode == 'fwd' else 'backward only'}), {cfg.dtype}, "
            f"{cfg.total_tokens} tokens, hidden {cfg.hidden}, {_timing_phrase(cfg)}")


def _timing_phrase(cfg) -> str:
    rounds = getattr(cfg, "rounds", 1) or 1
    once = f"median of {cfg.reps} after {cfg.warmup} warm-up"
    return once if rounds == 1 else f"median of {rounds} interleaved rounds, each the {once}"


def render_table(suite: Suite, rows: list[dict], title: str, ratio_peers: list[str]):
    """One table for one (headdim, causal) sweep: rows grouped by shape, cuflash rows in bold. The decode
    suite's table also has the page size, the split count and the host µs of an eager call."""
    from rich.markup import escape
    from rich.table import Table

    unit = "TFLOP/s" if suite.metric == "tflops" else "TB/s"
    decode = suite.name == "decode"
    has_delta = any("delta_vs_old_pct" in r for r in rows)
    has_note = any(r["error"] or r.get("note") for r in rows)
    table = Table(title=title, title_justify="left")
    table.add_column("shape (B×cache)" if decode else "shape (B×N×H)")
    table.add_column("impl")
    if decode:
        table.add_column("page", justify="right")
        table.add_column("splits", justify="right")
    table.add_column("ms", justify="right")
    if decode:
        table.add_column("host µs", justify="right")
    table.add_column(unit, justify="right")
    table.add_column("% ceil", justify="right")
    for peer in ratio_peers:
        table.add_column(f"vs {peer}", justify="right")
    table.add_column("max err", justify="right")
    table.add_column("extra mem", justify="right")
    if has_delta:
        table.add_column("Δ vs old", justify="right")
    if has_note:
        table.add_column("note", overflow="fold", max_width=40)

    previous = None
    for row in rows:
        shape = f"{row['batch']}×{row['seqlen_k']}" if decode else f"{row['batch']}×{row['seqlen_q']}×{row['heads']}"
        if previous is not None and shape != previous:
            table.add_section()
        ours = row["impl"].startswith("cuflash-")
        value = _metric(row)
        cells = [shape if shape != previous else "", row["impl"]]
        if decode:
            page = row.get("page_size")
            cells += ["contig" if not page else str(page), _fmt(row.get("num_splits"), "d", "")]
        cells.append(_fmt(row["ms"], ".4f" if decode else ".3f"))
        if decode:
            cells.append(_fmt(row.get("host_us"), ".1f"))
        cells += [_fmt(value, ".2f" if decode else ".1f"), _fmt(row["pct_of_ceiling"], ".0f")]
        for peer in ratio_peers:
            ratio = row["speedup_vs"].get(peer) if ours else None
            cells.append("" if ratio is None else f"[{'green' if ratio >= 1 else 'red'}]×{ratio:.2f}[/]")
        cells += [_fmt(row["max_err"], ".1e"), _fmt_bytes(row["extra_mem_bytes"])]
        if has_delta:
            delta = row.get("delta_vs_old_pct")
            cells.append("" if delta is None else f"[{'green' if delta >= 0 else 'red'}]{delta:+.1f}%[/]")
        if has_note:
            error, note = row["error"] or "", row.get("note") or ""
            cells.append(f"[yellow]{escape(error)}[/]" if error else f"[dim]{escape(note)}[/]" if note else "")
        table.add_row(*cells, style="bold" if ours else None)
        previous = shape
    return table


def save_svg(renderables, path: str, title: str = "cuflash bench") -> None:
    """Re-render the report into a recording console: the live progress bar never ends up in the SVG."""
    from rich.console import Console

    console = Console(record=True, file=io.StringIO(), width=180, force_terminal=True)
    for item in renderables:
        console.print(item)
    console.save_svg(path, title=title)


def write_json(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")


# ----------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------

def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _decode_shape_list(text: str) -> list[tuple[int, int]]:
    """"1x32768,16x8192": (batch, cache length) pairs of the decode suite."""
    pairs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        parts = item.lower().replace("×", "x").split("x")
        try:
            batch, length = (int(p) for p in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected BATCHxCACHE_LEN pairs like 16x8192, got {item!r}")
        if batch <= 0 or length <= 0:
            raise argparse.ArgumentTypeError(f"batch and cache length must be positive, got {item!r}")
        pairs.append((batch, length))
    if not pairs:
        raise argparse.ArgumentTypeError("expected a comma-separated list of BATCHxCACHE_LEN pairs")
    return pairs


def _cascade_case(text: str):
    """"64x32768x512": (batch, prefix keys, suffix keys) of the decode suite's cascade case; "0": none."""
    if text.strip() == "0":
        return ()
    parts = text.lower().replace("×", "x").split("x")
    try:
        batch, prefix, suffix = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxPREFIXxSUFFIX like 64x32768x512 (or 0), got {text!r}")
    if min(batch, prefix, suffix) <= 0:
        raise argparse.ArgumentTypeError(f"batch, prefix and suffix must be positive, got {text!r}")
    return batch, prefix, suffix


def _impl_list(text: str) -> list[str]:
    """Comma list; a bare cuflash implementation name ("fa1") means "cuflash-fa1"."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of implementations")
    return [n if n.startswith("cuflash-") or n in PEERS else f"cuflash-{n}" for n in names]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", choices=sorted(SUITES), default="prefill",
                        help="prefill: forward pass; backward: the backward pass alone; decode: one decoding step "
                             "over a KV cache (flash_attn_with_kvcache); fp8: the FP8 (e4m3) forward against the "
                             "bf16 kernels and an e4m3 matmul ceiling (sm_90) (default: prefill)")
    parser.add_argument("--impls", type=_impl_list, default=None,
                        help="comma list, e.g. cuflash-fa1,torch-cudnn,naive (default: every cuflash "
                             "implementation usable on this GPU plus every peer found)")
    parser.add_argument("--headdims", type=_int_list, default=None, help="comma list (default: 64,128,256)")
    parser.add_argument("--seqlens", type=_int_list, default=None,
                        help="comma list (default: 512,1024,2048,4096,8192,16384)")
    parser.add_argument("--causal", choices=("both", "true", "false"), default="both")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                        help="inputs (fp8 suite: of the peers, and what the e4m3 inputs are quantised from)")
    parser.add_argument("--total-tokens", type=int, default=None,
                        help="tokens per batch: batch = total // seqlen (default: 16384)")
    parser.add_argument("--hidden", type=int, default=None, help="model width: heads = hidden // headdim (default: 2048)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (default: 5)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls; the median is reported (default: 30)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="prefill / backward / fp8: time every implementation of a shape this many times, in "
                             "turn (backwards every other round), and report the median of the rounds; the rows "
                             "keep each round's milliseconds in ms_rounds (default: 1)")
    parser.add_argument("--include-slow", action="store_true",
                        help=f"also run {', '.join(SLOW_PEERS)} at long sequences (skipped by default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", default=None, help="write one row per (shape, impl)")
    parser.add_argument("--compare", metavar="OLD.json", default=None, help="add a change column against an older --json file")
    parser.add_argument("--svg", metavar="PATH", default=None, help="also save the report as an SVG")
    parser.add_argument("--quick", action="store_true", help="a tiny sweep (tests, smoke runs)")
    parser.add_argument("--decode-shapes", type=_decode_shape_list, default=None,
                        help="decode suite: BATCHxCACHE_LEN list (default: 1x32768,16x8192,64x4096,128x2048)")
    parser.add_argument("--page-sizes", type=_int_list, default=None,
                        help="decode suite: page sizes of cuflash's paged-cache rows, besides the contiguous "
                             "cache (default: 1,16,64,256)")
    parser.add_argument("--cascade", type=_cascade_case, default=None,
                        help="decode suite: BATCHxPREFIXxSUFFIX of the cascade case, BATCH requests sharing a "
                             "PREFIX-key prefix with SUFFIX keys each (d = 128); 0 to leave it out "
                             "(default: 64x32768x512)")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill options left unset from the full or the --quick defaults (explicit options always win)."""
    cfg = argparse.Namespace(**vars(args))
    quick = getattr(args, "quick", False)
    defaults = dict(QUICK_DEFAULTS if quick else FULL_DEFAULTS)
    if getattr(args, "suite", None) == "decode":
        defaults.update(DECODE_QUICK_DEFAULTS if quick else DECODE_FULL_DEFAULTS)
    for key, value in defaults.items():
        if getattr(cfg, key, None) is None:
            setattr(cfg, key, list(value) if isinstance(value, list) else value)
    cfg.causals = {"both": [False, True], "true": [True], "false": [False]}[cfg.causal]
    for key in ("total_tokens", "hidden", "reps", "rounds"):
        if getattr(cfg, key) <= 0:
            raise ValueError(f"--{key.replace('_', '-')} must be positive")
    if cfg.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    if getattr(cfg, "suite", None) == "decode":
        for batch, length in cfg.decode_shapes:
            for page in cfg.page_sizes:
                if length % page:
                    raise ValueError(f"--page-sizes: page size {page} does not divide the cache length {length} "
                                     f"(shape {batch}x{length})")
    return cfg


def _offline_check(arch: str) -> int:
    from . import compile_report

    return compile_report.run_offline_check(arch)


class _Sweep:
    """Walks the (headdim, causal) groups of one suite; one table per group. After a kernel fault the CUDA
    context is dead, so every later measurement becomes a "skipped" row instead of a cascade of errors."""

    def __init__(self, suite: Suite, cfg, impls: list[str], env: dict, old_rows, progress, task):
        self.suite, self.cfg, self.impls, self.env, self.old_rows = suite, cfg, impls, env, old_rows
        self.progress, self.task = progress, task
        self.context_lost = None
        self.ratio_peers = [p for p in suite.ratio_peers if p in impls]

    def shape_rows(self, shape: Shape) -> list[dict]:
        suite, cfg = self.suite, self.cfg
        case_type = Fp8Case if suite.name == "fp8" else Case
        case = case_type(shape, cfg.dtype, suite.mode, cfg.seed) if self.context_lost is None else None
        rows = []
        for impl in self.impls:
            self.progress.update(self.task, description=f"{suite.name} d={shape.headdim} "
                                 f"{'causal' if shape.causal else 'full'} {shape.label} {impl}")
            rows.append(self.row_unless_context_lost(impl, shape, lambda: measure(suite, case, impl, cfg, self.env)))
            self.progress.advance(self.task)
        # Further rounds interleave the implementations (backwards every other round), so that a drift of the
        # card's clocks over the shape's minute of timing falls on all of them alike rather than on the last.
        for r in range(1, cfg.rounds if self.context_lost is None else 1):
            order = list(zip(self.impls, rows))
            for impl, row in (order[::-1] if r % 2 else order):
                self.progress.update(self.task, description=f"{suite.name} d={shape.headdim} {shape.label} {impl} "
                                     f"(round {r + 1} of {cfg.rounds})")
                retime(case, impl, row, cfg)
        for row in rows:
            finish_rounds(suite, row)
        case = None
        return self.finish_shape(rows)

    def row_unless_context_lost(self, impl: str, shape: Shape, measure_row) -> dict:
        """``measure_row()``, or a "skipped" row once a kernel fault has killed the CUDA context; a fatal
        error in the measured row marks the context lost for every later one."""
        if self.context_lost is not None:
            return make_row(self.suite, impl, shape, row_dtype(impl, self.cfg.dtype), env=self.env,
                            error=f"skipped: CUDA context lost after {self.context_lost}")
        row = measure_row()
        if _is_fatal(row["error"]):
            self.context_lost = f"{impl} at {shape.label} d={shape.headdim}"
        return row

    def finish_shape(self, rows: list[dict]) -> list[dict]:
        """Frees the shape's memory (while the context lives) and adds the speed-ups over the peers."""
        if self.context_lost is None:
            free_memory()
        add_speedups(rows, self.suite.cuflash_peers)
        return rows

    def group(self, headdim: int, causal: bool):
        """Rows and table of one (headdim, causal) sweep over the sequence lengths."""
        cfg, suite = self.cfg, self.suite
        rows = []
        for shape in attention_shapes(headdim, causal, cfg.seqlens, cfg.total_tokens, cfg.hidden):
            rows += self.shape_rows(shape)
        if self.old_rows is not None:
            add_deltas(rows, self.old_rows)
        unit = "TFLOP/s" if suite.metric == "tflops" else "TB/s"
        dtype = f"e4m3, peers {cfg.dtype}" if suite.name == "fp8" else cfg.dtype
        title = (f"{suite.name} · d={headdim} · {'causal' if causal else 'non-causal'} · {dtype} · "
                 f"{unit}, % of the {CEILING_NAMES[suite.ceiling]} ceiling")
        return rows, render_table(suite, rows, title, self.ratio_peers)

    # decode suite: one table per head dim, rows per (batch, cache length): cuflash on the contiguous cache
    # and each page size, every peer on the contiguous cache

    def decode_entries(self) -> list[tuple[str, int]]:
        """(impl, page_size) measured on every decode shape, in table order."""
        return [(impl, page) for impl in self.impls
                for page in ([0] + list(self.cfg.page_sizes) if impl.startswith("cuflash-") else [0])]

    def decode_shape_rows(self, shape: Shape) -> list[dict]:
        suite, cfg = self.suite, self.cfg
        case = case_error = None
        if self.context_lost is None:
            try:
                case = DecodeCase(shape, cfg.dtype, cfg.seed)
            except Exception as exc:
                case_error = "out of memory" if _is_oom(exc) else _error_text(exc)
        rows = []
        for impl, page in self.decode_entries():
            row_shape = dataclasses.replace(shape, page_size=page)
            self.progress.update(self.task, description=f"decode d={shape.headdim} {row_shape.label} {impl}")
            if case_error is not None and self.context_lost is None:
                rows.append(make_row(suite, impl, row_shape, cfg.dtype, env=self.env, error=f"inputs: {case_error}"))
            else:
                rows.append(self.row_unless_context_lost(
                    impl, row_shape, lambda: measure_decode(suite, case, impl, page, cfg, self.env)))
            self.progress.advance(self.task)
        case = None
        return self.finish_shape(rows)

    def decode_group(self, headdim: int, checkpoint=None):
        """Rows and table of the decode shapes at one head dim; ``checkpoint(rows)`` after each shape."""
        cfg = self.cfg
        rows = []
        for shape in decode_shapes(headdim, cfg.decode_shapes):
            rows += self.decode_shape_rows(shape)
            if checkpoint is not None:
                checkpoint(rows)
        if self.old_rows is not None:
            add_deltas(rows, self.old_rows)
        title = (f"decode · d={headdim} · Sq=1 · {DECODE_HEADS} query / {DECODE_KV_HEADS} KV heads · {cfg.dtype} · "
                 "TB/s of K/V read, % of the copy ceiling · ms per CUDA-graph replay, host µs per eager call")
        return rows, render_table(self.suite, rows, title, self.ratio_peers)


def fp8_gpu_problem() -> str | None:
    """Why the fp8 suite cannot run on this GPU (None when it can): its kernel is sm_90a code."""
    major, minor = compute_capability()
    if (major, minor) < (9, 0):
        return (f"The fp8 suite needs a Hopper GPU (sm_90: the FP8 attention kernel uses FP8 wgmma); this GPU is "
                f"sm_{major}{minor}. Nothing measured.")
    return None


def run(args: argparse.Namespace) -> int:
    if not has_gpu():
        print(OFFLINE_SENTENCE)
        return _offline_check("sm_90a")
    if getattr(args, "suite", None) == "fp8":
        problem = fp8_gpu_problem()
        if problem is not None:
            print(problem)
            return 2

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    try:
        cfg = resolve(args)
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    suite = SUITES[cfg.suite]
    impls = cfg.impls or default_impls(cfg.suite)  # imports torch & co. when present, before collect_env reads versions
    try:
        old_rows = load_rows(cfg.compare) if cfg.compare else None
    except (OSError, ValueError) as exc:
        console.print(f"[red]--compare: cannot read {cfg.compare}: {exc}[/]")
        return 2

    env = collect_env()
    fp8 = suite.name == "fp8"
    with console.status(f"measuring the ceilings (bf16 matmul, D2D copy{', e4m3 matmul' if fp8 else ''})"):
        env["ceilings"] = measure_ceilings()
        if fp8:
            env["ceilings"].update(measure_fp8_ceiling())
    if fp8:
        env["skipped_peers"] = {peer: why for peer, why in fp8_peers()[1].items() if peer not in impls}
    renderables = [render_header(env, suite, cfg)]
    console.print(renderables[0])

    decode = suite.name == "decode"
    if decode:
        groups = [(d, False) for d in cfg.headdims]
        per_group = len(cfg.decode_shapes) * sum(1 + len(cfg.page_sizes) if i.startswith("cuflash-") else 1
                                                 for i in impls)
    else:
        groups = [(d, c) for d in cfg.headdims for c in cfg.causals]
        per_group = len(cfg.seqlens) * len(impls)
    rows: list[dict] = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True)

    def checkpoint(part):  # decode: after every shape, so that a crash later still leaves the finished part
        if cfg.json:
            write_json(cfg.json, rows + part)

    with progress:
        task = progress.add_task("sweep", total=len(groups) * per_group)
        sweep = _Sweep(suite, cfg, impls, env, old_rows, progress, task)
        for headdim, causal in groups:
            group_rows, table = sweep.decode_group(headdim, checkpoint) if decode else sweep.group(headdim, causal)
            progress.console.print(table)
            renderables.append(table)
            rows += group_rows
            if cfg.json:  # after every table, so that a crash later still leaves the finished part
                write_json(cfg.json, rows)

    if decode and cfg.cascade and "cuflash-decode" in impls:
        with console.status("the cascade case: a shared prefix against each request's own copy"):
            cascade_rows = measure_cascade(suite, cfg, env)
        batch, prefix, suffix = cfg.cascade
        table = render_table(suite, cascade_rows, f"decode · cascade · {batch} requests sharing a {prefix}-key "
                             f"prefix, {suffix} keys each · d={CASCADE_HEADDIM} · {cfg.dtype}", ["cuflash-decode"])
        console.print(table)
        renderables.append(table)
        rows += cascade_rows
        if cfg.json:
            write_json(cfg.json, rows)

    if cfg.svg:
        save_svg(renderables, cfg.svg)
    ours = [r for r in rows if r["impl"].startswith("cuflash-") and r["error"]]
    unsupported = [r for r in ours if _is_unsupported(r["error"])]
    failed = [r for r in ours if not _is_unsupported(r["error"])]
    if unsupported:
        console.print(f"{len(unsupported)} cuflash measurement(s) not supported (see the note column).")
    if failed:  # crashes, NaN outputs, out of memory: a cuflash bug, so the exit status says so
        console.print(f"[red]{len(failed)} cuflash measurement(s) failed[/] (see the note column).")
        return 1
    return 0
