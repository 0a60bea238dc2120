"""Cascade attention: many requests over one shared prefix, on cuflash's decode kernels.

When a batch of requests shares a long prompt prefix (a system prompt, a few-shot preamble, the
branches of one beam), attending to ``prefix + suffix_b`` per request reads the prefix's K/V once per
request. Cascade inference (FlashInfer's name for it) splits the keys in two:

  1. the prefix, once for the whole batch: every request's queries are stacked into one entry of
     ``batch x seqlen_q`` query rows over the single prefix cache, so the prefix's K/V are streamed by
     one set of thread blocks (its GQA groups packed as in ``flash_attn_with_kvcache``);
  2. each request's own suffix, through ``flash_attn_with_kvcache`` as usual (contiguous or paged cache);
  3. the two partial results merged by their log-sum-exp with ``flash_attn_combine``:
     out = (e^lse_p out_p + e^lse_s out_s) / (e^lse_p + e^lse_s), exactly softmax attention over the
     concatenated keys.

The partial outputs come back in q's dtype (the kernels' output), so the result carries one more
rounding of each part than a single pass would.
"""
from __future__ import annotations

import numbers

from . import api
from ._interop import Call, Spec

__all__ = ["cascade_attention"]


def cascade_attention(q, prefix_k, prefix_v, k_cache, v_cache, *, cache_seqlens, page_table=None,
                      softmax_scale=None, causal=False, return_softmax_lse=False, check=True):
    """Attention of each request's queries over a shared prefix followed by the request's own keys.

    ``q``                 (batch, seqlen_q, heads, headdim), fp16 or bf16
    ``prefix_k/prefix_v`` (prefix_len, kv_heads, headdim): the keys/values every request sees first
    ``k_cache/v_cache``   each request's own keys after the prefix, as ``flash_attn_with_kvcache`` takes
                          them: (batch, max_suffix, kv_heads, headdim), or paged (num_pages, page_size,
                          kv_heads, headdim) with ``page_table``; ``cache_seqlens`` (int32 (batch,) or
                          an int) counts them
    ``causal``            bottom-right aligned over prefix + suffix: query i of seqlen_q sees every
                          prefix key and suffix keys j <= i + cache_seqlens[b] - seqlen_q. The whole
                          prefix is visible to every query only when cache_seqlens[b] >= seqlen_q - 1,
                          which ``check=True`` verifies (with ``check=False`` it is the caller's promise;
                          with seqlen_q = 1, decoding, it always holds).

    Equals ``flash_attn_with_kvcache`` over caches holding prefix + suffix for every entry. Returns
    ``out`` (like q), or ``(out, lse)`` with ``return_softmax_lse=True`` (lse fp32 (batch, heads,
    seqlen_q), natural log). ``check`` is passed to the ``flash_attn_with_kvcache`` calls.
    """
    named = [("q", q), ("prefix_k", prefix_k), ("prefix_v", prefix_v), ("k_cache", k_cache), ("v_cache", v_cache)]
    if not isinstance(cache_seqlens, numbers.Integral):
        named.append(("cache_seqlens", cache_seqlens))
    if page_table is not None:
        named.append(("page_table", page_table))
    with Call(named) as call:
        spec = {s.name: s for s in call.specs}
        arr = {s.name: a for s, a in zip(call.specs, call.arrays)}
        check_prefix(spec["q"], spec["prefix_k"], spec["prefix_v"])
        if not isinstance(check, bool):
            raise TypeError(f"check must be a bool; got {type(check).__name__}")
        seqlens = arr.get("cache_seqlens", cache_seqlens)
        seqlen_q = spec["q"].shape[1]
        if causal and check and seqlen_q > 1:
            lens = seqlens.get() if "cache_seqlens" in arr else [int(cache_seqlens)]
            if len(lens) and int(min(lens)) < seqlen_q - 1:
                raise ValueError(f"cache_seqlens must be >= seqlen_q - 1 = {seqlen_q - 1} for causal cascade "
                                 f"attention (a query must see the whole prefix); got min {int(min(lens))}")
        import cupy

        out, lse = merge_prefix_and_suffix(
            arr["q"], arr["prefix_k"], arr["prefix_v"], arr["k_cache"], arr["v_cache"], seqlens, arr.get("page_table"),
            softmax_scale, causal, check, kvcache=api.flash_attn_with_kvcache, combine=api.flash_attn_combine,
            xp=cupy)
        return (call.wrap(out), call.wrap(lse)) if return_softmax_lse else call.wrap(out)


def check_prefix(q: Spec, prefix_k: Spec, prefix_v: Spec) -> None:
    """The shared prefix against q: (prefix_len >= 1, kv_heads, headdim), q's dtype, kv_heads dividing q's
    heads. Everything else is checked by the flash_attn_with_kvcache calls."""
    if len(q.shape) != 4:
        raise ValueError(f"q must have 4 dimensions (batch, seqlen_q, heads, headdim); got shape {q.shape}")
    heads, headdim = q.shape[2], q.shape[3]
    for s in (prefix_k, prefix_v):
        if len(s.shape) != 3:
            raise ValueError(f"{s.name} must have 3 dimensions (prefix_len, kv_heads, headdim); got shape {s.shape}")
        if s.dtype != q.dtype:
            raise TypeError(f"{s.name} must have q's dtype {q.dtype}; got {s.dtype}")
    if prefix_k.shape != prefix_v.shape:
        raise ValueError(f"prefix_k and prefix_v must have the same shape; got {prefix_k.shape} and {prefix_v.shape}")
    prefix_len, kv_heads, d = prefix_k.shape
    if prefix_len < 1:
        raise ValueError("prefix_k must hold at least one key (prefix_len >= 1); without a prefix call "
                         "flash_attn_with_kvcache")
    if d != headdim:
        raise ValueError(f"prefix_k's head dim must be q's ({headdim}); got {d}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"prefix_k's kv_heads must divide q's heads ({heads}); got {kv_heads}")


def merge_prefix_and_suffix(q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, page_table, softmax_scale,
                            causal, check, *, kvcache, combine, xp):
    """The three steps on arrays of one array module ``xp`` (``kvcache`` / ``combine`` stand for
    flash_attn_with_kvcache / flash_attn_combine; the CPU tier runs this with NumPy references)."""
    b, sq, h, d = q.shape
    # 1. Every request's queries as one entry of b * sq rows over the prefix; no mask (all of it is visible).
    out_p, lse_p = kvcache(q.reshape(1, b * sq, h, d), prefix_k[None], prefix_v[None],
                           cache_seqlens=prefix_k.shape[0], softmax_scale=softmax_scale, causal=False,
                           return_softmax_lse=True, check=check)
    # 2. Each request's own keys, bottom-right causal within them when asked.
    out_s, lse_s = kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
                           softmax_scale=softmax_scale, causal=causal, return_softmax_lse=True, check=check)
    # 3. Merge by log-sum-exp: lse_p (1, h, b * sq) -> (b, h, sq), the layout of lse_s.
    o_part = xp.stack([out_p.reshape(b, sq, h, d), out_s]).astype(xp.float32)
    l_part = xp.stack([lse_p.reshape(h, b, sq).transpose(1, 0, 2), lse_s]).astype(xp.float32)
    return combine(o_part, l_part, out_dtype=str(q.dtype))
