"""router_gemm_bench's JSON as a markdown table: per shape the layer's call (cublasGemmEx) and the fastest
cublasLt algorithm, each in ms and as a fraction of a copy of x, and what the fastest is (tile, stages,
split-K) so a rule can be read off.

Usage: python3 bench/reports/router_report.py router_gemm.json [--md out.md]
"""
import argparse
import json
import sys

LAYER = "gemmex (the layer's)"


def rows(doc):
    out = []
    for s in doc["shapes"]:
        vs = [v for v in s["variants"] if v["ms"] > 0]
        layer = next((v for v in vs if v["name"] == LAYER), None)
        lts = [v for v in vs if v["name"] != LAYER]
        best = min(lts, key=lambda v: v["ms"]) if lts else None
        out.append({"shape": f'{s["T"]}:{s["d"]}:{s["E"]}', "E": s["E"], "copy_tbs": s["copy_tbs"],
                    "layer": layer, "best": best, "algos": len(lts)})
    return out


def pct(v, copy_tbs):
    return 100.0 * v["tbs"] / copy_tbs if v else float("nan")


def markdown(doc):
    lines = [f'router_gemm_bench on {doc["device"]} at {doc["commit"]} (median of {doc["reps"]} reps, x from HBM '
             f'each rep); TB/s for x + W_r read and the logits written once; % of a copy of x.', "",
             "| T:d:E | copy TB/s | layer's gemmex ms (% copy) | fastest cublasLt ms (% copy) | layer / fastest "
             "| fastest: algo, tile, stages, split-K, swizzle | algos |",
             "|---|---|---|---|---|---|---|"]
    ratios = []
    for r in rows(doc):
        lay, best = r["layer"], r["best"]
        if lay and best:
            ratios.append(lay["ms"] / best["ms"])
        fmt = (lambda v: f'{v["ms"]:.4f} ({pct(v, r["copy_tbs"]):.0f}%)' if v else "n/a")
        what = (f'{best["algo_id"]}, {best["tile_id"]}, {best["stages_id"]}, {best["split_k"]}, {best["swizzle"]}'
                if best else "n/a")
        ratio = f'{lay["ms"] / best["ms"]:.2f}' if lay and best else "n/a"
        lines.append(f'| {r["shape"]} | {r["copy_tbs"]:.2f} | {fmt(lay)} | {fmt(best)} | {ratio} | {what} | '
                     f'{r["algos"]} |')
    if ratios:
        g = 1.0
        for x in ratios:
            g *= x
        g **= 1.0 / len(ratios)
        lines += ["", f"Geomean layer / fastest cublasLt: {g:.3f} over {len(ratios)} shapes "
                  f"(min {min(ratios):.2f}, max {max(ratios):.2f})."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--md", help="write the table here (default: stdout)")
    a = ap.parse_args(argv)
    md = markdown(json.load(open(a.json)))
    if a.md:
        open(a.md, "w").write(md)
    else:
        sys.stdout.write(md)


if __name__ == "__main__":
    main()
