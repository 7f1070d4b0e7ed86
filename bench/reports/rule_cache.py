#!/usr/bin/env python3
"""A heuristic change's layer A/B on any shapes, with one build: the old rule's picks as a tune cache.

  python3 bench/reports/rule_cache.py --old OLD_BIN --new build/smoe_heuristic --sm-count 132 --hbm-gbps 3352 \
      --configs bench/configs/unseen_draw.json [--configs ...] [--kinds da_dswiglu] [--controls 3] \
      --out-configs changed.json --out-cache old_picks.cache.json
  python3 bench/reports/rule_cache.py --check-log bench/results/h100/tune/configs.tune.log   (the key map)

OLD_BIN / NEW_BIN: two builds of apps/smoe_heuristic (the heuristic with no GPU). The old one needs no
CUDA build: `g++ -std=c++17 -I<dir with the old engine/heuristic.h> -Isrc -Iinclude -Ibuild/engine_instances
apps/smoe_heuristic.cpp src/engine/{heuristic,config,overrides}.cpp` (a copied heuristic.cpp works the
same way). For every shape of the configs files, each layer GEMM's tune key (the map below, the one
the layer looks up: bench_layer's interleaved gate/up, halves=0) goes to both; the shapes where some
pick of --kinds differs are written to --out-configs (bench_layer's format; plus --controls shapes
where nothing differs) and the old picks of the differing keys to --out-cache (the tune cache format,
version 2). Then, in one device call with the new build (`scripts/device.sh ab`; an AB_CONFIGS entry
may be a path):
  AB_ENV_A='SMOE_ENGINE_TUNE= SMOE_ENGINE_TUNE_CACHE=old_picks.cache.json' AB_VARIANTS='rule:' \
  AB_CONFIGS='changed.json' scripts/device.sh build ab
side A reads the old picks (SMOE_ENGINE_TUNE= : the cache is read, nothing measured), side B is the
heuristic. Keys of two shapes that share a cache key (same N, K, E, log2 rows bucket) but were given
different old picks are reported and the shape dropped (its A side would be ambiguous).

Scoring an A/B (a patch's, or the cache's) by the stages the change touches:
  python3 bench/reports/rule_cache.py --old OLD_BIN --new NEW_BIN --hbm-gbps 3352 --configs ... \
      --a a_configs_1.json --a a_configs_2.json --b b_configs_1.json --b b_configs_2.json [--md score.md]
--a / --b: bench_layer JSONs of the two sides, one per pass (all configs files' passes together, in
round order; `scripts/device.sh ab` writes them as ab/<side>_<set>_<round>.json). Each changed key's
stage (the KEY_MAP kind's layer stage) gets a / b of the lowest pass per side and of each round; every
other GEMM stage of the same passes, which ran the same kernel on both sides, is the noise it is read
against (geomean, 10th and 90th percentile); --kinds must then name every kind the change can touch
(the default: all six), or a changed stage of another kind is read as noise. It scores a patch's A/B
(each side runs its own heuristic); for the cache A/B above, a shape that shares a cached key with a
changed one but was not itself changed also runs the cached pick on side A (its own old pick is the same
where the rows bucket decides the pick, as in every configs file so far). A whole-layer geomean mixes the few stages a rule moves
with the noise of the rest (bench/results/h100/banded_unpaired_ab.md: changed stages 1.023 against
unchanged 0.995 where the layer read 0.99-1.00).
"""

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tuner_report import CONFIG_RE, KEY_RE  # noqa: E402  (the tune log's one grammar)
from heuristic_fit import heuristic_picks  # noqa: E402  (the one smoe_heuristic call)
from layer_ab import geomean, load as load_layer_passes  # noqa: E402  (the one bench_layer JSON reader)

# The layer's GEMMs as the tune keys name them (smoe_tune's logs, checked by --check-log): kind -> (N, K)
# from the layer's shape; every one has rows = T K. Varlen-K kinds: N and K as the key has them.
KEY_MAP = {
    "up_swiglu": lambda d, n: (2 * n, d),
    "down_store": lambda d, n: (d, n),
    "da_dswiglu": lambda d, n: (n, d),
    "dw_gather_p": lambda d, n: (n, d),
    "dw_gather_p_t": lambda d, n: (2 * n, d),
    "dx_store": lambda d, n: (d, 2 * n),
}


def rows_bucket(rows, experts):
    """tune_cache.cpp's rows_bucket: floor(log2(rows / E)) of the integer quotient, 0 below 2."""
    per, b = rows // experts if experts > 0 else rows, 0
    while per > 1:
        per >>= 1
        b += 1
    return b


def layer_keys(cfg, kinds):
    T, d, n, E, K = cfg["T"], cfg["d"], cfg["n"], cfg["E"], cfg["K"]
    return [(kind, *KEY_MAP[kind](d, n), E, T * K) for kind in kinds]


# Each tune kind's stage in bench_layer's "kernels" (expert_gemms.h: dW2 gathers P = dout, dW1 gathers Q = x).
STAGE = {"up_swiglu": "fwd.up_proj", "down_store": "fwd.down_proj", "da_dswiglu": "bwd.dA_proj",
         "dw_gather_p": "bwd.dW2", "dw_gather_p_t": "bwd.dW1", "dx_store": "bwd.dX_proj"}


def load_passes(paths):
    """[{config name: {stage: ms}}] per pass (layer_ab's reader: configs bench_layer could not run are left out)."""
    return [{name: {k[:-3]: v for k, v in kernels.items() if k.endswith("_ms")} for name, (_, kernels, _) in runs.items()}
            for runs in load_layer_passes(paths)]


def merge_rounds(paths):
    """The passes of several configs files, grouped into rounds by position: a path's round is its
    index among the paths of its own set, so --a x_1 --a y_1 --a x_2 --a y_2 and --a x_1 --a x_2 --a y_1
    --a y_2 both give two rounds. A path's set: its file name less a trailing _<round> (device.sh ab's
    <side>_<set>_<round>.json), else the config names it holds."""
    rounds, seen = [], {}
    for path, runs in zip(paths, load_passes(paths)):
        stem = os.path.splitext(os.path.basename(path))[0]
        m = re.search(r"_(\d+)$", stem)
        key = stem[:m.start()] if m else tuple(sorted(runs))
        i = int(m.group(1)) - 1 if m else seen.get(key, 0)  # a numbered pass keeps its round (a glob sorts 10 < 2)
        seen[key] = i + 1
        while len(rounds) <= i:
            rounds.append({})
        rounds[i].update(runs)
    return rounds


def score(changes, a_paths, b_paths, names=None):
    """changes: {config name: {stage: (old pick, new pick)}}; names: the configs the picks were asked for
    (default: those of changes); the passes' other configs are left out, not read as noise. Rows of the
    changed stages and the noise of the unchanged GEMM stages, from the two sides' passes."""
    A, B = merge_rounds(a_paths), merge_rounds(b_paths)
    if len(A) != len(B):
        raise SystemExit(f"--a has {len(A)} rounds, --b {len(B)}")
    names = set(changes) if names is None else set(names)
    ran = [n for n in A[0] if n in names and all(n in side[i] for side in (A, B) for i in range(len(A)))]
    for n in sorted(names - set(ran)):
        print(f"score: {n} is not in every pass of both sides; left out" + (" (it changed)" if n in changes else ""))
    outside = sorted({n for side in (A, B) for r in side for n in r} - names)
    if outside:
        print(f"score: {len(outside)} configs of the passes are not in --configs; left out")
    rows, noise = [], []
    for name in ran:
        for stage in STAGE.values():
            a = [A[i][name][stage] for i in range(len(A))]
            b = [B[i][name][stage] for i in range(len(B))]
            ratio = min(a) / min(b)
            if stage in changes.get(name, {}):
                old, new = changes[name][stage]
                rows.append(dict(config=name, stage=stage, old=old, new=new, a_ms=min(a), b_ms=min(b), ratio=ratio,
                                 rounds=[x / y for x, y in zip(a, b)]))
            else:
                noise.append(ratio)
    return rows, noise


def score_md(rows, noise):
    noise = sorted(noise)
    pct = lambda q: noise[round(q * (len(noise) - 1))]  # noqa: E731  (nearest rank)
    out = ["| config | stage | a pick -> b pick | a ms | b ms | a / b | per round |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['config']} | {r['stage']} | {r['old']} -> {r['new']} | {r['a_ms']:.3f} | {r['b_ms']:.3f} | "
                   f"{r['ratio']:.3f} | {' / '.join(f'{x:.2f}' for x in r['rounds'])} |")
    out.append("")
    if rows:
        t_a, t_b = sum(r["a_ms"] for r in rows), sum(r["b_ms"] for r in rows)
        out.append(f"Changed stages: {len(rows)}, geomean a / b {geomean([r['ratio'] for r in rows]):.3f}, "
                   f"time-weighted {t_a / t_b:.3f} ({t_a:.1f} ms / {t_b:.1f} ms).")
        # The landing test (docs/wip/README.md): the changed stages above the noise in every round, each round's
        # ratios paired within the round (its two sides ran minutes apart at most).
        per_round = [geomean([r["rounds"][i] for r in rows]) for i in range(len(rows[0]["rounds"]))]
        out.append(f"Per round, the changed stages' geomean a / b: {' / '.join(f'{x:.3f}' for x in per_round)}.")
        for stage in STAGE.values():
            xs = [r["ratio"] for r in rows if r["stage"] == stage]
            if xs:
                out.append(f"- {stage}: {len(xs)}, geomean {geomean(xs):.3f}, {min(xs):.2f}-{max(xs):.2f}")
    if noise:
        out.append(f"Unchanged GEMM stages (the same kernel on both sides: the noise): {len(noise)}, geomean "
                   f"{geomean(noise):.3f}, 10th-90th percentile {pct(0.1):.3f}-{pct(0.9):.3f}.")
    else:
        out.append("Unchanged GEMM stages: none in these passes (no noise to read the changed ones against).")
    return "\n".join(out) + "\n"


def picks(binary, keys, sm_count, hbm_gbps):
    return heuristic_picks(binary, [{"kind": k, "N": N, "K": Kd, "E": E, "rows": rows, "halves": 0, "sms": sm_count}
                                    for k, N, Kd, E, rows in keys], hbm_gbps)


def check_log(path):
    """The key map against a tune log: each config's interleaved (halves=0) keys are the map's (a key an
    earlier config of the log had is not listed again)."""
    cfg, logged, bad, n_keys = None, {}, 0, 0
    for line in open(path):
        m = CONFIG_RE.match(line)
        if m:
            cfg = dict(name=m.group(1), T=int(m.group(2)), d=int(m.group(3)), n=int(m.group(4)), E=int(m.group(5)),
                       K=int(m.group(6)))
            logged[cfg["name"]] = (cfg, set())
            continue
        m = KEY_RE.match(line)
        if m and cfg and m.group(6) == "0":
            logged[cfg["name"]][1].add((m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5))))
    seen = set()  # smoe_tune prints a key once: a later config sharing it does not list it again
    for name, (cfg, keys) in logged.items():
        mine = {(k, N, Kd, E, rows_bucket(rows, E)) for k, N, Kd, E, rows in layer_keys(cfg, list(KEY_MAP))}
        n_keys += len(keys)
        if keys - mine:
            bad += 1
            print(f"{name}: keys the map does not make: {sorted(keys - mine)}")
        if mine - keys - seen:  # e.g. a key the tune cache had before the run: measured, so not printed
            print(f"{name}: not in the log (in the cache before?): {sorted(mine - keys - seen)}")
        seen |= keys
    print(f"{path}: {len(logged)} configs, {n_keys} keys, {bad} configs with keys the map does not make")
    return bad == 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check-log", action="append", default=[], help="a smoe_tune log: check the key map")
    p.add_argument("--old")
    p.add_argument("--new")
    p.add_argument("--configs", action="append", default=[])
    p.add_argument("--kinds", default=",".join(KEY_MAP), help="comma-separated tune kinds to compare")
    p.add_argument("--sm-count", type=int, default=132)
    p.add_argument("--hbm-gbps", type=int, help="the device's, as its tune keys have it (H100 3352)")
    p.add_argument("--controls", type=int, default=0, help="unchanged shapes to keep as controls")
    p.add_argument("--out-configs")
    p.add_argument("--out-cache")
    p.add_argument("--a", action="append", default=[], help="side A's bench_layer JSON, one per pass (scoring)")
    p.add_argument("--b", action="append", default=[], help="side B's, the same passes (scoring)")
    p.add_argument("--md", help="scoring: write the table here too")
    a = p.parse_args()
    if a.check_log:
        sys.exit(0 if all([check_log(f) for f in a.check_log]) else 1)
    scoring = bool(a.a or a.b)
    if scoring and not (a.a and a.b):
        p.error("scoring needs both --a and --b")
    if not (a.old and a.new and a.configs and a.hbm_gbps and (scoring or (a.out_configs and a.out_cache))):
        p.error("--old, --new, --configs, --hbm-gbps and either --out-configs and --out-cache, or --a and --b, "
                "are required")
    kinds = a.kinds.split(",")
    for k in kinds:
        if k not in KEY_MAP:
            p.error(f"--kinds: {k} is not one of {','.join(KEY_MAP)}")
    cfgs = [c for f in a.configs for c in json.load(open(f))]
    keys = [k for c in cfgs for k in layer_keys(c, kinds)]
    old, new = picks(a.old, keys, a.sm_count, a.hbm_gbps), picks(a.new, keys, a.sm_count, a.hbm_gbps)
    entries, changed, controls, cache, changes = {}, [], [], {}, {}
    per = len(kinds)
    for i, c in enumerate(cfgs):
        diff = [(keys[j], old[j], new[j]) for j in range(i * per, (i + 1) * per) if old[j] != new[j]]
        if not diff:
            if len(controls) < a.controls:
                controls.append(c)
            continue
        for (kind, _, _, _, _), o, nw in diff:  # scoring: every changed stage, also of a shape dropped below
            changes.setdefault(c["name"], {})[STAGE[kind]] = (o, nw)
        clash = False
        for (kind, N, Kd, E, rows), o, _ in diff:
            ck = (kind, N, Kd, E, rows_bucket(rows, E))
            if cache.get(ck, o) != o:
                print(f"{c['name']}: key {ck} has two old picks ({cache[ck]}, {o}); shape dropped")
                clash = True
        if clash:
            continue
        for (kind, N, Kd, E, rows), o, nw in diff:
            ck = (kind, N, Kd, E, rows_bucket(rows, E))
            cache[ck] = o
            entries[ck] = {"kind": kind, "N": N, "K": Kd, "E": E, "rows_bucket": ck[4], "halves": False,
                           "sm_count": a.sm_count, "hbm_gbps": a.hbm_gbps, "config": o}
            print(f"{c['name']}: {kind} N={N} K={Kd}: {o} -> {nw}")
        changed.append(c)
    if scoring:
        text = score_md(*score(changes, a.a, a.b, [c["name"] for c in cfgs]))
        print(text, end="")
        if a.md:
            open(a.md, "w").write(text)
        if not (a.out_configs and a.out_cache):
            return
    json.dump(changed + controls, open(a.out_configs, "w"), indent=1)
    with open(a.out_cache, "w") as f:
        f.write('{"version": 2, "entries": [\n')
        f.write(",\n".join("  " + json.dumps(e) for e in entries.values()))
        f.write("\n]}\n")
    print(f"{len(changed)} of {len(cfgs)} shapes change ({len(entries)} keys), {len(controls)} controls -> "
          f"{a.out_configs}, {a.out_cache}")


if __name__ == "__main__":
    main()
