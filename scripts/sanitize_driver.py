"""Runs one kernel family on representative variants, small enough for compute-sanitizer's racecheck.

    python scripts/sanitize_driver.py --list              # the families this package and GPU have
    python scripts/sanitize_driver.py FAMILY [FAMILY...]   # e.g. fa1-fwd fa1-bwd fa2-fwd
    python scripts/sanitize_driver.py --check FAMILY...    # also compare with the fp32 reference

scripts/sanitize.sh runs this under each compute-sanitizer tool. Variants per family: the smallest
and largest head dim, causal and not, Sq != Sk both ways with odd lengths (77 x 133, 133 x 77), GQA
(4 query heads on 2 KV heads), batch 2; plus a single query row, a sliding window in fp16 on MQA,
and softcap + ALiBi where the family has them. CuPy's memory pool is switched off, so every array
is its own cudaMalloc of exactly its size: memcheck then sees a read past the end of an input, and
initcheck sees a read of memory nobody wrote (a pool would hand out memory written before).
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
    return out


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
