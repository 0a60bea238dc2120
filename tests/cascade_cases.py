"""Inputs for the cascade-attention tests (CPU and GPU tiers): a shared prefix, per-request suffix caches
(contiguous or paged), and the same keys laid out as one contiguous cache per request (prefix, then
suffix) for the reference "attention over the concatenation". NumPy arrays in ml_dtypes' bf16."""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def cascade_inputs(rng, *, b, sq, h, hkv, d, prefix_len, lens, paged, page_size=16):
    """dict: q, prefix_k, prefix_v, k_cache, v_cache, cache_seqlens, page_table (or None), and the concatenated
    cache: concat_k, concat_v, concat_seqlens."""
    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(BF16)

    cap = max(max(lens), 1)
    suffix_k, suffix_v = rand(b, cap, hkv, d), rand(b, cap, hkv, d)
    out = dict(q=rand(b, sq, h, d), prefix_k=rand(prefix_len, hkv, d), prefix_v=rand(prefix_len, hkv, d),
               cache_seqlens=np.asarray(lens, np.int32), page_table=None)
    if paged:
        per = -(-cap // page_size)
        pages = b * per
        perm = rng.permutation(pages).astype(np.int32)
        kc, vc = rand(pages, page_size, hkv, d), rand(pages, page_size, hkv, d)
        for bi in range(b):
            for j in range(per):
                rows = slice(j * page_size, min(cap, (j + 1) * page_size))
                n = rows.stop - rows.start
                kc[perm[bi * per + j], :n] = suffix_k[bi, rows]
                vc[perm[bi * per + j], :n] = suffix_v[bi, rows]
        out.update(k_cache=kc, v_cache=vc, page_table=perm.reshape(b, per))
    else:
        out.update(k_cache=suffix_k, v_cache=suffix_v)
    concat_k = np.concatenate([np.broadcast_to(out["prefix_k"], (b, prefix_len, hkv, d)), suffix_k], axis=1)
    concat_v = np.concatenate([np.broadcast_to(out["prefix_v"], (b, prefix_len, hkv, d)), suffix_v], axis=1)
    out.update(concat_k=np.ascontiguousarray(concat_k), concat_v=np.ascontiguousarray(concat_v),
               concat_seqlens=out["cache_seqlens"] + prefix_len)
    return out


# (b, sq, h, hkv, d, prefix_len, lens, paged, causal): ragged suffixes with empty and one-key entries,
# GQA, decoding (sq = 1) and several queries with the causal mask (every suffix >= sq - 1). The prefix
# goes through the decode kernel below heuristics.CASCADE_PREFILL_MIN_ROWS = 64 query rows per KV head
# (b * sq * h / hkv), through the prefill kernels in chunks from there: the last five cases (72, 64, 128,
# 64 and 64 rows; on a GPU of 108-132 SMs one chunk, 7 chunks of 640 keys (the last 384), 3 of 768 (the
# last 464), 2 of 768 (the last 732), one).
CASES = [
    (4, 1, 8, 2, 128, 300, (0, 1, 77, 200), False, False),
    (4, 1, 8, 2, 128, 300, (0, 1, 77, 200), True, True),
    (3, 3, 4, 4, 64, 129, (2, 40, 5), False, True),
    (3, 3, 8, 1, 64, 64, (2, 33, 16), True, True),
    (2, 1, 16, 2, 256, 1000, (513, 3), True, False),
    (16, 1, 32, 8, 128, 4224, (0, 1, 7, 113, 239, 64, 5, 300, 2, 33, 17, 128, 255, 9, 40, 77), False, False),
    (8, 4, 8, 2, 64, 2000, (3, 3, 70, 16, 200, 4, 31, 129), True, True),
    (4, 2, 16, 2, 256, 1500, (1, 100, 7, 64), False, True),
    (64, 1, 4, 4, 64, 300, tuple(range(0, 640, 10)), True, False),
]
