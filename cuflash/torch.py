"""PyTorch adapter: differentiable cuflash attention on torch CUDA tensors.

    import torch
    from cuflash.torch import flash_attn_func, flash_attn_varlen_func

    q = torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 1024, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)   # GQA 16:4
    v = torch.randn(2, 1024, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=True)
    out.sum().backward()                                  # q.grad, k.grad, v.grad

Public functions
----------------
``flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
alibi_slopes=None, deterministic=False, return_lse=False, impl="auto")``
    ``cuflash.flash_attn_func`` on torch tensors, differentiable with respect to q, k and v. Layout,
    masks and options are those of ``cuflash.flash_attn_func``. With ``return_lse=True`` it returns
    ``(out, lse)``; lse (batch, heads, seqlen_q, float32) is not differentiable (a loss that uses it
    gets no gradient through it). The backward runs ``cuflash.flash_attn_backward`` with the same
    options (softcap, ALiBi and dropout included; ``deterministic=True`` asks it for bit-reproducible
    gradients); an option the installed backward lacks makes the backward raise ``ValueError``, the
    forward alone works. ``impl`` picks the kernel family of the forward; the backward uses the same
    family where that family's backward takes the call (head dim, options), otherwise "auto".
    Positional arguments follow flash-attn's ``flash_attn_func`` (``dropout_p`` fourth), so switching is
    a change of import.
``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_lse=False,
impl="auto", deterministic=False, validate=True)``
    ``cuflash.flash_attn_varlen_func`` on torch tensors (packed sequences: q (total_q, heads, headdim),
    k/v (total_k, kv_heads, headdim), int32 ``cu_seqlens_*`` (batch + 1,) on q's device, Python int
    ``max_seqlen_*``), differentiable with respect to q, k and v through
    ``cuflash.flash_attn_varlen_backward``; argument order as in flash-attn. lse is (heads, total_q)
    float32. ``validate=True`` checks the offsets on the host in the forward (a synchronisation); the
    backward never re-checks them (they are saved for backward, so autograd refuses offsets modified
    in place since the forward).
``flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None, softmax_scale=None, causal=False,
window_size=(-1, -1), softcap=0.0, rotary_interleaved=False, alibi_slopes=None, num_splits=0,
return_softmax_lse=False, *, check=True)``
    ``cuflash.flash_attn_with_kvcache`` on torch tensors (inference, no autograd): appends k/v to the
    (contiguous or paged) cache in place, then attends; flash-attn's positional order, ``page_table``
    standing for its ``block_table`` (``cache_leftpad`` and ``alibi_slopes`` must be None). As the custom
    op ``cuflash::flash_attn_with_kvcache`` it declares k_cache and v_cache mutated.
``use_custom_op(enabled)``
    Switches the ``torch.library`` registration on or off for this process (returns the previous
    setting); ``custom_op_enabled()`` reads it.

Dropout
-------
``dropout_p > 0`` drops attention probabilities (kept ones scaled by 1 / (1 - dropout_p)), as
flash-attn does whenever ``dropout_p > 0``: pass ``dropout_p=p if self.training else 0.0`` from a
module. Each call draws a fresh 63-bit Philox seed from torch's global (default CPU) generator --
``torch.randint(0, 2**63 - 1, ())`` -- and uses dropout offset 0; the seed is a CPU int64 tensor
saved in the autograd context, and the backward regenerates the forward's mask from the same seed
and offset. So ``torch.manual_seed(s)`` makes the masks, outputs and (with ``deterministic=True``)
gradients reproducible, ``torch.random.fork_rng`` and activation checkpointing (which save and
restore the CPU RNG state) replay the same masks, and ``torch.cuda.manual_seed`` alone does not
change them. Under ``torch.compile`` the draw is an ordinary random op of the graph (no graph
break). With ``dropout_p == 0`` (the default) no seed is drawn, the RNG state is untouched and the
calls into cuflash are exactly those without dropout.

Two paths
---------
* Custom ops (default): ``flash_attn_func`` calls ``torch.ops.cuflash.flash_attn_fwd`` (returns out and
  lse), whose ``register_autograd`` backward calls ``torch.ops.cuflash.flash_attn_bwd`` (returns dq,
  dk, dv); ``flash_attn_varlen_func`` likewise calls ``torch.ops.cuflash.flash_attn_varlen_fwd`` /
  ``flash_attn_varlen_bwd``. All have ``register_fake`` implementations (out like q, lse (B, H, Sq)
  -- (H, total_q) for varlen -- float32, grads like q/k/v, all contiguous), so
  ``torch.compile(fullgraph=True)`` traces a model using them without a graph break, forward and
  backward, and ``torch.library.opcheck`` passes on the ops. The dispatcher adds a few microseconds
  per call.
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
import numbers
import os
from typing import Optional

import torch

from . import api as _api

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "use_custom_op", "custom_op_enabled"]

_ENV_SWITCH = "CUFLASH_TORCH_CUSTOM_OP"
_OFF_VALUES = ("0", "false", "off", "no")
_NAMESPACE = "cuflash"
FWD_OP_NAME = f"{_NAMESPACE}::flash_attn_fwd"
BWD_OP_NAME = f"{_NAMESPACE}::flash_attn_bwd"
VARLEN_FWD_OP_NAME = f"{_NAMESPACE}::flash_attn_varlen_fwd"
VARLEN_BWD_OP_NAME = f"{_NAMESPACE}::flash_attn_varlen_bwd"
KVCACHE_OP_NAME = f"{_NAMESPACE}::flash_attn_with_kvcache"
_SEED_HIGH = 2 ** 63 - 1  # dropout seeds are drawn from [0, 2**63 - 1)


def _switch_from_env() -> bool:
    return os.environ.get(_ENV_SWITCH, "1").strip().lower() not in _OFF_VALUES


_use_custom_op = False  # set below, after the ops are (maybe) registered
_fwd_op = None  # torch.ops.cuflash.flash_attn_fwd.default once registered
_bwd_op = None  # torch.ops.cuflash.flash_attn_bwd.default once registered
_varlen_fwd_op = None  # torch.ops.cuflash.flash_attn_varlen_fwd.default once registered
_varlen_bwd_op = None  # torch.ops.cuflash.flash_attn_varlen_bwd.default once registered
_kvcache_op = None  # torch.ops.cuflash.flash_attn_with_kvcache.default once registered


# --------------------------------------------------------------------------------------------------
# The calls into cuflash (shared by both paths). Tensors in, tensors out; run on torch's current stream.
# --------------------------------------------------------------------------------------------------

def _dropout_kwargs(dropout_p, dropout_seed, dropout_offset) -> dict:
    """cuflash's dropout keywords: none at all when dropout_p == 0 (the call is then exactly the one
    without dropout), else p, the seed (an int from the CPU int64 seed tensor) and the offset."""
    if not dropout_p:
        return {}
    seed = None if dropout_seed is None else int(dropout_seed.item())
    return {"dropout_p": float(dropout_p), "dropout_seed": seed, "dropout_offset": int(dropout_offset)}


def _attention_forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, impl,
                       deterministic, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
    """(out, lse) from cuflash; out is a new contiguous tensor like q, lse (B, H, Sq) float32."""
    return _api.flash_attn_func(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, return_lse=True, impl=impl,
        **_dropout_kwargs(dropout_p, dropout_seed, dropout_offset),
    )


def _attention_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
                        alibi_slopes, impl, deterministic, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
    """(dq, dk, dv) from cuflash, each a new contiguous tensor of q's / k's / v's shape."""
    dq, dk, dv = _api.flash_attn_backward(
        _kernel_readable(dout), q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
        window_size=(window_left, window_right),
        impl=_backward_impl(impl, q.shape[-1], causal, window_left, window_right, softcap, alibi_slopes, deterministic,
                            dropout_p),
        **_backward_extras(softcap, alibi_slopes, deterministic),
        **_backward_dropout(_api.flash_attn_backward, dropout_p, dropout_seed, dropout_offset),
    )
    return _standard_contiguous(dq), _standard_contiguous(dk), _standard_contiguous(dv)


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_left, window_right, softcap, alibi_slopes, impl, deterministic, validate,
                    dropout_p=0.0, dropout_seed=None, dropout_offset=0):
    """(out, lse) from cuflash's varlen forward; out a new contiguous tensor like q, lse (H, total_q)."""
    out, lse = _api.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), causal=causal,
        softmax_scale=softmax_scale, window_size=(window_left, window_right), softcap=softcap,
        alibi_slopes=alibi_slopes, return_lse=True, impl=impl, validate=validate,
        **_dropout_kwargs(dropout_p, dropout_seed, dropout_offset),
    )
    return _standard_contiguous(out), _standard_contiguous(lse)


def _varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, impl, deterministic,
                     validate, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
    """(dq, dk, dv) from cuflash's varlen backward, new contiguous tensors of q's / k's / v's shape."""
    backward = _api.flash_attn_varlen_backward
    dq, dk, dv = backward(
        _kernel_readable(dout), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
        int(max_seqlen_k), causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        impl=_backward_impl(impl, q.shape[-1], causal, window_left, window_right, softcap, alibi_slopes, deterministic,
                            dropout_p, varlen=True),
        validate=validate,
        **_backward_extras(softcap, alibi_slopes, deterministic, backward=backward),
        **_backward_dropout(backward, dropout_p, dropout_seed, dropout_offset),
    )
    return _standard_contiguous(dq), _standard_contiguous(dk), _standard_contiguous(dv)


@functools.lru_cache(maxsize=None)
def _backward_parameters(fn) -> frozenset:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return frozenset()


def _unsupported_by_backward(name):
    return ValueError(
        f"cuflash's backward does not support {name} yet: the forward ran with it, but gradients "
        f"cannot be computed. Call without {name}, or without requires_grad."
    )


def _backward_extras(softcap, alibi_slopes, deterministic=False, backward=None) -> dict:
    """softcap / alibi_slopes / deterministic for cuflash's backward (``cuflash.flash_attn_backward``
    unless ``backward`` is given): passed through where it takes them (it then decides), refused here
    with a clear message where it does not have them."""
    params = _backward_parameters(backward if backward is not None else _api.flash_attn_backward)
    extras = {}
    for name, value, is_set in (("softcap", softcap, bool(softcap)),
                                ("alibi_slopes", alibi_slopes, alibi_slopes is not None),
                                ("deterministic", deterministic, bool(deterministic))):
        if name in params:
            extras[name] = value
        elif is_set:
            raise _unsupported_by_backward(name)
    return extras


def _backward_dropout(backward, dropout_p, dropout_seed, dropout_offset) -> dict:
    """The forward's dropout keywords for ``backward`` (none when dropout_p == 0)."""
    kwargs = _dropout_kwargs(dropout_p, dropout_seed, dropout_offset)
    if kwargs and "dropout_p" not in _backward_parameters(backward):
        raise _unsupported_by_backward("dropout")
    return kwargs


def _backward_impl(impl: str, headdim: int, causal, window_left, window_right, softcap, alibi_slopes, deterministic,
                   dropout_p, varlen=False) -> str:
    """The forward's kernel family for the backward where its backward runs this call, else "auto"."""
    features = _api._features(causal, (window_left, window_right), softcap, alibi_slopes, deterministic, varlen,
                              dropout=True if dropout_p else None)
    return _api._backward_impl_for(impl, headdim, features)


def _kernel_readable(t):
    """``t`` itself when the kernels can read its layout (rank 4, or rank 3 for packed varlen
    tensors; last dim contiguous, other strides multiples of 8 elements, 16-byte aligned start), else
    a contiguous copy."""
    if t.dim() in (3, 4):
        shape, strides, last = t.shape, t.stride(), t.dim() - 1
        ok = (shape[last] <= 1 or strides[last] == 1) and all(shape[i] <= 1 or strides[i] % 8 == 0
                                                               for i in range(last))
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
                deterministic, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
        out, lse = _attention_forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                      alibi_slopes, impl, deterministic, dropout_p, dropout_seed, dropout_offset)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, dropout_seed)
        ctx.options = (softmax_scale, causal, window_left, window_right, softcap, impl, deterministic, dropout_p,
                       dropout_offset)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, alibi_slopes, dropout_seed = ctx.saved_tensors
        (softmax_scale, causal, window_left, window_right, softcap, impl, deterministic, dropout_p,
         dropout_offset) = ctx.options
        dq, dk, dv = _attention_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left,
                                         window_right, softcap, alibi_slopes, impl, deterministic, dropout_p,
                                         dropout_seed, dropout_offset)
        return (dq, dk, dv) + (None,) * 11


class _FlashAttnVarlenFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_left, window_right, softcap, alibi_slopes, impl, deterministic, validate, dropout_p,
                dropout_seed, dropout_offset):
        out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                   causal, window_left, window_right, softcap, alibi_slopes, impl, deterministic,
                                   validate, dropout_p, dropout_seed, dropout_offset)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed)
        ctx.options = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, impl,
                       deterministic, dropout_p, dropout_offset)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed = ctx.saved_tensors
        (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, impl, deterministic,
         dropout_p, dropout_offset) = ctx.options
        # validate=False: the forward checked these offsets, and autograd refuses them if modified since.
        dq, dk, dv = _varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                                      alibi_slopes, impl, deterministic, False, dropout_p, dropout_seed,
                                      dropout_offset)
        return (dq, dk, dv) + (None,) * 16


# --------------------------------------------------------------------------------------------------
# Path 2: torch.library custom ops with fake implementations and an autograd formula.
# --------------------------------------------------------------------------------------------------

def _register_ops() -> None:
    """Defines every cuflash custom op (once per process). Each public function registers its ops in
    a ``_register_*`` function listed in ``_REGISTRATIONS``."""
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
    """cuflash::flash_attn_fwd (q, k, v -> out, lse) and cuflash::flash_attn_bwd (-> dq, dk, dv). The
    dropout arguments come last with defaults (no dropout), so calls written before them still work."""
    global _fwd_op, _bwd_op
    Tensor = torch.Tensor

    @torch.library.custom_op(FWD_OP_NAME, mutates_args=())
    def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float], causal: bool,
                       window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                       impl: str, deterministic: bool, dropout_p: float = 0.0,
                       dropout_seed: Optional[Tensor] = None, dropout_offset: int = 0) -> tuple[Tensor, Tensor]:
        return _attention_forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                  alibi_slopes, impl, deterministic, dropout_p, dropout_seed, dropout_offset)

    @flash_attn_fwd.register_fake
    def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, impl,
                  deterministic, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
        batch, seqlen_q, heads, _ = q.shape
        out = q.new_empty((batch, seqlen_q, heads, v.shape[-1]))  # (v's head dim: FA3's forward may differ)
        lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
        return out, lse

    @torch.library.custom_op(BWD_OP_NAME, mutates_args=())
    def flash_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                       softcap: float, alibi_slopes: Optional[Tensor], impl: str, deterministic: bool,
                       dropout_p: float = 0.0, dropout_seed: Optional[Tensor] = None,
                       dropout_offset: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        return _attention_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right,
                                   softcap, alibi_slopes, impl, deterministic, dropout_p, dropout_seed,
                                   dropout_offset)

    @flash_attn_bwd.register_fake
    def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
                  alibi_slopes, impl, deterministic, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def _setup_context(ctx, inputs, output):
        (q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, impl, deterministic,
         dropout_p, dropout_seed, dropout_offset) = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, dropout_seed)
        ctx.options = (softmax_scale, causal, window_left, window_right, softcap, impl, deterministic, dropout_p,
                       dropout_offset)
        ctx.mark_non_differentiable(lse)

    def _backward(ctx, dout, _dlse):
        q, k, v, out, lse, alibi_slopes, dropout_seed = ctx.saved_tensors
        (softmax_scale, causal, window_left, window_right, softcap, impl, deterministic, dropout_p,
         dropout_offset) = ctx.options
        dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
                             alibi_slopes, impl, deterministic, dropout_p, dropout_seed, dropout_offset)
        return (dq, dk, dv) + (None,) * 11

    flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)
    _bwd_op = torch.ops.cuflash.flash_attn_bwd.default
    _fwd_op = torch.ops.cuflash.flash_attn_fwd.default


def _register_flash_attn_varlen() -> None:
    """cuflash::flash_attn_varlen_fwd (q, k, v, cu_seqlens_q/k, max_seqlen_q/k -> out, lse) and
    cuflash::flash_attn_varlen_bwd (-> dq, dk, dv). The maxima are int arguments (SymInt in the
    schema), not tensors."""
    global _varlen_fwd_op, _varlen_bwd_op
    Tensor = torch.Tensor

    @torch.library.custom_op(VARLEN_FWD_OP_NAME, mutates_args=())
    def flash_attn_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                              max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float], causal: bool,
                              window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                              impl: str, deterministic: bool, validate: bool, dropout_p: float = 0.0,
                              dropout_seed: Optional[Tensor] = None,
                              dropout_offset: int = 0) -> tuple[Tensor, Tensor]:
        return _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal, window_left, window_right, softcap, alibi_slopes, impl, deterministic,
                               validate, dropout_p, dropout_seed, dropout_offset)

    @flash_attn_varlen_fwd.register_fake
    def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                         window_left, window_right, softcap, alibi_slopes, impl, deterministic, validate,
                         dropout_p=0.0, dropout_seed=None, dropout_offset=0):
        total_q, heads, _ = q.shape
        out = q.new_empty((total_q, heads, v.shape[-1]))
        lse = q.new_empty((heads, total_q), dtype=torch.float32)
        return out, lse

    @torch.library.custom_op(VARLEN_BWD_OP_NAME, mutates_args=())
    def flash_attn_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                              softcap: float, alibi_slopes: Optional[Tensor], impl: str, deterministic: bool,
                              validate: bool, dropout_p: float = 0.0, dropout_seed: Optional[Tensor] = None,
                              dropout_offset: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        return _varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, impl,
                                deterministic, validate, dropout_p, dropout_seed, dropout_offset)

    @flash_attn_varlen_bwd.register_fake
    def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, impl, deterministic,
                         validate, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def _setup_context(ctx, inputs, output):
        (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
         window_right, softcap, alibi_slopes, impl, deterministic, validate, dropout_p, dropout_seed,
         dropout_offset) = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed)
        ctx.options = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, impl,
                       deterministic, dropout_p, dropout_offset)
        ctx.mark_non_differentiable(lse)

    def _backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed = ctx.saved_tensors
        (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, impl, deterministic,
         dropout_p, dropout_offset) = ctx.options
        # validate=False: the forward checked these offsets, and autograd refuses them if modified since.
        dq, dk, dv = _varlen_bwd_op(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, impl,
                                    deterministic, False, dropout_p, dropout_seed, dropout_offset)
        return (dq, dk, dv) + (None,) * 16

    flash_attn_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)
    _varlen_bwd_op = torch.ops.cuflash.flash_attn_varlen_bwd.default
    _varlen_fwd_op = torch.ops.cuflash.flash_attn_varlen_fwd.default


def _kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, page_table, cache_batch_idx, rotary_cos,
             rotary_sin, rotary_interleaved, softmax_scale, causal, window_left, window_right, softcap, num_splits,
             check):
    """(out, lse) of cuflash.flash_attn_with_kvcache; ``cache_seqlens`` is the tensor, or None with the length
    in ``cache_seqlens_int`` (custom-op schemas take one type per argument)."""
    out, lse = _api.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens_int if cache_seqlens is None else cache_seqlens,
        page_table=page_table, cache_batch_idx=cache_batch_idx, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, num_splits=num_splits, return_softmax_lse=True,
        check=check)
    return out, lse


def _register_flash_attn_with_kvcache() -> None:
    """cuflash::flash_attn_with_kvcache (-> out, lse): inference only (no autograd). It writes the new
    tokens into k_cache and v_cache, so the schema declares them mutated."""
    global _kvcache_op
    Tensor = torch.Tensor

    @torch.library.custom_op(KVCACHE_OP_NAME, mutates_args=("k_cache", "v_cache"))
    def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
                                v: Optional[Tensor], cache_seqlens: Optional[Tensor], cache_seqlens_int: int,
                                page_table: Optional[Tensor], cache_batch_idx: Optional[Tensor],
                                rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], rotary_interleaved: bool,
                                softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                                softcap: float, num_splits: int, check: bool) -> tuple[Tensor, Tensor]:
        return _kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, page_table, cache_batch_idx,
                        rotary_cos, rotary_sin, rotary_interleaved, softmax_scale, causal, window_left, window_right,
                        softcap, num_splits, check)

    @flash_attn_with_kvcache.register_fake
    def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, page_table, cache_batch_idx,
                      rotary_cos, rotary_sin, rotary_interleaved, softmax_scale, causal, window_left, window_right,
                      softcap, num_splits, check):
        batch, seqlen_q, heads, headdim = q.shape
        return q.new_empty((batch, seqlen_q, heads, headdim)), q.new_empty((batch, heads, seqlen_q),
                                                                          dtype=torch.float32)

    _kvcache_op = torch.ops.cuflash.flash_attn_with_kvcache.default


_REGISTRATIONS = (_register_flash_attn, _register_flash_attn_varlen, _register_flash_attn_with_kvcache)
_registered = False


def use_custom_op(enabled: bool) -> bool:
    """Route ``flash_attn_func`` / ``flash_attn_varlen_func`` through the torch.library custom ops
    (True: traceable by torch.compile) or straight through torch.autograd.Functions (False: lowest
    eager overhead). Returns the previous setting. Turning it on registers the ops if
    ``CUFLASH_TORCH_CUSTOM_OP=0`` kept them unregistered."""
    global _use_custom_op
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool; got {type(enabled).__name__}")
    previous = _use_custom_op
    if enabled:
        _register_ops()
    _use_custom_op = enabled
    return previous


def custom_op_enabled() -> bool:
    """Whether ``flash_attn_func`` / ``flash_attn_varlen_func`` currently go through the custom ops."""
    return _use_custom_op


# --------------------------------------------------------------------------------------------------
# Public functions: argument checks, the dropout seed, then one of the two paths.
# --------------------------------------------------------------------------------------------------

def _window_pair(window_size):
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 = unbounded; got {window_size!r}")
    left, right = window_size
    if isinstance(left, bool) or isinstance(right, bool) or not isinstance(left, int) or not isinstance(right, int):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 = unbounded; got {window_size!r}")
    return left, right


def _common_options(softmax_scale, causal, window_size, softcap, deterministic):
    """(softmax_scale, window_left, window_right, softcap) checked and normalised."""
    window_left, window_right = _window_pair(window_size)
    if not isinstance(causal, bool) or not isinstance(deterministic, bool):
        raise TypeError(f"causal and deterministic must be bools; got {type(causal).__name__} and "
                        f"{type(deterministic).__name__}")
    if isinstance(softmax_scale, bool) or isinstance(softcap, bool):
        raise TypeError("softmax_scale and softcap must be floats, not bools")
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    return softmax_scale, window_left, window_right, float(softcap)


def _dropout_p_value(dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1); got {type(dropout_p).__name__}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    return dropout_p


def _draw_dropout_seed():
    """A fresh dropout seed: a CPU int64 scalar tensor in [0, 2**63 - 1) from torch's global (default CPU)
    generator, so ``torch.manual_seed`` reproduces it. A tensor, not an int, so that torch.compile traces
    the draw as a graph op instead of breaking the graph at ``.item()``."""
    return torch.randint(0, _SEED_HIGH, (), dtype=torch.int64, device="cpu")


def _dropout_args(dropout_p):
    """(dropout_p, seed tensor or None, offset) for one call; no draw when dropout_p == 0."""
    dropout_p = _dropout_p_value(dropout_p)
    if dropout_p == 0.0:
        return 0.0, None, 0
    return dropout_p, _draw_dropout_seed(), 0


def _max_seqlen(name, value):
    """A Python int (or a SymInt under torch.compile) >= 0."""
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a Python int (e.g. int(lengths.max())); got {type(value).__name__}")
    value = int(value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}")
    return value


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_lse=False, impl="auto"):
    """Exact attention on torch CUDA tensors, differentiable with respect to q, k and v.

    q (batch, seqlen_q, heads, headdim), k/v (batch, seqlen_k, kv_heads, headdim), fp16 or bf16.
    Returns ``out`` like q, or ``(out, lse)`` with ``return_lse=True`` (lse: (batch, heads, seqlen_q)
    float32, not differentiable). Options as in ``cuflash.flash_attn_func``; ``deterministic=True``
    makes the backward bit-reproducible (``cuflash.flash_attn_backward``). ``dropout_p > 0`` applies
    dropout with a seed drawn from torch's global generator (``torch.manual_seed`` reproduces it; the
    backward reuses it): see the module docstring, also for the custom-op switch and what works under
    ``torch.compile``.
    """
    softmax_scale, window_left, window_right, softcap = _common_options(softmax_scale, causal, window_size, softcap,
                                                                        deterministic)
    dropout_p, dropout_seed, dropout_offset = _dropout_args(dropout_p)
    args = (q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, impl, deterministic,
            dropout_p, dropout_seed, dropout_offset)
    if _use_custom_op:
        out, lse = _fwd_op(*args)
    else:
        out, lse = _FlashAttnFunction.apply(*args)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           return_lse=False, impl="auto", deterministic=False, validate=True):
    """Exact attention over packed variable-length sequences on torch CUDA tensors, differentiable with
    respect to q, k and v.

    q (total_q, heads, headdim), k/v (total_k, kv_heads, headdim), fp16 or bf16; ``cu_seqlens_q`` /
    ``cu_seqlens_k`` int32 (batch + 1,) offsets on the same device (sequence b is rows cu[b] .. cu[b + 1]
    - 1; empty sequences allowed); ``max_seqlen_q`` / ``max_seqlen_k`` Python ints, the longest
    lengths. Returns ``out`` like q, or ``(out, lse)`` with ``return_lse=True`` (lse: (heads, total_q)
    float32, not differentiable); rows after ``cu_seqlens_q[-1]`` get out 0, lse -inf and gradient 0.
    Masks apply per sequence (causal aligned bottom-right within each). Options as in
    ``cuflash.flash_attn_varlen_func``; ``validate=True`` checks the offsets on the host in the forward (a
    synchronisation; the backward never re-checks them). ``dropout_p`` as in ``flash_attn_func``.
    """
    softmax_scale, window_left, window_right, softcap = _common_options(softmax_scale, causal, window_size, softcap,
                                                                        deterministic)
    max_seqlen_q = _max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _max_seqlen("max_seqlen_k", max_seqlen_k)
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool; got {type(validate).__name__}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor (int32, on q's device); got {type(cu).__name__}")
    dropout_p, dropout_seed, dropout_offset = _dropout_args(dropout_p)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
            window_right, softcap, alibi_slopes, impl, deterministic, validate, dropout_p, dropout_seed,
            dropout_offset)
    if _use_custom_op:
        out, lse = _varlen_fwd_op(*args)
    else:
        out, lse = _FlashAttnVarlenFunction.apply(*args)
    return (out, lse) if return_lse else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, page_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=False, alibi_slopes=None,
                            num_splits=0, return_softmax_lse=False, *, check=True):
    """Attention of new queries over a KV cache on torch CUDA tensors (inference: no autograd), appending k
    and v to the cache in place first: ``cuflash.flash_attn_with_kvcache`` (shapes, paged layout,
    rotary, splits, ``check``). Positional order as flash-attn's (``page_table`` in the place of its
    ``block_table``); ``cache_leftpad`` and ``alibi_slopes`` are not supported and must stay None, and
    ``rotary_interleaved`` defaults to False (flash-attn: True). ``cache_seqlens`` is an int32 tensor
    (batch,) or a Python int. Returns ``out`` like q, or ``(out, lse)`` with ``return_softmax_lse=True``
    (lse (batch, heads, seqlen_q) float32). With the custom-op switch on, the call is
    ``torch.ops.cuflash.flash_attn_with_kvcache`` (k_cache and v_cache declared mutated), so
    ``torch.compile(fullgraph=True)`` traces it.
    """
    if cache_leftpad is not None:
        raise ValueError("cache_leftpad is not supported by cuflash: pass None (left-padded caches are not implemented)")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes is not supported by flash_attn_with_kvcache in cuflash: pass None")
    softmax_scale, window_left, window_right, softcap = _common_options(softmax_scale, causal, window_size, softcap,
                                                                        False)
    if cache_seqlens is None:
        raise TypeError("cache_seqlens is required: an int32 tensor (batch,) or a Python int")
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens_tensor, seqlens_int = cache_seqlens, 0
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        seqlens_tensor, seqlens_int = None, int(cache_seqlens)
    else:
        raise TypeError(f"cache_seqlens must be an int32 tensor (batch,) or a Python int; got "
                        f"{type(cache_seqlens).__name__}")
    for name, value in (("rotary_interleaved", rotary_interleaved), ("return_softmax_lse", return_softmax_lse),
                        ("check", check)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int (0 = choose); got {type(num_splits).__name__}")
    args = (q, k_cache, v_cache, k, v, seqlens_tensor, seqlens_int, page_table, cache_batch_idx, rotary_cos,
            rotary_sin, rotary_interleaved, softmax_scale, causal, window_left, window_right, softcap, int(num_splits),
            check)
    out, lse = _kvcache_op(*args) if _use_custom_op else _kvcache(*args)
    return (out, lse) if return_softmax_lse else out


if _switch_from_env():
    use_custom_op(True)
