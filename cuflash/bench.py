"""``python -m cuflash bench``: the benchmark report on the local GPU.

One run measures, on the same GPU and in the same process:

* the ceilings: a bf16 dense matmul 8192^3 through cuBLAS (TFLOP/s) and a device-to-device copy of
  2 GiB (bytes read + written, TB/s);
* every cuflash implementation usable on this GPU (``cuflash-fa1``, ``cuflash-fa2``, ...);
* the peers found here: torch SDPA backends (``torch-flash``, ``torch-cudnn``, ``torch-efficient``,
  ``torch-math``), ``flash_attn``, ``flashinfer`` and the materialised ``naive`` attention.

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
)

#: Keys that identify the same measurement across two runs (``--compare``).
MATCH_KEYS = ("suite", "impl", "dtype", "batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "headdim", "causal")

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}

#: Peers that get a "vs <peer>" column in the tables (the JSON carries the ratio to every peer).
TABLE_RATIO_PEERS = ("torch-cudnn", "torch-flash", "flash_attn", "flashinfer", "naive")

#: Peers so slow that they are skipped above this sequence length unless ``--include-slow``.
SLOW_PEERS = {"torch-math": 4096}

# Full sweep and the tiny --quick one. Options given on the command line win over both.
FULL_DEFAULTS = dict(headdims=[64, 128, 256], seqlens=[512, 1024, 2048, 4096, 8192, 16384],
                     total_tokens=16384, hidden=2048, warmup=5, reps=30)
QUICK_DEFAULTS = dict(headdims=[64, 128], seqlens=[256, 1024], total_tokens=2048, hidden=2048, warmup=1, reps=3)

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

    @property
    def label(self) -> str:
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


SUITES = {
    "prefill": Suite("prefill", "fwd", "tflops", "bf16_matmul_tflops",
                     lambda s: flops_attention(s.batch, s.heads, s.seqlen_q, s.seqlen_k, s.headdim, s.causal, "fwd")),
    "backward": Suite("backward", "bwd", "tflops", "bf16_matmul_tflops",
                      lambda s: flops_attention(s.batch, s.heads, s.seqlen_q, s.seqlen_k, s.headdim, s.causal, "bwd")),
}


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
        import cupy

        slicers = (self.slice_q,) if self.mode == "fwd" else (self.slice_q, self.slice_kv, self.slice_kv)
        err = 0.0
        for ref, out, cut in zip(self.reference(), outs, slicers):
            got = cut(_to_cupy(out)).astype(cupy.float32)
            this = float(cupy.max(cupy.abs(got - ref.astype(cupy.float32))))
            if not math.isfinite(this):  # max() would silently drop a NaN
                return this
            err = max(err, this)
        return err


# ----------------------------------------------------------------------------------------------------
# implementations: name -> factory(case) -> Timed (a zero-arg fn to time, returning its outputs)
# ----------------------------------------------------------------------------------------------------

class Timed(NamedTuple):
    fn: Callable[[], tuple]                 # returns (out,) for fwd, (dq, dk, dv) for bwd, layout (B, S, H, D)
    before: Callable[[], None] | None = None  # untimed per-call preparation


def _cuflash_factory(impl: str):
    def make(case: Case) -> Timed:
        from .api import flash_attn_backward, flash_attn_func

        kw = dict(causal=case.shape.causal, softmax_scale=case.scale, impl=impl)
        if case.mode == "fwd":
            return Timed(lambda: (flash_attn_func(case.q, case.k, case.v, **kw),))
        out, lse = flash_attn_func(case.q, case.k, case.v, return_lse=True, **kw)
        return Timed(lambda: tuple(flash_attn_backward(case.dout, case.q, case.k, case.v, out, lse, **kw)))

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


PEERS: dict[str, Callable[[Case], Timed]] = {
    "torch-flash": _sdpa_factory("FLASH_ATTENTION"),
    "torch-cudnn": _sdpa_factory("CUDNN_ATTENTION"),
    "torch-efficient": _sdpa_factory("EFFICIENT_ATTENTION"),
    "torch-math": _sdpa_factory("MATH"),
    "flash_attn": _flash_attn,
    "flashinfer": _flashinfer,
    "naive": _naive,
}


def factory_for(name: str) -> Callable[[Case], Timed]:
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


def default_impls() -> list[str]:
    from .api import available_impls

    return [f"cuflash-{impl}" for impl in available_impls()] + detect_peers()


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
             extra_mem_bytes=None, env=None, reps=None) -> dict:
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
    """Time one implementation on one case; failures become a row with ``ms: null`` and an ``error``."""
    shape = case.shape
    limit = SLOW_PEERS.get(impl)
    if limit is not None and shape.seqlen_q > limit and not cfg.include_slow:
        return make_row(suite, impl, shape, cfg.dtype, error="skipped: too slow", env=env)
    ms = max_err = extra = error = reps = None
    timed = outs = None
    try:
        timed = factory_for(impl)(case)
        extra, outs = measure_extra_memory(timed)  # also the first call: compiles, fills caches
        try:
            max_err = case.max_err(outs)
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
    return make_row(suite, impl, shape, cfg.dtype, ms=ms, max_err=max_err, error=error,
                    extra_mem_bytes=extra, env=env, reps=reps)


def add_speedups(rows: list[dict]) -> None:
    """On the cuflash rows of one shape: speed-up over each peer that ran (peer ms / cuflash ms)."""
    peers = {r["impl"]: r["ms"] for r in rows if not r["impl"].startswith("cuflash-") and r["ms"]}
    for row in rows:
        if row["impl"].startswith("cuflash-") and row["ms"]:
            row["speedup_vs"] = {name: peer_ms / row["ms"] for name, peer_ms in peers.items()}


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
    peers = ", ".join(f"{k} {env[k]}" for k in ("torch", "cudnn", "flash_attn", "flashinfer") if env.get(k))
    for key, value in (
        ("GPU", f"{env['gpu']} (sm_{env['compute_capability'].replace('.', '')}, {env['sms']} SMs)"),
        ("driver / CUDA", f"{env['driver'] or '?'} / driver API {env['cuda_driver_api']}, "
                          f"runtime {env['cuda_runtime']}, NVRTC {env['nvrtc']}"),
        ("cuflash / CuPy", f"{env['cuflash']} / {env['cupy']}"),
        ("peers", peers or "none importable (only naive)"),
        ("ceilings", f"bf16 matmul 8192³ {_fmt(ceil.get('bf16_matmul_tflops'), '.0f')} TFLOP/s "
                     f"({ceil.get('matmul_via') or ceil.get('matmul_error', '?')}); "
                     f"D2D copy {_fmt(ceil.get('copy_tbps'), '.2f')} TB/s (read + write)"),
        ("suite", f"{suite.name} ({'forward' if suite.mode == 'fwd' else 'backward only'}), {cfg.dtype}, "
                  f"{cfg.total_tokens} tokens, hidden {cfg.hidden}, median of {cfg.reps} after {cfg.warmup} warm-up"),
    ):
        grid.add_row(key, value)
    return Panel(grid, title="cuflash bench", expand=False)


def render_table(suite: Suite, rows: list[dict], title: str, ratio_peers: list[str]):
    """One table for one (headdim, causal) sweep: rows grouped by shape, cuflash rows in bold."""
    from rich.table import Table

    unit = "TFLOP/s" if suite.metric == "tflops" else "TB/s"
    has_delta = any("delta_vs_old_pct" in r for r in rows)
    has_note = any(r["error"] for r in rows)
    table = Table(title=title, title_justify="left")
    table.add_column("shape (B×N×H)")
    table.add_column("impl")
    table.add_column("ms", justify="right")
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
        shape = f"{row['batch']}×{row['seqlen_q']}×{row['heads']}"
        if previous is not None and shape != previous:
            table.add_section()
        ours = row["impl"].startswith("cuflash-")
        value = _metric(row)
        cells = [shape if shape != previous else "", row["impl"], _fmt(row["ms"], ".3f"), _fmt(value, ".1f"),
                 _fmt(row["pct_of_ceiling"], ".0f")]
        for peer in ratio_peers:
            ratio = row["speedup_vs"].get(peer) if ours else None
            cells.append("" if ratio is None else f"[{'green' if ratio >= 1 else 'red'}]×{ratio:.2f}[/]")
        cells += [_fmt(row["max_err"], ".1e"), _fmt_bytes(row["extra_mem_bytes"])]
        if has_delta:
            delta = row.get("delta_vs_old_pct")
            cells.append("" if delta is None else f"[{'green' if delta >= 0 else 'red'}]{delta:+.1f}%[/]")
        if has_note:
            error = row["error"] or ""
            cells.append(f"[yellow]{error}[/]" if error else "")
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


def _impl_list(text: str) -> list[str]:
    """Comma list; a bare cuflash implementation name ("fa1") means "cuflash-fa1"."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of implementations")
    return [n if n.startswith("cuflash-") or n in PEERS else f"cuflash-{n}" for n in names]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", choices=sorted(SUITES), default="prefill",
                        help="prefill: forward pass; backward: the backward pass alone (default: prefill)")
    parser.add_argument("--impls", type=_impl_list, default=None,
                        help="comma list, e.g. cuflash-fa1,torch-cudnn,naive (default: every cuflash "
                             "implementation usable on this GPU plus every peer found)")
    parser.add_argument("--headdims", type=_int_list, default=None, help="comma list (default: 64,128,256)")
    parser.add_argument("--seqlens", type=_int_list, default=None,
                        help="comma list (default: 512,1024,2048,4096,8192,16384)")
    parser.add_argument("--causal", choices=("both", "true", "false"), default="both")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--total-tokens", type=int, default=None,
                        help="tokens per batch: batch = total // seqlen (default: 16384)")
    parser.add_argument("--hidden", type=int, default=None, help="model width: heads = hidden // headdim (default: 2048)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (default: 5)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls; the median is reported (default: 30)")
    parser.add_argument("--include-slow", action="store_true",
                        help=f"also run {', '.join(SLOW_PEERS)} at long sequences (skipped by default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", default=None, help="write one row per (shape, impl)")
    parser.add_argument("--compare", metavar="OLD.json", default=None, help="add a change column against an older --json file")
    parser.add_argument("--svg", metavar="PATH", default=None, help="also save the report as an SVG")
    parser.add_argument("--quick", action="store_true", help="a tiny sweep (tests, smoke runs)")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill options left unset from the full or the --quick defaults (explicit options always win)."""
    cfg = argparse.Namespace(**vars(args))
    defaults = QUICK_DEFAULTS if getattr(args, "quick", False) else FULL_DEFAULTS
    for key, value in defaults.items():
        if getattr(cfg, key, None) is None:
            setattr(cfg, key, list(value) if isinstance(value, list) else value)
    cfg.causals = {"both": [False, True], "true": [True], "false": [False]}[cfg.causal]
    for key in ("total_tokens", "hidden", "reps"):
        if getattr(cfg, key) <= 0:
            raise ValueError(f"--{key.replace('_', '-')} must be positive")
    if cfg.warmup < 0:
        raise ValueError("--warmup must be >= 0")
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
        self.ratio_peers = [p for p in TABLE_RATIO_PEERS if p in impls]

    def shape_rows(self, shape: Shape) -> list[dict]:
        suite, cfg = self.suite, self.cfg
        case = Case(shape, cfg.dtype, suite.mode, cfg.seed) if self.context_lost is None else None
        rows = []
        for impl in self.impls:
            self.progress.update(self.task, description=f"{suite.name} d={shape.headdim} "
                                 f"{'causal' if shape.causal else 'full'} {shape.label} {impl}")
            if self.context_lost is not None:
                rows.append(make_row(suite, impl, shape, cfg.dtype, env=self.env,
                                     error=f"skipped: CUDA context lost after {self.context_lost}"))
            else:
                rows.append(measure(suite, case, impl, cfg, self.env))
                if _is_fatal(rows[-1]["error"]):
                    self.context_lost = f"{impl} at {shape.label} d={shape.headdim}"
            self.progress.advance(self.task)
        case = None
        if self.context_lost is None:
            free_memory()
        add_speedups(rows)
        return rows

    def group(self, headdim: int, causal: bool):
        """Rows and table of one (headdim, causal) sweep over the sequence lengths."""
        cfg, suite = self.cfg, self.suite
        rows = []
        for shape in attention_shapes(headdim, causal, cfg.seqlens, cfg.total_tokens, cfg.hidden):
            rows += self.shape_rows(shape)
        if self.old_rows is not None:
            add_deltas(rows, self.old_rows)
        unit, roof = ("TFLOP/s", "matmul") if suite.metric == "tflops" else ("TB/s", "copy")
        title = (f"{suite.name} · d={headdim} · {'causal' if causal else 'non-causal'} · {cfg.dtype} · "
                 f"{unit}, % of the {roof} ceiling")
        return rows, render_table(suite, rows, title, self.ratio_peers)


def run(args: argparse.Namespace) -> int:
    if not has_gpu():
        print(OFFLINE_SENTENCE)
        return _offline_check("sm_90a")

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    try:
        cfg = resolve(args)
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    suite = SUITES[cfg.suite]
    impls = cfg.impls or default_impls()  # imports torch & co. when present, before collect_env reads versions
    try:
        old_rows = load_rows(cfg.compare) if cfg.compare else None
    except (OSError, ValueError) as exc:
        console.print(f"[red]--compare: cannot read {cfg.compare}: {exc}[/]")
        return 2

    env = collect_env()
    with console.status("measuring the ceilings (bf16 matmul, D2D copy)"):
        env["ceilings"] = measure_ceilings()
    renderables = [render_header(env, suite, cfg)]
    console.print(renderables[0])

    groups = [(d, c) for d in cfg.headdims for c in cfg.causals]
    rows: list[dict] = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True)
    with progress:
        task = progress.add_task("sweep", total=len(groups) * len(cfg.seqlens) * len(impls))
        sweep = _Sweep(suite, cfg, impls, env, old_rows, progress, task)
        for headdim, causal in groups:
            group_rows, table = sweep.group(headdim, causal)
            progress.console.print(table)
            renderables.append(table)
            rows += group_rows
            if cfg.json:  # after every table, so that a crash later still leaves the finished part
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
