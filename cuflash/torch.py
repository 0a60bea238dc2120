"""PyTorch adapter: differentiable cuflash attention on torch CUDA tensors.

    import torch
    from cuflash.torch import flash_attn_func

    q = torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 1024, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)   # GQA 16:4
    v = torch.randn(2, 1024, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=True)
    out.sum().backward()                                  # q.grad, k.grad, v.grad

Public functions
----------------
``flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
alibi_slopes=None, return_lse=False, impl="auto", deterministic=False)``
    ``cuflash.flash_attn_func`` on torch tensors, differentiable with respect to q, k and v. Layout,
    masks and options are those of ``cuflash.flash_attn_func``. With ``return_lse=True`` it returns
    ``(out, lse)``; lse (batch, heads, seqlen_q, float32) is not differentiable (a loss that uses it
    gets no gradient through it). The backward runs ``cuflash.flash_attn_backward`` with the same
    options (softcap and ALiBi included; ``deterministic=True`` asks it for bit-reproducible
    gradients); an option the installed backward lacks makes the backward raise ``ValueError``, the
    forward alone works. ``impl`` picks the kernel family of the forward; the backward uses the same
    family where that family has a backward kernel, otherwise "auto".
``use_custom_op(enabled)``
    Switches the ``torch.library`` registration on or off for this process (returns the previous
    setting); ``custom_op_enabled()`` reads it.

Two paths
---------
* Custom ops (default): ``flash_attn_func`` calls ``torch.ops.cuflash.flash_attn_fwd`` (returns out and
  lse), whose ``register_autograd`` backward calls ``torch.ops.cuflash.flash_attn_bwd`` (returns dq,
  dk, dv). Both have ``register_fake`` implementations (out like q, lse (B, H, Sq) float32, grads like
  q/k/v, all contiguous), so ``torch.compile(fullgraph=True)`` traces a model using
  ``flash_attn_func`` without a graph break, forward and backward, and ``torch.library.opcheck`` passes
  on both ops. The dispatcher adds a few microseconds per call.
* Plain ``torch.autograd.Function`` (the switch off): the lowest call overhead in eager mode, but
  ``torch.compile`` cannot trace into it (the call into CuPy is a graph break, so
  ``fullgraph=True`` fails).

The switch: set the environment variable ``CUFLASH_TORCH_CUSTOM_OP=0`` (also ``false``/``off``/``no``)
before ``import cuflash.torch`` and the ops are not even registered; or call
``cuflash.torch.use_custom_op(False)`` / ``use_custom_op(True)`` at any time (turning it on registers
the ops if that has not happened yet). ``torch.compile`` guards on the switch: flipping it makes a
compiled function recompile on its next call (and with the switch off, ``fullgraph=True`` then fails).

Notes
-----
* Kernels run on torch's current CUDA stream (``torch.cuda.stream(s)`` is honoured).
* Outputs and gradients are allocated by CuPy's memory pool and handed to torch through DLPack (zero
  copy); torch's caching allocator does not see them. CUDA-graph capture (``torch.cuda.graphs``,
  ``torch.compile(mode="reduce-overhead")``) of these calls is not supported.
* The output gradient ``dout`` is passed to the kernels as it is when its layout is one they read
  (last dimension contiguous, other strides multiples of 8 elements, 16-byte aligned start), and
  copied to a contiguous tensor otherwise (e.g. the broadcast gradient of ``out.sum()``). q, k and v
  are never copied: a layout the kernels cannot read raises cuflash's error.

``import cuflash`` never imports torch; ``import cuflash.torch`` does.
"""
import functools
import inspect
import os
from typing import Optional

import torch

from . import api as _api

__all__ = ["flash_attn_func", "use_custom_op", "custom_op_enabled"]

_ENV_SWITCH = "CUFLASH_TORCH_CUSTOM_OP"
_OFF_VALUES = ("0", "false", "off", "no")
_NAMESPACE = "cuflash"
FWD_OP_NAME = f"{_NAMESPACE}::flash_attn_fwd"
BWD_OP_NAME = f"{_NAMESPACE}::flash_attn_bwd"


def _switch_from_env() -> bool:
    return os.environ.get(_ENV_SWITCH, "1").strip().lower() not in _OFF_VALUES


_use_custom_op = False  # set below, after the ops are (maybe) registered
_fwd_op = None  # torch.ops.cuflash.flash_attn_fwd.default once registered
_bwd_op = None  # torch.ops.cuflash.flash_attn_bwd.default once registered


# --------------------------------------------------------------------------------------------------
# The calls into cuflash (shared by both paths). Tensors in, tensors out; run on torch's current stream.
# --------------------------------------------------------------------------------------------------

def _attention_forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, impl,
                       deterministic):
    """(out, lse) from cuflash; out is a new contiguous tensor like q, lse (B, H, Sq) float32."""
    return _api.flash_attn_func(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, return_lse=True, impl=impl,
    )


def _attention_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
                        alibi_slopes, impl, deterministic):
    """(dq, dk, dv) from cuflash, each a new contiguous tensor of q's / k's / v's shape."""
    dq, dk, dv = _api.flash_attn_backward(
        _kernel_readable(dout), q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), impl=_backward_impl(impl),
        **_backward_extras(softcap, alibi_slopes, deterministic),
    )
    return _standard_contiguous(dq), _standard_contiguous(dk), _standard_contiguous(dv)


@functools.lru_cache(maxsize=None)
def _backward_parameters(fn) -> frozenset:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return frozenset()


def _backward_extras(softcap, alibi_slopes, deterministic=False) -> dict:
    """softcap / alibi_slopes / deterministic for ``cuflash.flash_attn_backward``: passed through where
    it takes them (it then decides), refused here with a clear message where it does not have them."""
    params = _backward_parameters(_api.flash_attn_backward)
    extras = {}
    for name, value, is_set in (("softcap", softcap, bool(softcap)),
                                ("alibi_slopes", alibi_slopes, alibi_slopes is not None),
                                ("deterministic", deterministic, bool(deterministic))):
        if name in params:
            extras[name] = value
        elif is_set:
            raise ValueError(
                f"cuflash's backward does not support {name} yet: the forward ran with it, but gradients "
                f"cannot be computed. Call without {name}, or without requires_grad."
            )
    return extras


def _backward_impl(impl: str) -> str:
    """The forward's kernel family for the backward where it has a backward kernel, else "auto"."""
    family = getattr(_api, "_FAMILIES", {}).get(impl)
    if family is not None and getattr(family, "BWD_FEATURES", None) is None:
        return "auto"
    return impl


def _kernel_readable(t):
    """``t`` itself when the kernels can read its layout (rank 4, last dim contiguous, other strides
    multiples of 8 elements, 16-byte aligned start), else a contiguous copy."""
    if t.dim() == 4:
        shape, strides = t.shape, t.stride()
        ok = (shape[3] <= 1 or strides[3] == 1) and all(shape[i] <= 1 or strides[i] % 8 == 0 for i in range(3))
        if ok and t.data_ptr() % 16 == 0:
            return t
    return t.clone(memory_format=torch.contiguous_format)


def _standard_contiguous(t):
    """``t`` with the standard row-major strides the fake implementations promise."""
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= max(int(size), 1)
    if tuple(reversed(expected)) == tuple(t.stride()):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


# --------------------------------------------------------------------------------------------------
# Path 1: plain autograd.Function (no dispatcher; not traceable by torch.compile).
# --------------------------------------------------------------------------------------------------

class _FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, impl,
                deterministic):
        out, lse = _attention_forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                      alibi_slopes, impl, deterministic)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
        ctx.options = (softmax_scale, causal, window_left, window_right, softcap, impl, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
        softmax_scale, causal, window_left, window_right, softcap, impl, deterministic = ctx.options
        dq, dk, dv = _attention_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left,
                                         window_right, softcap, alibi_slopes, impl, deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------------
# Path 2: torch.library custom ops with fake implementations and an autograd formula.
# --------------------------------------------------------------------------------------------------

def _register_ops() -> None:
    """Defines every cuflash custom op (once per process). Each public function registers its ops in
    a ``_register_*`` function listed in ``_REGISTRATIONS`` (varlen / kvcache go next to flash_attn)."""
    global _registered
    if _registered:
        return
    if not hasattr(torch.library, "custom_op") or not hasattr(torch.library, "register_fake"):
        raise RuntimeError(
            f"cuflash.torch's custom ops need torch.library.custom_op (torch >= 2.4); this is torch "
            f"{torch.__version__}. Use cuflash.torch.use_custom_op(False) (or {_ENV_SWITCH}=0)."
        )
    for register in _REGISTRATIONS:
        register()
    _registered = True


def _register_flash_attn() -> None:
    """cuflash::flash_attn_fwd (q, k, v -> out, lse) and cuflash::flash_attn_bwd (-> dq, dk, dv)."""
    global _fwd_op, _bwd_op
    Tensor = torch.Tensor

    @torch.library.custom_op(FWD_OP_NAME, mutates_args=())
    def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float], causal: bool,
                       window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                       impl: str, deterministic: bool) -> tuple[Tensor, Tensor]:
        return _attention_forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                  alibi_slopes, impl, deterministic)

    @flash_attn_fwd.register_fake
    def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, impl,
                  deterministic):
        batch, seqlen_q, heads, headdim = q.shape
        out = q.new_empty((batch, seqlen_q, heads, headdim))
        lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
        return out, lse

    @torch.library.custom_op(BWD_OP_NAME, mutates_args=())
    def flash_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                       softcap: float, alibi_slopes: Optional[Tensor], impl: str,
                       deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
        return _attention_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right,
                                   softcap, alibi_slopes, impl, deterministic)

    @flash_attn_bwd.register_fake
    def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
                  alibi_slopes, impl, deterministic):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def _setup_context(ctx, inputs, output):
        q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, impl, deterministic = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
        ctx.options = (softmax_scale, causal, window_left, window_right, softcap, impl, deterministic)
        ctx.mark_non_differentiable(lse)

    def _backward(ctx, dout, _dlse):
        q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
        softmax_scale, causal, window_left, window_right, softcap, impl, deterministic = ctx.options
        dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
                             alibi_slopes, impl, deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None, None

    flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)
    _bwd_op = torch.ops.cuflash.flash_attn_bwd.default
    _fwd_op = torch.ops.cuflash.flash_attn_fwd.default


_REGISTRATIONS = (_register_flash_attn,)
_registered = False


def use_custom_op(enabled: bool) -> bool:
    """Route ``flash_attn_func`` through the torch.library custom ops (True: traceable by torch.compile)
    or straight through a torch.autograd.Function (False: lowest eager overhead). Returns the previous
    setting. Turning it on registers the ops if ``CUFLASH_TORCH_CUSTOM_OP=0`` kept them unregistered."""
    global _use_custom_op
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool; got {type(enabled).__name__}")
    previous = _use_custom_op
    if enabled:
        _register_ops()
    _use_custom_op = enabled
    return previous


def custom_op_enabled() -> bool:
    """Whether ``flash_attn_func`` currently goes through the torch.library custom ops."""
    return _use_custom_op


def _window_pair(window_size):
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 = unbounded; got {window_size!r}")
    left, right = window_size
    if isinstance(left, bool) or isinstance(right, bool) or not isinstance(left, int) or not isinstance(right, int):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 = unbounded; got {window_size!r}")
    return left, right


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, return_lse=False, impl="auto", deterministic=False):
    """Exact attention on torch CUDA tensors, differentiable with respect to q, k and v.

    q (batch, seqlen_q, heads, headdim), k/v (batch, seqlen_k, kv_heads, headdim), fp16 or bf16.
    Returns ``out`` like q, or ``(out, lse)`` with ``return_lse=True`` (lse: (batch, heads, seqlen_q)
    float32, not differentiable). Options as in ``cuflash.flash_attn_func``; ``deterministic=True``
    makes the backward bit-reproducible (``cuflash.flash_attn_backward``). See the module docstring
    for the custom-op switch and what works under ``torch.compile``.
    """
    window_left, window_right = _window_pair(window_size)
    if not isinstance(causal, bool) or not isinstance(deterministic, bool):
        raise TypeError(f"causal and deterministic must be bools; got {type(causal).__name__} and "
                        f"{type(deterministic).__name__}")
    if isinstance(softmax_scale, bool) or isinstance(softcap, bool):
        raise TypeError("softmax_scale and softcap must be floats, not bools")
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    softcap = float(softcap)
    if _use_custom_op:
        out, lse = _fwd_op(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, impl,
                           deterministic)
    else:
        out, lse = _FlashAttnFunction.apply(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                            alibi_slopes, impl, deterministic)
    return (out, lse) if return_lse else out


if _switch_from_env():
    use_custom_op(True)
