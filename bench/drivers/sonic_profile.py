#!/usr/bin/env python3
"""SonicMoE's kernels one by one (torch.profiler, CUDA activity), next to this library's through its torch op
in the same process on the same inputs: which of its GEMMs / sums is faster than ours.

Usage (GPU machine, SonicMoE installed by bench/baselines/sonicmoe_env.sh; `scripts/device.sh sonic` with
SONIC_STAGE=profile):
  python3 bench/drivers/sonic_profile.py --configs "30B n256 E256 K16,30B n512 E128 K8" --out DIR [--systems sonicmoe,ours]
Per config and system: the same inputs as bench/drivers/side_by_side.py (torch_baseline.make_inputs, seed 0),
forward + backward --warmup times (SonicMoE's JIT compiles and autotunes there), then --iters profiled
iterations; DIR/<config>.<system>.md lists every kernel name with its calls and ms per iteration, largest
first, and the sum (= the system's GPU time per forward + backward, gaps between kernels excluded);
DIR/profile.json holds both tables per config (and one iteration's kernels in launch order, which names
each GEMM where a kernel serves several), rewritten after each, so a call cut at its time limit keeps
what finished. --resume PREV.json (an earlier call's profile.json, same commit and GPU) keeps its tables and
profiles only the (config, system) pairs it lacks: on a warm machine a second call goes on where the first
was cut (scripts/device.sh: SONIC_PROFILE_RESUME).

--ncu: for Nsight Compute (`ncu --profile-from-start off ... sonic_profile.py --ncu`, scripts/device.sh sonic with
SONIC_STAGE=ncu): after the warm-up, one iteration runs between cudaProfilerStart and cudaProfilerStop, so ncu
measures only the layer's kernels, never SonicMoE's autotune or JIT launches; no torch.profiler, no tables
(bench/reports/sonic_ncu_report.py reads ncu's).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # side_by_side (bench/drivers)
import side_by_side as sbs  # noqa: E402  (imports without torch: the CPU tests of the helpers below)

torch = sbs.torch


def pending(doc, names, systems):
    """The (config, system) pairs still to profile: those the (resumed) document does not hold."""
    have = doc.get("configs", {})
    return [(n, s) for n in names for s in systems if s not in have.get(n, {})]


def launch_order(events, iters):
    """One iteration's kernels in launch order, [{"name", "ms"}], from the profiled CUDA events
    [(start_us, name, duration_us)] of `iters` identical iterations; None when the count does not split
    evenly (then the iterations differed and no one of them stands for the others). The aggregated
    table cannot say which GEMM a kernel is when one kernel serves several (SonicMoE's autotuned quack
    GEMMs share names); the order can (sonic_profile_report.py, launch-order table)."""
    if not events or iters <= 0 or len(events) % iters:
        return None
    first = sorted(events, key=lambda e: e[0])[:len(events) // iters]
    return [{"name": name, "ms": dur / 1e3} for _, name, dur in first]


def resumed(path, commit, gpu, iters):
    """An earlier call's profile.json to go on from; refused if it was made at another commit, on another
    GPU model or with another --iters (its tables would not compare with the new ones)."""
    doc = json.load(open(path))
    for key, want in (("commit", commit), ("gpu", gpu), ("iters", iters)):
        if doc.get(key) != want:
            sys.exit(f"--resume {path}: its {key} is {doc.get(key)!r}, this run's {want!r}; tables of different "
                     f"{key}s do not compare: resume only a profile of the same commit, GPU and --iters")
    doc.setdefault("configs", {})
    return doc


def ncu_args_refusal(args):
    """Why these arguments cannot run under --ncu, or None. One (config, system) per process: ncu's report
    then holds that pair's kernels alone, in launch order, which is how the report names each GEMM."""
    if not args.ncu:
        return None
    if args.resume:
        return "--ncu and --resume: --ncu writes no tables to resume"
    n_cfg = len([c for c in args.configs.split(",") if c])
    n_sys = len([s for s in args.systems.split(",") if s])
    if n_cfg != 1 or n_sys != 1:
        return f"--ncu: one config and one system per process (got {n_cfg} and {n_sys}): ncu's report names no pair"
    return None


def profile_config(cfg, args, device, system):
    K = int(cfg["K"])
    params, dout = sbs.layer_inputs(cfg, args, device)
    stream = torch.cuda.current_stream().cuda_stream
    if system == "ours":
        import smoe_torch  # noqa: F401  (registers the op's autograd)

    def step():
        for p in params:
            p.grad = None
        if system == "ours":
            out = sbs.ours_forward(params, K)
        else:
            out = sbs.sonic_forward(params, K, stream)
        out.backward(dout)

    t0 = time.time()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    if args.ncu:
        torch.cuda.profiler.start()
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return warm_s, None, None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
    rows, events = {}, []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        r = rows.setdefault(ev.name, [0, 0.0])
        r[0] += 1
        r[1] += us
        events.append((ev.time_range.start, ev.name, us))
    table = sorted(((name, c / args.iters, us / args.iters / 1e3) for name, (c, us) in rows.items()),
                   key=lambda r: -r[2])
    return warm_s, table, launch_order(events, args.iters)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True)
    ap.add_argument("--configs-file", default=sbs.DEFAULT_CONFIGS)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default="sonicmoe,ours", help="which of sonicmoe,ours to profile")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", help="an earlier call's profile.json: keep its tables, profile only what it lacks")
    ap.add_argument("--ncu", action="store_true",
                    help="one iteration between cudaProfilerStart / Stop after the warm-up, for ncu; no tables")
    args = ap.parse_args()
    ncu_refusal = ncu_args_refusal(args)
    if ncu_refusal:
        sys.exit(ncu_refusal)
    systems = [x for x in args.systems.split(",") if x]
    bad = [x for x in systems if x not in ("sonicmoe", "ours")]
    if bad or not systems:
        sys.exit(f"--systems: {args.systems!r}; known: sonicmoe, ours")
    if "sonicmoe" in systems and sbs.SONIC_REASON:
        sys.exit(sbs.SONIC_REASON)
    os.makedirs(args.out, exist_ok=True)
    cfgs = {c["name"]: c for c in json.load(open(args.configs_file))}
    missing = [n for n in args.configs.split(",") if n not in cfgs]
    if missing:
        sys.exit(f"--configs: {missing} not in {args.configs_file}")
    if torch is None:
        sys.exit(f"torch does not import ({sbs.TORCH_REASON}): run this on the GPU machine")
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    doc = (resumed(args.resume, args.commit, gpu, args.iters) if args.resume
           else {"commit": args.commit, "gpu": gpu, "iters": args.iters, "configs": {}})
    todo = pending(doc, args.configs.split(","), systems)
    if args.resume:
        print(f"resumed {args.resume}: {len(todo)} of {len(args.configs.split(',')) * len(systems)} tables to go",
              flush=True)
        json.dump(doc, open(os.path.join(args.out, "profile.json"), "w"), indent=1)
    for name, system in todo:
        warm_s, table, sequence = profile_config(cfgs[name], args, device, system)
        if args.ncu:
            print(f"ncu: one iteration of {name}, {system}, between cudaProfilerStart / Stop (warm-up {warm_s:.0f} s)",
                  flush=True)
            torch.cuda.empty_cache()
            continue
        total = sum(ms for _, _, ms in table)
        lines = [f"# {system} kernels, {name} (forward + backward, ms per iteration over {args.iters}; "
                 f"warm-up {warm_s:.0f} s)", "", "| kernel | calls | ms |", "|---|---|---|"]
        lines += [f"| {n[:150]} | {c:g} | {ms:.3f} |" for n, c, ms in table]
        lines.append(f"| **sum** | | **{total:.3f}** |")
        path = os.path.join(args.out, name.replace(" ", "_") + f".{system}.md")
        open(path, "w").write("\n".join(lines) + "\n")
        print("\n".join(lines[:3] + [f"{ms:8.3f}  {c:g}x  {n[:110]}" for n, c, ms in table[:25]]), flush=True)
        print(f"sum {total:.3f} ms", flush=True)
        doc["configs"].setdefault(name, {})[system] = {
            "sum_ms": total, "warmup_s": warm_s,
            "kernels": [{"name": n, "calls": c, "ms": ms} for n, c, ms in table], "sequence": sequence}
        # Rewritten after every table: a call cut at its limit keeps what finished.
        json.dump(doc, open(os.path.join(args.out, "profile.json"), "w"), indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
