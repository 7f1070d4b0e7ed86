#!/usr/bin/env python3
"""Score the engine heuristic against the tuner's measurements, on the CPU (issue 37 item 1: the
heuristic re-derived from the tuner's results over many shapes).

  python3 bench/reports/heuristic_fit.py --bin build/smoe_heuristic LOG [LOG ...] [--md out.md] [--json out.json]
  python3 bench/reports/heuristic_fit.py --tuner-json bench/results/h200/tuner.json   (the keys tuner_report.py kept)

LOG: build/smoe_tune's stdout (one configs file each; `scripts/device.sh tune` keeps them as
$OUT/tune/<name>.tune.log). Every key there lists each candidate's isolated median and marks with `*`
the pick of the heuristic the log was measured with ("logged"). smoe_heuristic gives this build's
pick for the same key with the exact rows (T*K from the log's config line), so a rule edited in
src/engine/heuristic.cpp is scored against old measurements without a GPU: per key the pick's time
over the fastest candidate's (its regret), and per GEMM kind and per config the sum of picked times
over the sum of fastest. A pick the log did not time (a candidate this build added) is `unmeasured`.

Isolated times are L2-warm and per GEMM; the layer A/B (`scripts/device.sh tune`) is the check that
a change carries over (bench/results/h200/tuner.md: wins below ~4% alone did not).
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tuner_report import CAND_RE, CONFIG_RE, KEY_RE  # noqa: E402  (the tune log's one grammar)

DEVICE_RE = re.compile(r"^device: .* hbm_gbps=(\d+)")  # smoe_tune's first line (since 2026-12-06)
HBM_RE = re.compile(r" hbm_gbps=(\d+)")  # in each key's line too (TuneKey, since 2026-12-06)

MISS = 1.05  # a pick this much slower than the fastest is listed (the tuner's margin)


def parse_log(path):
    """[{config, rows, kind, N, K, E, halves, sms, cands: {label: ms}, logged}] of one tune log."""
    keys, cfg, rows, cur, hbm = [], None, None, None, 0
    for line in open(path):
        m = DEVICE_RE.match(line)
        if m:
            hbm = int(m.group(1))
            continue
        m = CONFIG_RE.match(line)
        if m:
            cfg, rows = m.group(1), int(m.group(2)) * int(m.group(6))
            cur = None
            continue
        m = KEY_RE.match(line)
        if m:
            cur = {"config": cfg, "rows": rows, "kind": m.group(1), "N": int(m.group(2)), "K": int(m.group(3)),
                   "E": int(m.group(4)), "halves": int(m.group(6)), "sms": int(m.group(7)), "cands": {},
                   "logged": None, "log": path, "hbm_gbps": int(HBM_RE.search(line).group(1)) if HBM_RE.search(line) else hbm}
            keys.append(cur)
            continue
        m = CAND_RE.match(line)
        if m and cur is not None:
            cur["cands"][m.group(2)] = float(m.group(3))
            if m.group(1):
                cur["logged"] = m.group(2)
    return [k for k in keys if k["cands"] and k["rows"] is not None]


def parse_tuner_json(path, sms=132):
    """The same records from tuner_report.py's JSON (its sets name their configs files, for the rows;
    the SM count is not kept there: sms)."""
    keys = []
    for st in json.load(open(path))["sets"]:
        rows = {c["name"]: c["T"] * c["K"] for c in json.load(open(st["configs"]))}
        for k in st["keys"]:
            if k["config"] not in rows:
                continue
            cands = {c["config"]: c["ms"] for c in k["candidates"]}
            logged = next((c["config"] for c in k["candidates"] if c["heuristic"]), None)
            keys.append({"config": k["config"], "rows": rows[k["config"]], "kind": k["kind"], "N": k["N"], "K": k["K"],
                         "E": k["E"], "halves": int(k["halves"]), "sms": sms, "cands": cands, "logged": logged,
                         "log": f"{path}:{st['name']}"})
    return [k for k in keys if k["cands"]]


def heuristic_picks(binary, keys, hbm_gbps=0):
    text = "".join(f"{k['kind']} N={k['N']} K={k['K']} E={k['E']} rows={k['rows']} halves={k['halves']} "
                   f"sm_count={k['sms']} hbm_gbps={k.get('hbm_gbps') or hbm_gbps}\n" for k in keys)
    out = subprocess.run([binary], input=text, capture_output=True, text=True, check=True).stdout.splitlines()
    if len(out) != len(keys):
        sys.exit(f"{binary}: {len(out)} answers for {len(keys)} keys")
    bad = [o for o in out if o.startswith("error")]
    if bad:
        sys.exit(f"{binary}: {bad[0]}")
    return out


def finite(v):
    return v is not None and math.isfinite(v)


def score(keys):
    """Adds best / regret fields per key; returns per-kind and per-config sums."""
    for k in keys:
        ok = {c: ms for c, ms in k["cands"].items() if finite(ms) and ms > 0}
        k["best"] = min(ok, key=ok.get) if ok else None
        best = ok.get(k["best"]) if ok else None
        for who in ("logged", "pick"):
            ms = ok.get(k[who])
            k[who + "_ms"] = ms
            k[who + "_regret"] = ms / best if finite(ms) and finite(best) else None
        k["best_ms"] = best
    sums = {"kind": {}, "config": {}}
    for k in keys:
        if not (finite(k["best_ms"]) and finite(k["pick_ms"]) and finite(k["logged_ms"])):
            continue
        for group, name in (("kind", k["kind"]), ("config", k["config"])):
            s = sums[group].setdefault(name, {"keys": 0, "best": 0.0, "pick": 0.0, "logged": 0.0, "misses": 0})
            s["keys"] += 1
            s["best"] += k["best_ms"]
            s["pick"] += k["pick_ms"]
            s["logged"] += k["logged_ms"]
            s["misses"] += k["pick_regret"] > MISS
    return sums


def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def markdown(keys, sums, logs):
    out = [f"# Heuristic against the tuner's measurements ({len(keys)} keys from {len(logs)} logs)", "",
           "Isolated medians from `smoe_tune`; `logged` is the heuristic the logs were measured with, `pick` this "
           "build's (`smoe_heuristic`). Regret = the pick's time over the fastest candidate's.", "",
           "## Per GEMM kind (sum of times over the sum of fastest)", "",
           "| kind | keys | logged | pick | picks > 5% off |", "|---|---|---|---|---|"]
    for name, s in sorted(sums["kind"].items()):
        out.append(f"| {name} | {s['keys']} | {s['logged'] / s['best']:.3f} | {s['pick'] / s['best']:.3f} | {s['misses']} |")
    allk = [s for s in sums["kind"].values()]
    if allk:
        b = sum(s["best"] for s in allk)
        out.append(f"| all | {sum(s['keys'] for s in allk)} | {sum(s['logged'] for s in allk) / b:.3f} | "
                   f"{sum(s['pick'] for s in allk) / b:.3f} | {sum(s['misses'] for s in allk)} |")
    out += ["", "## Per config (its GEMMs' summed times over the fastest)", "",
            "| config | logged | pick |", "|---|---|---|"]
    for name, s in sums["config"].items():
        out.append(f"| {name} | {s['logged'] / s['best']:.3f} | {s['pick'] / s['best']:.3f} |")
    out += ["", f"## Keys where this build's pick is > {int(round((MISS - 1) * 100))}% off the fastest, or unmeasured", "",
            "| config | kind | N | K | E | rows/E | pick | regret | fastest | logged (regret) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for k in keys:
        r = k["pick_regret"]
        if r is None or r > MISS:
            out.append(f"| {k['config']} | {k['kind']} | {k['N']} | {k['K']} | {k['E']} | {k['rows'] // k['E']} | "
                       f"{k['pick']} | {fmt(r) if r is not None else 'unmeasured'} | {k['best']} | "
                       f"{k['logged']} ({fmt(k['logged_regret'])}) |")
    changed = [k for k in keys if k["pick"] != k["logged"]]
    out += ["", f"## Keys whose pick differs from the logged heuristic's ({len(changed)})", "",
            "| config | kind | N | K | E | rows/E | logged | pick | pick / logged |", "|---|---|---|---|---|---|---|---|---|"]
    for k in changed:
        ratio = k["pick_ms"] / k["logged_ms"] if finite(k["pick_ms"]) and finite(k["logged_ms"]) else None
        out.append(f"| {k['config']} | {k['kind']} | {k['N']} | {k['K']} | {k['E']} | {k['rows'] // k['E']} | "
                   f"{k['logged']} | {k['pick']} | {fmt(ratio)} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="*", help="smoe_tune stdout logs")
    ap.add_argument("--tuner-json", action="append", default=[], help="tuner_report.py JSON (SM count 132; its keys take --hbm-gbps, 0 unless given)")
    ap.add_argument("--bin", default="build/smoe_heuristic", help="this build's smoe_heuristic")
    ap.add_argument("--hbm-gbps", type=int, default=0,
                    help="the measuring device's HBM bandwidth in GB/s where a log does not say it (smoe_tune's "
                         "'device:' line): H100 SXM 3352, H200 4917; 0 = unknown (the heuristic's default rules)")
    ap.add_argument("--md", help="write the markdown report here (default: stdout)")
    ap.add_argument("--json", help="write every key with its picks and regrets here")
    args = ap.parse_args()
    keys = [k for p in args.logs for k in parse_log(p)] + [k for p in args.tuner_json for k in parse_tuner_json(p)]
    if not keys:
        sys.exit("no keys in the logs")
    for k, p in zip(keys, heuristic_picks(args.bin, keys, args.hbm_gbps)):
        k["pick"] = p
    sums = score(keys)
    md = markdown(keys, sums, args.logs + args.tuner_json)
    if args.md:
        open(args.md, "w").write(md)
    else:
        sys.stdout.write(md)
    if args.json:
        json.dump({"logs": args.logs, "keys": keys, "sums": sums}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
