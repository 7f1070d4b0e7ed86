#!/usr/bin/env python3
"""The layer's memory-bound stages against HBM bandwidth (issue 37 item 4), from bench_layer JSONs.

  python3 bench/reports/memory_stages.py --copy-tbs 4.3 run1.json [run2.json ...] > memory_stages.md

Per config, each stage's lowest median over the given runs, and the bandwidth it reaches for the
bytes it must move at the least (bf16 activations, fp32 logits; index and score traffic left out,
so the figure is an upper bound of what a kernel with extra traffic could show):
  aggregate  (forward)  reads the R = T*K expert output rows [R, d] and writes out [T, d]
  dx_sum     (backward) reads dX~ [R, d] and writes dx [T, d]
  router     (forward)  the router GEMM: reads x [T, d] and W [E, d], writes fp32 logits [T, E]
  routing    (forward)  reads the logits, writes K (index, score) pairs per token
`--copy-tbs`: the device-to-device copy bandwidth to compare with (H200: ~4.3 TB/s, device tool's
KINDS.md, counting bytes read and written; H100: ~3.0, gather_sum_bench).
`--before AB.json --before-commit C`: add, for the aggregation and the dx sum, the same stage of an
earlier build from a layer_ab.py JSON (its per-stage medians for commit C) and the speedup since.
"""

import argparse
import json


def stage_bytes(c):
    T, d, E, K = c["T"], c["d"], c["E"], c["K"]
    R = T * K
    return {
        "fwd.aggregate_ms": R * d * 2 + T * d * 2,
        "bwd.dx_sum_ms": R * d * 2 + T * d * 2,
        "fwd.router_gemm_ms": T * d * 2 + E * d * 2 + T * E * 4,
        "fwd.routing_ms": T * E * 4 + T * K * 8,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--copy-tbs", type=float, default=4.3)
    p.add_argument("--before", help="layer_ab.py JSON of an earlier build")
    p.add_argument("--before-commit", help="which of its commits (default: its 'b')")
    a = p.parse_args()
    before = {}
    if a.before:
        ab = json.load(open(a.before))
        bc = a.before_commit or ab["b"]
        for row in ab["rows"]:
            for st in ("fwd.aggregate", "bwd.dx_sum"):
                v = row.get("stages", {}).get(st, {}).get(bc)
                if v:
                    before.setdefault(row["config"], {})[st + "_ms"] = v
        before_label = bc
    best, meta = {}, {}
    for f in a.runs:
        doc = json.load(open(f))
        for r in doc["results"]:
            c, k = r["config"], r.get("kernels", {})
            b = best.setdefault(c["name"], {})
            meta.setdefault(c["name"], (c, doc.get("commit", "?")))
            for kk, v in k.items():
                if kk.endswith("_ms") and v > 0:
                    b[kk] = min(b.get(kk, v), v)
    names = {"fwd.aggregate_ms": "aggregate", "bwd.dx_sum_ms": "dx_sum", "fwd.router_gemm_ms": "router GEMM",
             "fwd.routing_ms": "routing"}
    print(f"Memory-bound stages: ms and TB/s (% of a {a.copy_tbs} TB/s copy) for the least bytes each must move; "
          "`share`: these four + the router's backward, as a fraction of the stage sum.\n")
    extra = [f"aggregate at {before_label}", f"dx_sum at {before_label}"] if before else []
    print("| config | commit | " + " | ".join(list(names.values()) + extra) + " | share |")
    print("|---|---|" + "---|" * (len(names) + len(extra)) + "---|")
    for n, k in best.items():
        c, commit = meta[n]
        if not k:  # a config that failed in every run: bench_layer wrote no stage times
            print(f"| {n} | {commit} | " + " | ".join("-" for _ in list(names) + extra) + " | - |")
            continue
        by = stage_bytes(c)
        cells = []
        for s in names:
            if s not in k:
                cells.append("-")
                continue
            tbs = by[s] / k[s] / 1e9
            cells.append(f"{k[s]:.3f} ms, {tbs:.2f} ({100 * tbs / a.copy_tbs:.0f}%)")
        for s in ("fwd.aggregate_ms", "bwd.dx_sum_ms") if before else ():
            old = before.get(n, {}).get(s)
            if old is None or s not in k:
                cells.append("-")
                continue
            tbs = by[s] / old / 1e9
            cells.append(f"{old:.3f} ms ({100 * tbs / a.copy_tbs:.0f}%), now x{old / k[s]:.2f}")
        total = sum(v for kk, v in k.items() if "." in kk)
        mem = sum(k.get(s, 0) for s in names) + k.get("bwd.router_bwd_ms", 0)
        share = f"{mem / total:.3f}" if total > 0 else "-"
        print(f"| {n} | {commit} | " + " | ".join(cells) + f" | {share} |")


if __name__ == "__main__":
    main()
