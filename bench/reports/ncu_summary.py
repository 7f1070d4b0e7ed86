#!/usr/bin/env python3
"""One line per kernel from an Nsight Compute report's raw page (`ncu --import R --csv --page raw`,
scripts/device.sh ncu): duration, SM / memory / L2 / DRAM throughput in % of peak, achieved
occupancy, and the three largest warp stall reasons (cycles per issued instruction), as a markdown
table. Which limiter to read from it: SM% high = compute-bound (tensor pipe); L2% or DRAM% near
their peak with SM% low = memory-bound; both low with long_scoreboard / barrier stalls = latency
(loads waited on, or warpgroups waiting for each other).

    python3 bench/reports/ncu_summary.py out/ncu_OLMoE-7B.csv
"""
import csv
import re
import sys

# (column header, metric name in the raw page, scale): the first name present wins.
COLUMNS = [
    ("us", ["gpu__time_duration.sum"], 1e-3),   # raw unit ns (scaled if the unit row says usecond)
    ("SM%", ["sm__throughput.avg.pct_of_peak_sustained_elapsed"], 1),
    ("mem%", ["gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"], 1),
    ("L2%", ["lts__throughput.avg.pct_of_peak_sustained_elapsed"], 1),
    ("DRAM%", ["gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed"], 1),
    ("occ%", ["sm__warps_active.avg.pct_of_peak_sustained_active"], 1),
]
# Shown only where the report has them (NCU_FLAGS='--metrics dram__bytes_read.sum,dram__bytes_write.sum'):
# the bytes a kernel moved to and from DRAM, in GB, to set beside what it must move.
BYTE_COLUMNS = [("DRAM rd GB", "dram__bytes_read.sum"), ("DRAM wr GB", "dram__bytes_write.sum")]
BYTE_SCALE = {"byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0, "Tbyte": 1e3}
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
TIME_SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def number(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return None


def short_name(name, width=70):
    """engine_kernel<...Traits...> names are long: keep the template's telling parts, the epilogue
    (which GEMM of the layer it is) included where the cut would drop it."""
    n = re.sub(r"\s+", " ", name)
    n = n.replace("smoe::engine::", "").replace("cute::", "").replace("(anonymous namespace)::", "")
    if len(n) <= width:
        return n
    epi = re.findall(r"\bEpi\w+", n)
    tail = f" {epi[-1]}" if epi and epi[-1] not in n[: width - 3] else ""
    return n[: width - 3 - len(tail)] + "..." + tail


def read_raw(path):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r and not r[0].startswith("==")]
    no_kernels = f"{path}: no kernels (an ncu raw CSV has a header, a unit row, then a row per kernel)"
    if len(rows) < 2:
        raise SystemExit(no_kernels)
    header, units = rows[0], rows[1]
    has_units = all(number(u) is None for u in units[3:]) and "Kernel Name" not in units
    data = rows[2:] if has_units else rows[1:]
    if not data:
        raise SystemExit(no_kernels)
    unit_of = dict(zip(header, units)) if has_units else {}
    return header, unit_of, data


def summarize(path):
    header, unit_of, data = read_raw(path)
    idx = {h: i for i, h in enumerate(header)}
    kcol = idx.get("Kernel Name")
    if kcol is None:
        raise SystemExit(f"{path}: no 'Kernel Name' column")
    stall_cols = [(m.group(1), i) for h, i in idx.items() for m in [STALL.match(h)] if m]
    byte_cols = [(col, idx[name], BYTE_SCALE.get(unit_of.get(name, "byte"), 1e-9))
                 for col, name in BYTE_COLUMNS if name in idx]
    heads = [c[0] for c in COLUMNS] + [c[0] for c in byte_cols]
    out = ["| # | kernel | " + " | ".join(heads) + " | top stalls (cycles / issue) |",
           "|---|---|" + "---|" * len(heads) + "---|"]
    for k, row in enumerate(data):
        cells = []
        for col, names, scale in COLUMNS:
            v = None
            for name in names:
                if name in idx and idx[name] < len(row):
                    v = number(row[idx[name]])
                    if col == "us":
                        scale = TIME_SCALE.get(unit_of.get(name, "nsecond"), scale)
                    break
            cells.append("-" if v is None else f"{v * scale:.1f}")
        for _, i, scale in byte_cols:
            v = number(row[i]) if i < len(row) else None
            cells.append("-" if v is None else f"{v * scale:.2f}")
        stalls = sorted(((number(row[i]) or 0.0, n) for n, i in stall_cols if i < len(row)), reverse=True)[:3]
        top = ", ".join(f"{n} {v:.1f}" for v, n in stalls if v > 0) or "-"
        out.append(f"| {k} | {short_name(row[kcol])} | " + " | ".join(cells) + f" | {top} |")
    return "\n".join(out)


def main(argv):
    if len(argv) != 2:
        raise SystemExit(__doc__)
    print(summarize(argv[1]))


if __name__ == "__main__":
    main(sys.argv)
