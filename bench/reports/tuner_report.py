#!/usr/bin/env python3
"""The engine tuner's evidence: what `smoe_tune` measured per GEMM key, and a layer A/B of the
heuristic against the tuned cache, into one JSON and a markdown table.

  python3 bench/reports/tuner_report.py --commit <sha> --device "NVIDIA H200" \
      --set public tune.log heur_1.json,heur_2.json tuned_1.json,tuned_2.json \
      [--set wide ...] --out bench/results/h200/tuner.json --md bench/results/h200/tuner.md

tune.log     : build/smoe_tune's stdout (SMOE_ENGINE_TUNE_CACHE=<new file> build/smoe_tune <configs>)
heur_*.json  : build/bench_layer --out ... with SMOE_ENGINE_TUNE=0 (the heuristic)
tuned_*.json : build/bench_layer --out ... with SMOE_ENGINE_TUNE_CACHE=<the file smoe_tune wrote>
The A/B runs alternate (heuristic, tuned, heuristic, tuned) in one call; per system and stage the
report keeps the lowest of the passes' medians, so one slow pass (clock, a neighbour) moves nothing.
"""

import argparse
import json
import math
import re

KEY_RE = re.compile(r"^  (\S+) N=(\d+) K=(\d+) E=(\d+) rows_bucket=(\d+) halves=(\d) sm_count=(\d+)")
CAND_RE = re.compile(r"^\s+(\*)?\s*(\S+)\s+([\d.]+|inf|nan) ms(\s+<- winner)?")  # inf: a candidate that failed
CONFIG_RE = re.compile(r"^(\S.*): T=(\d+) d=(\d+) n=(\d+) E=(\d+) K=(\d+)")


def parse_tune_log(path):
    """[{config, kind, N, K, E, rows_bucket, halves, candidates: [{config, ms, heuristic}], chosen}]"""
    keys, cfg, cur = [], None, None
    for line in open(path):
        m = CONFIG_RE.match(line)
        if m:
            cfg = m.group(1)
            continue
        m = KEY_RE.match(line)
        if m:
            cur = {"config": cfg, "kind": m.group(1), "N": int(m.group(2)), "K": int(m.group(3)),
                   "E": int(m.group(4)), "rows_bucket": int(m.group(5)), "halves": m.group(6) == "1",
                   "candidates": [], "chosen": None}
            keys.append(cur)
            continue
        m = CAND_RE.match(line)
        if m and cur is not None:
            cur["candidates"].append({"config": m.group(2), "ms": float(m.group(3)), "heuristic": bool(m.group(1))})  # float("inf") parses
            if m.group(4):
                cur["chosen"] = m.group(2)
    for k in keys:
        c = k["candidates"]
        finite = lambda v: v is not None and math.isfinite(v)  # noqa: E731
        heur = next((x["ms"] for x in c if x["heuristic"]), None)
        best = min((x["ms"] for x in c if finite(x["ms"])), default=None)
        chosen = next((x["ms"] for x in c if x["config"] == k["chosen"]), None)
        k["heuristic_over_fastest"] = heur / best if finite(heur) and finite(best) and best > 0 else None
        k["heuristic_over_chosen"] = heur / chosen if finite(heur) and finite(chosen) and chosen > 0 else None
    return keys


def load_bench(paths):
    """{config name: {"fwd_ms", "bwd_ms", stage: ms}}, the lowest over the passes."""
    out = {}
    for p in paths:
        for r in json.load(open(p))["results"]:
            s = r["systems"].get("ours", {})
            if "fwd_ms" not in s:
                continue
            row = {"fwd_ms": s["fwd_ms"], "bwd_ms": s["bwd_ms"], **r.get("kernels", {})}
            have = out.setdefault(r["config"]["name"], {})
            for k, v in row.items():
                have[k] = min(have.get(k, v), v)
    return out


def ab(heur, tuned):
    rows = []
    for name, h in heur.items():
        t = tuned.get(name)
        if not t:
            continue
        stages = {k[:-3]: h[k] / t[k] for k in h if k.endswith("_ms") and k in t and "." in k and h[k] >= 0.3}
        rows.append({"config": name, "heuristic_fwd_ms": h["fwd_ms"], "heuristic_bwd_ms": h["bwd_ms"],
                     "tuned_fwd_ms": t["fwd_ms"], "tuned_bwd_ms": t["bwd_ms"],
                     "speedup": (h["fwd_ms"] + h["bwd_ms"]) / (t["fwd_ms"] + t["bwd_ms"]),
                     "stage_speedup": stages})
    return rows


def md(doc):
    lines = [f"# Engine tuner: measured per-GEMM choices and the layer A/B ({doc['commit']}, {doc['device']})", "",
             "Layer time fwd+bwd, the heuristic (`SMOE_ENGINE_TUNE=0`) against the cache `smoe_tune` wrote "
             "(lowest of two interleaved passes each, bench_layer --warmup 3 --reps 10). "
             "`GEMMs changed`: keys where the tuner's pick differs from the heuristic's "
             "(isolated speedup of the chosen candidate).", ""]
    for s in doc["sets"]:
        lines += [f"## {s['name']} ({s['configs']}, {s['commit']})", "", s.get("note", ""), "",
                  "| config | heuristic ms | tuned ms | speedup | GEMMs changed (isolated) | stages (>= 0.3 ms) moved > 3% in the layer |",
                  "|---|---|---|---|---|---|"]
        changed = {}
        for k in s["keys"]:
            heur = next((c["config"] for c in k["candidates"] if c["heuristic"]), None)
            if k["chosen"] and k["chosen"] != heur:
                r = k["heuristic_over_chosen"]
                changed.setdefault(k["config"], []).append(f"{k['kind']} {k['chosen']}" + (f" x{r:.2f}" if r else ""))
        for r in s["ab"]:
            moved = ", ".join(f"{st.split('.')[-1]} x{v:.2f}" for st, v in r["stage_speedup"].items() if abs(v - 1) > 0.03)
            lines.append(f"| {r['config']} | {r['heuristic_fwd_ms'] + r['heuristic_bwd_ms']:.3f} | "
                         f"{r['tuned_fwd_ms'] + r['tuned_bwd_ms']:.3f} | {r['speedup']:.3f} | "
                         f"{'; '.join(changed.get(r['config'], [])) or '-'} | {moved or '-'} |")
        lines.append("")
    lines += doc.get("notes_md", [])
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--set", nargs=4, action="append", metavar=("NAME", "TUNE_LOG", "HEUR_JSONS", "TUNED_JSONS"),
                   required=True)
    p.add_argument("--configs", action="append", default=[], help="the configs file of each --set, in order")
    p.add_argument("--set-commit", action="append", default=[], help="the commit each --set ran at, in order")
    p.add_argument("--set-note", action="append", default=[], help="one line on each --set, in order")
    p.add_argument("--commit", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--command", default="")
    p.add_argument("--notes", default=None, help="a markdown file appended to the table")
    p.add_argument("--out", required=True)
    p.add_argument("--md", default=None)
    a = p.parse_args()
    doc = {"commit": a.commit, "device": a.device, "command": a.command, "sets": []}
    for i, (name, log, heur, tuned) in enumerate(a.set):
        pick = lambda xs: xs[i] if i < len(xs) else ""  # noqa: E731
        doc["sets"].append({"name": name, "configs": pick(a.configs), "commit": pick(a.set_commit) or a.commit,
                            "note": pick(a.set_note),
                            "keys": parse_tune_log(log),
                            "ab": ab(load_bench(heur.split(",")), load_bench(tuned.split(",")))})
    if a.notes:
        doc["notes_md"] = open(a.notes).read().splitlines()
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md(doc))


if __name__ == "__main__":
    main()
