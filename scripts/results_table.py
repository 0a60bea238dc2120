"""Markdown summary of committed bench JSON (for README / NOTES snapshots): TFLOP/s per impl at one N.

    python scripts/results_table.py bench/results/h200-prefill.json 8192
"""
import json
import sys


def main(path: str, seqlen: int) -> None:
    rows = json.load(open(path))
    impls = [i for i in ("cuflash-fa1", "cuflash-fa2", "cuflash-fa3", "torch-flash", "torch-cudnn", "torch-efficient", "naive")
             if any(r["impl"] == i for r in rows)]
    idx = {(r["headdim"], r["causal"], r["impl"]): r for r in rows if r["seqlen_q"] == seqlen}
    print("| d | causal | " + " | ".join(impls) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in impls) + " |")
    for d in sorted({k[0] for k in idx}):
        for causal in (False, True):
            cells = []
            for i in impls:
                r = idx.get((d, causal, i))
                cells.append(f"{r['tflops']:.0f}" if r and r.get("tflops") else "—")
            print(f"| {d} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
