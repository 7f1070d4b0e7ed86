#!/usr/bin/env python3
"""What the torch module costs over the bare op: does smoe_torch.MoE copy the expert weights per step?

Per config, forward and forward+backward (CUDA events, warm-up, median: torch_baseline.measure) of
  op_interleaved  torch.ops.smoe.moe_forward on gate/up already interleaved [E,2n,d] (the floor);
  op_two          the same op given torchtitan's w1 (gate) and w3 (up) [E,n,d] as two tensors;
  op_stack        the op after torch.stack of w1/w3 into [E,2n,d] inside the step (what a module
                  that stores two tensors and hands the kernels an interleaved copy pays; the
                  module did this before its weights were packed);
  module_packed   smoe_torch.MoE, w1 / w3 the two halves of one storage (the default);
  module_unpacked smoe_torch.MoE with both w1 and w3 replaced by separate Parameters (as FSDP2's
                  unsharded parameters are): the two-tensor path.
All bf16, the same numbers (torch_baseline.make_inputs); the module's router weights are the op's.

Usage (on the GPU, after `pip install --no-build-isolation .`):
  python3 bench/drivers/module_vs_op.py --out bench/results/h200/module_vs_op.json --commit $(git rev-parse HEAD)
"""
import argparse
import json
import os
import sys

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
sys.path.insert(0, os.path.join(BENCH, "baselines"))
import torch_baseline as tb  # noqa: E402

DEFAULT = "1.4B n256 E128 K8,30B n256 E256 K16,OLMoE-7B,Qwen3-235B"
SYSTEMS = ("op_interleaved", "op_two", "op_stack", "module_packed", "module_unpacked")


def interleave(w1, w3):
    E, n, d = w1.shape
    return torch.stack((w1, w3), dim=2).reshape(E, 2 * n, d)


def module_for(x, wr, w1, w3, w2, K, unpacked):
    import smoe_torch
    E, n, d = w1.shape
    m = smoe_torch.MoE(d, n, E, K, pack_gate_up=True).to(device=x.device, dtype=torch.bfloat16)
    m.load_state_dict({"router.gate.weight": wr.detach(), "experts.w1": w1.detach(),
                       "experts.w2": w2.detach(), "experts.w3": w3.detach()})
    if unpacked:
        for name in ("w1", "w3"):
            setattr(m.experts, name, torch.nn.Parameter(getattr(m.experts, name).detach().contiguous()))
    return m


def bench_config(cfg, args, device):
    T, d, n, E, K = (int(cfg[k]) for k in ("T", "d", "n", "E", "K"))
    x, wr, w1, w3, w2, dout = tb.make_inputs(T, d, n, E, device, seed=args.seed)
    op = torch.ops.smoe.moe_forward
    res = {}
    for system in SYSTEMS:
        if system == "op_interleaved":
            wi = interleave(w1.detach(), w3.detach()).contiguous().requires_grad_(True)
            params = [x, wr, wi, w2]
            fwd = lambda: op(x, wr, wi, w2, K)[0]  # noqa: E731
        elif system == "op_two":
            params = [x, wr, w1, w2, w3]
            fwd = lambda: op(x, wr, w1, w2, K, w3)[0]  # noqa: E731
        elif system == "op_stack":
            params = [x, wr, w1, w2, w3]
            fwd = lambda: op(x, wr, interleave(w1, w3), w2, K)[0]  # noqa: E731
        else:
            m = module_for(x, wr, w1, w3, w2, K, unpacked=system == "module_unpacked")
            params = [x] + list(m.parameters())
            fwd = lambda: m(x)  # noqa: E731
        r = tb.measure(fwd, params, dout, cfg, args, device)
        res[system] = {k: r[k] for k in ("fwd_ms", "bwd_ms", "held_bytes", "peak_bytes")}
        res[system]["total_ms"] = r["fwd_ms"] + r["bwd_ms"]
        del params, fwd
        if system.startswith("module"):
            del m
        torch.cuda.empty_cache()
    floor = res["op_interleaved"]["total_ms"]
    for system in SYSTEMS:
        res[system]["vs_op_interleaved"] = res[system]["total_ms"] / floor
    return res


def main():
    import smoe_torch  # noqa: F401  (registers torch.ops.smoe)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=DEFAULT, help="comma-separated config names")
    ap.add_argument("--configs-file", default=tb.DEFAULT_CONFIGS)
    ap.add_argument("--shape", action="append", metavar="T,d,n,E,K", help="a shape outside the configs (repeatable)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    device = torch.device("cuda")
    cfgs = tb.load_configs(args)
    out = {"commit": args.commit, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "reps": args.reps, "warmup": args.warmup, "results": {}}
    print(f"{'config':22s} " + " ".join(f"{s:>16s}" for s in SYSTEMS) + "   (fwd+bwd ms; x of op_interleaved)")
    for cfg in cfgs:
        name = cfg["name"]
        r = bench_config(cfg, args, device)
        out["results"][name] = r
        print(f"{name:22s} " + " ".join(f"{r[s]['total_ms']:8.3f} ({r[s]['vs_op_interleaved']:.2f}x)" for s in SYSTEMS),
              flush=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
