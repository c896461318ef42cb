"""Where one kernel's warps stall, from the SASS source page tools/gpu_check.sh's NCU_DETAIL writes
($OUT/ncu-source-KERNEL.csv.gz: `ncu --page source --csv --print-source sass`): the stall reasons' shares of all
samples, then the SASS lines holding the most samples, in program order, each with its three largest reasons.

    python3 tools/ncu_stalls.py ncu-source-KERNEL.csv.gz [--lines 30]
"""
import argparse
import csv
import gzip
import signal
import sys
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"


def count(text: str) -> int:
    return int(text) if text.isdigit() else 0


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # read through `head`: its end is the reader's, not an error
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source_csv")
    ap.add_argument("--lines", type=int, default=30)
    args = ap.parse_args()
    try:
        with gzip.open(args.source_csv, "rt") as f:
            table = list(csv.reader(f))
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as e:
        sys.exit(f"ncu_stalls: {args.source_csv}: {e}")
    header = table[1] if len(table) > 1 else []  # the first row names the kernel
    col = {name: i for i, name in enumerate(header)}
    if SAMPLES not in col or "Source" not in col:
        sys.exit(f"ncu_stalls: {args.source_csv} is not ncu's source page with stall samples "
                 "(ncu --import REPORT --page source --csv --print-source sass)")
    lines = [row for row in table[2:] if len(row) == len(header)]
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]

    totals = Counter({name: sum(count(row[col[name]]) for row in lines) for name in reasons})
    everything = sum(totals.values())
    print(f"{table[0][1] if len(table[0]) > 1 else ''}: {len(lines)} SASS lines, {everything} samples")
    for name, n in totals.most_common(10):
        print(f"  {name[6:]:24s} {n:7d} {100 * n / max(everything, 1):5.1f}%")
    busiest = sorted(range(len(lines)), key=lambda i: -count(lines[i][col[SAMPLES]]))[:args.lines]
    for i in sorted(busiest):
        row = lines[i]
        top = sorted(((count(row[col[name]]), name[6:]) for name in reasons), reverse=True)[:3]
        print(f"{i:5d} {count(row[col[SAMPLES]]):6d}  {row[col['Source']].strip()[:60]:60s} "
              + " ".join(f"{name}:{n}" for n, name in top if n))


if __name__ == "__main__":
    main()
