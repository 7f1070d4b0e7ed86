#!/usr/bin/env python3
"""Each GEMM's near-best candidates timed inside the layer: forced picks as tune caches, one device call.

  python3 bench/reports/layer_candidates.py plan --log bench/results/h100/tune/configs.tune.log \
      --configs bench/configs/configs.json --names DeepSeek-V3.2 [--kinds up_swiglu,dx_store] \
      [--within 1.15] [--per-key 3] [--bin build/smoe_heuristic] --out-dir .devrun/lc
  AB_ENV_A= AB_DIGEST=0 AB_ROUNDS=2 AB_VARIANTS="$(cat .devrun/lc/variants.txt)" \
      AB_CONFIGS=.devrun/lc/configs.json BUILD_TARGETS='bench_layer layer_digest' scripts/device.sh build ab
  python3 bench/reports/layer_candidates.py report --plan .devrun/lc/plan.json --ab <OUT>/ab [--md lc.md]

Why: the tuner ranks candidates by their isolated medians, and on the largest shapes the layer disagrees
(the H100's DeepSeek-V3.2: `up_swiglu<256>` 4% faster than the pair alone, 11-98% slower in the layer,
bench/results/h100/banded_unpaired_ab.md; its dA' 1.16-1.7x its isolated time, layer_vs_isolated.md).
`plan` takes, for each GEMM key of the named configs, its candidates from smoe_tune logs within --within
of the isolated best (at most --per-key, fastest first) less the current pick (--bin: this build's
smoe_heuristic; else the log's `*`), and writes tune caches: variant j forces the j-th alternative of
every key (keys without one run the heuristic), so a few variants cover every config; bench_layer times
each stage on its own. Also the configs file and `variants.txt` (device.sh ab's AB_VARIANTS: side B's
runs read their cache, SMOE_ENGINE_TUNE= measures nothing). --out-dir must lie inside the tree (the
device call copies it; .devrun/ is neither tracked nor ignored). Side A is the heuristic. AB_DIGEST=0: another tile may round differently, so the digests are not
compared. `report` reads the ab step's per-pass JSONs and lists, per forced pick and each config that
runs it, the candidate's stage time in the layer (lowest pass, and per round) beside the pick's and the
isolated medians; the ab step's own reports give the whole passes. The H100's 41 tuned shapes at
--within 1.05 --per-key 2: 2 variants forcing 235 picks.
"""

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from heuristic_fit import heuristic_picks, parse_log  # noqa: E402  (the tune log's one reader)
from rule_cache import KEY_MAP, STAGE, layer_keys, merge_rounds, rows_bucket  # noqa: E402  (the layer's keys)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log_keys(paths):
    """{(kind, N, K, E, rows bucket): record} of the logs' interleaved (halves = 0) keys, all of one device
    (a cache entry names the device's SMs and bandwidth, and the engine skips an entry of another)."""
    out, device = {}, None
    for p in paths:
        for k in parse_log(p):
            if k["halves"] != 0:
                continue
            if device is None:
                device = (k["sms"], k["hbm_gbps"])
            elif (k["sms"], k["hbm_gbps"]) != device:
                sys.exit(f"--log {p}: sm_count={k['sms']} hbm_gbps={k['hbm_gbps']}, the other logs {device}: "
                         "one device's logs at a time")
            out[(k["kind"], k["N"], k["K"], k["E"], rows_bucket(k["rows"], k["E"]))] = k
    return out


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
    # The caches' paths go into AB_VARIANTS relative to the tree's root, where the device call runs (an
    # absolute path, or one outside the tree, names no file there: the engine would read an empty cache and
    # run the heuristic, and the report would give the pick's time as the candidate's).
    rel = os.path.relpath(os.path.abspath(args.out_dir), ROOT)
    if rel.startswith(".."):
        sys.exit(f"--out-dir {args.out_dir}: must lie inside the tree ({ROOT})")
    # The cache keys of the chosen configs' GEMMs (a key two configs share is one key: one forced pick).
    keys = {}
    for c in chosen:
        for kind, N, Kd, E, rows in layer_keys(c, kinds):
            ck = (kind, N, Kd, E, rows_bucket(rows, E))
            rec = logged.get(ck)
            if rec is None:
                print(f"{c['name']}: {kind} N={N} K={Kd} E={E} not in the logs; skipped")
                continue
            keys.setdefault(ck, dict(rec=rec, uses=[]))["uses"].append([c["name"], STAGE[kind], rows])
    order = list(keys)
    picks = [keys[ck]["rec"]["logged"] for ck in order]
    if args.bin:
        # The heuristic sees the exact rows; the cache key only their bucket: every use is asked, and a key
        # whose uses get different picks is reported (its alternatives leave out the first use's pick).
        asks = [(ck, u) for ck in order for u in keys[ck]["uses"]]
        got = heuristic_picks(args.bin, [dict(kind=ck[0], N=ck[1], K=ck[2], E=ck[3], rows=u[2], halves=0,
                                              sms=keys[ck]["rec"]["sms"], hbm_gbps=keys[ck]["rec"]["hbm_gbps"])
                                         for ck, u in asks])
        per_key = {}
        for (ck, u), pick in zip(asks, got):
            per_key.setdefault(ck, []).append((u[0], pick))
        for ck, ps in per_key.items():
            if len({p for _, p in ps}) > 1:
                print(f"{ck[0]} N={ck[1]} K={ck[2]} E={ck[3]}: the heuristic picks differ between its uses: {ps}")
        picks = [per_key[ck][0][1] for ck in order]
    # Variant j forces every key's j-th alternative: its candidates within --within of the isolated best
    # (at most --per-key, fastest first) less the pick. bench_layer times each stage on its own, so one
    # pass measures one alternative of every GEMM; that a forced stage may leave another L2 state to the
    # next stage is the caveat.
    variants = []
    for ck, pick in zip(order, picks):
        rec = keys[ck]["rec"]
        timed = sorted((ms, lab) for lab, ms in rec["cands"].items() if ms == ms and ms != float("inf"))
        near = [(ms, lab) for ms, lab in timed if ms <= args.within * timed[0][0]][:args.per_key]
        for j, (ms, lab) in enumerate([x for x in near if x[1] != pick]):
            while len(variants) <= j:
                variants.append([])
            variants[j].append(dict(kind=ck[0], N=ck[1], K=ck[2], E=ck[3], rows_bucket=ck[4], candidate=lab,
                                    isolated_ms=ms, pick=pick, pick_isolated_ms=rec["cands"].get(pick),
                                    sm_count=rec["sms"], hbm_gbps=rec["hbm_gbps"],
                                    uses=[u[:2] for u in keys[ck]["uses"]]))
            print(f"v{j}: {ck[0]} N={ck[1]} K={ck[2]} E={ck[3]}: {lab} ({ms:.3f} ms alone; the pick {pick} "
                  f"{rec['cands'].get(pick, float('nan')):.3f}) in {', '.join(u[0] for u in keys[ck]['uses'])}")
    os.makedirs(os.path.join(ROOT, rel), exist_ok=True)
    ab_variants, doc = [], []
    for j, entries in enumerate(variants):
        path = os.path.join(rel, f"v{j}.cache.json")
        with open(os.path.join(ROOT, path), "w") as f:
            f.write('{"version": 2, "entries": [\n')
            f.write(",\n".join("  " + json.dumps({"kind": e["kind"], "N": e["N"], "K": e["K"], "E": e["E"],
                                                   "rows_bucket": e["rows_bucket"], "halves": False,
                                                   "sm_count": e["sm_count"], "hbm_gbps": e["hbm_gbps"],
                                                   "config": e["candidate"]}) for e in entries))
            f.write("\n]}\n")
        ab_variants.append(f"v{j}:SMOE_ENGINE_TUNE= SMOE_ENGINE_TUNE_CACHE={path}")
        doc.append(dict(variant=f"v{j}", cache=path, entries=entries))
    json.dump(chosen, open(os.path.join(args.out_dir, "configs.json"), "w"), indent=1)
    json.dump({"log": args.log, "within": args.within, "per_key": args.per_key, "variants": doc},
              open(os.path.join(args.out_dir, "plan.json"), "w"), indent=1)
    open(os.path.join(args.out_dir, "variants.txt"), "w").write(";".join(ab_variants))
    print(f"{len(variants)} variants forcing {sum(map(len, variants))} picks over {len(chosen)} configs -> "
          f"{args.out_dir}/variants.txt")


def passes(ab_dir, side, stem):
    """The side's per-round JSONs of one configs set, in round order (device.sh ab: <side>_<stem>_<round>.json)."""
    found = []
    for f in os.listdir(ab_dir):
        m = re.fullmatch(re.escape(f"{side}_{stem}_") + r"(\d+)\.json", f)
        if m:
            found.append((int(m.group(1)), os.path.join(ab_dir, f)))
    return [p for _, p in sorted(found)]


def report(args):
    """One row per forced pick and config that runs it. Rounds are interleaved (device.sh ab: a, v0, v1, ...;
    even rounds reversed), so round i of side a and of a variant ran minutes apart at most: the verdict pairs
    them. `candidate`: the candidate's stage was faster than the pick's in every round by more than --margin;
    `pick`: slower in every round by more than it; `-`: neither (the single-stage noise of one H100 pass is
    4-7%, bench/results/h100/memory_stages.md)."""
    p = json.load(open(args.plan))
    stem = args.stem
    a = merge_rounds(passes(args.ab, "a", stem))
    if not a:
        sys.exit(f"--ab: no a_{stem}_<round>.json in {args.ab}")
    first = json.load(open(passes(args.ab, "a", stem)[0]))
    commit, gpu = first.get("commit", "unknown"), first.get("gpu", "unknown")
    lines = [f"Each GEMM's near-best candidates in the layer ({commit}, {gpu}, {len(a)} interleaved rounds): stage times, "
             "the lowest round and every round; `pick / candidate` > 1 means the candidate ran faster.", "",
             "| config | stage | variant | candidate | alone ms | layer ms | per round | the pick | its alone ms |"
             " its layer ms | pick / candidate in the layer | per round | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for v in p["variants"]:
        b = merge_rounds(passes(args.ab, v["variant"], stem))
        for e in v["entries"]:
            for cfg, stage in e["uses"]:
                head = f"| {cfg} | {stage} | {v['variant']} | {e['candidate']} | {e['isolated_ms']:.3f} |"
                if len(b) != len(a) or any(cfg not in r for r in a + b):
                    lines.append(f"{head} not run | | {e['pick']} | | | | | |")
                    continue
                ta = [r[cfg][stage] for r in a]
                tb = [r[cfg][stage] for r in b]
                paired = [x / y for x, y in zip(ta, tb)]
                verdict = ("candidate" if min(paired) > 1 + args.margin else
                           "pick" if max(paired) < 1 - args.margin else "-")
                alone = "unmeasured" if e["pick_isolated_ms"] is None else f"{e['pick_isolated_ms']:.3f}"
                lines.append(f"{head} {min(tb):.3f} | {' / '.join(f'{x:.2f}' for x in tb)} | {e['pick']} | {alone} | "
                             f"{min(ta):.3f} | {min(ta) / min(tb):.3f} | {' / '.join(f'{x:.2f}' for x in paired)} | "
                             f"{verdict} |")
                rows.append(dict(config=cfg, stage=stage, variant=v["variant"], kind=e["kind"], N=e["N"], K=e["K"],
                                 E=e["E"], rows_bucket=e["rows_bucket"], candidate=e["candidate"], pick=e["pick"],
                                 candidate_isolated_ms=e["isolated_ms"], pick_isolated_ms=e["pick_isolated_ms"],
                                 candidate_ms=tb, pick_ms=ta, pick_over_candidate=paired, verdict=verdict))
    won = [r for r in rows if r["verdict"] == "candidate"]
    lost = [r for r in rows if r["verdict"] == "pick"]
    lines += ["", f"Verdicts at a {args.margin:.0%} margin in every round: the candidate faster on {len(won)} of "
              f"{len(rows)} forced stages, the pick faster on {len(lost)}.", ""]
    if won:
        lines += ["The candidates faster in every round (the picks to re-read), largest saving first:", "",
                  "| kind | N | K | E | rows bucket | config | the pick -> the candidate | pick / candidate, rounds | "
                  "saved ms (lowest) |", "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(won, key=lambda r: min(r["candidate_ms"]) - min(r["pick_ms"])):
            lines.append(f"| {r['kind']} | {r['N']} | {r['K']} | {r['E']} | {r['rows_bucket']} | {r['config']} | "
                         f"{r['pick']} -> {r['candidate']} | {min(r['pick_over_candidate']):.3f}-"
                         f"{max(r['pick_over_candidate']):.3f} | {min(r['pick_ms']) - min(r['candidate_ms']):.3f} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.md:
        open(args.md, "w").write(text)
    if args.json:
        # Side a's whole passes too (bench_layer's JSONs, round order): the heuristic's layer on every shape, for
        # reports that read bench_layer runs (gemm_floors.py, memory_stages.py) without another device call.
        a_passes = [json.load(open(f)) for f in passes(args.ab, "a", stem)]
        json.dump({"commit": commit, "gpu": gpu, "plan": args.plan, "margin": args.margin, "rounds": len(a), "rows": rows,
                   "a_passes": a_passes},
                  open(args.json, "w"), indent=1)


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
    pl.add_argument("--out-dir", required=True)
    rp = sub.add_parser("report")
    rp.add_argument("--plan", required=True)
    rp.add_argument("--ab", required=True, help="the ab step's folder ($OUT/ab)")
    rp.add_argument("--stem", default="configs", help="the configs set's stem (plan writes configs.json)")
    rp.add_argument("--margin", type=float, default=0.03, help="a verdict needs every round beyond 1 +- this")
    rp.add_argument("--md")
    rp.add_argument("--json", help="the rows (per-round stage times of both sides) as JSON")
    args = ap.parse_args()
    plan(args) if args.cmd == "plan" else report(args)


if __name__ == "__main__":
    main()
