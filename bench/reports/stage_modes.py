"""Per-GEMM stage times of bench_layer runs under different engine switches, side by side.

Usage: python3 bench/reports/stage_modes.py NAME=LOG [NAME=LOG ...] > table.md
Each LOG is bench_layer's stdout (its "per-stage median ms" block); the table has one row per
(config, GEMM stage) and one column per run, the fastest marked.
"""
import re
import sys

STAGES = ["fwd.routing", "fwd.up_proj", "fwd.down_proj", "fwd.aggregate", "bwd.gather_dout", "bwd.dA_proj",
          "bwd.dW2", "bwd.dW1", "bwd.dX_proj", "bwd.dx_sum"]


def parse(path):
    text = open(path).read().split("per-stage median ms:")[1]
    out = {}
    for line in text.strip().splitlines():
        if " fwd." not in line:
            continue
        name = line[: line.index(" fwd.")].strip()
        out[name] = {k: float(v) for k, v in re.findall(r"(\S+)=([\d.]+)", line)}
    return out


def main():
    runs = [(a.split("=", 1)[0], parse(a.split("=", 1)[1])) for a in sys.argv[1:]]
    print("| config | stage | " + " | ".join(n for n, _ in runs) + " |")
    print("|---|---|" + "---|" * len(runs))
    for cfg in runs[0][1]:
        # "all stages": the sum of every stage of the run (forward and backward), the layer's time.
        for st in STAGES + ["all stages"]:
            if st == "all stages":
                vals = [sum(r[cfg].values()) if cfg in r else None for _, r in runs]
            else:
                vals = [r[cfg].get(st) if cfg in r else None for _, r in runs]
            if all(v is None for v in vals):
                continue  # a stage no run has (bwd.gather_dout only where dW2 reads gathered rows)
            best = min(v for v in vals if v is not None)
            cells = [("**%.3f**" % v if v == best else "%.3f" % v) if v is not None else "-" for v in vals]
            print(f"| {cfg} | {st} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
