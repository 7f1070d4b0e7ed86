#!/usr/bin/env python3
"""Each GEMM of one forward + backward under Nsight Compute, ours beside SonicMoE's: the launch configuration
its autotune (or our heuristic) chose and what the kernel reached (issue 37: "where you stop short, say per
GEMM what holds it back").

  python3 bench/reports/sonic_ncu_report.py DIR [--md out.md]

DIR/manifest.tsv (scripts/device.sh sonic, SONIC_STAGE=ncu) has a line per ncu run: config, system (ours or
sonicmoe) and the run's raw page (`ncu --import R --csv --page raw`, a row per kernel in launch order) as a
path relative to DIR. A run profiles one iteration of one system (bench/drivers/sonic_profile.py --ncu), so
its kernels in order name the GEMMs as sonic_profile_report.py does (SONIC_GEMM_ORDER, OURS_GEMM_ORDER).
What the columns say about a tile: the grid is the persistent CTA count (or the tile count when not
persistent), the cluster the CTAs sharing an operand by multicast, the dynamic shared memory the pipeline's
stages (and an epilogue's staging), the registers per thread the warpgroups' split. ncu locks the clocks to
base and flushes the caches by default, so its times are longer than a profiler's; both systems are measured
the same way. A run whose raw page cannot be read is named and left out; the others still report.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_summary import BYTE_SCALE, TIME_SCALE, number, read_raw, short_name  # noqa: E402
from sonic_profile_report import OURS_GEMM_ORDER, SONIC_GEMM_ORDER, gemm_launches, is_gemm  # noqa: E402

SYSTEMS = {"ours": ("ours", OURS_GEMM_ORDER), "sonicmoe": ("SonicMoE", SONIC_GEMM_ORDER)}
# (column, metric names: the first present wins). Missing metrics print as "-".
METRICS = [
    ("grid", ["launch__grid_size"]),
    ("block", ["launch__block_size"]),
    ("cluster", ["launch__cluster_dim_x"]),
    ("regs", ["launch__registers_per_thread"]),
    ("SM%", ["sm__throughput.avg.pct_of_peak_sustained_elapsed"]),
    ("tensor%", ["sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
                 "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed"]),
    ("DRAM%", ["gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed"]),
    ("L2 hit%", ["lts__t_sector_hit_rate.pct"]),
]
TIME = "gpu__time_duration.sum"
SMEM = "launch__shared_mem_per_block_dynamic"
DRAM_READ = "dram__bytes_read.sum"
DRAM_WRITE = "dram__bytes_write.sum"
KB_SCALE = {"byte": 1 / 1024, "Kbyte": 1000 / 1024, "Mbyte": 1e6 / 1024}


def kernels(path):
    """The raw page's kernels in launch order: [{"name", "ms", column: text}]."""
    header, unit_of, data = read_raw(path)
    idx = {h: i for i, h in enumerate(header)}
    if "Kernel Name" not in idx:
        raise SystemExit(f"{path}: no 'Kernel Name' column")

    def value(row, name):
        i = idx.get(name)
        return number(row[i]) if i is not None and i < len(row) else None

    out = []
    for row in data:
        t = value(row, TIME)
        k = {"name": row[idx["Kernel Name"]],
             "ms": (t or 0.0) * TIME_SCALE.get(unit_of.get(TIME, "nsecond"), 1e-3) / 1e3}
        for col, names in METRICS:
            v = next((value(row, n) for n in names if n in idx), None)
            k[col] = "-" if v is None else (f"{v:.0f}" if col in ("grid", "block", "cluster", "regs") else f"{v:.1f}")
        v = value(row, SMEM)  # ncu's Kbyte is 1000 bytes; the column is KiB
        unit = unit_of.get(SMEM, "byte").split("/")[0]
        k["smem KB"] = "-" if v is None else f"{v * KB_SCALE.get(unit, 1 / 1024):.0f}"
        for col, name in (("DRAM rd GB", DRAM_READ), ("DRAM wr GB", DRAM_WRITE)):
            v = value(row, name)
            k[col] = "-" if v is None else f"{v * BYTE_SCALE.get(unit_of.get(name, 'byte'), 1e-9):.2f}"
        out.append(k)
    return out


def read_manifest(folder):
    """{config: {system: [kernels]}} in the manifest's order, and the runs that could not be read
    [(config, system, why)]."""
    path = os.path.join(folder, "manifest.tsv")
    runs, failed = {}, []
    for n, line in enumerate(open(path), 1):
        if not line.strip():
            continue
        parts = line.rstrip("\n").split("\t")
        if len(parts) != 3 or parts[1] not in SYSTEMS:
            raise SystemExit(f"{path}:{n}: want 'config<TAB>ours|sonicmoe<TAB>csv', got {line.strip()!r}")
        cfg, system, csv_path = parts
        try:
            runs.setdefault(cfg, {})[system] = kernels(os.path.join(folder, csv_path))
        except (SystemExit, OSError) as e:
            failed.append((cfg, system, str(e)))
    return runs, failed


COLUMNS = ["ms", "grid", "cluster", "block", "regs", "smem KB", "SM%", "tensor%", "DRAM%", "L2 hit%", "DRAM rd GB",
           "DRAM wr GB"]


def config_lines(cfg, systems):
    lines = [f"## {cfg}", ""]
    roles = {s: gemm_launches(ks, SYSTEMS[s][1]) for s, ks in systems.items()}
    for s, r in roles.items():
        if r is None:
            lines.append(f"{SYSTEMS[s][0]}: its {sum(1 for k in systems[s] if is_gemm(k['name']))} GEMM launches do "
                         f"not fit the expected order ({', '.join(SYSTEMS[s][1])}); every kernel is listed below.")
    lines += ["| GEMM | system | " + " | ".join(COLUMNS) + " | kernel |", "|---|---|" + "---|" * len(COLUMNS) + "---|"]
    for role in SONIC_GEMM_ORDER:
        for s in ("ours", "sonicmoe"):
            if s not in roles or roles[s] is None:
                continue
            for k in roles[s][role]:
                cells = [f"{k['ms']:.3f}"] + [k[c] for c in COLUMNS[1:]]
                lines.append(f"| {role} | {SYSTEMS[s][0]} | " + " | ".join(cells) + f" | `{short_name(k['name'], 60)}` |")
        if all(roles.get(s) for s in ("ours", "sonicmoe")):
            o = sum(k["ms"] for k in roles["ours"][role])
            so = sum(k["ms"] for k in roles["sonicmoe"][role])
            ratio = f"{so / o:.2f}" if o > 0 else "-"
            lines.append(f"| {role} | sonic / ours | {ratio} |" + " |" * (len(COLUMNS) - 1) + " |")
    for s, ks in systems.items():
        if roles.get(s) is None:
            lines += ["", f"{SYSTEMS[s][0]}, every kernel in launch order:", ""]
            lines += [f"{i}. {k['ms']:.3f} ms `{short_name(k['name'], 90)}`" for i, k in enumerate(ks)]
    total = {s: sum(k["ms"] for k in ks) for s, ks in systems.items()}
    lines += ["", "All profiled kernels: " + ", ".join(f"{SYSTEMS[s][0]} {t:.3f} ms" for s, t in total.items()), ""]
    return lines


def report(runs, failed=()):
    lines = ["Each GEMM of one forward + backward under Nsight Compute (ncu's clocks), by launch order; "
             "`sonic / ours` > 1: ours is faster.", ""]
    lines += [f"Not read: {cfg}, {system}: {why}" for cfg, system, why in failed]
    if failed:
        lines.append("")
    for cfg, systems in runs.items():
        if systems:
            lines += config_lines(cfg, systems)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--md")
    args = ap.parse_args()
    runs, failed = read_manifest(args.folder)
    text = report(runs, failed)
    if args.md:
        open(args.md, "w").write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
