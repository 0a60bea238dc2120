"""CPU tier: cuflash.cascade_attention's glue (cuflash.cascade.merge_prefix_and_suffix: the queries of all
requests over the prefix, through the decode kernel in one pass or the prefill kernels in chunks, the suffix
pass, the LSE layouts, the merge) run with NumPy references in place of the kernels, against attention over
the concatenated keys; the choice between the two prefix paths and the chunk length; its prefix checks."""
from __future__ import annotations

import inspect
import itertools
import sys
from unittest import mock

import numpy as np
import pytest

import cuflash
from cuflash import _device, cascade, decode, fa2, heuristics
from cuflash import reference as ref
from cascade_cases import CASES, cascade_inputs
from test_decode_cpu import vals
from test_bad_input_table import Case, _ReachedKernel, _SpecCall, check_refused, spec, spec_env  # noqa: F401 (fixture)


def _kvcache_ref(q, k_cache, v_cache, *, cache_seqlens, page_table=None, softmax_scale=None, causal=False,
                 return_softmax_lse=True, check=True):
    """flash_attn_with_kvcache's result by the fp32 reference (an int cache_seqlens as the kernel takes it)."""
    assert return_softmax_lse and isinstance(check, bool)
    lens = np.full(q.shape[0], cache_seqlens, np.int32) if isinstance(cache_seqlens, int) else cache_seqlens
    out, lse, _, _ = ref.kvcache_attention_ref(q, k_cache, v_cache, cache_seqlens=lens, page_table=page_table,
                                               softmax_scale=softmax_scale, causal=causal)
    return np.asarray(out, np.float32), np.asarray(lse, np.float32)


def _varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
                causal=False, return_lse=False, validate=True):
    """flash_attn_varlen_func's result by the fp32 reference, sequence by sequence: out (total_q, heads, d),
    lse (heads, total_q). Checks first what the glue promises the kernels with validate=False: int32
    offsets from 0 to the arrays' ends, the stated maxima, no empty sequence."""
    assert return_lse and not causal and validate is False
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == np.int32 and cu_seqlens_q.shape == cu_seqlens_k.shape
    lens_q, lens_k = np.diff(cu_seqlens_q), np.diff(cu_seqlens_k)
    assert cu_seqlens_q[0] == cu_seqlens_k[0] == 0 and lens_q.min() > 0 and lens_k.min() > 0
    assert (cu_seqlens_q[-1], cu_seqlens_k[-1]) == (q.shape[0], k.shape[0])
    assert (lens_q.max(), lens_k.max()) == (max_seqlen_q, max_seqlen_k)
    out = np.empty(q.shape, np.float32)
    lse = np.empty((q.shape[1], q.shape[0]), np.float32)
    for qa, qb, ka, kb in zip(cu_seqlens_q[:-1], cu_seqlens_q[1:], cu_seqlens_k[:-1], cu_seqlens_k[1:]):
        o, l_ = ref.attention_ref(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], softmax_scale=softmax_scale)
        out[qa:qb], lse[:, qa:qb] = o[0], l_[0]
    return out, lse


def _combine_ref(o_part, l_part, *, out_dtype):
    assert o_part.dtype == np.float32 and l_part.dtype == np.float32 and out_dtype == "bfloat16"
    return ref.combine_ref(o_part, l_part)


class _Recorder:
    """A stand-in kernel function that records the arguments of each call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.fn(*args, **kwargs)


def _case_id(c):
    b, sq, h, hkv, d, prefix_len, _, paged, causal = c
    return (f"b{b}-sq{sq}-h{h}-{hkv}-d{d}-p{prefix_len}-{'paged' if paged else 'contig'}"
            f"-{'causal' if causal else 'full'}")


def _merge(x, causal, prefix_chunk, *, kvcache=_kvcache_ref, varlen=_varlen_ref, combine=_combine_ref):
    return cascade.merge_prefix_and_suffix(
        x["q"], x["prefix_k"], x["prefix_v"], x["k_cache"], x["v_cache"], x["cache_seqlens"], x["page_table"],
        None, causal, True, prefix_chunk=prefix_chunk, kvcache=kvcache, varlen=varlen, combine=combine, xp=np)


# None: the prefix through the decode kernel; else keys per chunk through the prefill kernels: 64 to 1000
# keys make 1 to 66 chunks of the cases' prefixes, most of them with a shorter last chunk (300 = 4 x 64 + 44,
# 1000 = 7 x 128 + 104, 129 = 2 x 64 + 1), some not (64 = 64, 300 = 3 x 100), and 10**6 one chunk.
CHUNKS = [None, 64, 100, 128, 10 ** 6]


@pytest.mark.parametrize("prefix_chunk", CHUNKS, ids=lambda c: "decode" if c is None else f"chunk{c}")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_glue_equals_attention_over_the_concatenation(case, prefix_chunk):
    b, sq, h, hkv, d, prefix_len, lens, paged, causal = case
    x = cascade_inputs(np.random.default_rng(0), b=b, sq=sq, h=h, hkv=hkv, d=d, prefix_len=prefix_len, lens=lens,
                       paged=paged)
    kvcache, varlen = _Recorder(_kvcache_ref), _Recorder(_varlen_ref)
    out, lse = _merge(x, causal, prefix_chunk, kvcache=kvcache, varlen=varlen)
    want_out, want_lse, _, _ = ref.kvcache_attention_ref(x["q"], x["concat_k"], x["concat_v"],
                                                         cache_seqlens=x["concat_seqlens"], causal=causal)
    assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq)
    np.testing.assert_allclose(out, np.asarray(want_out, np.float64), atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(lse, np.asarray(want_lse, np.float64), atol=2e-6, rtol=1e-6)
    # the path asked for: the decode kernel twice (prefix, suffix), or once with one prefill call of the
    # chunks, GQA packed into rows (kv_heads heads, b * sq * h / kv_heads rows per chunk)
    assert len(kvcache.calls) == (2 if prefix_chunk is None else 1)
    assert len(varlen.calls) == (prefix_chunk is not None)
    if prefix_chunk is not None:
        (q_chunks, _, _, cu_q, cu_k, rows, _), _ = varlen.calls[0]
        parts = -(-prefix_len // prefix_chunk)
        assert rows == b * sq * h // hkv and q_chunks.shape == (parts * rows, hkv, d) and len(cu_k) == parts + 1


def test_glue_can_fail():
    """The comparison above notices a wrong merge: dropping the prefix changes the answer, and so does
    dropping the last chunk of it."""
    x = cascade_inputs(np.random.default_rng(1), b=2, sq=1, h=4, hkv=2, d=64, prefix_len=50, lens=(10, 20), paged=False)
    want, _, _, _ = ref.kvcache_attention_ref(x["q"], x["concat_k"], x["concat_v"], cache_seqlens=x["concat_seqlens"])

    def no_prefix(o_part, l_part, *, out_dtype):
        return ref.combine_ref(o_part[1:], l_part[1:])

    def no_last_chunk(*args, **kwargs):
        out, lse = _varlen_ref(*args, **kwargs)
        lse[:, -args[5]:] = -np.inf  # the last sequence (max_seqlen_q rows) weighs nothing in the merge
        return out, lse

    out, _ = _merge(x, False, None, combine=no_prefix)
    assert np.abs(out - np.asarray(want, np.float64)).max() > 1e-2
    out, _ = _merge(x, False, 20, varlen=no_last_chunk)
    assert np.abs(out - np.asarray(want, np.float64)).max() > 1e-2


# ----------------------------------------------------------------------------------------------------
# which prefix path, and the chunk length
# ----------------------------------------------------------------------------------------------------

def test_chunks_at_issue_6s_shape():
    """64 requests x 1 query x 4 heads per KV head = 256 rows, 8 KV heads, a 32k prefix, 132 SMs: 16 chunks
    of 2048 keys, 2 tiles of 128 rows x 8 KV heads each, 256 tiles for 2 x 132 places."""
    assert heuristics.cascade_prefix_chunk(256, 8, 32768, 132) == 2048


def test_chunk_rule():
    """Tile-aligned chunks; at most 2 x SMs tiles unless one chunk has more; chunks of 512 keys or more
    unless there is one; and as many chunks as those two bounds allow, fewer only where the alignment
    lengthens the chunks."""
    align, min_chunk = heuristics.CASCADE_CHUNK_ALIGN, heuristics.CASCADE_MIN_CHUNK
    for rows, kv_heads, prefix_len, sms in itertools.product((64, 100, 256, 1000, 40000), (1, 2, 8, 32),
                                                             (1, 127, 511, 512, 1000, 4224, 32768, 10 ** 6),
                                                             (1, 2, 108, 132)):
        chunk = heuristics.cascade_prefix_chunk(rows, kv_heads, prefix_len, sms)
        parts = -(-prefix_len // chunk)
        tiles_per_chunk = -(-rows // 128) * kv_heads
        bound = max(1, min(2 * sms // tiles_per_chunk, prefix_len // min_chunk))
        where = (rows, kv_heads, prefix_len, sms, chunk)
        assert chunk % align == 0 and 1 <= parts <= bound, where
        assert parts * tiles_per_chunk <= max(2 * sms, tiles_per_chunk), where
        assert parts == 1 or chunk >= min_chunk, where
        assert parts == bound or -(-prefix_len // bound) % align, where


@pytest.mark.parametrize("q, pk, chunk", [
    ((2, 1, 8, 128), (100, 2, 128), None),  # 8 rows per KV head
    ((15, 1, 32, 128), (32768, 8, 128), None),  # 60
    ((16, 1, 32, 128), (32768, 8, 128), 1024),  # 64: 33 chunks of 993 keys counted, 32 of 1024 after alignment
    ((8, 2, 32, 128), (32768, 8, 128), 1024),  # 64, from 2 queries per request
    ((64, 1, 32, 128), (32768, 8, 128), 2048),  # issue 6's shape
    ((64, 1, 8, 64), (300, 8, 64), 384),  # MHA, 64 rows; a prefix shorter than a chunk: one chunk
])
def test_path_and_chunk_through_the_public_function(monkeypatch, q, pk, chunk):
    """cascade_attention hands the glue the decode path below 64 query rows per KV head and the chunk
    length of cascade_prefix_chunk (for a GPU of 132 SMs) from there."""
    seen = {}

    def merge(*args, prefix_chunk, **kwargs):
        seen["chunk"] = prefix_chunk
        raise _ReachedKernel("cascade.merge_prefix_and_suffix")

    monkeypatch.setattr(cascade, "merge_prefix_and_suffix", merge)
    monkeypatch.setattr(_device, "device_properties", lambda device=0: {"multiProcessorCount": 132, "sharedMemPerBlockOptin": 232448})
    monkeypatch.setitem(sys.modules, "cupy", mock.MagicMock(name="cupy"))
    cache = spec((q[0], 64) + pk[1:])
    with pytest.raises(_ReachedKernel):
        cascade.cascade_attention(spec(q), spec(pk), spec(pk), cache, cache, cache_seqlens=32)
    assert seen["chunk"] == chunk


def test_the_prefill_kernels_take_every_call_the_decode_kernel_takes():
    """The chunked prefix needs no fallback: FA2 (what impl="auto" takes where FA3 does not run) has every
    head dim of the decode kernel, on every GPU that runs it, with packed variable-length batches."""
    assert set(decode.HEADDIMS) <= set(fa2.HEADDIMS) and fa2.MIN_CC <= decode.MIN_CC
    assert "varlen" in fa2.FWD_FEATURES and getattr(fa2, "ARCHS", None) is None


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


def _cascade_call(q=(2, 1, 8, 128), pk=(100, 2, 128), pv=(100, 2, 128), pdtype="bfloat16", kc=(2, 64, 2, 128),
                  vc=(2, 64, 2, 128), cdtype="bfloat16", **kw):
    args = dict(cache_seqlens=vals([5, 7]))
    args.update(kw)
    return lambda: cascade.cascade_attention(spec(q), spec(pk, pdtype), spec(pv, pdtype), spec(kc, cdtype),
                                             spec(vc, cdtype), **args)


PAGED = dict(kc=(8, 16, 2, 128), vc=(8, 16, 2, 128))  # 8 pages of 16 keys, 4 pages per entry
TABLE = [[0, 1, 2, 3], [4, 5, 6, 7]]

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
    Case("cascade_attention", "cache_seqlens", "causal_short_suffix_vector", "spec",
         _cascade_call(q=(2, 4, 8, 128), cache_seqlens=vals([5, 2]), causal=True), ValueError, ("seqlen_q - 1",)),
    # the suffix's arguments: refused before the prefix pass launches anything (merge_prefix_and_suffix
    # is the first step that touches the GPU; these rows fail if it is reached)
    Case("cascade_attention", "k_cache", "rank_5", "spec", _cascade_call(kc=(2, 64, 2, 128, 1)), ValueError,
         ("4 dimensions",)),
    Case("cascade_attention", "k_cache", "dtype", "spec", _cascade_call(cdtype="float16"), TypeError, ("dtype",)),
    Case("cascade_attention", "k_cache", "headdim", "spec", _cascade_call(kc=(2, 64, 2, 64), vc=(2, 64, 2, 64)), ValueError,
         ("head dim",)),
    Case("cascade_attention", "v_cache", "shape", "spec", _cascade_call(vc=(2, 32, 2, 128)), ValueError,
         ("v_cache",)),
    Case("cascade_attention", "k_cache", "batch", "spec", _cascade_call(kc=(3, 64, 2, 128), vc=(3, 64, 2, 128)),
         ValueError, ("batch",)),
    Case("cascade_attention", "cache_seqlens", "dtype", "spec", _cascade_call(cache_seqlens=vals([5, 7], "int64")),
         TypeError, ("int32",)),
    Case("cascade_attention", "cache_seqlens", "past_capacity", "spec", _cascade_call(cache_seqlens=vals([5, 65])),
         ValueError, ("out of range",)),
    Case("cascade_attention", "page_table", "dtype", "spec",
         _cascade_call(page_table=vals(TABLE, "int64"), **PAGED), TypeError, ("int32",)),
    Case("cascade_attention", "page_table", "page_out_of_range", "spec",
         _cascade_call(page_table=vals([[0, 1, 2, 3], [4, 5, 8, 7]]), cache_seqlens=vals([5, 40]), **PAGED),
         ValueError, ("out of range",)),
    Case("cascade_attention", "softmax_scale", "negative", "spec", _cascade_call(softmax_scale=-1.0), ValueError,
         ("positive",)),
    Case("cascade_attention", "softmax_scale", "str", "spec", _cascade_call(softmax_scale="0.1"), TypeError,
         ("float",)),
    Case("cascade_attention", "causal", "not_bool", "spec", _cascade_call(causal=1), TypeError, ("bool",)),
]


@pytest.fixture
def _merge_is_a_kernel(monkeypatch):
    """merge_prefix_and_suffix stands for the first launch: a bad-input row must be refused before it."""
    def merge(*args, **kwargs):
        raise _ReachedKernel("cascade.merge_prefix_and_suffix")

    monkeypatch.setattr(cascade, "merge_prefix_and_suffix", merge)
    monkeypatch.setattr(_device, "device_properties", lambda device=0: {"multiProcessorCount": 132, "sharedMemPerBlockOptin": 232448})
    monkeypatch.setitem(sys.modules, "cupy", mock.MagicMock(name="cupy"))


@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
def test_bad_input(case, request, _merge_is_a_kernel):
    check_refused(case, request)


def test_table_covers_every_argument():
    unchecked = {"return_softmax_lse"}  # any value is fine (truthiness)
    seen = {c.arg for c in BAD}
    missing = [a for a in inspect.signature(cuflash.cascade_attention).parameters if a not in unchecked | seen]
    assert not missing, f"no rows for cascade_attention({missing}=...)"
    ids = [c.id for c in BAD]
    assert len(ids) == len(set(ids)), "duplicate row ids"


@pytest.mark.parametrize("kw", [
    dict(),
    dict(cache_seqlens=32),
    dict(cache_seqlens=vals([0, 64])),  # an empty suffix; a full one
    dict(page_table=vals(TABLE), cache_seqlens=vals([5, 64]), **PAGED),
    dict(page_table=vals([[0, 1, 9, -1], [4, 5, 6, 7]]), cache_seqlens=vals([20, 7]), **PAGED),  # unused entries
    dict(q=(2, 4, 8, 128), cache_seqlens=vals([3, 9]), causal=True, softmax_scale=0.5),
    dict(cache_seqlens=vals([5, 65]), check=False),  # check=False reads no value
])
def test_good_calls_reach_the_merge(kw, request, _merge_is_a_kernel):
    request.getfixturevalue("spec_env")
    with pytest.raises(_ReachedKernel):
        _cascade_call(**kw)()
