#!/usr/bin/env python3
"""A group of new instances against the rest, from smoe_tune logs (the tuner's isolated medians).

  python3 bench/reports/candidate_group.py --kind da_dswiglu --group 'da_dswiglu<256>,da_dswiglu_c2<256>' LOG [LOG ...]

Per key of that GEMM kind that timed the group: the logged pick (*) and its time, the fastest other
candidate, the group's fastest, and rest / group (> 1: the group is faster). Then the geomean, range and
how many keys the group wins by >= 5% (the tuner's margin). Isolated times are L2-warm and per GEMM;
a rule built on them still needs the same-call layer A/B (bench/results/h200/tuner.md).
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from heuristic_fit import parse_log  # noqa: E402  (the tune log's one grammar)


def compare(keys, kind, group):
    """[(key, pick, pick ms, best other, its ms, best of group, its ms, rest / group)]."""
    out = []
    for k in keys:
        if k["kind"] != kind:
            continue
        g = {c: t for c, t in k["cands"].items() if c in group and math.isfinite(t)}
        r = {c: t for c, t in k["cands"].items() if c not in group and math.isfinite(t)}
        if not g or not r:
            continue
        bg, br = min(g, key=g.get), min(r, key=r.get)
        pick = k["logged"]
        out.append((k, pick, k["cands"].get(pick, float("nan")), br, r[br], bg, g[bg], r[br] / g[bg]))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+")
    p.add_argument("--kind", required=True)
    p.add_argument("--group", required=True, help="comma-separated candidate labels")
    a = p.parse_args()
    group = set(a.group.split(","))
    rows = compare([k for f in a.logs for k in parse_log(f)], a.kind, group)
    print("| config | N | K | pick | ms | fastest other | ms | fastest of group | ms | other / group |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k, pick, pt, br, rt, bg, gt, ratio in rows:
        print(f"| {k['config']} | {k['N']} | {k['K']} | {pick} | {pt:.4f} | {br} | {rt:.4f} | {bg} | {gt:.4f} | {ratio:.3f} |")
    if rows:
        logs = [math.log(r[-1]) for r in rows]
        wins = sum(r[-1] >= 1.05 for r in rows)
        print(f"\n{len(rows)} keys: other / group geomean {math.exp(sum(logs) / len(logs)):.3f} "
              f"(min {math.exp(min(logs)):.3f}, max {math.exp(max(logs)):.3f}); the group wins by >= 5% on {wins}")
    else:
        print("\nno key timed both the group and another candidate")


if __name__ == "__main__":
    main()
