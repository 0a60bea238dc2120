"""Cascade attention: many requests over one shared prefix, on cuflash's decode and prefill kernels.

When a batch of requests shares a long prompt prefix (a system prompt, a few-shot preamble, the
branches of one beam), attending to ``prefix + suffix_b`` per request reads the prefix's K/V once per
request. Cascade inference (FlashInfer's name for it) splits the keys in two:

  1. the prefix, once for the whole batch: every request's queries attend to the single prefix with no
     mask (all of it is visible), so its K/V are streamed by one set of thread blocks. With few query
     rows per KV head (batch x seqlen_q x the GQA group, below ``heuristics.CASCADE_PREFILL_MIN_ROWS``)
     this is one ``flash_attn_with_kvcache`` entry of batch x seqlen_q queries, memory-bound like
     decoding. With more rows it is compute-bound, and goes through the prefill kernels
     (``flash_attn_varlen_func``: FA3 on Hopper, else FA2): the group's heads are packed into rows (one
     query sequence per KV head, so K/V tiles serve all of them), and the prefix is cut into chunks
     (``heuristics.cascade_prefix_chunk``), each a sequence of the packed batch with its own copy of the
     queries, so that there are enough tiles to fill the GPU; each chunk gives a partial result;
  2. each request's own suffix, through ``flash_attn_with_kvcache`` as usual (contiguous or paged cache);
  3. the partial results merged by their log-sum-exp in one ``flash_attn_combine``:
     out = sum_i e^lse_i out_i / sum_i e^lse_i, exactly softmax attention over the concatenated keys.

The partial outputs come back in q's dtype (the kernels' output), so the result carries one more
rounding of each part than a single pass would.
"""
from __future__ import annotations

import numbers

from . import _validate, api
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
        check_suffix(spec, arr, cache_seqlens, softmax_scale, causal, check)
        import cupy

        from ._device import device_properties
        from .heuristics import CASCADE_PREFILL_MIN_ROWS, cascade_prefix_chunk

        b, sq, h, _ = spec["q"].shape
        prefix_len, kv_heads, _ = spec["prefix_k"].shape
        rows = b * sq * (h // kv_heads)  # query rows per KV head over the prefix
        chunk = None  # the decode kernel, in one pass
        if rows >= CASCADE_PREFILL_MIN_ROWS:  # the device's properties (host time) only on this path
            chunk = cascade_prefix_chunk(rows, kv_heads, prefix_len,
                                         device_properties(call.device.id)["multiProcessorCount"])
        out, lse = merge_prefix_and_suffix(
            arr["q"], arr["prefix_k"], arr["prefix_v"], arr["k_cache"], arr["v_cache"], seqlens, arr.get("page_table"),
            softmax_scale, causal, check, prefix_chunk=chunk, kvcache=api.flash_attn_with_kvcache,
            varlen=api.flash_attn_varlen_func, combine=api.flash_attn_combine, xp=cupy)
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


def check_suffix(spec: dict, arr: dict, cache_seqlens, softmax_scale, causal, check: bool) -> None:
    """Every argument of the suffix's flash_attn_with_kvcache call, checked before the prefix pass launches
    anything (that call checks them again, but only after the prefix's kernels ran): the caches, lengths and
    page table as that call checks them (their values too with ``check``), the scale, ``causal``, and with
    ``causal`` that each entry's suffix lets every query see the whole prefix."""
    dims = _validate.check_kvcache(spec["q"], spec["k_cache"], spec["v_cache"], None, None,
                                   spec.get("cache_seqlens", cache_seqlens), spec.get("page_table"), None, None, None)
    from . import decode

    if dims.headdim not in decode.HEADDIMS:
        raise ValueError(f"cascade_attention: head dim {dims.headdim} is not supported (the suffix runs on "
                         f"flash_attn_with_kvcache; supported: {list(decode.HEADDIMS)})")
    _validate.softmax_scale_or_default(softmax_scale, dims.headdim)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    if not check:
        return
    lens = arr["cache_seqlens"].get() if "cache_seqlens" in arr else [int(cache_seqlens)] * dims.batch
    pages = arr["page_table"].get() if "page_table" in arr else None
    _validate.check_kvcache_values(dims, lens, pages, None, None, 0)
    seqlen_q = dims.seqlen_q
    if causal and seqlen_q > 1 and int(min(lens)) < seqlen_q - 1:
        raise ValueError(f"cache_seqlens must be >= seqlen_q - 1 = {seqlen_q - 1} for causal cascade "
                         f"attention (a query must see the whole prefix); got min {int(min(lens))}")


def merge_prefix_and_suffix(q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, page_table, softmax_scale,
                            causal, check, *, prefix_chunk, kvcache, varlen, combine, xp):
    """The three steps on arrays of one array module ``xp`` (``kvcache`` / ``varlen`` / ``combine`` stand
    for flash_attn_with_kvcache / flash_attn_varlen_func / flash_attn_combine; the CPU tier runs this with
    NumPy references). ``prefix_chunk``: None for the prefix in one pass of the decode kernel, else the
    keys per chunk of the prefix through the prefill kernels."""
    b, sq, h, d = q.shape
    prefix_len = prefix_k.shape[0]
    parts = 1 if prefix_chunk is None else -(-prefix_len // prefix_chunk)
    # The partial results in the layouts flash_attn_combine takes, fp32: the prefix's first, the suffix's last.
    o_part = xp.empty((parts + 1, b, sq, h, d), dtype=xp.float32)
    l_part = xp.empty((parts + 1, b, h, sq), dtype=xp.float32)
    # 1. Every request's queries over the prefix.
    if prefix_chunk is None:
        _prefix_by_decode(q, prefix_k, prefix_v, softmax_scale, check, kvcache, o_part[0], l_part[0])
    else:
        _prefix_by_chunks(q, prefix_k, prefix_v, softmax_scale, prefix_chunk, parts, varlen, xp, o_part[:parts],
                          l_part[:parts])
    # 2. Each request's own keys, bottom-right causal within them when asked.
    o_part[parts], l_part[parts] = kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
                                           softmax_scale=softmax_scale, causal=causal, return_softmax_lse=True,
                                           check=check)
    # 3. Merge by log-sum-exp.
    return combine(o_part, l_part, out_dtype=str(q.dtype))


def _prefix_by_decode(q, prefix_k, prefix_v, softmax_scale, check, kvcache, o_dest, l_dest):
    """The queries of all requests as one entry of b * sq rows over the prefix, one decode-kernel pass
    (its blocks pack each GQA group's heads); writes o_dest (b, sq, h, d) and l_dest (b, h, sq)."""
    b, sq, h, d = q.shape
    out, lse = kvcache(q.reshape(1, b * sq, h, d), prefix_k[None], prefix_v[None], cache_seqlens=prefix_k.shape[0],
                       softmax_scale=softmax_scale, causal=False, return_softmax_lse=True, check=check)
    o_dest[...] = out.reshape(b, sq, h, d)
    l_dest[...] = lse.reshape(h, b, sq).transpose(1, 0, 2)  # (1, h, b * sq) -> (b, h, sq)


def _prefix_by_chunks(q, prefix_k, prefix_v, softmax_scale, chunk, parts, varlen, xp, o_dest, l_dest):
    """The prefix in ``parts`` chunks of ``chunk`` keys (the last one shorter), each a sequence of one packed
    flash_attn_varlen_func call; writes o_dest (parts, b, sq, h, d) and l_dest (parts, b, h, sq).

    The heads of a GQA group share their K/V and see the whole prefix unmasked, so they are packed into
    rows: query head kv * g + j of query row r becomes row r * g + j of head kv, one sequence of
    rows = b * sq * g per KV head, and the call is plain multi-head attention (kv_heads heads on both
    sides): a K/V tile serves rows of all g heads, and 128-row tiles fill even when b * sq is small. Each
    chunk gets its own copy of these rows (the packed layout holds each sequence's queries once)."""
    b, sq, h, d = q.shape
    prefix_len, kv_heads, _ = prefix_k.shape
    g = h // kv_heads
    rows = b * sq * g
    packed = q.reshape(b * sq, kv_heads, g, d).transpose(0, 2, 1, 3)  # (b * sq, g, kv_heads, d)
    q_chunks = xp.ascontiguousarray(xp.broadcast_to(packed, (parts,) + packed.shape)).reshape(parts * rows, kv_heads, d)
    # Offsets made by device kernels, not copied from the host: the call may be captured in a CUDA graph.
    cu_q = xp.arange(0, (parts + 1) * rows, rows, dtype=xp.int32)
    cu_k = xp.arange(0, (parts + 1) * chunk, chunk, dtype=xp.int32)
    cu_k[-1] = prefix_len  # the last chunk ends with the prefix
    # validate=False: the offsets are right by construction, and checking them would copy them to the host.
    out, lse = varlen(q_chunks, prefix_k, prefix_v, cu_q, cu_k, rows, min(chunk, prefix_len),
                      softmax_scale=softmax_scale, causal=False, return_lse=True, validate=False)
    # out (parts * rows, kv_heads, d) and lse (kv_heads, parts * rows) back to query heads kv * g + j.
    o_dest.reshape(parts, b, sq, kv_heads, g, d)[...] = out.reshape(parts, b, sq, g, kv_heads, d).transpose(
        0, 1, 2, 4, 3, 5)
    l_dest.reshape(parts, b, kv_heads, g, sq)[...] = lse.reshape(kv_heads, parts, b, sq, g).transpose(1, 2, 0, 4, 3)
