"""JAX adapter: differentiable cuflash attention on JAX GPU arrays, eagerly and under ``jax.jit``.

    import jax, jax.numpy as jnp
    from cuflash.jax import flash_attn

    q = jax.random.normal(jax.random.key(0), (2, 1024, 16, 128), jnp.bfloat16)
    k = v = jax.random.normal(jax.random.key(1), (2, 1024, 4, 128), jnp.bfloat16)   # GQA 16:4
    out = flash_attn(q, k, v, causal=True)
    dq, dk, dv = jax.grad(lambda q, k, v: flash_attn(q, k, v, causal=True).astype(jnp.float32).sum(),
                          argnums=(0, 1, 2))(q, k, v)
    jax.jit(lambda q, k, v: flash_attn(q, k, v, causal=True))(q, k, v)

Public function
---------------
``flash_attn(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), impl="auto",
deterministic=False)``
    ``cuflash.flash_attn_func`` as a ``jax.custom_vjp`` function: the forward keeps (q, k, v, out,
    lse) and the backward is ``cuflash.flash_attn_backward``. Layout and masks as in
    ``cuflash.flash_attn_func``: q (batch, seqlen_q, heads, headdim), k/v (batch, seqlen_k, kv_heads,
    headdim), float16 or bfloat16, bottom-right aligned causal mask. Shapes and options are checked
    when the call is traced, with cuflash's messages. ``impl`` picks the forward's kernel family; the
    backward uses the same family where that family's backward takes the call, otherwise "auto".
    ``deterministic=True`` asks the backward for bit-reproducible gradients.
``HAS_BUFFER_CALLBACK``
    Whether the installed JAX has ``jax.experimental.buffer_callback`` (needed under transformations).

What works where
----------------
* Eager (concrete ``jax.Array`` inputs, including ``jax.grad`` / ``jax.vjp`` outside ``jit``, whose
  custom-VJP rules see concrete arrays): the arrays cross to cuflash through DLPack, zero copy.
* Under ``jax.jit`` (and ``vmap``, ``grad`` of a jitted function, ``lax.scan`` ...), i.e. whenever an
  input is a tracer: each call is a ``jax.experimental.buffer_callback``. XLA hands the callback its
  device buffers and its CUDA stream; the callback wraps the buffers as CuPy arrays (no copy), runs
  cuflash on XLA's stream, and writes the results into XLA's output buffers (one device-to-device copy
  of out and lse, or of dq/dk/dv, on that same stream: cuflash's public functions allocate their own
  results). The kernels are ordered with the rest of the XLA program by the stream; nothing
  synchronises with the host. The callback is not marked command-buffer compatible, so XLA does not
  capture it into a CUDA graph.
* ``vmap``: extra leading batch axes are folded into the batch axis (``vmap_method="broadcast_all"``,
  unbatched operands are broadcast first).
* Without ``buffer_callback`` (older JAX) a traced call raises ``RuntimeError`` saying so; eager calls
  still work. There is no ``pure_callback`` fallback: it would copy every operand to the host and back.
* Temporaries (cuflash's own results, the backward's fp32 accumulators) come from CuPy's memory pool,
  outside XLA's allocator. XLA preallocates 75% of GPU memory by default; for large problems set
  ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` or ``XLA_PYTHON_CLIENT_MEM_FRACTION`` so CuPy has room.
* Arrays must be on a CUDA device: CPU arrays are refused with cuflash's message (eager) or a
  ``TypeError`` from the callback (under jit on the CPU backend).

``import cuflash`` never imports JAX; ``import cuflash.jax`` does.
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _validate
from . import api as _api
from ._interop import Spec

try:  # recent JAX releases (0.10 and 0.11 have it); absent in older ones
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # pragma: no cover - depends on the installed JAX
    _buffer_callback = None

__all__ = ["flash_attn", "HAS_BUFFER_CALLBACK"]

HAS_BUFFER_CALLBACK = _buffer_callback is not None

_KDL_CUDA = 2  # DLPack device types
_KDL_CUDA_MANAGED = 13


class _Options(NamedTuple):
    """The static options of one call (hashable: a custom_vjp nondiff argument and a cache key)."""

    causal: bool
    softmax_scale: float | None
    window_size: tuple[int, int]
    impl: str
    deterministic: bool = False


# --------------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------------

def flash_attn(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), impl="auto",
               deterministic=False):
    """Exact attention softmax(scale · q kᵀ) v on JAX GPU arrays; differentiable in q, k and v.

    Returns ``out`` like q. Works eagerly and under ``jax.jit`` / ``vmap`` / ``grad`` (see the module
    docstring). Options as in ``cuflash.flash_attn_func``.
    """
    q, k, v = (x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (q, k, v))
    opts = _check(q, k, v, causal, softmax_scale, window_size, impl, deterministic)
    return _flash_attn(q, k, v, opts)


def _check(q, k, v, causal, softmax_scale, window_size, impl, deterministic=False) -> _Options:
    """cuflash's own argument checks, run on shapes and dtypes at trace time (no device needed)."""
    specs = [_spec(name, x) for name, x in (("q", q), ("k", k), ("v", v))]
    dims = _validate.check_qkv(*specs)
    _validate.softmax_scale_or_default(softmax_scale, dims.headdim)
    _validate.window_bounds(window_size, causal, dims)
    if impl not in tuple(_api.IMPLS) + ("auto",):
        raise ValueError(f"impl must be one of {tuple(_api.IMPLS) + ('auto',)}; got {impl!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool; got {type(deterministic).__name__}")
    scale = None if softmax_scale is None else float(softmax_scale)
    return _Options(causal, scale, (int(window_size[0]), int(window_size[1])), impl, deterministic)


def _spec(name: str, x) -> Spec:
    shape = tuple(int(s) for s in x.shape)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return Spec(name, shape, tuple(reversed(strides)), np.dtype(x.dtype).name, 0, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash_attn(q, k, v, opts):
    out, _ = _forward(q, k, v, opts)
    return out


def _flash_attn_fwd(q, k, v, opts):
    out, lse = _forward(q, k, v, opts)
    return out, (q, k, v, out, lse)


def _flash_attn_bwd(opts, residuals, dout):
    q, k, v, out, lse = residuals
    return _backward(dout, q, k, v, out, lse, opts)


_flash_attn.defvjp(_flash_attn_fwd, _flash_attn_bwd)


def _backward_kwargs(opts: _Options, headdim: int) -> dict:
    """flash_attn_backward's options; the forward's kernel family where its backward runs the call, else
    "auto"."""
    features = _api._features(opts.causal, opts.window_size, 0.0, None, opts.deterministic)
    kwargs = dict(causal=opts.causal, softmax_scale=opts.softmax_scale, window_size=opts.window_size,
                  impl=_api._backward_impl_for(opts.impl, headdim, features))
    if opts.deterministic:  # only when asked, so a cuflash without the option still runs the default
        kwargs["deterministic"] = True
    return kwargs


def _tracer_type():
    tracer = getattr(jax.core, "Tracer", None)
    if tracer is None:  # pragma: no cover - if a JAX release drops the public alias
        from jax._src.core import Tracer as tracer
    return tracer


_Tracer = _tracer_type()


def _is_concrete(*xs) -> bool:
    return all(isinstance(x, jax.Array) and not isinstance(x, _Tracer) for x in xs)


def _forward(q, k, v, opts: _Options):
    """(out, lse): eagerly through DLPack, or as a buffer callback when traced."""
    if _is_concrete(q, k, v):
        return _api.flash_attn_func(q, k, v, causal=opts.causal, softmax_scale=opts.softmax_scale,
                                    window_size=opts.window_size, return_lse=True, impl=opts.impl)
    batch, seqlen_q, heads, _ = q.shape
    results = (jax.ShapeDtypeStruct((batch, seqlen_q, heads, v.shape[-1]), q.dtype),
               jax.ShapeDtypeStruct((batch, heads, seqlen_q), jnp.float32))
    out, lse = _callback("forward", opts, results)(q, k, v)
    return out, lse


def _backward(dout, q, k, v, out, lse, opts: _Options):
    """(dq, dk, dv): eagerly through DLPack, or as a buffer callback when traced."""
    dout = dout.astype(q.dtype)
    if _is_concrete(dout, q, k, v, out, lse):
        return _api.flash_attn_backward(dout, q, k, v, out, lse, **_backward_kwargs(opts, q.shape[-1]))
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    return tuple(_callback("backward", opts, results)(dout, q, k, v, out, lse))


def _callback(direction: str, opts: _Options, results):
    if _buffer_callback is None:
        raise RuntimeError(
            "cuflash.jax.flash_attn was called on traced arrays (under jax.jit, vmap, scan, ...), which needs "
            f"jax.experimental.buffer_callback; this JAX ({jax.__version__}) does not have it. Upgrade JAX, "
            "or call flash_attn eagerly (outside jit) on concrete GPU arrays."
        )
    body = _forward_callback if direction == "forward" else _backward_callback
    return _buffer_callback(_bound(body, opts), results, vmap_method="broadcast_all")


@functools.lru_cache(maxsize=None)
def _bound(body, opts: _Options):
    """One callable per (direction, options), so repeated traces see the same primitive parameters."""
    return functools.partial(body, opts)


# --------------------------------------------------------------------------------------------------
# Inside XLA: the callbacks. Buffers arrive with any extra leading (vmap) axes; they are folded into
# the batch axis, which is free because XLA's buffers are dense row-major.
# --------------------------------------------------------------------------------------------------

def _forward_callback(opts, ctx, outs, q, k, v):
    out_buf, lse_buf = outs
    with _callback_scope(ctx, q):
        qa, ka, va, oa = (_fold_bshd(_device_view(b)) for b in (q, k, v, out_buf))
        la = _fold_bhs(_device_view(lse_buf))
        _forward_into(qa, ka, va, oa, la, opts)


def _backward_callback(opts, ctx, outs, dout, q, k, v, out, lse):
    dq_buf, dk_buf, dv_buf = outs
    with _callback_scope(ctx, q):
        doa, qa, ka, va, oa, dqa, dka, dva = (
            _fold_bshd(_device_view(b)) for b in (dout, q, k, v, out, dq_buf, dk_buf, dv_buf)
        )
        la = _fold_bhs(_device_view(lse))
        _backward_into(doa, qa, ka, va, oa, la, dqa, dka, dva, opts)


def _fold_bshd(a):
    return a.reshape((-1,) + tuple(a.shape[-3:])) if a.ndim != 4 else a


def _fold_bhs(a):
    return a.reshape((-1,) + tuple(a.shape[-2:])) if a.ndim != 3 else a


def _forward_into(qa, ka, va, out, lse, opts: _Options) -> None:
    """Runs cuflash on CuPy arrays on CuPy's current stream and copies the results into out / lse."""
    import cupy

    o, l = _api.flash_attn_func(qa, ka, va, causal=opts.causal, softmax_scale=opts.softmax_scale,
                                window_size=opts.window_size, return_lse=True, impl=opts.impl)
    cupy.copyto(out, o)
    cupy.copyto(lse, l)


def _backward_into(dout, qa, ka, va, oa, lse, dq, dk, dv, opts: _Options) -> None:
    import cupy

    grads = _api.flash_attn_backward(dout, qa, ka, va, oa, lse, **_backward_kwargs(opts, qa.shape[-1]))
    for dst, src in zip((dq, dk, dv), grads):
        cupy.copyto(dst, src)


def _device_view(buf):
    """A CuPy array over an XLA GPU buffer (no copy; valid only during the callback)."""
    import cupy

    dev_type, device = buf.__dlpack_device__()
    if int(dev_type) not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        raise TypeError(
            "cuflash.jax.flash_attn needs its arrays on a CUDA GPU; under jit XLA gave it a buffer on "
            f"DLPack device type {int(dev_type)} (CPU backend?). Put the arrays on the GPU (jax.device_put)."
        )
    ptr = int(buf.__cuda_array_interface__["data"][0])
    shape = tuple(int(s) for s in buf.shape)
    dtype = np.dtype(buf.dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, buf, int(device))
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))


class _StreamHandle:
    """A raw cudaStream_t behind the CUDA stream protocol (for cupy.cuda.Stream.from_external)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _cupy_stream(ptr: int, device: int):
    import cupy

    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14 (ExternalStream is deprecated there)
        return cupy.cuda.Stream.from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device)


@contextlib.contextmanager
def _callback_scope(ctx, first_buffer):
    """Makes the buffer's device and XLA's stream CuPy's current device and stream."""
    import cupy

    device = int(first_buffer.__dlpack_device__()[1])
    stream = ctx.stream
    if callable(stream):  # early buffer_callback releases had a method
        stream = stream()
    with cupy.cuda.Device(device), _cupy_stream(int(stream), device):
        yield
