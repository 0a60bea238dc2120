"""GPU tier: cuflash.cascade_attention against attention over the concatenated keys (prefix + each request's
suffix): the fp32 reference by the tolerance rule, and cuflash's own flash_attn_with_kvcache on caches
holding the concatenation; the causal precondition refused under check=True; torch tensors in and out."""
from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import reference as ref
from cascade_cases import CASES, cascade_inputs

pytestmark = pytest.mark.gpu


def _device(x):
    import cupy

    if x is None:
        return None
    if x.dtype == np.int32:
        return cupy.asarray(x)
    return cupy.asarray(np.asarray(x, np.float32)).astype("bfloat16")  # bf16 values: exact


@pytest.mark.parametrize("case", CASES, ids=[f"b{c[0]}-sq{c[1]}-h{c[2]}-{c[3]}-d{c[4]}-p{c[5]}-{'paged' if c[7] else 'contig'}"
                                             f"-{'causal' if c[8] else 'full'}" for c in CASES])
def test_equals_attention_over_the_concatenation(poison_allocations, case):
    b, sq, h, hkv, d, prefix_len, lens, paged, causal = case
    x = {k: _device(v) if isinstance(v, np.ndarray) else v
         for k, v in cascade_inputs(np.random.default_rng(0), b=b, sq=sq, h=h, hkv=hkv, d=d, prefix_len=prefix_len,
                                    lens=lens, paged=paged).items()}
    out, lse = cuflash.cascade_attention(x["q"], x["prefix_k"], x["prefix_v"], x["k_cache"], x["v_cache"],
                                         cache_seqlens=x["cache_seqlens"], page_table=x["page_table"], causal=causal,
                                         return_softmax_lse=True)
    assert out.shape == x["q"].shape and str(out.dtype) == "bfloat16" and lse.shape == (b, h, sq)
    concat = dict(cache_seqlens=x["concat_seqlens"], causal=causal)
    o_ref, lse_ref, _, _ = ref.kvcache_attention_ref(x["q"], x["concat_k"], x["concat_v"], **concat)
    o_low, _, _, _ = ref.kvcache_attention_ref(x["q"], x["concat_k"], x["concat_v"], lowp=True, **concat)
    ref.check_close("out", out, o_ref, o_low)
    ref.check_close("lse", lse, lse_ref, lse_ref, atol=2e-3)
    # the single-pass kernel over the concatenation agrees within the same rule
    plain = cuflash.flash_attn_with_kvcache(x["q"], x["concat_k"], x["concat_v"], **concat)
    ref.check_close("plain", plain, o_ref, o_low)


def test_causal_needs_the_whole_prefix_visible():
    x = {k: _device(v) if isinstance(v, np.ndarray) else v
         for k, v in cascade_inputs(np.random.default_rng(2), b=2, sq=4, h=4, hkv=2, d=64, prefix_len=32,
                                    lens=(2, 10), paged=False).items()}
    with pytest.raises(ValueError, match="cache_seqlens must be >= seqlen_q - 1"):
        cuflash.cascade_attention(x["q"], x["prefix_k"], x["prefix_v"], x["k_cache"], x["v_cache"],
                                  cache_seqlens=x["cache_seqlens"], causal=True)


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    x = cascade_inputs(np.random.default_rng(3), b=2, sq=1, h=8, hkv=2, d=128, prefix_len=100, lens=(5, 50),
                       paged=False)
    t = {k: torch.from_dlpack(_device(v)) for k, v in x.items() if isinstance(v, np.ndarray)}
    out = cuflash.cascade_attention(t["q"], t["prefix_k"], t["prefix_v"], t["k_cache"], t["v_cache"],
                                    cache_seqlens=t["cache_seqlens"])
    assert isinstance(out, torch.Tensor) and out.shape == t["q"].shape and out.dtype == torch.bfloat16
    o_ref, _, _, _ = ref.kvcache_attention_ref(_device(x["q"]), _device(x["concat_k"]), _device(x["concat_v"]),
                                               cache_seqlens=_device(x["concat_seqlens"]))
    o_low, _, _, _ = ref.kvcache_attention_ref(_device(x["q"]), _device(x["concat_k"]), _device(x["concat_v"]),
                                               cache_seqlens=_device(x["concat_seqlens"]), lowp=True)
    import cupy

    ref.check_close("out", cupy.from_dlpack(out), o_ref, o_low)
