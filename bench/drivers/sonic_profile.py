#!/usr/bin/env python3
"""SonicMoE's kernels one by one (torch.profiler, CUDA activity), to set against bench_layer's
per-stage times of this library at the same config: which of its GEMMs / sums is faster than ours.

Usage (GPU machine, SonicMoE installed by bench/baselines/sonicmoe_env.sh):
  python3 bench/drivers/sonic_profile.py --configs "30B n256 E256 K16,30B n512 E128 K8" --out DIR
Per config: the same inputs as bench/drivers/side_by_side.py (torch_baseline.make_inputs, seed 0), forward +
backward --warmup times (its JIT compiles and autotunes there), then --iters profiled iterations;
DIR/<config>.md lists every kernel name with its calls and ms per iteration, largest first, and the
sum (= SonicMoE's GPU time per forward + backward, gaps between kernels excluded).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # side_by_side (bench/drivers)
import torch  # noqa: E402
import side_by_side as sbs  # noqa: E402


def profile_config(cfg, args, device):
    K = int(cfg["K"])
    params, dout = sbs.layer_inputs(cfg, args, device)
    x, w_router, w1i, w2 = params
    stream = torch.cuda.current_stream().cuda_stream

    def step():
        for p in params:
            p.grad = None
        out = sbs.sonicmoe.moe_TC_softmax_topk_layer(x, w_router, w1i.permute(1, 2, 0), None, w2.permute(1, 2, 0),
                                                     None, K, stream, sbs.ActivationType.SWIGLU, False)[0]
        out.backward(dout)

    t0 = time.time()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        r = rows.setdefault(ev.name, [0, 0.0])
        r[0] += 1
        r[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    table = sorted(((name, c / args.iters, us / args.iters / 1e3) for name, (c, us) in rows.items()),
                   key=lambda r: -r[2])
    return warm_s, table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True)
    ap.add_argument("--configs-file", default=sbs.DEFAULT_CONFIGS)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if sbs.SONIC_REASON:
        sys.exit(sbs.SONIC_REASON)
    os.makedirs(args.out, exist_ok=True)
    cfgs = {c["name"]: c for c in json.load(open(args.configs_file))}
    device = torch.device("cuda")
    for name in args.configs.split(","):
        warm_s, table = profile_config(cfgs[name], args, device)
        total = sum(ms for _, _, ms in table)
        lines = [f"# SonicMoE kernels, {name} (forward + backward, ms per iteration over {args.iters}; "
                 f"warm-up {warm_s:.0f} s)", "", "| kernel | calls | ms |", "|---|---|---|"]
        lines += [f"| {n[:150]} | {c:g} | {ms:.3f} |" for n, c, ms in table]
        lines.append(f"| **sum** | | **{total:.3f}** |")
        path = os.path.join(args.out, name.replace(" ", "_") + ".md")
        open(path, "w").write("\n".join(lines) + "\n")
        print("\n".join(lines[:3] + [f"{ms:8.3f}  {c:g}x  {n[:110]}" for n, c, ms in table[:25]]), flush=True)
        print(f"sum {total:.3f} ms", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
