"""GPU tier: cuflash.cascade_attention against attention over the concatenated keys (prefix + each request's
suffix): the fp32 reference by the tolerance rule, and cuflash's own flash_attn_with_kvcache on caches
holding the concatenation, with the prefix through the decode kernel and (from 64 query rows per KV head)
through the prefill kernels in chunks; the chunked path captured in a CUDA graph; the causal precondition
refused under check=True; torch tensors in and out."""
from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import api, heuristics
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
def test_equals_attention_over_the_concatenation(poison_allocations, monkeypatch, case):
    b, sq, h, hkv, d, prefix_len, lens, paged, causal = case
    x = {k: _device(v) if isinstance(v, np.ndarray) else v
         for k, v in cascade_inputs(np.random.default_rng(0), b=b, sq=sq, h=h, hkv=hkv, d=d, prefix_len=prefix_len,
                                    lens=lens, paged=paged).items()}
    varlen_calls = []
    varlen = api.flash_attn_varlen_func

    def counted_varlen(*args, **kwargs):
        varlen_calls.append(args)
        return varlen(*args, **kwargs)

    monkeypatch.setattr(api, "flash_attn_varlen_func", counted_varlen)
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
    # the prefix took the path its rows ask for: one prefill call of all its chunks from 64 rows per KV head
    assert len(varlen_calls) == (b * sq * h // hkv >= heuristics.CASCADE_PREFILL_MIN_ROWS)


def test_chunked_prefix_in_a_cuda_graph():
    """With check=False the chunked prefix reads nothing on the host (its chunk offsets are made by device
    kernels), so a call is captured in a CUDA graph; its replay after new suffix keys are written in place
    equals an eager call on them (the same kernels on the same inputs: bitwise)."""
    import cupy

    from cuflash.bench import capture_on_stream

    b, sq, h, hkv, d, prefix_len, lens, paged, _ = CASES[5]  # 64 rows per KV head: the prefix in chunks
    rng = np.random.default_rng(4)
    x = {k: _device(v) if isinstance(v, np.ndarray) else v
         for k, v in cascade_inputs(rng, b=b, sq=sq, h=h, hkv=hkv, d=d, prefix_len=prefix_len, lens=lens,
                                    paged=paged).items()}
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        def call():
            return cuflash.cascade_attention(x["q"], x["prefix_k"], x["prefix_v"], x["k_cache"], x["v_cache"],
                                             cache_seqlens=x["cache_seqlens"], check=False)

        call()  # compiles and loads the kernels outside the capture
        graph, out = capture_on_stream(stream, call)
        x["k_cache"][...] = _device(rng.standard_normal(x["k_cache"].shape, dtype=np.float32))
        graph.launch(stream)
        want = call()
        stream.synchronize()
    assert bool(cupy.array_equal(out, want))


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
