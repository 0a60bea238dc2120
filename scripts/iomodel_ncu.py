"""Predicted (cuflash.iomodel) against measured (Nsight Compute) DRAM bytes of one attention call.

On the GPU machine (ncu on the PATH or --ncu):

    python scripts/iomodel_ncu.py [--out DIR] [--quick] [--headdims 128] [--seqlens 1024,4096]
                                  [--cases naive:forward,fa1:forward,fa2:forward,fa3:forward,...]

writes ``iomodel_ncu.md`` and ``iomodel_ncu.json`` under ``--out`` (default ``$OUT``, else the current
directory). ``--dry-run`` prints the ncu command lines and writes the predictions only (no GPU needed).
Each case is one ncu run (process start, compile cache lookup, warm-up, one profiled call): the defaults
(7 impl:direction pairs at d = 128, N = 1k and 4k, with and without the causal mask; decode once per N) are
26 runs, estimated at about 3 minutes with warm compile caches (not yet timed on the H200);
``--headdims 64,128`` doubles them. A decode case is one query over a cache of N keys, with the
split count the model takes for 132 SMs (passed to the call, so prediction and measurement agree).

How a case is measured. Each case runs

    ncu --profile-from-start off --target-processes all --clock-control none --cache-control all
        --metrics dram__bytes_read.sum,dram__bytes_write.sum --csv --print-units base --log-file LOG
        python scripts/iomodel_ncu.py --driver <case>

The driver (this file, ``--driver``) makes the inputs, compiles and warms up with two calls, synchronises,
and brackets exactly ONE call with cudaProfilerStart / cudaProfilerStop: ncu profiles every kernel of that
call and nothing else (the naive attention's cuBLAS GEMMs and CuPy elementwise kernels, the three kernels
of a cuflash backward), without depending on kernel names or launch counts. The DRAM bytes are summed over
those kernels.

What is compared. ``predicted`` is ``cuflash.iomodel.predict``'s ``hbm_bytes``: no L2 reuse between thread
blocks (every tile load from DRAM) -- the upper bound the ratio column refers to. ``min`` is the lower
bound ``hbm_bytes_min`` with the whole grid as one wave (each kernel's compulsory bytes; ncu's
``--cache-control all`` starts every kernel with a flushed L2, which is what that bound assumes), and
``wave`` the same with waves of (SMs x resident blocks per SM of the main kernel) blocks, from the
driver's occupancy query. The H100/H200 L2 (50-60 MB) holds a whole head's K/V at these sizes, so the
flash kernels' measured bytes are expected near ``min``/``wave`` rather than ``predicted`` at small N.
The L2 is write-back: lines still dirty when a kernel ends are written to DRAM later and are not in that
kernel's ``dram__bytes_write``, so the measured writes of small outputs can fall below both bounds.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
DEFAULT_CASES = "naive:forward,fa1:forward,fa2:forward,fa3:forward,fa1:backward,fa3:backward,decode:forward"
UNITS = {"byte": 1.0, "bytes": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
         "kibyte": 2.0 ** 10, "mibyte": 2.0 ** 20, "gibyte": 2.0 ** 30}


# ----------------------------------------------------------------------------------------------------
# ncu output
# ----------------------------------------------------------------------------------------------------

def _value(text: str, unit: str) -> float:
    text = text.strip().replace(",", "")
    if not text or text.lower() in ("n/a", "nan"):
        return float("nan")
    return float(text) * UNITS.get(unit.strip().lower(), 1.0)


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels of an ``ncu --csv`` log (details page, one row per metric): [{id, name, read_bytes,
    write_bytes}] in profiling order. Lines that are not CSV (``==PROF==`` messages) are skipped."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    kernels: dict[int, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        metric = row.get("Metric Name")
        if metric not in METRICS:
            continue
        kid = int(row["ID"])
        k = kernels.setdefault(kid, {"id": kid, "name": row.get("Kernel Name") or row.get("Function Name") or "?",
                                     "read_bytes": 0.0, "write_bytes": 0.0})
        key = "read_bytes" if metric == METRICS[0] else "write_bytes"
        k[key] += _value(row.get("Metric Value", ""), row.get("Metric Unit", "byte"))
    return [kernels[i] for i in sorted(kernels)]


# ----------------------------------------------------------------------------------------------------
# the driver: one measured call between cudaProfilerStart and cudaProfilerStop
# ----------------------------------------------------------------------------------------------------

def _occupancy_info(impl: str, direction: str, headdim: int, dtype: str, causal: bool) -> dict:
    """SMs, L2 size and resident blocks per SM of the main cuflash kernel (wave size for the L2 bound)."""
    import cupy
    from cupy_backends.cuda.api import driver

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    info = {"gpu": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
            "sms": int(props["multiProcessorCount"]), "l2_bytes": int(props.get("l2CacheSize", 0)),
            "blocks_per_sm": None, "wave_blocks": None}
    if impl == "naive":
        return info
    from cuflash import decode, fa1, fa2, fa3
    from cuflash._jit import get_function

    if impl == "decode":
        variant = decode.fwd_variant(headdim, dtype, paged=False)
    elif impl == "fa3":  # the forward's persistent grid is about one block per SM: its wave is the grid
        variant = (fa3.fwd_variant(headdim, dtype, unmasked=not causal) if direction == "forward"
                   else fa3.bwd_variant(headdim, dtype, block_m=fa3.bwd_block_m(headdim, softcap=False)))
    else:
        family = fa1 if impl == "fa1" else fa2
        variant = (family.fwd_variant if direction == "forward" else family.bwd_variant)(headdim, dtype)
    fn = get_function(variant)
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, variant.threads, variant.smem_bytes)
    info.update(blocks_per_sm=int(per_sm), wave_blocks=int(per_sm) * info["sms"], kernel=variant.kernel)
    return info


def run_driver(args) -> int:
    import cupy
    import numpy as np
    from cupy_backends.cuda.api import runtime

    import cuflash
    from cuflash import reference

    dtype = {"bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    rng = np.random.default_rng(0)
    kv = args.kv_heads or args.heads

    def randn(shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

    q = randn((args.batch, args.seqlen_q or args.seqlen, args.heads, args.headdim))
    k, v = (randn((args.batch, args.seqlen, kv, args.headdim)) for _ in range(2))
    if args.impl == "decode":  # q over a full cache of args.seqlen keys, no new keys appended
        seqlens = cupy.full((args.batch,), args.seqlen, dtype=cupy.int32)

        def call():  # check=False: no copy of cache_seqlens to the host inside the measured call
            return cuflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=args.mask_causal,
                                                   num_splits=args.num_splits, check=False)
    elif args.impl in ("torch-flash", "torch-cudnn"):  # a peer's kernels (scripts/ncu_profile.sh cases)
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.FLASH_ATTENTION if args.impl == "torch-flash" else SDPBackend.CUDNN_ATTENTION
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2).requires_grad_(args.direction != "forward")
                      for x in (q, k, v))

        def sdpa():
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=args.mask_causal)
        if args.direction == "forward":
            call = sdpa
        else:
            out = sdpa()
            dout = torch.randn_like(out)

            def call():
                return torch.autograd.grad(out, (tq, tk, tv), dout, retain_graph=True)
    elif args.impl == "naive":
        if args.direction == "forward":
            def call():
                return reference.attention_naive(q, k, v, causal=args.mask_causal)
        else:
            out = reference.attention_naive(q, k, v, causal=args.mask_causal)
            dout = randn(q.shape)

            def call():
                return reference.attention_naive_backward(dout, q, k, v, out, causal=args.mask_causal)
    else:
        if args.direction == "forward":
            def call():
                return cuflash.flash_attn_func(q, k, v, causal=args.mask_causal, impl=args.impl)
        else:
            out, lse = cuflash.flash_attn_func(q, k, v, causal=args.mask_causal, return_lse=True, impl=args.impl)
            dout = randn(q.shape)

            def call():
                return cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=args.mask_causal, impl=args.impl)

    for _ in range(2):  # compile, then a warm call: the measured call allocates from CuPy's pool
        call()
    cupy.cuda.Device().synchronize()
    if args.info:
        Path(args.info).write_text(json.dumps(_occupancy_info(args.impl, args.direction, args.headdim, dtype,
                                                              args.mask_causal)))
    runtime.profilerStart()
    result = call()
    cupy.cuda.Device().synchronize()
    runtime.profilerStop()
    del result
    return 0


# ----------------------------------------------------------------------------------------------------
# the cases
# ----------------------------------------------------------------------------------------------------

def _cases(args) -> list[dict]:
    """The cases: ``seqlen`` keys, ``seqlen_q`` queries (N, or one for decode), ``num_splits`` for decode
    (the model's count for 132 SMs, which the driver passes on)."""
    out = []
    for item in args.cases.split(","):
        impl, _, direction = item.strip().partition(":")
        direction = direction or "forward"
        decode = impl == "decode"
        # one query sees every key with or without the causal mask: the same call, measured once
        causals = args.causals[:1] if decode else args.causals
        for d in args.headdims:
            for n in args.seqlens:
                for causal in causals:
                    case = dict(impl=impl, direction=direction, headdim=d, seqlen=n, seqlen_q=1 if decode else n,
                                causal=causal, batch=args.batch, heads=args.heads,
                                kv_heads=args.kv_heads or args.heads)
                    if decode:
                        case["num_splits"] = _predict(case, args.dtype)["tiles"]["num_splits"]
                    out.append(case)
    return out


def _predict(case: dict, dtype: str, wave_blocks=None) -> dict:
    from cuflash import iomodel

    return iomodel.predict(case["impl"], batch=case["batch"], heads=case["heads"], kv_heads=case["kv_heads"],
                           seqlen_q=case["seqlen_q"], seqlen_k=case["seqlen"], headdim=case["headdim"],
                           causal=case["causal"], direction=case["direction"], dtype_bytes=2,
                           wave_blocks=wave_blocks, naive_matmul="cupy" if dtype == "fp16" else "cublas",
                           num_splits=case.get("num_splits"))


def _label(case: dict) -> str:
    direction = "fwd" if case["direction"] == "forward" else "bwd"
    if case["impl"] == "decode":
        return (f"decode fwd d={case['headdim']} Sk={case['seqlen']} ({case['seqlen_q']} query, "
                f"{case['num_splits']} splits)")
    return f"{case['impl']} {direction} d={case['headdim']} N={case['seqlen']}{' causal' if case['causal'] else ''}"


def _ncu_command(args, case: dict, log: Path, info: Path) -> list[str]:
    driver = [sys.executable, str(Path(__file__).resolve()), "--driver", "--impl", case["impl"],
              "--direction", case["direction"], "--headdim", str(case["headdim"]), "--seqlen", str(case["seqlen"]),
              "--batch", str(case["batch"]), "--heads", str(case["heads"]), "--kv-heads", str(case["kv_heads"]),
              "--dtype", args.dtype, "--info", str(info)] + (["--mask-causal"] if case["causal"] else [])
    if case["impl"] == "decode":
        driver += ["--seqlen-q", str(case["seqlen_q"]), "--num-splits", str(case["num_splits"])]
    return [args.ncu, "--profile-from-start", "off", "--target-processes", "all", "--clock-control", "none",
            "--cache-control", args.cache_control, "--metrics", ",".join(METRICS), "--csv", "--print-units", "base",
            "--log-file", str(log)] + driver


def _measure(args, case: dict, workdir: Path, index: int) -> tuple[dict | None, dict, str]:
    log, info = workdir / f"case{index}.csv", workdir / f"case{index}.info.json"
    cmd = _ncu_command(args, case, log, info)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, {}, f"timed out after {args.timeout} s"
    text = log.read_text() if log.exists() else ""
    meta = json.loads(info.read_text()) if info.exists() else {}
    kernels = parse_ncu_csv(text)
    if proc.returncode != 0 or not kernels:
        tail = (proc.stdout + proc.stderr + text)[-2000:]
        return None, meta, f"ncu exit {proc.returncode}, {len(kernels)} kernels profiled: {tail}"
    measured = {"read_bytes": sum(k["read_bytes"] for k in kernels),
                "write_bytes": sum(k["write_bytes"] for k in kernels), "kernels": kernels}
    measured["bytes"] = measured["read_bytes"] + measured["write_bytes"]
    return measured, meta, ""


# ----------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------

def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.3f}"


def _markdown(rows: list[dict], args, meta: dict) -> str:
    lines = ["# cuflash IO model: predicted vs measured DRAM bytes", ""]
    gpu = meta.get("gpu") or "(dry run: nothing measured)"
    l2 = f", L2 {meta['l2_bytes'] / 2 ** 20:.0f} MiB" if meta.get("l2_bytes") else ""
    lines += [f"GPU: {gpu}{l2}; dtype {args.dtype}; batch {args.batch}, heads {args.heads}"
              f"{'' if not args.kv_heads else f', kv heads {args.kv_heads}'}; ncu --cache-control "
              f"{args.cache_control}, one call per case (cudaProfilerStart/Stop).", "",
              "predicted = no L2 reuse between thread blocks (upper bound; the ratio column divides by it); "
              "min = perfect L2 reuse over the whole kernel (compulsory bytes, lower bound); wave = perfect "
              "reuse within waves of SMs x resident blocks. Measured: dram__bytes_read.sum + "
              "dram__bytes_write.sum over every kernel of the call. GB = 1e9 bytes. The check takes the reads: "
              "the L2 is write-back, so output that fits in it can still be there when a kernel ends and its "
              "write bytes fall below the compulsory ones.", "",
              "| case | predicted GB | wave GB | min GB | measured read GB | measured write GB | measured GB "
              "| measured / predicted | reads within [min, predicted] | kernels |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        wave = r["predicted_wave"]["hbm_bytes_min"] if r.get("predicted_wave") else None
        if m is None:
            meas = ["-", "-", "-", "-", "-" if not r.get("error") else "error", "-"]
        else:
            inside = p["hbm_read_bytes_min"] * 0.95 <= m["read_bytes"] <= p["hbm_read_bytes"] * 1.05
            meas = [_gb(m["read_bytes"]), _gb(m["write_bytes"]), _gb(m["bytes"]), f"{m['bytes'] / p['hbm_bytes']:.2f}",
                    "yes" if inside else "no", str(len(m["kernels"]))]
        lines.append(f"| {r['label']} | {_gb(p['hbm_bytes'])} | {_gb(wave)} | {_gb(p['hbm_bytes_min'])} | "
                     + " | ".join(meas) + " |")
    per_kernel = [r for r in rows if r["measured"] and r["case"]["impl"] != "naive"]
    if per_kernel:
        lines += ["", "## cuflash kernels", "",
                  "| case | kernel | predicted read GB | min read GB | measured read GB | predicted write GB "
                  "| measured write GB |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in per_kernel:
            for mk in r["measured"]["kernels"]:
                pk = next((k for k in r["predicted"]["kernels"] if k["name"] in mk["name"]), None)
                if pk is None:
                    lines.append(f"| {r['label']} | {mk['name']} | - | - | {_gb(mk['read_bytes'])} | - | "
                                 f"{_gb(mk['write_bytes'])} |")
                    continue
                lines.append(f"| {r['label']} | {mk['name']} | {_gb(pk['read_bytes'])} | {_gb(pk['read_bytes_min'])} | "
                             f"{_gb(mk['read_bytes'])} | {_gb(pk['write_bytes'])} | {_gb(mk['write_bytes'])} |")
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += ["", "## errors", ""] + [f"- {r['label']}: {r['error'][:500]}" for r in errors]
    return "\n".join(lines) + "\n"


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="output folder (default: $OUT, else the current directory)")
    p.add_argument("--cases", default=DEFAULT_CASES, help=f"impl:direction list (default {DEFAULT_CASES})")
    p.add_argument("--headdims", type=_int_list, default=[128])
    p.add_argument("--seqlens", type=_int_list, default=[1024, 4096])
    p.add_argument("--causal", choices=("both", "true", "false"), default="both")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--quick", action="store_true", help="d = 128, N = 1024, no mask only")
    p.add_argument("--ncu", default="ncu", help="the ncu executable")
    p.add_argument("--cache-control", choices=("all", "none"), default="all",
                   help="ncu's L2 flush before each kernel (default all: cold L2, as the min bound assumes)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per ncu run")
    p.add_argument("--dry-run", action="store_true", help="print the ncu commands, write the predictions only")
    p.add_argument("--render", metavar="JSON", default=None,
                   help="rewrite iomodel_ncu.md from an earlier run's iomodel_ncu.json (no GPU, no ncu)")
    # driver mode (run under ncu)
    p.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="fa1", help=argparse.SUPPRESS)
    p.add_argument("--direction", default="forward", help=argparse.SUPPRESS)
    p.add_argument("--headdim", type=int, default=128, help=argparse.SUPPRESS)
    p.add_argument("--seqlen", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--seqlen-q", type=int, default=None, help=argparse.SUPPRESS)  # decode's queries
    p.add_argument("--num-splits", type=int, default=0, help=argparse.SUPPRESS)  # decode's KV splits
    p.add_argument("--info", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mask-causal", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.driver:
        args.causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
        if args.quick:
            args.headdims, args.seqlens, args.causals = [128], [1024], [False]
    return args


def render(path: Path, out: Path) -> int:
    """iomodel_ncu.md again from a run's JSON: the table's layout and checks may change after the device
    time; the measured numbers are the run's."""
    data = json.loads(path.read_text())
    rows, meta = data["cases"], data["meta"]
    first = rows[0]["case"]
    args = argparse.Namespace(dtype=data["dtype"], batch=first["batch"], heads=first["heads"],
                              kv_heads=None if first["kv_heads"] in (None, first["heads"]) else first["kv_heads"],
                              cache_control=meta.get("cache_control", "all"))
    md = _markdown(rows, args, meta)
    (out / "iomodel_ncu.md").write_text(md)
    print(md)
    print(f"wrote {out / 'iomodel_ncu.md'} from {path}")
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.driver:
        return run_driver(args)

    out = Path(args.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    if args.render:
        return render(Path(args.render), out)
    if not args.dry_run and shutil.which(args.ncu) is None:
        print(f"iomodel_ncu: {args.ncu!r} not found (install Nsight Compute or pass --ncu PATH); "
              "--dry-run writes the predictions only", file=sys.stderr)
        return 2
    rows, meta = [], {}
    with tempfile.TemporaryDirectory(prefix="iomodel_ncu_") as tmp:
        for i, case in enumerate(_cases(args)):
            row = {"label": _label(case), "case": case, "predicted": _predict(case, args.dtype), "measured": None,
                   "predicted_wave": None, "error": ""}
            if args.dry_run:
                log, info = Path(tmp) / f"case{i}.csv", Path(tmp) / f"case{i}.info.json"
                print(shlex.join(_ncu_command(args, case, log, info)))
            else:
                t0 = time.time()
                measured, info, error = _measure(args, case, Path(tmp), i)
                meta = {**meta, **{k: info[k] for k in ("gpu", "l2_bytes", "sms") if k in info}}
                row.update(measured=measured, error=error, device=info)
                if info.get("wave_blocks"):
                    row["predicted_wave"] = _predict(case, args.dtype, info["wave_blocks"])
                got = "error" if measured is None else f"{measured['bytes'] / 1e9:.3f} GB"
                print(f"{row['label']}: predicted {row['predicted']['hbm_bytes'] / 1e9:.3f} GB "
                      f"(min {row['predicted']['hbm_bytes_min'] / 1e9:.3f}), measured {got} [{time.time() - t0:.0f} s]",
                      flush=True)
                if error:
                    print(f"  {error[-400:]}", file=sys.stderr)
            rows.append(row)
    meta["cache_control"] = args.cache_control
    md = _markdown(rows, args, meta)
    (out / "iomodel_ncu.md").write_text(md)
    (out / "iomodel_ncu.json").write_text(json.dumps({"meta": meta, "dtype": args.dtype, "cases": rows}, indent=1))
    print(md)
    print(f"wrote {out / 'iomodel_ncu.md'} and {out / 'iomodel_ncu.json'}")
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
