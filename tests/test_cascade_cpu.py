"""CPU tier: cuflash.cascade_attention's glue (cuflash.cascade.merge_prefix_and_suffix: the queries of all
requests stacked over the prefix, the suffix pass, the LSE layouts, the merge) run with NumPy references in
place of the kernels, against attention over the concatenated keys; and its prefix checks."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import cascade
from cuflash import reference as ref
from cascade_cases import CASES, cascade_inputs
from test_bad_input_table import Case, _SpecCall, check_refused, spec, spec_env  # noqa: F401 (fixture)


def _kvcache_ref(q, k_cache, v_cache, *, cache_seqlens, page_table=None, softmax_scale=None, causal=False,
                 return_softmax_lse=True, check=True):
    """flash_attn_with_kvcache's result by the fp32 reference (an int cache_seqlens as the kernel takes it)."""
    assert return_softmax_lse and isinstance(check, bool)
    lens = np.full(q.shape[0], cache_seqlens, np.int32) if isinstance(cache_seqlens, int) else cache_seqlens
    out, lse, _, _ = ref.kvcache_attention_ref(q, k_cache, v_cache, cache_seqlens=lens, page_table=page_table,
                                               softmax_scale=softmax_scale, causal=causal)
    return np.asarray(out, np.float32), np.asarray(lse, np.float32)


def _combine_ref(o_part, l_part, *, out_dtype):
    assert o_part.dtype == np.float32 and l_part.dtype == np.float32 and out_dtype == "bfloat16"
    return ref.combine_ref(o_part, l_part)


@pytest.mark.parametrize("case", CASES, ids=[f"b{c[0]}-sq{c[1]}-h{c[2]}-{c[3]}-d{c[4]}-p{c[5]}-{'paged' if c[7] else 'contig'}"
                                             f"-{'causal' if c[8] else 'full'}" for c in CASES])
def test_glue_equals_attention_over_the_concatenation(case):
    b, sq, h, hkv, d, prefix_len, lens, paged, causal = case
    x = cascade_inputs(np.random.default_rng(0), b=b, sq=sq, h=h, hkv=hkv, d=d, prefix_len=prefix_len, lens=lens,
                       paged=paged)
    out, lse = cascade.merge_prefix_and_suffix(
        x["q"], x["prefix_k"], x["prefix_v"], x["k_cache"], x["v_cache"], x["cache_seqlens"], x["page_table"],
        None, causal, True, kvcache=_kvcache_ref, combine=_combine_ref, xp=np)
    want_out, want_lse, _, _ = ref.kvcache_attention_ref(x["q"], x["concat_k"], x["concat_v"],
                                                         cache_seqlens=x["concat_seqlens"], causal=causal)
    assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq)
    np.testing.assert_allclose(out, np.asarray(want_out, np.float64), atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(lse, np.asarray(want_lse, np.float64), atol=2e-6, rtol=1e-6)


def test_glue_can_fail():
    """The comparison above notices a wrong merge: dropping the prefix changes the answer."""
    x = cascade_inputs(np.random.default_rng(1), b=2, sq=1, h=4, hkv=2, d=64, prefix_len=50, lens=(10, 20), paged=False)

    def no_prefix(o_part, l_part, *, out_dtype):
        return ref.combine_ref(o_part[1:], l_part[1:])

    out, _ = cascade.merge_prefix_and_suffix(
        x["q"], x["prefix_k"], x["prefix_v"], x["k_cache"], x["v_cache"], x["cache_seqlens"], None, None, False, True,
        kvcache=_kvcache_ref, combine=no_prefix, xp=np)
    want, _, _, _ = ref.kvcache_attention_ref(x["q"], x["concat_k"], x["concat_v"], cache_seqlens=x["concat_seqlens"])
    assert np.abs(out - np.asarray(want, np.float64)).max() > 1e-2


Q = spec((2, 1, 8, 128))


@pytest.mark.parametrize("pk,pv,exc,words", [
    (spec((2, 100, 2, 128)), spec((100, 2, 128)), ValueError,
     "3 dimensions"),
    (spec((100, 2, 128), "float16"), spec((100, 2, 128), "float16"), TypeError, "q's dtype"),
    (spec((100, 2, 128)), spec((99, 2, 128)), ValueError, "same shape"),
    (spec((0, 2, 128)), spec((0, 2, 128)), ValueError, "at least one key"),
    (spec((100, 2, 64)), spec((100, 2, 64)), ValueError, "head dim"),
    (spec((100, 3, 128)), spec((100, 3, 128)), ValueError, "divide"),
])
def test_prefix_checks(pk, pv, exc, words):
    import dataclasses

    pk, pv = dataclasses.replace(pk, name="prefix_k"), dataclasses.replace(pv, name="prefix_v")
    with pytest.raises(exc, match=words) as info:
        cascade.check_prefix(dataclasses.replace(Q, name="q"), pk, pv)
    assert "prefix_" in str(info.value)


def test_prefix_checks_pass_good_input():
    import dataclasses

    cascade.check_prefix(dataclasses.replace(Q, name="q"), dataclasses.replace(spec((100, 2, 128)), name="prefix_k"),
                         dataclasses.replace(spec((100, 2, 128)), name="prefix_v"))


# ----------------------------------------------------------------------------------------------------
# bad input through the public function (Specs in place of arrays, as tests/test_bad_input_table.py)
# ----------------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _cascade_on_specs(monkeypatch):
    monkeypatch.setattr(cascade, "Call", _SpecCall)


def _cascade_call(q=(2, 1, 8, 128), pk=(100, 2, 128), pv=(100, 2, 128), pdtype="bfloat16", **kw):
    args = dict(cache_seqlens=spec((2,), "int32"))
    args.update(kw)
    return lambda: cascade.cascade_attention(spec(q), spec(pk, pdtype), spec(pv, pdtype), spec((2, 64, 2, 128)),
                                             spec((2, 64, 2, 128)), **args)


BAD = [
    Case("cascade_attention", "q", "rank_3", "spec", _cascade_call(q=(2, 8, 128)), ValueError, ("4 dimensions",)),
    Case("cascade_attention", "prefix_k", "rank_4", "spec", _cascade_call(pk=(1, 100, 2, 128)), ValueError,
         ("3 dimensions",)),
    Case("cascade_attention", "prefix_k", "dtype", "spec", _cascade_call(pdtype="float16"), TypeError, ("q's dtype",)),
    Case("cascade_attention", "prefix_v", "shape", "spec", _cascade_call(pv=(99, 2, 128)), ValueError,
         ("same shape",)),
    Case("cascade_attention", "prefix_k", "empty", "spec", _cascade_call(pk=(0, 2, 128), pv=(0, 2, 128)), ValueError,
         ("at least one key",)),
    Case("cascade_attention", "prefix_k", "headdim", "spec", _cascade_call(pk=(100, 2, 64), pv=(100, 2, 64)),
         ValueError, ("head dim",)),
    Case("cascade_attention", "prefix_k", "kv_heads", "spec", _cascade_call(pk=(100, 3, 128), pv=(100, 3, 128)),
         ValueError, ("divide",)),
    Case("cascade_attention", "check", "not_bool", "spec", _cascade_call(check=1), TypeError, ("bool",)),
    Case("cascade_attention", "cache_seqlens", "causal_short_suffix", "spec",
         _cascade_call(q=(2, 4, 8, 128), cache_seqlens=2, causal=True), ValueError, ("seqlen_q - 1",)),
]


@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
def test_bad_input(case, request):
    check_refused(case, request)
