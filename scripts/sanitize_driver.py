"""Runs one kernel family on representative variants, small enough for compute-sanitizer's racecheck.

    python scripts/sanitize_driver.py --list              # the families this package and GPU have
    python scripts/sanitize_driver.py FAMILY [FAMILY...]   # e.g. fa1-fwd fa1-bwd fa2-fwd
    python scripts/sanitize_driver.py --check FAMILY...    # also compare with the fp32 reference

scripts/sanitize.sh runs this under each compute-sanitizer tool. Variants per family: the smallest
and largest head dim, causal and not, Sq != Sk both ways with odd lengths (77 x 133, 133 x 77), GQA
(4 query heads on 2 KV heads), batch 2; plus a single query row, a sliding window in fp16 on MQA,
and softcap + ALiBi where the family has them. The family "decode" (flash_attn_with_kvcache and
flash_attn_combine) runs contiguous caches and paged ones (page sizes 1, 16, 64, pages shuffled) with
ragged cache lengths 0, 1 and 133 in one batch, GQA 8 on 2, head dims 64 / 128 / 256, unsplit and
forced into 3 splits (the combine kernel), 3 causal queries, the in-place append with rotary, a window,
softcap, fp16, and the combine on its own (see _decode_cases). The family "cascade" runs
cascade_attention on four of tests/cascade_cases.py's cases (decoding over a paged cache with empty and
one-key suffixes, 3 causal queries on a contiguous one, head dim 256 under a 1000-key prefix, and a prefix
cut into chunks for the prefill kernels; see _cascade_cases). The family "fp8" runs fp8.quantize on every
head dim with the rotation on and off, block 1, 64, 128 and None over 77 and 300 rows (None over 300: the
two-launch amax + convert path), block 200 (that path with an empty tile), a strided x and fp16 (see
_fp8_cases). The family "fa3-fp8" runs the FP8 forward (flash_attn_func on e4m3 inputs: the V transpose
and the kernel) on every head dim, causal and not, Sq != Sk both ways, GQA and MQA, per-block and
per-(batch, head) descales and one query row (see _fa3_fp8_cases). CuPy's memory pool is switched off,
so every array is its own cudaMalloc of exactly its size: memcheck then sees a read past the end of an input, and initcheck sees a read of memory nobody
wrote (a pool would hand out memory written before). Without --check nothing but the family's own work
runs on the GPU: its kernels, CuPy's input casts, and what the function itself runs through CuPy
(cascade_attention's copies of the queries per prefix chunk, chunk offsets and casts of the partial
results, fp8.quantize's zeroed amax scratch).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parents[1] / "tests"  # tests/cascade_cases.py: the cascade family's inputs


def _families():
    import cuflash

    out = []
    for name in cuflash.available_impls():
        fam = importlib.import_module(f"cuflash.{name}")
        if fam.FWD_FEATURES is not None:
            out.append(f"{name}-fwd")
        if fam.BWD_FEATURES is not None:
            out.append(f"{name}-bwd")
    if _decode_available():
        # cascade_attention is flash_attn_with_kvcache calls (or one over the suffixes and a prefill call,
        # FA3 or FA2, which runs on every GPU decode runs on) and a combine
        out += ["decode", "cascade"]
    if _fp8_available():
        out.append("fp8")
    if _fp8_attention_available():
        out.append("fa3-fp8")
    return out


def _decode_available():
    """What flash_attn_with_kvcache itself asks of the GPU: decode.MIN_CC (and ARCHS, should it get any)."""
    from cuflash import api, decode
    from cuflash._device import compute_capability, has_gpu

    return has_gpu() and api._supports_arch(decode, compute_capability()) is None


def _fp8_available():
    """What fp8.quantize itself asks of the GPU: fp8.MIN_CC or newer (sm_89, the e4m3 conversion)."""
    from cuflash import fp8
    from cuflash._device import compute_capability, has_gpu

    return has_gpu() and compute_capability() >= fp8.MIN_CC


def _fp8_attention_available():
    """What flash_attn_func's FP8 path asks of the GPU: the FA3 kernels' arch (sm_90a)."""
    from cuflash import api, fa3
    from cuflash._device import compute_capability, has_gpu

    return has_gpu() and api._supports_arch(fa3, compute_capability()) is None


def _cases(name, direction):
    from cuflash import api, fa3

    fam = importlib.import_module(f"cuflash.{name}")
    feats = fam.FWD_FEATURES if direction == "fwd" else fam.BWD_FEATURES
    dims = sorted(api.headdims(fam, "forward" if direction == "fwd" else "backward"))
    mid = min(dims, key=lambda d: abs(d - 64))
    cases = []
    for d in (dims[0], dims[-1]):
        for causal in (False, True):
            for sq, sk in ((77, 133), (133, 77)):
                cases.append(dict(b=2, sq=sq, sk=sk, h=4, hkv=2, d=d, dtype="bfloat16", causal=causal))
    if name == "fa3":  # issue 4 asks for one causal and one non-causal run of every FA3 head dim
        for d in dims[1:-1]:
            for causal in (False, True):
                cases.append(dict(b=2, sq=133, sk=77 if causal else 133, h=4, hkv=2, d=d, dtype="bfloat16",
                                  causal=causal))
        if direction == "fwd":  # the GQA-packed path (few query rows)
            cases.append(dict(b=2, sq=5, sk=133, h=8, hkv=2, d=128, dtype="bfloat16", causal=True))
            # three consumer warpgroups, 64 of the 122 spare rows before row 0 (tile_order.row_shift): Q
            # loaded from before the tensor, the first warpgroup stores nothing
            cases.append(dict(b=1, sq=1030, sk=1030, h=2, hkv=1, d=64, dtype="bfloat16", causal=True))
            # the stream-K tail (fa3.fill_tail): one round of one-block tiles and one more, whose K tiles go
            # out in pieces to several blocks (partials, flags, the merge)
            for d in (dims[0], 128, dims[-1]):
                heads = fa3._sm_count() + 1
                cases.append(dict(b=1, sq=128, sk=300, h=heads, hkv=heads, d=d, dtype="bfloat16", causal=False))
            # 2-3 tiles per block of one K tile each (the ring's phases carry on across tiles) and, causal with
            # Sq > Sk, empty ones between them; some blocks get only empty tiles
            for causal in (False, True):
                cases.append(dict(b=2, sq=1000, sk=100, h=20, hkv=4, d=128, dtype="bfloat16", causal=causal))
            # keys scaled 4x and 16x by block: row maxima rise past the speculative max's headroom (d = 128:
            # the warpgroup's vote and the recompute of S under the P V in flight)
            for causal in (False, True):
                cases.append(dict(b=1, sq=200, sk=600, h=4, hkv=2, d=128, dtype="bfloat16", causal=causal,
                                  rising_max=True))
    cases.append(dict(b=1, sq=1, sk=133, h=4, hkv=2, d=mid, dtype="bfloat16", causal=True))
    if "window" in feats:
        cases.append(dict(b=1, sq=77, sk=133, h=2, hkv=1, d=mid, dtype="float16", causal=False, window=(16, 8)))
    takes = _public_takes("flash_attn_backward" if direction == "bwd" else "flash_attn_func")
    extra = {}
    if "softcap" in feats and "softcap" in takes:
        extra["softcap"] = 10.0
    if "alibi" in feats and "alibi_slopes" in takes:
        extra["alibi"] = True
    if "deterministic" in feats and direction == "bwd" and "deterministic" in takes:
        for d in (dims[0], dims[-1]):
            cases.append(dict(b=2, sq=133, sk=77, h=4, hkv=2, d=d, dtype="bfloat16", causal=False, deterministic=True))
        # causal: the K blocks reach a Q block at different steps (the order of their turns matters)
        for d in (dims[0], dims[-1]):
            cases.append(dict(b=1, sq=300, sk=300, h=4, hkv=2, d=d, dtype="bfloat16", causal=True,
                              deterministic=True))
        if name == "fa3":  # more K blocks than the rotated order takes, one head: dQ accumulator planes
            for d in (128, dims[-1]):
                cases.append(dict(b=1, sq=64, sk=8500 if d <= 128 else 4300, h=1, hkv=1, d=d, dtype="bfloat16",
                                  causal=False, deterministic=True))
    if extra:
        d = 128 if 128 in dims else dims[-1]
        cases.append(dict(b=1, sq=133, sk=77, h=4, hkv=2, d=d, dtype="bfloat16", causal=True, **extra))
        cases.append(dict(b=1, sq=77, sk=133, h=4, hkv=2, d=dims[0], dtype="float16", causal=False, **extra))
    return cases


def _public_takes(fn):
    import cuflash

    return set(inspect.signature(getattr(cuflash, fn)).parameters)


def _describe(c):
    s = f"d={c['d']} {c['dtype']} {c['sq']}x{c['sk']} b={c['b']} h={c['h']}/{c['hkv']} causal={c['causal']}"
    if c.get("window"):
        s += f" window={c['window']}"
    if c.get("softcap"):
        s += f" softcap={c['softcap']}"
    if c.get("alibi"):
        s += " alibi"
    if c.get("deterministic"):
        s += " deterministic"
    if c.get("rising_max"):
        s += " rising maxima"
    return s


class _NoReference(Exception):
    pass


def run_family(family, check, rng):
    if family in OWN_CASES:
        return _run_cases(family, *OWN_CASES[family], check, rng)
    import cupy

    import cuflash
    from cuflash import reference as ref

    name, direction = family.rsplit("-", 1)
    failures = 0
    for c in _cases(name, direction):
        def rand(*shape):
            return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(c["dtype"])

        q, k, v = rand(c["b"], c["sq"], c["h"], c["d"]), rand(c["b"], c["sk"], c["hkv"], c["d"]), rand(
            c["b"], c["sk"], c["hkv"], c["d"])
        if c.get("rising_max"):
            growth = cupy.asarray(4.0 ** np.minimum(np.arange(c["sk"]) // 128, 2), dtype=cupy.float32)
            k = (k.astype(cupy.float32) * growth[None, :, None, None]).astype(k.dtype)
        kw = dict(causal=c["causal"], window_size=c.get("window", (-1, -1)))
        extra = {}
        if c.get("softcap"):
            extra["softcap"] = c["softcap"]
        if c.get("alibi"):
            extra["alibi_slopes"] = cupy.asarray(2.0 ** (-8.0 * np.arange(1, c["h"] + 1) / c["h"]), dtype=cupy.float32)
        fwd_impl = name if direction == "fwd" or importlib.import_module(f"cuflash.{name}").FWD_FEATURES else "auto"
        if direction == "bwd" and name == "fa3":
            # The FA3 forward writes O with TMA stores (cp.async.bulk.tensor), which initcheck does not count
            # as writes: every read of O by the backward would be reported (and so would a copy of it). The
            # FA3 backward takes O and the LSE from the FA2 forward; the fa3-fwd family checks FA3's own.
            fwd_impl = "fa2"
        out, lse = cuflash.flash_attn_func(q, k, v, **kw, **extra, return_lse=True, impl=fwd_impl)
        status = "ran"
        if direction == "bwd":
            dout = rand(*q.shape)
            det = {"deterministic": True} if c.get("deterministic") else {}
            grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, **kw, **extra, **det, impl=name)
        cupy.cuda.Device().synchronize()
        if check:
            try:
                if direction == "fwd":
                    o_ref, lse_ref = ref.attention_ref(q, k, v, **kw, **extra)
                    o_low, _ = ref.attention_ref_lowp(q, k, v, **kw, **extra)
                    ref.check_close("out", out, o_ref, o_low)
                    ref.check_close("lse", lse, lse_ref, lse_ref, atol=2e-3 + 1e-3 * c.get("softcap", 0.0))
                elif not set(extra) <= set(inspect.signature(ref.attention_ref_backward_lowp).parameters):
                    raise _NoReference(f"no low-precision backward reference for {sorted(extra)}")
                else:
                    g_ref = ref.attention_ref_backward(dout, q, k, v, **kw, **extra)
                    g_low = ref.attention_ref_backward_lowp(dout, q, k, v, **kw, **extra)
                    for gname, g, r, lo in zip(("dq", "dk", "dv"), grads, g_ref, g_low):
                        ref.check_close(gname, g, r, lo)
                status = "ok"
            except _NoReference as exc:
                status = f"ran ({exc})"
            except AssertionError as exc:
                status = f"MISMATCH {exc}"
                failures += 1
        print(f"{family} {_describe(c)}: {status}", flush=True)
    return failures


# ----------------------------------------------------------------------------------------------------
# decode: flash_attn_with_kvcache and flash_attn_combine
# ----------------------------------------------------------------------------------------------------

DECODE_LENS = (0, 1, 133)  # cache_seqlens of one batch: an empty cache, one key, an odd length over 3 tiles


def _decode_cases():
    """The decode family's cases: flash_attn_with_kvcache ("kvcache"; page_size 0 = a contiguous cache)
    and one flash_attn_combine ("combine"). With DECODE_LENS, num_splits=3 gives the 133-key entry one
    64-key tile per split and the short entries empty trailing splits (they write 0 / -inf), so the
    combine kernel merges both kinds."""
    from cuflash import decode

    dims = decode.HEADDIMS
    mid = dims[len(dims) // 2]  # 128
    base = dict(fn="kvcache", b=3, sq=1, h=8, hkv=2, dtype="bfloat16", lens=DECODE_LENS, new=0, causal=False)
    cases = [dict(base, d=d, page_size=ps, num_splits=ns)
             for d in (dims[0], dims[-1]) for ps in (0, 1, 16, 64) for ns in (1, 3)]
    return cases + [
        # 12 query heads on 2 KV heads x 3 queries = 18 rows: a second 16-row block, mostly padding; bottom-
        # right causal leaves the first rows of the short entries without a key
        dict(base, d=mid, sq=3, h=12, page_size=16, causal=True, num_splits=3),
        # the in-place append of 2 tokens, GPT-NeoX rotary on half the channels; entry 1's new keys straddle
        # a page boundary (rows 15 and 16)
        dict(base, d=mid, sq=2, lens=(0, 15, 133), new=2, page_size=16, causal=True, num_splits=1, rotary_dim=64,
             interleaved=False),
        dict(base, d=mid, sq=2, page_size=64, num_splits=3, window=(40, 1)),  # the first tile of 133 keys skipped
        dict(base, d=mid, sq=2, page_size=0, causal=True, num_splits=1, softcap=2.0),
        dict(base, d=dims[0], dtype="float16", new=1, page_size=0, num_splits=3, rotary_dim=32, interleaved=True),
        # 35 splits: more than a warp's lanes; d = 320: a second, partly used pass of 256 columns; 30 rows:
        # the last block of 4 rows half empty
        dict(fn="combine", splits=35, b=2, s=3, h=5, d=320),
    ]


def _describe_decode(c):
    if c["fn"] == "combine":
        return f"combine splits={c['splits']} b={c['b']} s={c['s']} h={c['h']} d={c['d']}"
    layout = f"paged {c['page_size']}" if c["page_size"] else "contiguous"
    s = (f"d={c['d']} {c['dtype']} sq={c['sq']} b={c['b']} h={c['h']}/{c['hkv']} lens={c['lens']} {layout} "
         f"splits={c['num_splits']} causal={c['causal']}")
    if c["new"]:
        s += f" new={c['new']}"
    if c.get("rotary_dim"):
        s += f" rotary={c['rotary_dim']}{' interleaved' if c['interleaved'] else ''}"
    if c.get("window"):
        s += f" window={c['window']}"
    if c.get("softcap"):
        s += f" softcap={c['softcap']}"
    return s


def _kvcache_inputs(c, rng):
    """Host arrays of a kvcache case named as flash_attn_with_kvcache's arguments, laid out as in
    tests/test_decode_gpu.py: float32 (cast to the case's dtype on upload), int32 cache_seqlens and
    page_table. Every element is random -- the cache rows past each entry's keys and the pages no entry
    names too -- so what initcheck reports are the kernels' reads of their own unwritten scratch."""
    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    b, sq, h, hkv, d, new, ps = (c[k] for k in ("b", "sq", "h", "hkv", "d", "new", "page_size"))
    need = max(c["lens"]) + new  # keys of the longest entry after the append
    args = {"q": normal(b, sq, h, d)}
    if ps:
        max_pages = -(-need // ps) + 1
        pages = b * max_pages + 3  # a few pages no entry names
        table = rng.permutation(pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)  # distinct, shuffled
        for i, n in enumerate(c["lens"]):
            table[i, -(-(n + new) // ps):] = -1  # past the entry's keys: a read of the page would be out of bounds
        args.update(k_cache=normal(pages, ps, hkv, d), v_cache=normal(pages, ps, hkv, d), page_table=table)
    else:
        args.update(k_cache=normal(b, need + 5, hkv, d), v_cache=normal(b, need + 5, hkv, d))
    if new:
        args.update(k=normal(b, new, hkv, d), v=normal(b, new, hkv, d))
    args["cache_seqlens"] = np.asarray(c["lens"], np.int32)
    if c.get("rotary_dim"):  # positions up to the last new key or query
        rd = c["rotary_dim"]
        angles = np.arange(need + sq)[:, None] / 10000.0 ** (np.arange(0, rd, 2) / rd)
        args.update(rotary_cos=np.cos(angles).astype(np.float32), rotary_sin=np.sin(angles).astype(np.float32))
    return args


def _kvcache_options(c):
    """Keyword arguments that flash_attn_with_kvcache and reference.kvcache_attention_ref share."""
    return dict(causal=c["causal"], window_size=c.get("window", (-1, -1)), softcap=c.get("softcap", 0.0),
                rotary_interleaved=c.get("interleaved", False))


def _kvcache_call(c, args):
    import cuflash

    return cuflash.flash_attn_with_kvcache(**args, **_kvcache_options(c), num_splits=c["num_splits"],
                                           return_softmax_lse=True)


def _check_kvcache(c, before, after, out, lse):
    """out and lse against the fp32 reference by FlashAttention's rule, as tests/test_decode_gpu.py does;
    the caches after the append: v copied bit for bit, k within one ulp of the reference's rotary (the same
    fp32 products, rounded once). ``before``: the call's arguments with the caches as they were;
    ``after``: the caches the call appended to. Raises AssertionError."""
    from cuflash import reference as ref

    opts = _kvcache_options(c)
    o_ref, lse_ref, kc_ref, vc_ref = ref.kvcache_attention_ref(**before, **opts)
    o_low = ref.kvcache_attention_ref(**before, **opts, lowp=True)[0]
    ref.check_close("out", out, o_ref, o_low)
    ref.check_close("lse", lse, lse_ref, lse_ref, atol=2e-3)
    ref.check_close("v_cache", after["v_cache"], vc_ref, vc_ref, atol=0.0)
    ulp = (2.0 ** -7 if c["dtype"] == "bfloat16" else 2.0 ** -10) if c.get("rotary_dim") else 0.0
    ref.check_close("k_cache", after["k_cache"], kc_ref, kc_ref, atol=ulp * float(abs(kc_ref.astype("float32")).max()))


def _run_kvcache(c, rng, check):
    import cupy

    args = {n: cupy.asarray(a) if a.dtype == np.int32 else cupy.asarray(a).astype(c["dtype"])
            for n, a in _kvcache_inputs(c, rng).items()}
    # The reference starts from the caches as they were before the in-place append. Copied only with
    # --check: under the sanitizer nothing but the family's kernels is to run.
    before = dict(args, k_cache=args["k_cache"].copy(), v_cache=args["v_cache"].copy()) if check else None
    out, lse = _kvcache_call(c, args)
    cupy.cuda.Device().synchronize()
    if not check:
        return "ran"
    _check_kvcache(c, before, args, out, lse)
    return "ok"


def _combine_inputs(c, rng):
    """Random partials (float32): the last split has no keys anywhere (lse -inf, as a trailing split that
    got no tiles), and row (b 1, head 2, query 0) has none in any split (out 0, lse -inf)."""
    o = rng.standard_normal((c["splits"], c["b"], c["s"], c["h"], c["d"]), dtype=np.float32)
    lse = 4 * rng.standard_normal((c["splits"], c["b"], c["h"], c["s"]), dtype=np.float32)
    lse[-1] = -np.inf
    lse[:, 1, 2, 0] = -np.inf
    return {"out_partial": o, "lse_partial": lse}


def _check_combine(partials, out, lse):
    """Host out / lse against reference.combine_ref. All fp32: an absolute bound far above its rounding
    (|out| < 5, |lse| < 25) and far below what a wrong weight or a dropped split gives."""
    from cuflash import reference as ref

    want_o, want_l = ref.combine_ref(partials["out_partial"], partials["lse_partial"])
    ref.check_close("out", out, want_o, want_o, atol=1e-4)
    ref.check_close("lse", lse, want_l, want_l, atol=1e-4)


def _run_combine(c, rng, check):
    import cupy

    import cuflash

    host = _combine_inputs(c, rng)
    o = cupy.empty(host["out_partial"].shape, dtype=cupy.float32)
    # The last split stays unwritten: its lse is -inf, so the combine must not read it (initcheck says so
    # if it does).
    o[:-1] = cupy.asarray(host["out_partial"][:-1])
    out, lse = cuflash.flash_attn_combine(o, cupy.asarray(host["lse_partial"]))
    cupy.cuda.Device().synchronize()
    if not check:
        return "ran"
    _check_combine(host, out.get(), lse.get())
    return "ok"


def _run_decode_case(c, rng, check):
    return (_run_combine if c["fn"] == "combine" else _run_kvcache)(c, rng, check)


# ----------------------------------------------------------------------------------------------------
# cascade: cascade_attention (the prefix through flash_attn_with_kvcache or flash_attn_varlen_func, the
# suffixes through flash_attn_with_kvcache, the combine)
# ----------------------------------------------------------------------------------------------------

CASCADE_KEYS = ("b", "sq", "h", "hkv", "d", "prefix_len", "lens", "paged", "causal")  # a CASES tuple's fields
CASCADE_ARGS = ("q", "prefix_k", "prefix_v", "k_cache", "v_cache", "cache_seqlens", "page_table")  # the call's


def _cascade_module():
    """tests/cascade_cases.py, the cases and input builder the cascade tests use: imported from tests/ (put
    on sys.path, as pytest does for the tests) rather than copied, so the driver runs what they check."""
    if str(TESTS) not in sys.path:
        sys.path.append(str(TESTS))
    import cascade_cases

    return cascade_cases


def _cascade_cases():
    """Four of tests/cascade_cases.py's CASES: decoding over a paged cache (page size 16) with suffixes of
    0, 1, 77 and 200 keys (an empty suffix: lse -inf into the merge); 3 causal queries on contiguous caches
    (MHA, d = 64); d = 256 paged under a 1000-key prefix (the prefix pass over many tiles); 4 causal
    queries x 4 heads per KV head x 8 requests, 128 rows per KV head, so the 2000-key prefix goes through
    the prefill kernels in chunks (3 of 768 keys, the last 464: a K/V tile read across a chunk's end)."""
    cases = _cascade_module().CASES
    return [dict(zip(CASCADE_KEYS, cases[i])) for i in (1, 2, 4, 6)]


def _describe_cascade(c):
    return (f"d={c['d']} bfloat16 sq={c['sq']} b={c['b']} h={c['h']}/{c['hkv']} prefix={c['prefix_len']} "
            f"lens={c['lens']} {'paged 16' if c['paged'] else 'contiguous'} causal={c['causal']}")


def _cascade_inputs(c, rng):
    """tests/cascade_cases.py's inputs of the case (bf16 host arrays, int32 lengths and page table, and the
    concatenated caches the reference reads). Every element is random, every page in the table."""
    return _cascade_module().cascade_inputs(rng, **{k: c[k] for k in CASCADE_KEYS if k != "causal"})


def _cascade_call(c, args):
    import cuflash

    return cuflash.cascade_attention(*(args[n] for n in CASCADE_ARGS[:5]), cache_seqlens=args["cache_seqlens"],
                                     page_table=args["page_table"], causal=c["causal"], return_softmax_lse=True)


def _check_cascade(c, host, out, lse):
    """out and lse against the fp32 reference over the concatenated caches (the prefix, then each request's
    suffix) by FlashAttention's rule, as tests/test_cascade_gpu.py does (the reference on the host here).
    Raises AssertionError."""
    from cuflash import reference as ref

    concat = (host["q"], host["concat_k"], host["concat_v"])
    opts = dict(cache_seqlens=host["concat_seqlens"], causal=c["causal"])
    o_ref, lse_ref, _, _ = ref.kvcache_attention_ref(*concat, **opts)
    o_low = ref.kvcache_attention_ref(*concat, **opts, lowp=True)[0]
    ref.check_close("out", out, o_ref, o_low)
    ref.check_close("lse", lse, lse_ref, lse_ref, atol=2e-3)


def _to_device(a):
    """A host array on the GPU: int32 as it is, bf16 through float32 (exact); None stays None."""
    import cupy

    if a is None:
        return None
    if a.dtype == np.int32:
        return cupy.asarray(a)
    return cupy.asarray(a.astype(np.float32)).astype(str(a.dtype))


def _run_cascade(c, rng, check):
    import cupy

    host = _cascade_inputs(c, rng)
    out, lse = _cascade_call(c, {n: _to_device(host[n]) for n in CASCADE_ARGS})  # not the concatenation
    cupy.cuda.Device().synchronize()
    if not check:
        return "ran"
    _check_cascade(c, host, out, lse)
    return "ok"


# ----------------------------------------------------------------------------------------------------
# fp8: fp8.quantize
# ----------------------------------------------------------------------------------------------------

FP8_SEED = 0x0123456789ABCDEF  # both 32-bit halves go into the sign key
FP8_MAX_OFF_BY_ONE = 2e-3  # tests/test_fp8_gpu.py's bound on elements one e4m3 step from the float64 math


def _fp8_cases():
    """The fp8 family's cases, batch 2 and 3 heads (x (b, s, h, d)). Per head dim and rotation on / off
    (the six bf16 variants): block 1 over 300 rows (three tiles of one-row groups), 64 over 77 (two groups
    in one tile, the second of 13 rows), 128 over 300 (three tiles, the last of 44 rows) and None over 300
    (one 300-row group over three tiles: the two launches, amax merged by atomicMax, then the conversion).
    Then None over 77 (the whole sequence one fused group), block 200 over 300 (the two launches with two
    groups; the second group's second tile starts past the end and is empty), a strided x, and fp16."""
    from cuflash import fp8

    base = dict(b=2, h=3, dtype="bfloat16", seed=FP8_SEED)
    cases = [dict(base, d=d, s=s, block=block, hadamard=hadamard) for d in fp8.HEADDIMS for hadamard in (True, False)
             for block, s in ((1, 300), (64, 77), (128, 300), (None, 300))]
    return cases + [
        dict(base, d=128, s=77, block=None, hadamard=True),
        dict(base, d=128, s=300, block=200, hadamard=False),
        dict(base, d=128, s=77, block=64, hadamard=True, strided=True),
        dict(base, d=64, s=300, block=None, hadamard=True, dtype="float16"),
    ]


def _describe_fp8(c):
    s = f"d={c['d']} {c['dtype']} x={c['b']}x{c['s']}x{c['h']} block={c['block']} hadamard={c['hadamard']}"
    return s + " strided" if c.get("strided") else s


def _fp8_input(c, rng):
    """Host float32 values of the case's dtype (so the cast on upload is exact): x itself, or for a strided
    case the (b, s, 2h, d) array that x is a view of (_fp8_view). Every element is random, the heads the
    view skips too, so what initcheck reports are the kernel's own reads of unwritten memory."""
    from cuflash import reference as ref

    heads = 2 * c["h"] if c.get("strided") else c["h"]
    x = rng.standard_normal((c["b"], c["s"], heads, c["d"]), dtype=np.float32)
    return x.astype(ref._as_dtype(c["dtype"])).astype(np.float32)


def _fp8_view(c, x):
    """x as the kernel gets it (NumPy or CuPy). Strided: every other head from head 1 (head stride 2d, a
    start 2d elements in), so x's last element is the allocation's last and a read past it is out of bounds."""
    return x[:, :, 1::2] if c.get("strided") else x


def _fp8_call(c, x):
    from cuflash import fp8

    return fp8.quantize(x, block=c["block"], hadamard=c["hadamard"], seed=c["seed"])


def _same(name, got, want):
    """got equal to want bit for bit (NaN != NaN: an element left unwritten as NaN shows)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{name}: {got.dtype} {got.shape}, the fp32 model {want.dtype} {want.shape}")
    bad = np.argwhere(got != want)
    if bad.size:
        idx = tuple(int(i) for i in bad[0])
        raise AssertionError(f"{name}: {len(bad)} of {got.size} differ from the fp32 model, first at {idx}: "
                             f"{got[idx]!r}, model {want[idx]!r}")


def _check_fp8(c, x, data, descale):
    """Host data / descale of x (host, the values the kernel read) against reference.fp8_quantize, as
    tests/test_fp8_gpu.py compares them: bit for bit with its float32 mode (the kernel's own arithmetic);
    with the float64 math, descale within 1e-6 relative and data at most one e4m3 step off in at most
    FP8_MAX_OFF_BY_ONE of the elements (fp32 and fp64 may round an element at an e4m3 rounding boundary to
    either neighbour). Raises AssertionError."""
    from cuflash import reference as ref

    args = (x, c["block"], c["hadamard"], c["seed"])
    data32, descale32 = ref.fp8_quantize(*args, compute_dtype="float32")
    _same("descale", descale, descale32)
    _same("data", data, data32)
    data64, descale64 = ref.fp8_quantize(*args)
    rel = float(np.abs(descale.astype(np.float64) / descale64 - 1).max())
    if not rel <= 1e-6:
        raise AssertionError(f"descale: {rel:.2e} relative from the float64 math (allowed 1e-6)")
    dist = ref.e4m3_ulp_distance(data, data64)
    if dist.max() > 1 or (dist > 0).mean() > FP8_MAX_OFF_BY_ONE:
        raise AssertionError(f"data: {int((dist > 0).sum())} of {data.size} elements up to {int(dist.max())} e4m3 "
                             f"steps from the float64 math (allowed: one step, {FP8_MAX_OFF_BY_ONE:.0e} of them)")


def _run_fp8(c, rng, check):
    import cupy

    host = _fp8_input(c, rng)
    data, descale = _fp8_call(c, _fp8_view(c, cupy.asarray(host).astype(c["dtype"])))
    cupy.cuda.Device().synchronize()
    if not check:
        return "ran"
    _check_fp8(c, _fp8_view(c, host), data.get(), descale.get())
    return "ok"


def _fa3_fp8_cases():
    """The FP8 forward (flash_attn_func on e4m3 inputs, with its V transpose pre-pass): every head dim,
    causal and not, 77 x 133 and 133 x 77, GQA 4 on 2, per-block descales (Q 64, K/V 128: the last block of
    each short); then per-(batch, head) descales with K/V blocks of 256 keys on MQA, one query row, and at
    d = 128 two calls with rows enough for the long-row tiles (heuristics.FA3_FP8_LONG_MIN_SEQLEN), 2051 rows
    against 2100 keys: causal on K/V blocks of 128 (FA3_FP8_TILES_LONG: no pingpong) and not on blocks of 256
    (FA3_FP8_TILES_WIDE: 256-key tiles, the last one short), d = 64 causal on blocks of 256 (its 256-key
    tiles) and d = 256 both ways on blocks of 256 (its P_SMEM tiles: P through shared memory)."""
    cases = [dict(b=2, sq=sq, sk=sk, h=4, hkv=2, d=d, causal=causal, blocks=(64, 128))
             for d in (64, 128, 256) for causal in (False, True) for sq, sk in ((77, 133), (133, 77))]
    return cases + [dict(b=1, sq=133, sk=300, h=4, hkv=1, d=128, causal=True, blocks=(None, None)),
                    dict(b=2, sq=1, sk=300, h=4, hkv=2, d=256, causal=False, blocks=(128, 256)),
                    dict(b=1, sq=2051, sk=2100, h=1, hkv=1, d=128, causal=True, blocks=(64, 128)),
                    dict(b=1, sq=2051, sk=2100, h=2, hkv=1, d=128, causal=False, blocks=(128, 256)),
                    dict(b=1, sq=2051, sk=2100, h=2, hkv=1, d=64, causal=True, blocks=(64, 256)),
                    dict(b=1, sq=2051, sk=2100, h=2, hkv=1, d=256, causal=True, blocks=(128, 256)),
                    dict(b=1, sq=2051, sk=2100, h=2, hkv=2, d=256, causal=False, blocks=(128, 256))]


def _describe_fa3_fp8(c):
    return (f"d={c['d']} e4m3 {c['sq']}x{c['sk']} b={c['b']} h={c['h']}/{c['hkv']} causal={c['causal']} "
            f"blocks={c['blocks']}")


def _fa3_fp8_blocks(c):
    """descale_block for the case's quantiser blocks (None: one scale per head, whose entry is ignored)."""
    q_block, kv_block = c["blocks"]
    return q_block or 128, kv_block or 128


def _fa3_fp8_call(c, data, descales):
    """The public call the family runs: flash_attn_func on e4m3 bytes with their descales."""
    import cuflash

    (qd, kd, vd), (qs, ks, vs) = data, descales
    return cuflash.flash_attn_func(qd, kd, vd, q_descale=qs, k_descale=ks, v_descale=vs, fp8_format="e4m3",
                                   descale_block=_fa3_fp8_blocks(c), causal=c["causal"], return_lse=True)


def _run_fa3_fp8(c, rng, check):
    """Quantise bf16 inputs (cuflash.fp8.quantize, outside what the case checks) and run the FP8 forward;
    with check, compare with the reference as the GPU tests do (reference.check_fp8_attention)."""
    import cupy

    from cuflash import fp8
    from cuflash import reference as ref

    def rand(*shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype("bfloat16")

    q = rand(c["b"], c["sq"], c["h"], c["d"])
    k, v = rand(c["b"], c["sk"], c["hkv"], c["d"]), rand(c["b"], c["sk"], c["hkv"], c["d"])
    q_block, kv_block = c["blocks"]
    qd, qs = fp8.quantize(q, block=q_block, hadamard=True, seed=FP8_SEED)
    kd, ks = fp8.quantize(k, block=kv_block, hadamard=True, seed=FP8_SEED)
    vd, vs = fp8.quantize(v, block=kv_block, hadamard=False)
    data, descales = (qd, kd, vd), (qs, ks, vs)
    out, lse = _fa3_fp8_call(c, data, descales)
    cupy.cuda.Device().synchronize()
    if not check:
        return "ran"
    ref.check_fp8_attention("fa3-fp8", out, lse, data, descales, descale_block=_fa3_fp8_blocks(c),
                            causal=c["causal"])
    return "ok"


# ----------------------------------------------------------------------------------------------------
# the families with cases of their own
# ----------------------------------------------------------------------------------------------------

# family: (its cases, run one case (case, rng, check) -> status, describe a case)
OWN_CASES = {
    "decode": (_decode_cases, _run_decode_case, _describe_decode),
    "cascade": (_cascade_cases, _run_cascade, _describe_cascade),
    "fp8": (_fp8_cases, _run_fp8, _describe_fp8),
    "fa3-fp8": (_fa3_fp8_cases, _run_fa3_fp8, _describe_fa3_fp8),
}


def _run_cases(family, cases, run, describe, check, rng):
    """Runs every case and prints one line each; a mismatch (only --check compares) is counted and the
    next case still runs. Returns the number of mismatches."""
    failures = 0
    for c in cases():
        try:
            status = run(c, rng, check)
        except AssertionError as exc:
            status = f"MISMATCH {exc}"
            failures += 1
        print(f"{family} {describe(c)}: {status}", flush=True)
    return failures


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*")
    ap.add_argument("--list", action="store_true", help="print the families this package and GPU have")
    ap.add_argument("--check", action="store_true", help="compare with the fp32 reference (not under a sanitizer)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.list:
        print(" ".join(_families()))
        return 0
    import cupy

    cupy.cuda.set_allocator(None)  # no pool: exact-size allocations (see the module docstring)
    cupy.cuda.set_pinned_memory_allocator(None)
    known = _families()
    unknown = [f for f in args.families if f not in known]
    if unknown or not args.families:
        print(f"unknown or no family {unknown}; this package and GPU have: {' '.join(known)}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    failures = sum(run_family(f, args.check, rng) for f in args.families)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
