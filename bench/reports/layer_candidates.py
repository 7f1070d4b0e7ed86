#!/usr/bin/env python3
"""Each GEMM's near-best candidates timed inside the layer, one forced pick per variant of one device call.

  python3 bench/reports/layer_candidates.py plan --log bench/results/h100/tune/configs.tune.log \
      --configs bench/configs/configs.json --names DeepSeek-V3.2 [--kinds up_swiglu,dx_store] \
      [--within 1.15] [--per-key 3] [--bin build/smoe_heuristic] --out-dir .devrun/lc
  AB_ENV_A= AB_DIGEST=0 AB_ROUNDS=2 AB_VARIANTS="$(cat .devrun/lc/variants.txt)" \
      AB_CONFIGS=.devrun/lc/configs.json BUILD_TARGETS='bench_layer layer_digest' scripts/device.sh build ab
  python3 bench/reports/layer_candidates.py report --plan .devrun/lc/plan.json --ab <OUT>/ab [--md lc.md]

Why: the tuner ranks candidates by their isolated medians, and on the largest shapes the layer disagrees
(the H100's DeepSeek-V3.2: `up_swiglu<256>` 4% faster than the pair alone, 11-98% slower in the layer,
bench/results/h100/banded_unpaired_ab.md; its dA' 1.16-1.7x its isolated time, layer_vs_isolated.md).
`plan` takes, for each named config and GEMM kind, the key's candidates from a smoe_tune log within
--within of the isolated best (at most --per-key, fastest first), leaves out the current pick (--bin: this
build's smoe_heuristic; else the log's `*`), and writes one tune cache per remaining candidate that
forces it for that key alone (every other key runs the heuristic), the configs file, and `variants.txt`
(device.sh ab's AB_VARIANTS: side B's runs read their cache, SMOE_ENGINE_TUNE= measures nothing).
Side A is the heuristic. AB_DIGEST=0: another tile may round differently, so the digests are not
compared. `report` reads the ab step's per-pass JSONs and lists, per key, each candidate's stage time in
the layer (lowest pass, and per round) beside the heuristic's and the isolated medians; the ab step's own
reports give the whole passes.
"""

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from heuristic_fit import heuristic_picks, parse_log  # noqa: E402  (the tune log's one reader)
from rule_cache import KEY_MAP, STAGE, layer_keys, merge_rounds, rows_bucket  # noqa: E402  (the layer's keys)


def log_keys(paths):
    """{(kind, N, K, E, rows bucket): record} of the logs' interleaved (halves = 0) keys."""
    out = {}
    for p in paths:
        for k in parse_log(p):
            if k["halves"] == 0:
                out[(k["kind"], k["N"], k["K"], k["E"], rows_bucket(k["rows"], k["E"]))] = k
    return out


def variant_name(cfg_index, kind, i):
    """device.sh ab's variant names: letters, digits, _ and - (not the label's <>)."""
    return f"c{cfg_index}_{kind}_{i}"


def plan(args):
    logged = log_keys(args.log)
    cfgs = [c for f in args.configs for c in json.load(open(f))]
    names = args.names.split(",") if args.names else [c["name"] for c in cfgs]
    missing = [n for n in names if n not in {c["name"] for c in cfgs}]
    if missing:
        sys.exit(f"--names: {', '.join(missing)} not in --configs")
    kinds = args.kinds.split(",")
    for k in kinds:
        if k not in KEY_MAP:
            sys.exit(f"--kinds: {k} is not one of {','.join(KEY_MAP)}")
    chosen = [c for c in cfgs if c["name"] in names]
    os.makedirs(args.out_dir, exist_ok=True)
    variants, entries = [], []
    for ci, c in enumerate(chosen):
        keys = layer_keys(c, kinds)
        recs = []
        for kind, N, Kd, E, rows in keys:
            rec = logged.get((kind, N, Kd, E, rows_bucket(rows, E)))
            if rec is None:
                print(f"{c['name']}: {kind} N={N} K={Kd} E={E} not in the logs; skipped")
            recs.append(rec)
        picks = [None] * len(keys)
        if args.bin:
            ask = [dict(kind=k, N=N, K=Kd, E=E, rows=rows, halves=0, sms=args.sm_count, hbm_gbps=r["hbm_gbps"])
                   for (k, N, Kd, E, rows), r in zip(keys, recs) if r is not None]
            got = iter(heuristic_picks(args.bin, ask))
            picks = [next(got) if r is not None else None for r in recs]
        for (kind, N, Kd, E, rows), rec, pick in zip(keys, recs, picks):
            if rec is None:
                continue
            pick = pick or rec["logged"]
            timed = sorted((ms, lab) for lab, ms in rec["cands"].items() if ms == ms and ms != float("inf"))
            best = timed[0][0]
            near = [(ms, lab) for ms, lab in timed if ms <= args.within * best][:args.per_key]
            for i, (ms, lab) in enumerate([x for x in near if x[1] != pick]):
                name = variant_name(ci, kind, i)
                path = os.path.join(args.out_dir, f"{name}.cache.json")
                entry = {"kind": kind, "N": N, "K": Kd, "E": E, "rows_bucket": rows_bucket(rows, E), "halves": False,
                         "sm_count": rec["sms"], "hbm_gbps": rec["hbm_gbps"], "config": lab}
                with open(path, "w") as f:
                    f.write('{"version": 2, "entries": [\n  ' + json.dumps(entry) + "\n]}\n")
                variants.append(f"{name}:SMOE_ENGINE_TUNE= SMOE_ENGINE_TUNE_CACHE={path}")
                entries.append(dict(variant=name, config=c["name"], kind=kind, stage=STAGE[kind], N=N, K=Kd, E=E,
                                    candidate=lab, isolated_ms=ms, pick=pick,
                                    pick_isolated_ms=rec["cands"].get(pick), cache=path))
                print(f"{name}: {c['name']} {kind} N={N} K={Kd}: {lab} ({ms:.3f} ms alone; the pick {pick} "
                      f"{rec['cands'].get(pick, float('nan')):.3f})")
    json.dump(chosen, open(os.path.join(args.out_dir, "configs.json"), "w"), indent=1)
    json.dump({"log": args.log, "within": args.within, "per_key": args.per_key, "variants": entries},
              open(os.path.join(args.out_dir, "plan.json"), "w"), indent=1)
    open(os.path.join(args.out_dir, "variants.txt"), "w").write(";".join(variants))
    print(f"{len(variants)} variants over {len(chosen)} configs -> {args.out_dir}/variants.txt")


def passes(ab_dir, side, stem):
    """The side's per-round JSONs of one configs set, in round order (device.sh ab: <side>_<stem>_<round>.json)."""
    found = []
    for f in os.listdir(ab_dir):
        m = re.fullmatch(re.escape(f"{side}_{stem}_") + r"(\d+)\.json", f)
        if m:
            found.append((int(m.group(1)), os.path.join(ab_dir, f)))
    return [p for _, p in sorted(found)]


def report(args):
    p = json.load(open(args.plan))
    stem = args.stem
    a = merge_rounds(passes(args.ab, "a", stem))
    if not a:
        sys.exit(f"--ab: no a_{stem}_<round>.json in {args.ab}")
    lines = ["| config | stage | candidate | alone ms | layer ms | per round | the pick | its alone ms | its layer ms |"
             " pick / candidate in the layer |", "|---|---|---|---|---|---|---|---|---|---|"]
    for v in p["variants"]:
        b = merge_rounds(passes(args.ab, v["variant"], stem))
        if len(b) != len(a) or any(v["config"] not in r for r in a + b):
            lines.append(f"| {v['config']} | {v['stage']} | {v['candidate']} | {v['isolated_ms']:.3f} | not run | | "
                         f"{v['pick']} | | | |")
            continue
        ta = [r[v["config"]][v["stage"]] for r in a]
        tb = [r[v["config"]][v["stage"]] for r in b]
        alone = "unmeasured" if v["pick_isolated_ms"] is None else f"{v['pick_isolated_ms']:.3f}"
        lines.append(f"| {v['config']} | {v['stage']} | {v['candidate']} | {v['isolated_ms']:.3f} | {min(tb):.3f} | "
                     f"{' / '.join(f'{x:.2f}' for x in tb)} | {v['pick']} | {alone} | {min(ta):.3f} | "
                     f"{min(ta) / min(tb):.3f} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.md:
        open(args.md, "w").write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan")
    pl.add_argument("--log", action="append", required=True, help="smoe_tune logs holding the configs' keys")
    pl.add_argument("--configs", action="append", required=True)
    pl.add_argument("--names", help="comma-separated config names (default: all of --configs)")
    pl.add_argument("--kinds", default=",".join(KEY_MAP))
    pl.add_argument("--within", type=float, default=1.15, help="candidates up to this x the isolated best")
    pl.add_argument("--per-key", type=int, default=3, help="at most this many candidates per key, fastest first")
    pl.add_argument("--bin", help="this build's smoe_heuristic (the pick side A runs); default: the log's *")
    pl.add_argument("--sm-count", type=int, default=132)
    pl.add_argument("--out-dir", required=True)
    rp = sub.add_parser("report")
    rp.add_argument("--plan", required=True)
    rp.add_argument("--ab", required=True, help="the ab step's folder ($OUT/ab)")
    rp.add_argument("--stem", default="configs", help="the configs set's stem (plan writes configs.json)")
    rp.add_argument("--md")
    args = ap.parse_args()
    plan(args) if args.cmd == "plan" else report(args)


if __name__ == "__main__":
    main()
