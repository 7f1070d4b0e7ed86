"""Token rounding report: merges bench_layer runs with --router topk|nr|up|down|sr into one results
file (the shared results format, one entry per config and routing mode), writes a markdown table and
plots the tile waste and the layer time per mode, and the training curves of bench/drivers/tr_training.py.

    python3 bench/reports/token_rounding_report.py --runs DIR --training tr_training.json --out bench/results/h200
(DIR holds public_<mode>.json and sweep_<mode>.json from bench_layer.)
"""
import argparse
import json
import os

MODES = ["topk", "nr", "up", "down", "sr"]


def load(path):
    return json.load(open(path)) if os.path.exists(path) else None


def merge(runs):
    head, entries = None, []
    for suite in ("public", "sweep"):
        for m in MODES:
            d = load(os.path.join(runs, f"{suite}_{m}.json"))
            if d is None:
                continue
            head = head or {k: d[k] for k in d if k != "results"}
            for r in d["results"]:
                o = r["systems"]["ours"]
                if "error" not in o:
                    o["tile_waste"] = 1 - o["rows"] / o["tile_rows"] if o["tile_rows"] else 0.0
                entries.append({"config": r["config"], "suite": suite, "routing": m, "systems": r["systems"],
                                "kernels": r["kernels"]})
    return dict(head or {}, results=entries)


def table(merged):
    rows = {}
    for e in merged["results"]:
        rows.setdefault((e["suite"], e["config"]["name"]), {})[e["routing"]] = e["systems"]["ours"]
    out = ["| suite | config | " + " | ".join(f"{m} ms (waste, rows)" for m in MODES) + " |",
           "|---|---|" + "---|" * len(MODES)]
    for (suite, name), per in rows.items():
        cells = []
        for m in MODES:
            o = per.get(m)
            if o is None or "error" in o:
                cells.append("-")
            else:
                cells.append(f"{o['fwd_ms'] + o['bwd_ms']:.3f} ({100 * o['tile_waste']:.1f}%, {o['rows']})")
        out.append(f"| {suite} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plots(merged, training, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sweep = [e for e in merged["results"] if e["suite"] == "sweep" and "7B-like" in e["config"]["name"]]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in MODES:
        pts = sorted((e["config"]["T"] * e["config"]["K"] / e["config"]["E"], e["systems"]["ours"]) for e in sweep
                     if e["routing"] == m and "error" not in e["systems"]["ours"])
        if not pts:
            continue
        x = [p[0] for p in pts]
        ax[0].plot(x, [100 * p[1]["tile_waste"] for p in pts], "o-", label=m)
        ax[1].plot(x, [p[1]["fwd_ms"] + p[1]["bwd_ms"] for p in pts], "o-", label=m)
    for a, t in zip(ax, ["padded rows of the 128-row tiles (%)", "layer forward+backward (ms)"]):
        a.set_xscale("log", base=2)
        a.set_xlabel("mean tokens per expert (d 1536, n 256, E 128, K 8)")
        a.set_title(t)
        a.legend()
        a.grid(alpha=0.3)
    fig.suptitle(f"Token rounding vs top-K, H200, commit {merged.get('commit', '?')}")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "token_rounding.png"), dpi=110)
    if training:
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        Es = sorted({r["E"] for r in training["results"]})
        for a, E in zip(ax, Es):
            for r in training["results"]:
                if r["E"] != E or r.get("seed", 0) != 0:  # one curve per mode (seed 0)
                    continue
                L, w = r["train_loss"], 10
                sm = [sum(L[max(0, i - w + 1):i + 1]) / len(L[max(0, i - w + 1):i + 1]) for i in range(len(L))]
                lab = f"{r['mode']} (held-out top-K {r['heldout_topk']:.3f})"
                a.plot(sm, label=lab, lw=1.2)
            args = training["args"]
            tpe = args["B"] * args["S"] * args["K"] / E
            a.set_title(f"E = {E}: {tpe:.0f} tokens per expert = {tpe / 128:.1f} tiles")
            a.set_xlabel("step")
            a.set_ylim(2.0, 3.2)
            a.grid(alpha=0.3)
            a.legend(fontsize=8)
        ax[0].set_ylabel("train loss (10-step mean), bytes of Python stdlib")
        fig.suptitle(f"Training with token rounding, H200, commit {training.get('commit', '?')}")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "tr_training.png"), dpi=110)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", required=True)
    p.add_argument("--training", default="")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    merged = merge(a.runs)
    json.dump(merged, open(os.path.join(a.out, "token_rounding.json"), "w"), indent=1)
    open(os.path.join(a.out, "token_rounding.md"), "w").write(
        f"# Token rounding vs top-K (H200, commit {merged.get('commit')})\n\n"
        "Layer forward+backward ms, tile waste (padded rows of the 128-row tiles) and grouped rows, per "
        "routing mode. `bench_layer --router MODE` (warm-up 2, median of 5-7).\n\n" + table(merged))
    training = load(a.training) if a.training else None
    plots(merged, training, a.out)


if __name__ == "__main__":
    main()
