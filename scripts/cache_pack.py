"""Compile every variant a GPU call needs here, on the CPU machine, and pack their disk-cache entries into one
tarball that the device call carries: the H200 machine then starts with a warm cache instead of spending
its first minutes (device time) in NVRTC.

    python scripts/cache_pack.py [--out .cache-pack/sm_90a.tar.xz] [--no-probes] [--jobs N]

Cache entries are keyed by the sources, the options, the arch and the NVRTC version (cuflash._jit.cache_key),
so run this under the device's NVRTC (13.0 on the H200 machine, e.g. with LD_PRELOAD of a pip-installed
nvidia-cuda-nvrtc 13.0 libnvrtc.so.13): an entry built by another NVRTC is never found there. Packed: every
variant of the package's tables for sm_90a, and (unless --no-probes) the variants the probes in
scripts/gpu_check.sh A/B beyond the tables. scripts/gpu_check.sh unpacks .cache-pack/*.tar.xz into
$CUFLASH_CACHE_DIR before its stages; the pack's directory is git-ignored (name it in the call's carry).
"""
import argparse
import os
import sys
import tarfile
from pathlib import Path

from cuflash import _jit, compile_report, fa2, heuristics

ARCH = "sm_90a"
DEVICE_NVRTC = (13, 0)


def probe_variants() -> list:
    """The variants the probes and tune stages and the exp2 GPU tests take beyond the tables."""
    sys.path.insert(0, str(Path(__file__).parent))
    import ab_probe
    import fa3_exp2_probe
    import tune_fa2
    import tune_fa2_bwd

    variants = list(fa3_exp2_probe.probe_variants([64, 128], [0, 8, 4, 2])) + ab_probe.list_variants()
    tables = (heuristics.FA2_TILES, heuristics.FA2_TILES_SM90, heuristics.FA2_BWD_TILES, heuristics.FA2_BWD_TILES_PLAIN,
              heuristics.FA2_BWD_TILES_PLAIN_SM90)
    with ab_probe.tables_edited(tables, lambda table: None):  # (the edits below undone after)
        # the tune stage's FA2 candidates (each script's use() sets the tables the same way)
        for d in tune_fa2.CANDIDATES:
            for tiles in tune_fa2.CANDIDATES[d]:
                heuristics.FA2_TILES[d] = tiles
                heuristics.FA2_TILES_SM90.pop(d, None)
                variants.append(fa2.fwd_variant(d, "bfloat16"))
        for d in tune_fa2_bwd.CANDIDATES:
            heuristics.FA2_BWD_TILES_PLAIN.pop(d, None)
            heuristics.FA2_BWD_TILES_PLAIN_SM90.pop(d, None)
            for tiles in tune_fa2_bwd.CANDIDATES[d]:
                heuristics.FA2_BWD_TILES[d] = tiles
                variants.append(fa2.bwd_variant(d, "bfloat16"))
    return variants


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache-pack") / f"{ARCH}.tar.xz")
    parser.add_argument("--no-probes", action="store_true")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    args = parser.parse_args()
    if _jit.nvrtc_version() != DEVICE_NVRTC:
        sys.exit(f"NVRTC {_jit.nvrtc_version()} here, {DEVICE_NVRTC} on the device: its entries would never "
                 "be found there (load the device's libnvrtc first, see the docstring)")
    variants = list(dict.fromkeys(compile_report.all_variants(ARCH) + ([] if args.no_probes else probe_variants())))
    missing = [v for v in variants if not _jit.entry_path(v, ARCH).is_file()]
    print(f"{len(variants)} variants, {len(missing)} to compile ({args.jobs} at a time)", flush=True)
    rows = compile_report.compile_variants(missing, ARCH, args.jobs)
    bad = [f"{r['name']}: {compile_report.problems(r)}" for r in rows if compile_report.problems(r)]
    if bad:
        print("problems (packed all the same):", *bad, sep="\n  ")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(args.out, "w:xz") as tar:
        for v in variants:
            path = _jit.entry_path(v, ARCH)
            tar.add(path, arcname=path.name)
    size = sum(_jit.entry_path(v, ARCH).stat().st_size for v in variants)
    print(f"{args.out}: {len(variants)} entries, {size / 2**20:.0f} MiB -> {args.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
