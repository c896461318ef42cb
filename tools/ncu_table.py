"""Nsight Compute's serialized kernel times, summed by kernel name: the table behind "where a
pass's GPU time goes" when the pass is bound by Python's launches (tools/profile_kernels.py's
events then show the host's pace). Reads the CSV of

    ncu --clock-control none --cache-control none --csv \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum --log-file X.csv COMMAND

and prints one markdown row a kernel name, longest total first:

    python3 tools/ncu_table.py X.csv [--skip N] [--count M]

--skip/--count select launches by their order in the log (ncu's ID), e.g. one pass of several.
"""
import argparse
import csv
import re
import sys
from collections import defaultdict

UNITS = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "nsecond": 1e-3,
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def launches(path: str) -> dict[int, dict]:
    """ncu ID -> {"name", "us", "bytes"}; the log's lines before its CSV header are ncu's own."""
    try:
        with open(path, newline="") as f:
            lines = f.read().splitlines()
    except OSError as e:
        sys.exit(f"ncu_table: cannot read {path}: {e.strerror}")
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"ncu_table: no CSV header in {path}")
    try:
        return _by_id(csv.DictReader(lines[start:]))
    except (KeyError, ValueError) as e:
        sys.exit(f"ncu_table: {path} is not the CSV of ncu --csv --metrics (at {e})")


def _by_id(rows) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for row in rows:
        k = int(row["ID"])
        entry = out.setdefault(k, {"name": re.sub(r"\(.*", "", row["Kernel Name"]), "us": 0.0, "bytes": 0.0})
        value = float(row["Metric Value"].replace(",", "") or 0) * UNITS.get(row["Metric Unit"], 1.0)
        if row["Metric Name"] == "gpu__time_duration.sum":
            entry["us"] = value
        elif row["Metric Name"] == "dram__bytes_read.sum":
            entry["bytes"] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--count", type=int, default=None)
    args = ap.parse_args()
    rows = sorted(launches(args.csv).items())[args.skip:]
    rows = rows[:args.count] if args.count is not None else rows
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0])
    for _, e in rows:
        acc = by_name[e["name"]]
        acc[0] += 1
        acc[1] += e["us"]
        acc[2] += e["bytes"]
    total = sum(v[1] for v in by_name.values())
    print("| kernel | launches | us | share | us a launch | DRAM read GB/s |\n|---|---|---|---|---|---|")
    for name, (n, us, b) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {n} | {us:.1f} | {us / total:.1%} | {us / n:.2f} | {b / us / 1e3 if us else 0:.0f} |")
    print(f"| all | {sum(v[0] for v in by_name.values())} | {total:.1f} | | | |")


if __name__ == "__main__":
    main()
