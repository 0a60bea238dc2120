"""Where a kernel's warps wait, per SASS instruction, from the CSV that `NCU_SASS=REGEX
scripts/ncu_profile.sh` writes (ncu --page source --print-source sass --csv).

    python scripts/ncu_sass_stalls.py out/ncu-fa3-backward-d128-n8192-c0-sass.csv [--top 25]

Prints, per kernel in the file: the warp-stall samples summed by reason (share of all samples), the
instructions with the most samples (address, SASS, samples, top reasons), and the instructions with the
most excess global sectors (uncoalesced accesses).
"""
import argparse
import csv
import io
from collections import Counter


def kernels(path):
    """{kernel name: [row dict per instruction]}: the file holds one CSV table per kernel, each after a
    '"Kernel Name","<name>"' line; ncu's own messages (==PROF== ...) are skipped."""
    tables, name, lines = {}, None, []

    def close():
        if name is not None and lines:
            tables[name] = list(csv.DictReader(io.StringIO("".join(lines))))

    with open(path) as fh:
        for line in fh:
            if line.startswith("==") or not line.strip():
                continue
            if line.startswith('"Kernel Name"'):
                close()
                name, lines = next(csv.reader([line]))[1], []
            else:
                lines.append(line)
    close()
    return tables


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def report(name, rows, top):
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    by_reason = Counter()
    for r in rows:
        for k in reasons:
            by_reason[k] += number(r[k])
    total = sum(by_reason.values()) or 1.0
    print(f"== {name}: {len(rows)} instructions, {total:.0f} stall samples")
    print("  " + ", ".join(f"{k[6:]} {v / total:.0%}" for k, v in by_reason.most_common(8) if v))
    print(f"  top {top} instructions by samples:")
    for r in sorted(rows, key=lambda r: -number(r["Warp Stall Sampling (All Samples)"]))[:top]:
        samples = number(r["Warp Stall Sampling (All Samples)"])
        why = Counter({k[6:]: number(r[k]) for k in reasons}).most_common(2)
        print(f"  {r['Address'][-5:]} {samples / total:5.1%}  {r['Source'].strip()[:60]:60}  "
              + ", ".join(f"{k} {v:.0f}" for k, v in why if v))
    excess = [r for r in rows if number(r.get("L2 Theoretical Sectors Global Excessive")) > 0]
    if excess:
        print("  excess global sectors (uncoalesced):")
        for r in sorted(excess, key=lambda r: -number(r["L2 Theoretical Sectors Global Excessive"]))[:8]:
            print(f"  {r['Address'][-5:]} {number(r['L2 Theoretical Sectors Global Excessive']):12,.0f} of "
                  f"{number(r['L2 Theoretical Sectors Global']):12,.0f}  {r['Source'].strip()[:60]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for name, rows in kernels(args.csv).items():
        report(name, rows, args.top)


if __name__ == "__main__":
    main()
