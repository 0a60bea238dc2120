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
softcap, fp16, and the combine on its own (see _decode_cases). CuPy's memory pool is switched off, so
every array is its own cudaMalloc of exactly its size: memcheck then sees a read past the end of an
input, and initcheck sees a read of memory nobody wrote (a pool would hand out memory written before).
Without --check nothing but the family's kernels (and CuPy's input casts) runs on the GPU.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import sys

import numpy as np


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
        out.append("decode")
    return out


def _decode_available():
    """What flash_attn_with_kvcache itself asks of the GPU: decode.MIN_CC (and ARCHS, should it get any)."""
    from cuflash import api, decode
    from cuflash._device import compute_capability, has_gpu

    return has_gpu() and api._supports_arch(decode, compute_capability()) is None


def _cases(name, direction):
    from cuflash import api

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
    return s


class _NoReference(Exception):
    pass


def run_family(family, check, rng):
    if family == "decode":
        return run_decode(check, rng)
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
        kw = dict(causal=c["causal"], window_size=c.get("window", (-1, -1)))
        extra = {}
        if c.get("softcap"):
            extra["softcap"] = c["softcap"]
        if c.get("alibi"):
            extra["alibi_slopes"] = cupy.asarray(2.0 ** (-8.0 * np.arange(1, c["h"] + 1) / c["h"]), dtype=cupy.float32)
        fwd_impl = name if direction == "fwd" or importlib.import_module(f"cuflash.{name}").FWD_FEATURES else "auto"
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


def run_decode(check, rng):
    failures = 0
    for c in _decode_cases():
        try:
            status = (_run_combine if c["fn"] == "combine" else _run_kvcache)(c, rng, check)
        except AssertionError as exc:
            status = f"MISMATCH {exc}"
            failures += 1
        print(f"decode {_describe_decode(c)}: {status}", flush=True)
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
