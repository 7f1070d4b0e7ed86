#!/usr/bin/env python3
"""The gather-sums' picks against their measured variants (gather_sum_bench JSON), per stage and K class.

  python3 bench/reports/gather_picks.py gather_sum.json [--md out.md]

Per shape and stage: the pick's time over the fastest variant's (regret) and the old kernel's over the
pick's (speedup). Per stage and K class (K = 1, K = 2, K >= 3, as gather_shape.h decides): the variant
with the lowest geomean time over that class's shapes (variants measured on all of them), beside the
pick's geomean regret, so a device's picks can be re-derived from one `scripts/device.sh gather` run.
Variants no longer built (measured by an older bench) count like the others.
"""
import argparse
import json
import math
from collections import defaultdict


def k_class(K):
    return "K=1" if K <= 1 else "K=2" if K == 2 else "K>=3"


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def analyse(doc):
    """(rows, classes): rows per (shape, stage); classes[(stage, class)] = (best variant, its geomean
    regret, the pick's geomean regret, shapes)."""
    rows = []
    per_class = defaultdict(list)  # (stage, class) -> [{variant: ms}]
    for r in doc["results"]:
        by_stage = defaultdict(dict)
        picks = {}
        for v in r["variants"]:
            if not v.get("ok", True) or v["ms"] <= 0:
                continue
            by_stage[v["stage"]][v["variant"]] = v["ms"]
            if v.get("chosen"):
                picks[v["stage"]] = v["variant"]
        for stage, times in by_stage.items():
            new = {k: t for k, t in times.items() if k != "legacy"}
            if not new:
                continue
            best = min(new, key=new.get)
            pick = picks.get(stage)
            rows.append(dict(shape=f"T{r['T']} d{r['d']} K{r['K']} E{r['E']}", stage=stage, K=r["K"], best=best,
                             best_ms=new[best], pick=pick, pick_ms=new.get(pick),
                             legacy_ms=times.get("legacy"), copy_tbs=r.get("copy_tbs")))
            per_class[(stage, k_class(r["K"]))].append((new, pick))
    classes = {}
    for key, shapes in per_class.items():
        common = set.intersection(*(set(t) for t, _ in shapes))
        score = {v: geomean([t[v] / min(t.values()) for t, _ in shapes]) for v in common}
        best = min(score, key=score.get) if score else None
        pick_regret = geomean([t[p] / min(t.values()) for t, p in shapes if p in t])
        classes[key] = (best, score.get(best, float("nan")), pick_regret, len(shapes))
    return rows, classes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--md")
    a = ap.parse_args()
    doc = json.load(open(a.json))
    rows, classes = analyse(doc)
    out = [f"# Gather-sum picks vs measured variants ({doc.get('device', '?')}, {doc.get('commit', '?')})", "",
           "| stage | K class | shapes | fastest variant (geomean regret) | the pick's geomean regret |",
           "|---|---|---|---|---|"]
    for (stage, cls), (best, s, pr, n) in sorted(classes.items()):
        out.append(f"| {stage} | {cls} | {n} | {best} ({s:.3f}) | {pr:.3f} |")
    out += ["", "| shape | stage | pick | pick / fastest | fastest | old / pick |", "|---|---|---|---|---|---|"]
    for r in rows:
        reg = f"{r['pick_ms'] / r['best_ms']:.3f}" if r["pick_ms"] else "-"
        sp = f"{r['legacy_ms'] / r['pick_ms']:.2f}" if r["pick_ms"] and r["legacy_ms"] else "-"
        out.append(f"| {r['shape']} | {r['stage']} | {r['pick'] or '-'} | {reg} | {r['best']} | {sp} |")
    text = "\n".join(out) + "\n"
    if a.md:
        open(a.md, "w").write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
