#!/usr/bin/env python3
"""Where a kernel's warps wait, instruction by instruction: the top SASS lines of an ncu source page
(`ncu --import R --page source --print-source sass --csv`, NCU_SOURCE=1 scripts/device.sh ncu) by
warp-stall samples. The page holds one table per profiled kernel; each is summarised on its own.

Usage: python3 bench/reports/ncu_source_top.py ncu_<config>_source.csv [--top 25]
"""
import argparse
import csv


def tables(path):
    """Yield (title, header, rows) for each table of the page (a header row starts with Address or #)."""
    title, header, rows = "", None, []
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if not r:
                continue
            if any(c.strip() in ("Address", "# Address") for c in r[:3]) and any("Source" in c for c in r):
                if header:
                    yield title, header, rows
                header, rows = r, []
            elif header and len(r) == len(header):
                rows.append(r)
            else:
                if header:
                    yield title, header, rows
                    header, rows = None, []
                title = " ".join(r)[:160]
    if header:
        yield title, header, rows


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    for title, h, rows in tables(a.csv):
        samp = [i for i, c in enumerate(h) if "Sampling" in c and "All" in c] or \
               [i for i, c in enumerate(h) if "Sampling" in c]
        if not samp or not rows:
            continue
        si = samp[0]
        src = next(i for i, c in enumerate(h) if "Source" in c)
        total = sum(num(r[si]) for r in rows) or 1.0
        print(f"== {title}\n   {len(rows)} instructions, {total:.0f} samples ({h[si]})")
        # Per-reason columns (stall_*), if the page has them: the top three per line.
        reasons = [i for i, c in enumerate(h) if c.lower().startswith("stall") or "stall_" in c.lower()]
        for r in sorted(rows, key=lambda r: -num(r[si]))[: a.top]:
            why = sorted(((num(r[i]), h[i]) for i in reasons), reverse=True)[:3]
            why_s = ", ".join(f"{n} {v:.0f}" for v, n in why if v > 0)
            print(f"{num(r[si]) / total:6.1%}  {r[0]:>8}  {r[src][:70]:70}  {why_s}")


if __name__ == "__main__":
    main()
