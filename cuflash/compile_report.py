"""``python -m cuflash compile``: build every registered kernel variant offline, report its machine code.

Needs no GPU: NVRTC compiles for the requested arch, ptxas's ``-v`` report (in the NVRTC log) gives
registers, static shared memory, spill bytes and performance advisories, and ``nvdisasm`` (from the
``nvidia-cuda-nvdisasm`` wheel or the PATH) gives the instruction mix.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import _bwd_aux, decode, fa1, fa2, fa3, fp8
from ._jit import Compiled, CompileError, Variant, compile_variant

# Every kernel family contributes its variants for an arch here (Hopper-only families return none for
# other archs).
VARIANT_SOURCES = {
    "fa1": lambda arch: fa1.all_variants(),
    "fa2": fa2.all_variants,
    "fa3": fa3.all_variants,
    "bwd_aux": lambda arch: _bwd_aux.all_variants(sorted(set(fa1.HEADDIMS) | set(fa2.HEADDIMS))),
    "decode": decode.all_variants,  # 14 attention (tiles fitted to the arch) + 4 append/rotary + 3 combine
    "fp8": fp8.all_variants,  # quantisation to e4m3 (sm_89 and newer): 2 dtypes x 3 head dims x rotation on/off
}

# Opcodes that show a kernel uses the hardware it was written for. A plain name counts every instruction
# whose opcode starts with it (HMMA counts HMMA.16816.F32.BF16); a name with modifiers counts the
# instructions whose full mnemonic starts with it (F2FP.SATFINITE.E4M3: the fp32 -> e4m3 conversion, not
# the bf16/fp16 packing that is F2FP too).
OPCODES = ("HMMA", "HGMMA", "QGMMA", "LDGSTS", "LDSM", "UTMALDG", "UTMASTG", "UTMAREDG", "USETMAXREG",
           "F2FP.SATFINITE.E4M3")
# ptxas advisories that mean a wgmma got serialised (the kernel then runs far below its design).
SERIALISING_ADVISORIES = ("C7517", "C7510", "wgmma.wait_group", "serialized", "serialised")


def all_variants(arch: str, family: str | None = None) -> list[Variant]:
    out = []
    for name, source in VARIANT_SOURCES.items():
        if family in (None, name):
            out += source(arch)
    return out


def _log_section(log: str, kernel: str) -> str:
    """The part of a ptxas log that describes entry function ``kernel``."""
    parts = re.split(r"(?=ptxas info\s*: Compiling entry function)", log)
    for part in parts:
        if f"'{kernel}'" in part.split("\n", 1)[0]:
            return part
    return log


def parse_ptxas_log(log: str, kernel: str) -> dict:
    section = _log_section(log, kernel)
    regs = re.search(r"Used (\d+) registers", section)
    smem = re.search(r"(\d+) bytes smem", section)
    spill_st = re.search(r"(\d+) bytes spill stores", section)
    spill_ld = re.search(r"(\d+) bytes spill loads", section)
    stack = re.search(r"(\d+) bytes stack frame", section)
    advisories = [line.strip() for line in log.splitlines()
                  if any(key in line for key in SERIALISING_ADVISORIES) or "warning" in line.lower()]
    return {
        "regs": int(regs.group(1)) if regs else None,
        "static_smem": int(smem.group(1)) if smem else 0,
        "spill_bytes": (int(spill_st.group(1)) if spill_st else 0) + (int(spill_ld.group(1)) if spill_ld else 0),
        "stack_bytes": int(stack.group(1)) if stack else 0,
        "advisories": advisories,
    }


def find_tool(name: str) -> str | None:
    """``nvdisasm``/``cuobjdump`` from the NVIDIA pip wheels, else from the PATH."""
    try:
        import nvidia

        for base in nvidia.__path__:
            for sub in ("cu13", "cuda_nvdisasm", "cuda_cuobjdump", "cu12"):
                cand = Path(base) / sub / "bin" / name
                if cand.is_file() and os.access(cand, os.X_OK):
                    return str(cand)
    except ImportError:
        pass
    return shutil.which(name)


def count_opcodes(cubin: bytes, ops: tuple[str, ...] = OPCODES) -> dict[str, int] | None:
    """Occurrences of each opcode in ``ops`` (prefix match: HMMA.16816.F32.BF16 counts as HMMA; see OPCODES);
    None without nvdisasm."""
    tool = find_tool("nvdisasm")
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(cubin)
        path = fh.name
    try:
        sass = subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    counts = collections.Counter()
    for m in re.finditer(r"^\s*(?:/\*[0-9a-f]+\*/)?\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.MULTILINE):
        counts[m.group(1)] += 1  # the full mnemonic, modifiers included

    def matches(mnemonic: str, op: str) -> bool:
        return (mnemonic if "." in op else mnemonic.split(".")[0]).startswith(op)

    return {op: sum(n for name, n in counts.items() if matches(name, op)) for op in ops}


def report_variant(variant: Variant, arch: str) -> dict:
    row = {"name": variant.name, "family": variant.family, "kernel": variant.kernel, "arch": arch,
           "threads": variant.threads, "dynamic_smem": variant.smem_bytes}
    try:
        compiled: Compiled = compile_variant(variant, arch)
    except CompileError as exc:
        return row | {"ok": False, "error": str(exc), "regs": None, "smem": None, "spill_bytes": None,
                      "opcodes": {}}
    info = parse_ptxas_log(compiled.log, variant.kernel)
    return row | {
        "ok": True,
        "regs": info["regs"],
        "smem": info["static_smem"] + variant.smem_bytes,
        "static_smem": info["static_smem"],
        "spill_bytes": info["spill_bytes"],
        "stack_bytes": info["stack_bytes"],
        "advisories": info["advisories"],
        "opcodes": count_opcodes(compiled.cubin) or {},
    }


def problems(row: dict) -> list[str]:
    """Why a report row fails the static checks (empty when it passes)."""
    if not row["ok"]:
        return ["compile failed"]
    out = []
    if row["spill_bytes"]:
        out.append(f"{row['spill_bytes']} spill bytes")
    if row["stack_bytes"]:
        out.append(f"{row['stack_bytes']} bytes of stack (local memory)")
    if any(any(k in a for k in SERIALISING_ADVISORIES) for a in row.get("advisories", [])):
        out.append("wgmma serialised by ptxas")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", default="sm_90a", help="target, e.g. sm_80, sm_90a (default sm_90a)")
    parser.add_argument("--family", default=None, help="only this kernel family (e.g. fa1)")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compile this many variants at once (default: one per CPU core)")


def _print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"cuflash kernel variants for {rows[0]['arch'] if rows else '?'}")
    for col in ("variant", "threads", "regs", "smem", "spill", *OPCODES, "status"):
        table.add_column(col, justify="left" if col in ("variant", "status") else "right")
    for r in rows:
        ops = r.get("opcodes") or {}
        bad = problems(r)
        table.add_row(escape(r["name"]), str(r["threads"]), str(r["regs"]), str(r["smem"]), str(r["spill_bytes"]),
                      *(str(ops.get(op, "-")) for op in OPCODES),
                      "[red]" + "; ".join(bad) + "[/red]" if bad else "[green]ok[/green]")
    console = Console()
    if not console.is_terminal:
        console = Console(width=220)  # logs and CI: no terminal to fit, keep variant names whole
    console.print(table)


def compile_all(arch: str, family: str | None = None, jobs: int = 1) -> list[dict]:
    """One report row per variant of the package's tables (compile_variants)."""
    return compile_variants(all_variants(arch, family), arch, jobs)


def compile_variants(variants: list[Variant], arch: str, jobs: int = 1) -> list[dict]:
    """One report row per variant. NVRTC is single-threaded per program, so ``jobs`` worker processes
    compile in parallel; each writes its cubin to the shared disk cache (which is what warms it)."""
    variants = list(variants)
    if jobs <= 1 or len(variants) <= 1:
        return [report_variant(v, arch) for v in variants]
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        return list(pool.map(report_variant, variants, [arch] * len(variants)))


def run(args) -> int:
    rows = compile_all(args.arch, args.family, getattr(args, "jobs", 1))
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
    else:
        _print_table(rows)
    failed = [r for r in rows if problems(r)]
    for r in failed:
        print(f"FAILED {r['name']} ({r['arch']}): {'; '.join(problems(r))}", file=sys.stderr)
        if not r["ok"]:
            print(r["error"], file=sys.stderr)
    return 1 if failed else 0


def run_offline_check(arch: str = "sm_90a") -> int:
    """The no-GPU main job: the compile report for ``arch`` as a table."""
    return run(argparse.Namespace(arch=arch, family=None, json=False, jobs=os.cpu_count() or 1))
