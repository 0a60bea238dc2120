"""Shared helpers of the GPU tier: random inputs, and a kernel family checked against the fp32
reference by FlashAttention's tolerance rule (forward, or forward + backward)."""
import numpy as np

import cuflash
from cuflash import reference as ref


def inputs(rng, b, sq, sk, h, hkv, d, dtype):
    """q (b, sq, h, d), k and v (b, sk, hkv, d) from N(0, 1), in ``dtype`` on the GPU."""
    import cupy

    def rand(*shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

    return rand(b, sq, h, d), rand(b, sk, hkv, d), rand(b, sk, hkv, d)


def check_forward(impl, q, k, v, *, lse_atol=2e-3, **options):
    """``impl``'s forward (out and LSE) against the reference; ``options``: causal, window_size, softcap,
    alibi_slopes. Returns (out, lse)."""
    out, lse = cuflash.flash_attn_func(q, k, v, return_lse=True, impl=impl, **options)
    o_ref, lse_ref = ref.attention_ref(q, k, v, **options)
    o_low, _ = ref.attention_ref_lowp(q, k, v, **options)
    assert out.dtype == q.dtype and out.shape == q.shape
    ref.check_close("out", out, o_ref, o_low)
    ref.check_close("lse", lse, lse_ref, lse_ref, atol=lse_atol)
    return out, lse


def check_backward(impl, q, k, v, *, deterministic=False, **options):
    """``impl``'s forward + backward, gradients against the reference. Returns (dout, out, lse, grads)."""
    import cupy

    out, lse = cuflash.flash_attn_func(q, k, v, return_lse=True, impl=impl, **options)
    dout = cupy.asarray(np.random.default_rng().standard_normal(q.shape, dtype=np.float32)).astype(q.dtype)
    bwd_options = dict(options, deterministic=True) if deterministic else options
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, impl=impl, **bwd_options)
    grads_ref = ref.attention_ref_backward(dout, q, k, v, **options)
    grads_low = ref.attention_ref_backward_lowp(dout, q, k, v, **options)
    for name, g, g_ref, g_low, like in zip(("dq", "dk", "dv"), grads, grads_ref, grads_low, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype
        ref.check_close(name, g, g_ref, g_low)
    return dout, out, lse, grads
