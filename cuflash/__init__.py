"""cuflash: FlashAttention-family kernels in CUDA C, compiled at run time by NVRTC through CuPy.

Public API (flash-attn compatible names)::

    out = cuflash.flash_attn_func(q, k, v, causal=True)
    out, lse = cuflash.flash_attn_func(q, k, v, return_lse=True)
    dq, dk, dv = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)  # decoding
    plan = cuflash.plan_kvcache(q, k_cache, v_cache, cache_seqlens=lens, out=out)  # ... then each step:
    plan.run(q, k_cache, v_cache, cache_seqlens=lens, out=out)  # the same call, a fraction of the host time
    out = cuflash.cascade_attention(q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens=lens)  # shared prefix
    data, descale = cuflash.fp8.quantize(q, block=256, hadamard=True, seed=0)  # FP8 e4m3 inputs
    out = cuflash.flash_attn_func(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs, fp8_format="e4m3")  # Hopper

Arrays are (batch, seqlen, heads, headdim), fp16 or bf16, CuPy arrays or anything with ``__dlpack__``
(torch, JAX); results come back in the caller's framework.
"""
__version__ = "0.1.0"

from .api import (IMPLS, available_impls, flash_attn_backward, flash_attn_func,  # noqa: E402,F401
                  flash_attn_varlen_backward, flash_attn_varlen_func)
from .api import clear_plans, flash_attn_combine, flash_attn_with_kvcache  # noqa: E402,F401
from .cascade import cascade_attention  # noqa: E402,F401
from .decode_plan import DecodePlan, plan_kvcache  # noqa: E402,F401
from . import fp8  # noqa: E402,F401  (cuflash.fp8.quantize: FP8 e4m3 quantisation with a Hadamard rotation)

__all__ = ["flash_attn_func", "flash_attn_backward", "flash_attn_varlen_func", "flash_attn_varlen_backward",
           "flash_attn_with_kvcache", "flash_attn_combine", "plan_kvcache", "DecodePlan", "cascade_attention",
           "available_impls", "IMPLS", "fp8", "__version__"]
