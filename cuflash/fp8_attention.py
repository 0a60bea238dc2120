"""FP8 attention through ``flash_attn_func``: e4m3 q, k, v with per-block descales, on FA3's Hopper kernel.

``flash_attn_func`` hands a call here when ``is_fp8_call`` says it is one; ``forward`` checks it (every
refusal names the argument and says what was expected) and launches ``fa3.forward_fp8``. The inputs are uint8
arrays of OCP float8_e4m3fn bytes with ``fp8_format="e4m3"`` (``cuflash.fp8.quantize`` writes them and their
descales), or torch float8_e4m3fn tensors, viewed as uint8 here because CuPy and DLPack cannot carry fp8.
"""
from __future__ import annotations

import dataclasses
import numbers
import sys

from . import _device, _validate, fa3, fp8
from ._interop import Call
from .fp8 import FORMATS

DEFAULT_DESCALE_BLOCK = (fp8.DEFAULT_BLOCK, fp8.DEFAULT_BLOCK)  # (quantize's block)
IMPLS = ("auto", "fa3")  # the FP8 forward is FA3's kernel
_TORCH_E4M3 = "torch.float8_e4m3fn"
_BYTE_DTYPES = ("uint8", "torch.uint8")  # how uint8 spells itself in CuPy/NumPy/JAX and in torch


_DTYPE_TEXT: dict = {}


def _dtype_text(x) -> str:
    """``str(x.dtype)`` ("" without one), memoised per dtype: numpy builds the string in Python each time, and
    every flash_attn_func call asks for its three inputs' twice."""
    dt = getattr(x, "dtype", None)
    try:
        return _DTYPE_TEXT[dt]
    except KeyError:
        text = _DTYPE_TEXT[dt] = "" if dt is None else str(dt)
        return text
    except TypeError:  # an unhashable dtype object
        return str(dt)


def _is_default_block(descale_block) -> bool:
    return isinstance(descale_block, (tuple, list)) and list(descale_block) == list(DEFAULT_DESCALE_BLOCK)


def is_fp8_call(q, k, v, q_descale, k_descale, v_descale, fp8_format, descale_block) -> bool:
    """Whether ``flash_attn_func`` hands the call to ``forward``: an FP8 argument is given (``fp8_format``, a
    descale, a descale_block other than the default), or q, k or v holds FP8 data -- a float8 dtype, or uint8
    bytes (which ``forward`` refuses without ``fp8_format``, saying so, rather than the fp16/bf16 checks
    refusing uint8 without a word about FP8). Reads only the arguments' ``dtype`` attributes."""
    if fp8_format is not None or any(d is not None for d in (q_descale, k_descale, v_descale)):
        return True
    if not _is_default_block(descale_block):
        return True
    return any("float8" in _dtype_text(x) or _dtype_text(x) in _BYTE_DTYPES for x in (q, k, v))


def _as_bytes(name: str, x):
    """``(x, False)``, or ``(x viewed as uint8, True)`` for a torch float8_e4m3fn tensor. Other float8 dtypes
    are refused: torch's other formats are not e4m3fn, and other frameworks' fp8 arrays cannot cross DLPack."""
    dtype = _dtype_text(x)
    if "float8" not in dtype:
        return x, False
    if dtype == _TORCH_E4M3:
        return x.view(sys.modules["torch"].uint8), True  # a torch tensor: torch is imported
    if dtype.startswith("torch."):
        raise TypeError(f"{name} is a torch tensor of dtype {dtype}; FP8 attention takes e4m3 only: "
                        f"{_TORCH_E4M3} tensors, or uint8 bytes of e4m3 values with fp8_format='e4m3'")
    raise TypeError(f"{name} has dtype {dtype}, which DLPack cannot carry to CuPy: pass the bytes of e4m3 values "
                    "as uint8 with fp8_format='e4m3' (JAX: jax.lax.bitcast_convert_type(x, jnp.uint8))")


def _check_format(fp8_format, torch_fp8: bool) -> str | None:
    """The format of the call: ``fp8_format``, or "e4m3" for torch float8_e4m3fn inputs; None when neither."""
    if fp8_format is None:
        return "e4m3" if torch_fp8 else None
    if not isinstance(fp8_format, str) or fp8_format not in FORMATS:
        raise ValueError(f"fp8_format must be one of {FORMATS} (OCP float8_e4m3fn) or None; got {fp8_format!r}")
    return fp8_format


def _check_descale_block(descale_block) -> tuple[int, int]:
    if (not isinstance(descale_block, (tuple, list)) or len(descale_block) != 2
            or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in descale_block)):
        raise TypeError("descale_block must be a pair of ints (q_block, kv_block): the query rows and the keys "
                        f"that share one descale entry; got {descale_block!r}")
    q_block, kv_block = (int(b) for b in descale_block)
    if q_block < 1 or kv_block < 1:
        raise ValueError(f"descale_block entries must be >= 1; got {(q_block, kv_block)}")
    return q_block, kv_block


def _check_fp8_inputs(qkv, fmt, fp8_format, descales) -> None:
    """q, k and v all uint8 (FP8 bytes), and a format that says what the bytes are. ``descales``: the names of
    the descales given."""
    fp8 = [s for s in qkv if s.dtype == "uint8"]
    if not fp8:
        q = qkv[0]
        if descales:
            raise ValueError(f"{descales[0]} is given but q, k and v are {q.dtype}: descales apply to FP8 inputs "
                             f"only (uint8 e4m3 bytes with fp8_format='e4m3', or {_TORCH_E4M3} tensors)")
        if fp8_format is not None:
            raise TypeError(f"fp8_format={fp8_format!r} says q, k and v hold FP8 bytes, but q is {q.dtype}; FP8 "
                            f"inputs are uint8 arrays of e4m3 bytes (or {_TORCH_E4M3} tensors)")
        raise ValueError(f"descale_block is given but q, k and v are {q.dtype}: it applies to FP8 inputs only")
    for s in qkv:
        if s.dtype != "uint8":
            raise TypeError(f"{s.name} is {s.dtype} but {fp8[0].name} is FP8 (e4m3 bytes): q, k and v must all be "
                            "FP8 (mixing FP8 and other dtypes is not supported)")
    if fmt is None:
        raise TypeError("q, k and v are uint8: pass fp8_format='e4m3' to say that they hold FP8 e4m3 bytes (OCP "
                        "float8_e4m3fn, as cuflash.fp8.quantize writes them)")


def _check_unsupported(dims, *, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, dropout_seed,
                       dropout_offset, impl) -> tuple[float, tuple[int, int]]:
    """The options' usual checks, then a refusal of those the FP8 kernel lacks. Returns (scale, window)."""
    scale = _validate.softmax_scale_or_default(softmax_scale, dims.headdim)
    window = _validate.window_bounds(window_size, causal, dims)
    if tuple(window_size) != (-1, -1):
        raise ValueError(f"window_size={tuple(window_size)} is not supported with FP8 inputs (the FP8 kernel has "
                         "causal masking only); leave it (-1, -1)")
    if _validate.softcap_value(softcap):
        raise ValueError(f"softcap={softcap} is not supported with FP8 inputs; leave it 0")
    if _validate.dropout_args(dropout_p, dropout_seed, dropout_offset) is not None:
        raise ValueError(f"dropout_p={dropout_p} is not supported with FP8 inputs; leave it 0")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes is not supported with FP8 inputs; leave it None")
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} with FP8 inputs (the FP8 forward is FA3's Hopper kernel); "
                         f"got {impl!r}")
    return scale, window


def _check_descale(s, b: int, heads: int, heads_name: str, seqlen: int, seq_name: str, block: int, block_name: str,
                   descale_block, q) -> int:
    """A descale Spec: float32 (batch, heads, 1) or (batch, heads, ceil(seqlen / block)) on q's device.
    Returns its n."""
    if s.dtype != "float32":
        raise TypeError(f"{s.name} must be float32; got {s.dtype}")
    per_block = -(-seqlen // block)
    if len(s.shape) != 3 or s.shape[:2] != (b, heads) or s.shape[2] not in (1, per_block):
        got = "(" + ", ".join(str(n) for n in s.shape) + ")"
        raise ValueError(f"{s.name} must have shape (batch, {heads_name}, 1) = ({b}, {heads}, 1) (one scale per "
                         f"batch entry and head) or (batch, {heads_name}, ceil({seq_name} / {block_name})) = "
                         f"({b}, {heads}, {per_block}) (descale_block={tuple(descale_block)}); got {got}")
    _validate.check_same_device([q, s])
    return s.shape[2]


def launch_blocks(dims, nq: int, nk: int, q_block: int, kv_block: int) -> tuple[int, int]:
    """The (q_block, kv_block) ``fa3.forward_fp8`` gets: the caller's where the descales have one entry per
    block; where they have one entry (n == 1), a block that covers the whole sequence (for K/V a multiple of
    every FP8 key tile: fa3.fp8_whole_sequence_kv_block)."""
    if nq == 1:
        q_block = dims.seqlen_q
    if nk == 1:
        kv_block = fa3.fp8_whole_sequence_kv_block(dims.seqlen_k)
    return q_block, kv_block


def forward(q, k, v, *, q_descale, k_descale, v_descale, fp8_format, descale_block, causal, softmax_scale,
            window_size, softcap, alibi_slopes, dropout_p, dropout_seed, dropout_offset, return_lse, impl):
    """``flash_attn_func`` on FP8 inputs (its docstring describes the arguments)."""
    import cupy

    named, torch_fp8 = [], False
    for name, x in (("q", q), ("k", k), ("v", v)):
        x, viewed = _as_bytes(name, x)
        named.append((name, x))
        torch_fp8 |= viewed
    fmt = _check_format(fp8_format, torch_fp8)
    q_block, kv_block = _check_descale_block(descale_block)
    given = [(n, d) for n, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
             if d is not None]
    with Call(named + given) as call:
        def check():
            spec = {s.name: s for s in call.specs}
            qkv = [spec["q"], spec["k"], spec["v"]]
            _check_fp8_inputs(qkv, fmt, fp8_format, [n for n, _ in given])
            dims = _validate.check_qkv(*qkv, dtypes=_validate.FP8_DTYPES)
            _validate.check_v_headdim_is_q_s(dims, "FP8 attention")
            if dims.headdim not in fa3.FP8_HEADDIMS:
                raise ValueError(f"head dim {dims.headdim} is not supported with FP8 inputs (supported: "
                                 f"{list(fa3.FP8_HEADDIMS)})")
            scale, window = _check_unsupported(
                dims, causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
                impl=impl)

            b, h, hk = dims.batch, dims.heads, dims.kv_heads
            kv_side = (hk, "kv_heads", dims.seqlen_k, "seqlen_k", kv_block, "kv_block")
            sides = {"q_descale": (h, "heads", dims.seqlen_q, "seqlen_q", q_block, "q_block"),
                     "k_descale": kv_side, "v_descale": kv_side}
            n = dict.fromkeys(sides, 1)  # entries per (batch, head); 1 for a descale not given
            for name, _ in given:
                n[name] = _check_descale(spec[name], b, *sides[name], descale_block, spec["q"])
            nk = max(n["k_descale"], n["v_descale"])
            if nk > 1 and kv_block % fa3.FP8_BLOCK_N:
                per_block = "k_descale" if n["k_descale"] > 1 else "v_descale"
                raise ValueError(f"descale_block={(q_block, kv_block)}: kv_block must be a multiple of "
                                 f"{fa3.FP8_BLOCK_N} (the FP8 kernel's key tile) when {per_block} has one scale per "
                                 "block of keys")

            from .api import _supports_arch

            why = _supports_arch(fa3, _device.compute_capability(call.device.id))
            if why is not None:
                raise ValueError(f"FP8 attention runs on FA3's Hopper kernel, which cannot run on q's device "
                                 f"{call.device.id}: {why}")
            launch_q_block, launch_kv_block = launch_blocks(dims, n["q_descale"], nk, q_block, kv_block)
            out_dims = dataclasses.replace(dims, dtype="bfloat16")  # the kernel's dims carry the output's dtype
            return dims, out_dims, scale, window, n["q_descale"], nk, launch_q_block, launch_kv_block

        from .api import _checked

        options = ("fp8 forward", fmt, torch_fp8, q_block, kv_block, tuple(n for n, _ in given), causal,
                   softmax_scale, window_size, softcap, dropout_p, dropout_seed, dropout_offset, impl)
        # (given ALiBi slopes, check() refuses the call every time)
        checked = _checked(call, options, check, alibi_slopes)
        dims, out_dims, scale, window, nq, nk, launch_q_block, launch_kv_block = checked
        b, h, hk = dims.batch, dims.heads, dims.kv_heads
        arr = dict(zip((name for name, _ in named + given), call.arrays))

        def kernel_scale(name, shape):
            """A contiguous fp32 descale of ``shape``: the given one (a per-tensor k or v scale broadcast to
            the other's blocks: the kernel reads one block count for both), or ones."""
            if name not in arr:
                return cupy.ones(shape, dtype=cupy.float32)
            return cupy.ascontiguousarray(cupy.broadcast_to(arr[name], shape))

        q_scale = kernel_scale("q_descale", (b, h, nq))
        k_scale = kernel_scale("k_descale", (b, hk, nk))
        v_scale = kernel_scale("v_descale", (b, hk, nk))
        out = cupy.empty((b, dims.seqlen_q, h, dims.headdim), dtype="bfloat16")
        lse = cupy.empty((b, h, dims.seqlen_q), dtype=cupy.float32)
        fa3.forward_fp8(arr["q"], arr["k"], arr["v"], out, lse, q_scale, k_scale, v_scale, launch_q_block,
                        launch_kv_block, out_dims, window, scale, call.stream)
        return (call.wrap(out), call.wrap(lse)) if return_lse else call.wrap(out)
