#!/usr/bin/env python3
"""A same-call layer A/B of two builds from bench_layer JSONs, into one JSON and a markdown table.

  python3 bench/reports/layer_ab.py --a old=old_configs_1.json,old_configs_2.json,... \
      --b new=new_configs_1.json,new_configs_2.json,... --commit <a>..<b> --device "NVIDIA H100" \
      --command "<how it ran>" --out ab.json --md ab.md

The passes of each side ran interleaved in one device call (a, b, a, b). Per config and side the
lowest of its passes' fwd+bwd medians is kept, so one slow pass moves nothing, and every pass's own
ratio is listed too. The weight-gradient stages (dW1 + dW2, varlen-K) are reported beside it: where
the two builds run the same dW kernels, their ratio is this A/B's noise (on the H100 whole passes
moved by up to 10% with the GPU's clock). A second table gives every GEMM stage's ratio per config
beside one expert's weight bytes (W1: 2n x d bf16; W2 and the down-proj / dA' GEMMs hold half of it),
for rules that depend on them (e.g. the varlen-M tile order's bands). With two passes or more a third
table splits every GEMM stage's ratio into the odd and the even rounds: `scripts/device.sh ab` reverses
the sides' order in even rounds (AB_ORDER=alternate), so a ratio that holds in both halves is not a
side's position in the round (on the H100 two variants of one binary measured the same dW kernels
4-7% apart in geomean when they always ran second and third: bench/results/h100/dswiglu_staged_ab.json).
"""

import argparse
import json
import math


def load(paths):
    """[{name: (fwd+bwd ms, kernels)}] per pass."""
    out = []
    for p in paths:
        runs = {}
        for r in json.load(open(p))["results"]:
            s = r.get("systems", {}).get("ours")
            if not s or "fwd_ms" not in s:  # a config bench_layer could not run (it records {"error": ...})
                continue
            runs[r["config"]["name"]] = (s["fwd_ms"] + s["bwd_ms"], r["kernels"], r["config"])
        out.append(runs)
    return out


def side(arg):
    name, paths = arg.split("=", 1)
    return name, load([p for p in paths.split(",") if p])


def fmt(v):
    return "-" if v is None else f"{v:.3f}"


GEMM_STAGES = ("fwd.up_proj", "fwd.down_proj", "bwd.dA_proj", "bwd.dX_proj", "bwd.dW1", "bwd.dW2")


def w1_mib(cfg):
    """One expert's W1 (gate + up: 2n x d bf16) in MiB; None where the config lacks d or n."""
    if "d" not in cfg or "n" not in cfg:
        return None
    return 2 * cfg["n"] * cfg["d"] * 2 / 2**20


def geomean(v):
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else None


def odd_even(pa, pb, name):
    """Per GEMM stage [a / b over rounds 1, 3, ..., a / b over rounds 2, 4, ...] (lowest pass per side
    within each half); {} with fewer than two rounds."""
    out = {}
    if min(len(pa), len(pb)) < 2:
        return out
    for k in GEMM_STAGES:
        half = []
        for start in (0, 1):
            va = min((p[name][1].get(k + "_ms", math.inf) for p in pa[start::2]), default=math.inf)
            vb = min((p[name][1].get(k + "_ms", math.inf) for p in pb[start::2]), default=math.inf)
            half.append(va / vb if math.isfinite(va) and math.isfinite(vb) and vb > 0 else None)
        if None not in half:
            out[k] = half
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="name=pass1.json,pass2.json,... (the baseline)")
    ap.add_argument("--b", required=True, help="name=pass1.json,pass2.json,... (the change)")
    ap.add_argument("--commit", default="")
    ap.add_argument("--device", default="")
    ap.add_argument("--command", default="")
    ap.add_argument("--out")
    ap.add_argument("--md")
    args = ap.parse_args()
    (na, pa), (nb, pb) = side(args.a), side(args.b)
    if na == nb:
        ap.error("--a and --b need different names (they key the rows and stages)")
    rows = []
    for name in pa[0]:
        if not all(name in p for p in pa + pb):
            continue
        ta = min(p[name][0] for p in pa)
        tb = min(p[name][0] for p in pb)
        passes = [a[name][0] / b[name][0] for a, b in zip(pa, pb)]
        stages = {}
        for k in pa[0][name][1]:
            va = min(p[name][1].get(k, math.inf) for p in pa)
            vb = min(p[name][1].get(k, math.inf) for p in pb)
            if math.isfinite(va) and math.isfinite(vb) and vb > 0:
                stages[k.replace("_ms", "")] = {na: va, nb: vb}
        dw = lambda s: sum(stages.get(k, {}).get(s, 0.0) for k in ("bwd.dW1", "bwd.dW2"))  # noqa: E731
        rows.append({"config": name, "w1_mib": w1_mib(pa[0][name][2]), na + "_ms": ta, nb + "_ms": tb,
                     "speedup": ta / tb, "per_pass": passes,
                     "dw_ratio": dw(na) / dw(nb) if dw(nb) > 0 else None, "stages": stages,
                     "stages_odd_even": odd_even(pa, pb, name)})
    speed = [r["speedup"] for r in rows]
    summary = {"configs": len(rows), "geomean": geomean(speed), "min": min(speed, default=None),
               "max": max(speed, default=None), "dw_geomean": geomean([r["dw_ratio"] for r in rows if r["dw_ratio"]])}
    doc = {"commit": args.commit, "device": args.device, "command": args.command, "a": na, "b": nb,
           "summary": summary, "rows": rows}
    if args.out:
        json.dump(doc, open(args.out, "w"), indent=1)
    md = [f"# Layer A/B: {na} vs {nb} ({args.commit}, {args.device})", "",
          f"fwd+bwd ms, the lowest of {len(pa)} interleaved passes per side; speedup = {na} / {nb}. "
          f"`dW` = the dW1 + dW2 stages' ratio (varlen-K: the noise where both run the same kernels). "
          f"Stages listed where >= 0.3 ms and moved by more than 4%.", "",
          f"Geomean speedup {fmt(summary['geomean'])} over {summary['configs']} configs "
          f"(min {fmt(summary['min'])}, max {fmt(summary['max'])}); dW geomean {fmt(summary['dw_geomean'])}.", "",
          f"| config | {na} ms | {nb} ms | speedup | per pass | dW | stages moved |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        moved = " ".join(f"{k} x{v[na] / v[nb]:.2f}" for k, v in r["stages"].items()
                         if v[na] >= 0.3 and v[nb] > 0 and abs(v[na] / v[nb] - 1) > 0.04)
        dwr = f"{r['dw_ratio']:.3f}" if r["dw_ratio"] else "-"
        md.append(f"| {r['config']} | {r[na + '_ms']:.3f} | {r[nb + '_ms']:.3f} | {r['speedup']:.3f} | "
                  f"{' / '.join(f'{x:.3f}' for x in r['per_pass'])} | {dwr} | {moved or '-'} |")
    md += ["", f"Every GEMM stage: {na} / {nb} (lowest pass per side), with one expert's W1 in MiB (the down-proj "
           f"and dA' GEMMs' weights are half of it).", "",
           "| config | W1 MiB | " + " | ".join(k.split(".")[1] for k in GEMM_STAGES) + " |",
           "|---|---|" + "---|" * len(GEMM_STAGES)]
    for r in rows:
        cells = []
        for k in GEMM_STAGES:
            v = r["stages"].get(k)
            cells.append(f"{v[na] / v[nb]:.2f}" if v and v[nb] > 0 else "-")
        w = f"{r['w1_mib']:.1f}" if r["w1_mib"] is not None else "-"
        md.append(f"| {r['config']} | {w} | " + " | ".join(cells) + " |")
    split = [r for r in rows if r["stages_odd_even"]]
    if split:
        off = [(r["config"], k) for r in split for k, (o, e) in r["stages_odd_even"].items() if abs(o / e - 1) > 0.03]
        md += ["", f"Every GEMM stage's {na} / {nb}, odd rounds / even rounds (device.sh ab reverses the sides' "
               f"order in even rounds): {len(off)} of {sum(len(r['stages_odd_even']) for r in split)} stage "
               f"ratios differ by more than 3% between the halves.", "",
               "| config | " + " | ".join(k.split(".")[1] for k in GEMM_STAGES) + " |",
               "|---|" + "---|" * len(GEMM_STAGES)]
        for r in split:
            cells = [f"{v[0]:.2f} / {v[1]:.2f}" if (v := r["stages_odd_even"].get(k)) else "-" for k in GEMM_STAGES]
            md.append(f"| {r['config']} | " + " | ".join(cells) + " |")
    text = "\n".join(md) + "\n"
    if args.md:
        open(args.md, "w").write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
