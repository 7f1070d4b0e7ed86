"""Token rounding in training: a small byte-level MoE language model trained on real text (the
Python standard library's own sources, read as bytes) with plain top-K routing, each token-rounding
mode (NR, UP, DOWN, SR) and a pure-torch fp32 top-K twin; every model is evaluated on held-out text
with plain top-K routing (and the TR-trained ones also with their own routing).

Two sparsities: mean tokens per expert = 2 tiles (E = 32) and = 1 tile (E = 64) of the engine's
128-row tile, T*K = 8192 rows per MoE layer per step. SonicMoE's claim: a TR-trained model run with
top-K matches top-K training, stable at >= 2 tiles per expert, possibly worse at 1 tile.

    python3 bench/drivers/tr_training.py --steps 300 --out bench/results/h200/tr_training.json
    python3 bench/drivers/tr_training.py --experts 64 --modes topk,nr,down --seeds 4   # is a gap real?
"""
import argparse
import glob
import json
import math
import os
import subprocess
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import smoe_torch


def corpus(device):
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    data = b"".join(open(f, "rb").read() for f in files)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device=device, dtype=torch.long)
    split = int(len(t) * 0.95)
    return t[:split], t[split:], len(files)


class TorchMoE(nn.Module):
    """fp32 twin: torchtitan's MoE math (softmax over the K chosen, SwiGLU experts), plain torch."""

    def __init__(self, d, n, E, K):
        super().__init__()
        self.K = K
        self.router = nn.Linear(d, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, n, d) * 0.02)
        self.w3 = nn.Parameter(torch.randn(E, n, d) * 0.02)
        self.w2 = nn.Parameter(torch.randn(E, d, n) * 0.02)
        nn.init.trunc_normal_(self.router.weight, std=0.02)

    @torch.autocast("cuda", enabled=False)  # fp32 throughout, also inside the bf16-autocast model
    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1]).float()
        vals, idx = self.router(x).topk(self.K, dim=-1)
        s = vals.softmax(-1)
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                xe = x[tok]
                h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
                out = out.index_add(0, tok, (h @ self.w2[e].T) * s[tok, slot, None])
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, d, heads, moe):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.heads, self.moe = heads, moe

    def forward(self, x):
        B, S, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, S, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, S, d))
        return x + self.moe(self.n2(x)).to(x.dtype)


class LM(nn.Module):
    def __init__(self, d, n, E, K, layers, mode):
        super().__init__()
        self.emb = nn.Embedding(256, d)
        moes = []
        for _ in range(layers):
            if mode == "torch_fp32":
                moes.append(TorchMoE(d, n, E, K))
            else:
                moes.append(smoe_torch.MoE(d, n, E, K, token_rounding=None if mode == "topk" else mode))
        self.blocks = nn.ModuleList(Block(d, 4, m) for m in moes)
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, 256, bias=False)

    def set_rounding(self, mode):
        for b in self.blocks:
            if isinstance(b.moe, smoe_torch.MoE):
                b.moe.token_rounding = mode

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def batches(data, B, S, gen):
    while True:
        i = torch.randint(0, len(data) - S - 1, (B,), generator=gen, device=data.device)
        j = i[:, None] + torch.arange(S + 1, device=data.device)
        yield data[j[:, :-1]], data[j[:, 1:]]


@torch.no_grad()
def evaluate(model, data, B, S, batches_n=20):
    gen = torch.Generator(device=data.device)
    gen.manual_seed(1234)
    it = batches(data, B, S, gen)
    tot = 0.0
    for _ in range(batches_n):
        x, y = next(it)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            tot += F.cross_entropy(model(x).float().view(-1, 256), y.reshape(-1)).item()
    return tot / batches_n


def run(mode, E, args, train, held, seed=0):
    torch.manual_seed(seed)
    model = LM(args.d, args.n, E, args.K, args.layers, mode).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(42 + seed)
    it = batches(train, args.B, args.S, gen)
    losses = []
    t0 = time.time()
    for step in range(args.steps):
        x, y = next(it)
        lr = args.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().view(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    train_s = time.time() - t0
    res = {"mode": mode, "E": E, "seed": seed, "train_loss": losses, "train_s": train_s}
    model.set_rounding(None)
    res["heldout_topk"] = evaluate(model, held, args.B, args.S)
    if mode not in ("topk", "torch_fp32"):
        model.set_rounding(mode)
        res["heldout_own_routing"] = evaluate(model, held, args.B, args.S)
    print(f"E={E:3d} {mode:10s} final train {sum(losses[-20:]) / 20:.4f}  held-out top-K {res['heldout_topk']:.4f}"
          + (f"  own {res['heldout_own_routing']:.4f}" if "heldout_own_routing" in res else "")
          + f"  ({train_s:.1f} s)", flush=True)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--B", type=int, default=16)
    p.add_argument("--S", type=int, default=256)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--K", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--experts", default="32,64")
    p.add_argument("--modes", default="topk,nr,up,down,sr,torch_fp32")
    p.add_argument("--seeds", type=int, default=1, help="runs per (E, mode) with different init and data order")
    p.add_argument("--out", default="")
    args = p.parse_args()
    train, held, nfiles = corpus("cuda")
    print(f"corpus: {nfiles} stdlib .py files, {len(train) + len(held)} bytes (5% held out)")
    results = []
    for E in (int(e) for e in args.experts.split(",")):
        tpe = args.B * args.S * args.K / E
        print(f"-- E = {E}: {tpe:.0f} tokens per expert per layer = {tpe / 128:.1f} tiles")
        for mode in args.modes.split(","):
            runs = [run(mode, E, args, train, held, seed) for seed in range(args.seeds)]
            results.extend(runs)
            if args.seeds > 1:
                h = torch.tensor([r["heldout_topk"] for r in runs])
                print(f"E={E:3d} {mode:10s} held-out top-K over {args.seeds} seeds: {h.mean():.4f} +- {h.std():.4f}",
                      flush=True)
    if args.out:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        except OSError:
            commit = "unknown"
        json.dump({"commit": os.environ.get("SMOE_COMMIT", commit), "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "args": vars(args), "corpus_bytes": len(train) + len(held),
                   "results": results}, open(args.out, "w"))


if __name__ == "__main__":
    main()
