"""Shapes nobody tuned on: a seeded draw of MoE layer shapes in issue 37's families, none of them in
the committed configs files, for A/Bs and rules to be re-measured on (the standard: "every number is
re-measured independently on shapes you have not seen").

  python3 bench/configs/unseen.py --seed 20261206 --per-family 2 --out unseen.json
  python3 bench/configs/unseen.py --seed 20261207 --families odd_d --per-family 8 --out odd_d.json
  AB_UNSEEN_SEED=20261206 AB_CONFIGS='configs unseen' scripts/device.sh build ab   # the same draw

The seed defaults to today's date (UTC, YYYYMMDD), so each session meets new shapes and a report
that names its seed can be redrawn. A draw is a list in bench_layer's configs format (name, T, d, n,
E, K, source); every shape satisfies the layer's rules (d, n multiples of 64; K <= E <= 512), is no
(T, d, n, E, K) of bench/configs/*.json, and stays under --max-gb of memory held by bench_layer (an
estimate: weights and their gradients, the grouped rows' activations and gradients, the token
tensors; see held_gb) and --max-tflop of work per fwd + bwd (18 T K d n FLOPs), so a pass stays
seconds long.

Families (issue 37 item 5, "add to the sweep"):
  wide       d 4096-8192, n 2048-3584, E 64-384: experts wider than L2
  odd_n      n a multiple of 64 but not of 256 (n = 2880-like), any width
  k1_few_e   E <= 16, K = 1, n >= 8192
  few_rows   16-128 rows per expert (T K / E), E 64-512
  general    d 768-4096, n 256-2048, E 8-512, K 1-16
Opt-in (--families names it; not in the default draw, so a seed's default draw stays what it was):
  odd_d      d a multiple of 64 but not of 256 (gpt-oss's d = 2880), n 1024-3072, E 16-128, K 2-8: the
             store GEMMs' N = d then takes the ping-pong 128 x 192 tiles and the N % 256 != 0 rules
"""
import argparse
import datetime
import json
import pathlib
import random

HERE = pathlib.Path(__file__).resolve().parent
FAMILIES = ("wide", "odd_n", "k1_few_e", "few_rows", "general")
OPT_IN_FAMILIES = ("odd_d",)


def held_gb(T, d, n, E, K):
    """Bytes bench_layer keeps on the GPU, roughly (bf16 everywhere, 2x margin on the row tensors
    for workspace): W1 [E, 2n, d] + W2 [E, n, d] and their gradients; per grouped row (T K of them)
    H (2n), A' (n), dH (2n) and a gathered copy of d for the fp32 partial paths; per token x, y, dO,
    dX (d each)."""
    weights = 2 * (3 * E * n * d) * 2
    rows = T * K * (2 * n + n + 2 * n + d) * 2 * 2
    tokens = T * d * 4 * 2
    return (weights + rows + tokens) / 1e9


def tflop(T, d, n, E, K):
    return 18.0 * T * K * d * n / 1e12


def _pick(rng, lo, hi, step):
    return rng.randrange(lo, hi + 1, step)


def _draw(rng, family):
    """One (T, d, n, E, K) of the family, before the memory / work limits."""
    if family == "wide":
        d, n = _pick(rng, 4096, 8192, 512), _pick(rng, 2048, 3584, 256)
        E, K = rng.choice([64, 96, 128, 160, 256, 384]), rng.choice([4, 6, 8])
        rows = rng.choice([128, 256, 512, 1024, 2048])  # per expert
    elif family == "odd_n":
        d = _pick(rng, 1024, 7168, 512)
        n = rng.choice([m * 64 for m in range(11, 64) if m % 4 != 0])  # 704 .. 4032, not % 256
        E, K = rng.choice([16, 32, 64, 128, 256]), rng.choice([2, 4, 6, 8])
        rows = rng.choice([256, 512, 1024, 2048])
    elif family == "k1_few_e":
        d, n = _pick(rng, 2048, 6144, 512), _pick(rng, 8192, 16384, 1024)
        E, K = rng.choice([4, 8, 12, 16]), 1
        rows = rng.choice([512, 1024, 2048, 4096])
    elif family == "few_rows":
        d, n = _pick(rng, 1024, 7168, 512), _pick(rng, 512, 3072, 128)
        E, K = rng.choice([64, 128, 256, 384, 512]), rng.choice([4, 6, 8, 12, 16])
        rows = rng.choice([16, 32, 48, 64, 96, 128])
    elif family == "odd_d":
        d = rng.choice([m * 64 for m in range(24, 82) if m % 4 != 0])  # 1600 .. 5184, not % 256
        n = _pick(rng, 1024, 3072, 64)
        E, K = rng.choice([16, 32, 48, 64, 96, 128]), rng.choice([2, 4, 6, 8])
        rows = rng.choice([256, 512, 1024, 2048])
    else:  # general
        d, n = _pick(rng, 768, 4096, 256), _pick(rng, 256, 2048, 128)
        E = rng.choice([8, 16, 32, 60, 64, 96, 128, 256, 384, 512])
        K = rng.choice([k for k in (1, 2, 4, 6, 8, 12, 16) if k <= E])
        rows = rng.choice([64, 256, 1024, 4096])
    # T from the rows per expert, not a round number (counts off the tile are the point).
    T = max(1, (rows * E) // K + rng.randrange(-7, 8))
    return T, d, n, E, K


def known_shapes(folder=HERE):
    seen = set()
    for f in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(f.read_text())
        except ValueError:
            continue
        for c in doc if isinstance(doc, list) else []:
            if isinstance(c, dict) and all(k in c for k in "TdnEK"):
                seen.add((c["T"], c["d"], c["n"], c["E"], c["K"]))
    return seen


def draw(seed, per_family=2, families=FAMILIES, max_gb=40.0, max_tflop=40.0, known=None):
    """per_family shapes of each family, deterministic in (seed, the arguments, known)."""
    rng = random.Random(seed)
    known = known_shapes() if known is None else known
    out, taken = [], set(known)
    for fam in families:
        got, tries = 0, 0
        while got < per_family:
            tries += 1
            if tries > 10000:
                raise SystemExit(f"unseen.py: no {fam} shape fits --max-gb {max_gb} / --max-tflop {max_tflop}")
            s = _draw(rng, fam)
            T, d, n, E, K = s
            if s in taken or held_gb(*s) > max_gb or tflop(*s) > max_tflop:
                continue
            taken.add(s)
            got += 1
            out.append({"name": f"u{seed % 10000:04d} {fam} d{d} n{n} E{E} K{K} T{T}", "T": T, "d": d, "n": n,
                        "E": E, "K": K, "source": f"unseen.py --seed {seed}: {fam}"})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=int(datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")))
    p.add_argument("--per-family", type=int, default=2)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--max-gb", type=float, default=40.0, help="estimated GPU memory per shape (H100: 80 GB)")
    p.add_argument("--max-tflop", type=float, default=40.0, help="fwd + bwd work per shape")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    fams = tuple(f for f in a.families.split(",") if f)
    bad = [f for f in fams if f not in FAMILIES + OPT_IN_FAMILIES]
    if bad:
        p.error(f"--families: unknown {bad}; known: {','.join(FAMILIES + OPT_IN_FAMILIES)}")
    shapes = draw(a.seed, a.per_family, fams, a.max_gb, a.max_tflop)
    pathlib.Path(a.out).write_text("[\n" + ",\n".join(" " + json.dumps(c) for c in shapes) + "\n]\n")
    print(f"unseen.py: seed {a.seed}, {len(shapes)} shapes -> {a.out}")
    for c in shapes:
        print(f"  {c['name']}: {held_gb(c['T'], c['d'], c['n'], c['E'], c['K']):.1f} GB, "
              f"{tflop(c['T'], c['d'], c['n'], c['E'], c['K']):.1f} TFLOP")


if __name__ == "__main__":
    main()
