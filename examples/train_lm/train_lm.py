#!/usr/bin/env python3
"""End-to-end training benchmark: one decoder-only MoE language model trained with each MoE layer
implementation in turn, with the same init, data order, optimizer and schedule.

  smoe        smoe_torch.MoE: the library's fused softmax top-K router and SwiGLU experts
  smoe_tr     the same module trained with SonicMoE token rounding (--token-rounding, default nr),
              evaluated with plain top-K
  torchtitan  torchtitan's MoE in plain torch (TorchtitanMoE below): router, argsort permutation,
              torch._grouped_mm experts, scatter_add combine
  sonicmoe    SonicMoE's moe_TC_softmax_topk_layer, if `import sonicmoe` works (else skipped, reason recorded)

Model: byte-level (the tokens are the 256 byte values, no tokenizer), pre-norm decoder with RMSNorm,
causal SDPA attention with RoPE and an MoE FFN in every layer. Data: the Python standard library's
own .py sources, sorted and concatenated as bytes, last 5% held out (bench/drivers/tr_training.py's
corpus, less site-packages). fp32 master weights, bf16 compute under torch.autocast, fused AdamW,
linear warmup + cosine, grad clip 1.0. README.md beside this file: what is measured and how to run it.
"""
import argparse
import contextlib
import gc
import glob
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is a nicety: a \r line replaces it
    tqdm = None

ALL_VARIANTS = ("smoe", "smoe_tr", "torchtitan", "sonicmoe")
VOCAB = 256
SMOKE = dict(layers=2, dim=64, heads=2, experts=4, top_k=2, hidden=32, seq=32, batch=4, steps=8, warmup_steps=2,
             profile_steps=2, log_every=2, eval_every=4, eval_batches=2, lr_warmup=2)


# ---- data
def load_corpus(holdout=0.05):
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for f in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        # A pyenv / source-built Python keeps site-packages under stdlib/: installed packages would
        # make the text differ between machines (here they were 85% of the files).
        if {"site-packages", "dist-packages"} & set(os.path.relpath(f, root).split(os.sep)):
            continue
        files.append(f)
    chunks = []
    for f in files:
        with open(f, "rb") as fh:
            chunks.append(fh.read())
    data = b"".join(chunks)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    split = int(len(t) * (1 - holdout))
    info = {"source": f"{root}/**/*.py, sorted, concatenated as bytes (site-packages excluded)",
            "python": platform.python_version(), "files": len(files), "bytes": len(data),
            "train_bytes": split, "heldout_bytes": len(data) - split,
            "sha256_16": hashlib.sha256(data).hexdigest()[:16]}
    return t[:split], t[split:], info


def train_batch(data, B, S, gen):
    i = torch.randint(0, len(data) - S - 1, (B,), generator=gen, device=data.device)
    w = data[i[:, None] + torch.arange(S + 1, device=data.device)].long()
    return w[:, :-1], w[:, 1:]


def eval_set(data, B, S, n):
    """Evenly spaced windows of the held-out text: the same tokens for every variant and eval point."""
    starts = torch.linspace(0, len(data) - S - 2, n * B).long().to(data.device)
    w = data[starts[:, None] + torch.arange(S + 1, device=data.device)].long()
    return [(w[k * B:(k + 1) * B, :-1], w[k * B:(k + 1) * B, 1:]) for k in range(n)]


# ---- the model's dense parts
def rope_tables(S, hd, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.outer(torch.arange(S, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()  # [S, hd/2]


def apply_rope(x, cos, sin):
    """x [B, S, H, hd], pairs (i, i + hd/2) rotated (rotate-half); in fp32, returned in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).type_as(x)


def attend(x, w_qkv, w_o, cos, sin, heads):
    B, S, d = x.shape
    q, k, v = F.linear(x, w_qkv).view(B, S, 3, heads, d // heads).unbind(2)
    q, k = apply_rope(q, cos[:S], sin[:S]), apply_rope(k, cos[:S], sin[:S])
    a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return F.linear(a.transpose(1, 2).reshape(B, S, d), w_o)


def head_loss(x, norm_w, eps, head_w, y):
    logits = F.linear(F.rms_norm(x, x.shape[-1:], norm_w, eps), head_w)
    return F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))


_COMPILED = {}


def maybe_compiled(fn, on):
    """One compiled graph per function, shared by every layer: the weights are arguments, so the
    layers differ in no guard (a compiled bound method per module would recompile per layer)."""
    if on and fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn] if on else fn


class Attention(nn.Module):
    def __init__(self, d, heads, S, compile_):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        cos, sin = rope_tables(S, d // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._attend = maybe_compiled(attend, compile_)  # inside this eager module: its timing hooks stay

    def forward(self, x):
        return self._attend(x, self.qkv.weight, self.o.weight, self.cos, self.sin, self.heads)


class FeedForward(nn.Module):
    """torchtitan's FeedForward (its shared experts): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# ---- torchtitan's MoE, transcribed (torchtitan/models/moe/moe.py: TokenChoiceTopKRouter, TokenReorderer,
# GroupedExperts with _run_experts_grouped_mm, MoE.forward) with score_func="softmax", route_norm=True,
# route_scale=1, score_before_experts=False (the scores weight the expert outputs, as in smoe and
# SonicMoE: the same function) and no load balancing. Left out: the DTensor / EP branches and
# indices_padding_wrapper, whose per-expert row padding torch._grouped_mm does not need in bf16
# (bench/baselines/torch_baseline.py).
_GMM_OK = {}  # (device type, dtype) -> torch._grouped_mm runs forward and backward there


def _probe_grouped_mm(device, dtype):
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.enable_grad():  # the first call may come from an evaluation
            a = torch.randn(6, 16, device=device, dtype=dtype, requires_grad=True)
            b = torch.randn(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
            out = torch._grouped_mm(a, b.transpose(-2, -1), offs=torch.tensor([2, 6], dtype=torch.int32, device=device))
            out.backward(torch.ones_like(out))
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_mm(a, b, offs):
    """torch._grouped_mm(a [R, k], b [E, k, m], offs). Always on CUDA (torchtitan's path: an error there
    must surface, not turn into a loop); on the CPU a per-expert loop where torch cannot run it."""
    key = (a.device.type, a.dtype)
    if key not in _GMM_OK:
        _GMM_OK[key] = a.is_cuda or _probe_grouped_mm(a.device, a.dtype)
    if _GMM_OK[key]:
        return torch._grouped_mm(a, b, offs=offs)
    outs, start = [], 0
    for e, end in enumerate(offs.tolist()):
        outs.append(a[start:end] @ b[e])
        start = end
    return torch.cat(outs)


class TorchtitanRouter(nn.Module):
    def __init__(self, dim, num_experts, top_k):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, x):
        scores = F.softmax(self.gate(x).to(torch.float32), dim=1)  # bf16 logits under autocast, fp32 softmax
        top_scores, idx = torch.topk(scores, k=self.top_k, dim=1)
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        # torchtitan passes the int64 ids; histc has no integer kernel on the CPU, and the counts are exact either way
        counts = torch.histc(idx.view(-1).float(), bins=self.num_experts, min=0, max=self.num_experts)
        return top_scores, idx, counts


class TorchtitanExperts(nn.Module):
    def __init__(self, dim, hidden, num_experts, compute_dtype):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # gate
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # up
        self.compute_dtype = compute_dtype  # torchtitan: bf16; fp32 only for the CPU smoke and the tests

    def forward(self, x, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        cd = self.compute_dtype
        h = F.silu(grouped_mm(x.to(cd), self.w1.to(cd).transpose(-2, -1), offs))
        h = h * grouped_mm(x.to(cd), self.w3.to(cd).transpose(-2, -1), offs)
        return grouped_mm(h, self.w2.to(cd).transpose(-2, -1), offs).type_as(x)


class TorchtitanMoE(nn.Module):
    def __init__(self, dim, hidden, experts, top_k, shared=0, compute_dtype=torch.bfloat16):
        super().__init__()
        self.top_k = top_k
        self.router = TorchtitanRouter(dim, experts, top_k)
        self.experts = TorchtitanExperts(dim, hidden, experts, compute_dtype)
        self.shared_experts = FeedForward(dim, hidden * shared) if shared > 0 else None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_scores, idx, counts = self.router(x)
        order = torch.argsort(idx.view(-1), stable=True)  # TokenReorderer
        scores_sorted = top_scores.view(-1)[order]
        tok = (order // self.top_k).reshape(-1, 1).expand(-1, x.shape[-1])
        routed_out = self.experts(torch.gather(x, 0, tok), counts)
        out = self.shared_experts(x).to(x.dtype) if self.shared_experts is not None else torch.zeros_like(x)
        routed_out = (routed_out.to(torch.float32) * scores_sorted.reshape(-1, 1)).to(x.dtype)
        return out.scatter_add(0, tok, routed_out).reshape(shape)


# ---- the other layers, on the same parameter names (router.gate.weight, experts.w1/w2/w3,
# shared_experts.w{1,2,3}.weight), so that one init fills every variant alike
class SonicMoE(nn.Module):
    """SonicMoE's layer (the call of bench/drivers/side_by_side.py). It reads gate/up interleaved by
    row, [E, 2n, d] as permute(1, 2, 0): built per step while casting the fp32 master weights to
    bf16, which copies anyway (as smoe's module casts w1 and w3).

    Evaluation also runs its training kernels (is_inference_mode=False, under no_grad): on a fresh
    machine its kernels compile and autotune cold on first use, 8.4 min for the first training step at
    b984359, and the inference kernels would compile a second time at the first evaluation (that run
    was cut off there). The output is the same either way: in sonic-moe 0.1.2.post1 the flag only
    decides whether the up-projection also stores its pre-activation H for backward (store_preact)."""

    def __init__(self, sonic, dim, hidden, experts, top_k, shared=0):
        super().__init__()
        self.sonic, self.top_k = sonic, top_k  # sonic: (the sonicmoe module, its ActivationType), or None
        self.router = nn.Module()
        self.router.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.experts.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.experts.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.shared_experts = FeedForward(dim, hidden * shared) if shared > 0 else None

    def forward(self, x):
        mod, act = self.sonic
        bf, shape, e = torch.bfloat16, x.shape, self.experts
        x2 = x.reshape(-1, shape[-1]).to(bf).contiguous()
        w13 = torch.stack((e.w1.to(bf), e.w3.to(bf)), dim=2).flatten(1, 2)  # row 2j gate j, 2j + 1 up j
        with torch.autocast("cuda", enabled=False):
            out = mod.moe_TC_softmax_topk_layer(
                x2, self.router.gate.weight.to(bf), w13.permute(1, 2, 0), None, e.w2.to(bf).permute(1, 2, 0), None,
                self.top_k, torch.cuda.current_stream().cuda_stream, act.SWIGLU, False)[0]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x2).to(out.dtype)
        return out.reshape(shape).to(x.dtype)


def make_smoe(smoe_torch, a, rounding):
    m = smoe_torch.MoE(a.dim, a.hidden, a.experts, a.top_k, token_rounding=rounding, num_shared_experts=a.shared)
    # The module's parameters are dense by default (pack_gate_up=False), which fused AdamW needs: packed
    # halves are refused on CUDA and updated wrongly on the CPU. Checked, so a changed default shows.
    assert all(p.is_contiguous() for p in m.parameters()), "smoe_torch.MoE parameters must be dense here"
    return m


class Block(nn.Module):
    def __init__(self, a, moe, moe_dtype):
        super().__init__()
        self.attn_norm, self.moe_norm = nn.RMSNorm(a.dim, eps=1e-6), nn.RMSNorm(a.dim, eps=1e-6)
        self.attn = Attention(a.dim, a.heads, a.seq, a.compile)
        self.moe, self.moe_dtype = moe, moe_dtype

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        # Every layer gets a bf16 input, as under FSDP2's bf16 param_dtype in torchtitan (autocast
        # leaves the norm's output fp32, which would make torchtitan gather and scatter fp32 rows).
        return x + self.moe(self.moe_norm(x).to(self.moe_dtype)).to(x.dtype)


class LM(nn.Module):
    def __init__(self, a, make_moe, moe_dtype):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, a.dim)
        self.blocks = nn.ModuleList(Block(a, make_moe(), moe_dtype) for _ in range(a.layers))
        self.norm = nn.RMSNorm(a.dim, eps=1e-6)
        self.head = nn.Linear(a.dim, VOCAB, bias=False)
        self._loss = maybe_compiled(head_loss, a.compile)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self._loss(x, self.norm.weight, self.norm.eps, self.head.weight, targets)


@torch.no_grad()
def init_params(model, seed, layers):
    """torchtitan-style init drawn in sorted-name order from one generator, into a dense buffer per
    parameter: the same names and shapes give the same values in every variant."""
    gen = torch.Generator(device=next(model.parameters()).device)
    gen.manual_seed(seed)
    depth_std = 0.02 / math.sqrt(2 * layers)
    h = hashlib.sha256()
    total = 0.0
    for name, p in sorted(model.named_parameters()):
        t = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        if "norm" in name:
            t.fill_(1.0)
        elif name == "emb.weight":
            t.normal_(generator=gen)
        else:
            std = p.shape[-1] ** -0.5 if name == "head.weight" else (
                depth_std if name.endswith(("attn.o.weight", "experts.w2", "shared_experts.w2.weight")) else 0.02)
            nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std, generator=gen)
        p.copy_(t)
        h.update(f"{name}{tuple(p.shape)}".encode())
        total += float(t.double().abs().sum())
    return {"names_sha256_16": h.hexdigest()[:16], "abs_sum": total}


# ---- timing
class Clock:
    """CUDA events on the GPU (their deltas are the step's device time, no per-step sync needed);
    perf_counter on the CPU, where everything is synchronous."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def ms(self, a, b):
        return a.elapsed_time(b) if self.cuda else 1e3 * (b - a)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


class ModuleTimer:
    """Marks around every attention and MoE module, forward (forward pre-hook / hook) and backward
    (full backward pre-hook: the module's output gradient is ready; full backward hook: its input
    gradient is done). Autograd runs a device's backward on one thread in dependency order, and the
    rest of the block waits for the module's input gradient, so that interval holds the module's own
    kernels (weight-gradient accumulation aside). The hooks add identity nodes and event records,
    so they are attached in a few profiling steps only, which the throughput leaves out."""

    def __init__(self, clock, groups):
        self.clock, self.groups, self.handles, self.spans, self.open = clock, groups, [], [], {}

    def attach(self):
        for cat, mods in self.groups.items():
            for m in mods:
                self.handles += [
                    m.register_forward_pre_hook(lambda mod, args, c=cat: self._start(mod, c + "_fwd")),
                    m.register_forward_hook(lambda mod, args, out, c=cat: self._stop(mod, c + "_fwd")),
                    m.register_full_backward_pre_hook(lambda mod, gout, c=cat: self._start(mod, c + "_bwd")),
                    m.register_full_backward_hook(lambda mod, gin, gout, c=cat: self._stop(mod, c + "_bwd"))]

    def detach(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _start(self, mod, key):
        self.open[(id(mod), key)] = self.clock.mark()

    def _stop(self, mod, key):
        self.spans.append((key, self.open.pop((id(mod), key)), self.clock.mark()))

    def collect(self):
        out = {f"{c}_{p}": 0.0 for c in self.groups for p in ("fwd", "bwd")}
        for key, a, b in self.spans:
            out[key] += self.clock.ms(a, b)
        self.spans = []
        return out


class Progress:
    """tqdm if it imports, else a \r line."""

    def __init__(self, total, desc):
        self.bar = tqdm(total=total, desc=desc, mininterval=5, ncols=110) if tqdm else None
        self.total, self.desc, self.n = total, desc, 0

    def update(self, n, info):
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix_str(info, refresh=False)
        else:
            print(f"\r{self.desc} {self.n}/{self.total} {info}", end="", file=sys.stderr, flush=True)

    def write(self, msg):
        tqdm.write(msg) if self.bar is not None else print(f"\n{msg}", flush=True)

    def close(self):
        self.bar.close() if self.bar is not None else print(file=sys.stderr)


def lr_at(step, a):
    warm = min(a.lr_warmup, max(1, a.steps // 10))
    if step < warm:
        return a.lr * (step + 1) / warm
    p = (step - warm) / max(1, a.steps - warm)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def finite(v):
    return v if v is not None and math.isfinite(v) else None


def quantile(v, q):
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))] if s else None


@torch.no_grad()
def evaluate(model, batches, amp):
    model.eval()  # smoe_tr: top-K routing in evaluation
    tot = 0.0
    for x, y in batches:
        with amp():
            tot = tot + model(x, y).float()
    model.train()
    return finite(float(tot) / len(batches))


# ---- one training run
def run(variant, seed, a, data, device, factories, budget_s, res, save):
    t_start = time.perf_counter()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    moe_dtype = torch.bfloat16 if cuda else torch.float32
    with torch.device(device):
        model = LM(a, factories[variant], moe_dtype)
    res["init"] = init_params(model, seed, a.layers)
    assert all(p.is_contiguous() for p in model.parameters()), "fused AdamW needs dense parameters"
    decay = {n: p.dim() >= 2 and n != "emb.weight" for n, p in model.named_parameters()}  # matrices only
    opt = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if decay[n]]},
                             {"params": [p for n, p in model.named_parameters() if not decay[n]], "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), weight_decay=a.weight_decay, fused=cuda)
    amp = (lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    train, held = data
    evals = eval_set(held, a.batch, a.seq, a.eval_batches)
    gen = torch.Generator(device=device)
    gen.manual_seed(1000 + seed)  # the data order: per seed, not per variant
    clock = Clock(device)
    timer = ModuleTimer(clock, {"attention": [b.attn for b in model.blocks], "moe": [b.moe for b in model.blocks]})
    profile = range(a.warmup_steps, a.warmup_steps + a.profile_steps)
    report_at = a.warmup_steps + a.profile_steps + 20
    T = a.batch * a.seq
    marks, prof, pending = [], [], []
    res.update(train_loss=[], grad_norm=[], eval_loss=[], setup_s=time.perf_counter() - t_start)
    bar = Progress(a.steps, f"{variant} s{seed}")
    step_ms = lambda: [clock.ms(s, e) for i, s, e in marks if i >= a.warmup_steps]  # noqa: E731
    stop, done, t_train = None, 0, time.perf_counter()
    last_save = t_train
    for step in range(a.steps):
        if time.perf_counter() - t_start > budget_s:
            stop = f"wall budget of {budget_s:.0f} s reached"
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        profiling = step in profile
        if profiling:
            clock.sync()
            timer.attach()
        if step == a.warmup_steps and cuda:
            res["static_mem_bytes"] = torch.cuda.memory_allocated()  # parameters + AdamW state
        t0 = clock.mark()
        x, y = train_batch(train, a.batch, a.seq, gen)
        with amp():
            loss = model(x, y)
        loss.backward()
        t_opt = clock.mark()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = clock.mark()
        done = step + 1
        if profiling:
            timer.detach()
            clock.sync()
            b = timer.collect()
            b.update(optimizer=clock.ms(t_opt, t1), step=clock.ms(t0, t1))
            prof.append(b)
        else:
            marks.append((step, t0, t1))
        pending.append(torch.stack((loss.detach().float(), gnorm.detach().float())))
        if done % a.log_every == 0 or done == a.steps:
            vals = torch.stack(pending).tolist()  # the only host sync of an ordinary step
            res["train_loss"] += [[done - len(vals) + i + 1, finite(v[0])] for i, v in enumerate(vals)]
            res["grad_norm"].append([done, finite(vals[-1][1])])
            pending = []
            bar.update(len(vals), f"loss {vals[-1][0]:.3f} lr {lr_at(step, a):.1e}")
            if time.perf_counter() - last_save > 15:  # partial curves survive a kill of the whole call
                save()
                last_save = time.perf_counter()
            if not all(math.isfinite(v[0]) for v in vals):
                stop = "non-finite training loss"
                break
        if prof and done == a.warmup_steps + a.profile_steps:
            bar.write(f"[{variant} s{seed}] module times (ms, mean of {len(prof)} profiling steps): "
                      + ", ".join(f"{k} {statistics.mean(p[k] for p in prof):.1f}" for k in prof[0]))
        if done == report_at:
            clock.sync()
            ms = step_ms()
            bar.write(f"[{variant} s{seed}] step {done}: median step {statistics.median(ms):.1f} ms over {len(ms)} "
                      f"timed steps = {T / statistics.median(ms) * 1e3:,.0f} tokens/s")
        if a.eval_every and done % a.eval_every == 0 and done < a.steps:
            res["eval_loss"].append([done, evaluate(model, evals, amp)])
            save()
    clock.sync()
    bar.close()
    res["train_wall_s"] = time.perf_counter() - t_train
    res.update(status="stopped" if stop else "done", steps_done=done, tokens_trained=done * T)
    if stop:
        res["stop_reason"] = stop
    ms = step_ms()
    med = statistics.median(ms) if ms else None
    res.update(timed_steps=len(ms), step_ms_median=med, step_ms_p10=quantile(ms, 0.1), step_ms_p90=quantile(ms, 0.9),
               tokens_per_s=T / med * 1e3 if med else None, tokens_per_day=T / med * 1e3 * 86400 if med else None,
               model_tflops_per_s=flops_per_token(a) * T / med / 1e9 if med else None)
    if prof:
        bd = {k: statistics.mean(p[k] for p in prof) for k in prof[0]}
        bd["rest"] = bd["step"] - sum(bd[k] for k in ("attention_fwd", "attention_bwd", "moe_fwd", "moe_bwd"))
        res["breakdown_ms"] = bd
        res["breakdown_fraction"] = {"attention": (bd["attention_fwd"] + bd["attention_bwd"]) / bd["step"],
                                     "moe": (bd["moe_fwd"] + bd["moe_bwd"]) / bd["step"],
                                     "rest": bd["rest"] / bd["step"]}
    if cuda:
        res["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
    res["final_eval_loss"] = evaluate(model, evals, amp)
    res["eval_loss"].append([done, res["final_eval_loss"]])
    res["final_eval_bits_per_byte"] = res["final_eval_loss"] / math.log(2) if res["final_eval_loss"] else None
    if variant == "torchtitan":
        res["grouped_mm"] = "torch._grouped_mm" if _GMM_OK.get((device.type, moe_dtype)) else "per-expert loop"
    if variant.startswith("smoe"):
        import smoe_torch
        res["smoe_nonfinite_status"] = list(smoe_torch.nonfinite_status())
    del model, opt


def flops_per_token(a):
    """Model FLOPs (6 x active matmul parameters + causal attention), fwd + bwd, not hardware FLOPs."""
    per_layer = 4 * a.dim ** 2 + a.experts * a.dim + (a.top_k + a.shared) * 3 * a.hidden * a.dim
    return 6 * (a.layers * per_layer + VOCAB * a.dim) + 6 * a.layers * a.seq * a.dim


def availability(device, a, wanted):
    """{variant: (MoE factory or None, reason it is skipped)}; imports only what `wanted` needs."""
    out = {"torchtitan": (lambda: TorchtitanMoE(a.dim, a.hidden, a.experts, a.top_k, a.shared,
                                                torch.bfloat16 if device.type == "cuda" else torch.float32), None)}
    if not {"smoe", "smoe_tr", "sonicmoe"} & set(wanted):
        return out
    try:
        import smoe_torch
        why = None if device.type == "cuda" else "smoe_torch needs a CUDA GPU"
    except Exception as e:  # noqa: BLE001  (any failure to load the extension is a reason to skip)
        smoe_torch, why = None, f"smoe_torch does not import: {type(e).__name__}: {e}"
    out["smoe"] = (None if why else (lambda: make_smoe(smoe_torch, a, None)), why)
    out["smoe_tr"] = (None if why else (lambda: make_smoe(smoe_torch, a, a.token_rounding or "nr")), why)
    if "sonicmoe" not in wanted:
        return out
    try:
        import sonicmoe
        from sonicmoe.enums import ActivationType
        why = None if device.type == "cuda" else "SonicMoE needs a CUDA GPU"
    except Exception as e:  # noqa: BLE001
        sonicmoe = ActivationType = None
        why = f"sonicmoe does not import: {type(e).__name__}: {e}"
    out["sonicmoe"] = (None if why else (lambda: SonicMoE((sonicmoe, ActivationType), a.dim, a.hidden, a.experts,
                                                           a.top_k, a.shared)), why)
    return out


# ---- output
def write_json(doc, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)  # a run killed mid-write keeps the previous file


def summarize(doc):
    by = {}
    for r in doc["runs"]:
        if r.get("tokens_per_s"):
            by.setdefault(r["variant"], []).append(r)
    out = {}
    for v, rs in by.items():
        ev = [r["final_eval_loss"] for r in rs if r.get("final_eval_loss") is not None]
        out[v] = {"seeds": len(rs), "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                  "final_eval_loss_mean": statistics.mean(ev) if ev else None,
                  "peak_mem_bytes": max((r.get("peak_mem_bytes") or 0) for r in rs) or None}
    if "torchtitan" in out:
        for v in out:
            out[v]["speedup_vs_torchtitan"] = out[v]["tokens_per_s"] / out["torchtitan"]["tokens_per_s"]
    return out


def plot(doc, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"skipped: matplotlib does not import ({e})"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in doc["runs"]:
        pts = [(s, v) for s, v in r.get("train_loss", []) if v is not None]
        if not pts:
            continue
        steps, ema, acc = [], [], None
        for s, v in pts:  # EMA: the per-step loss of a byte-level LM is noisy
            acc = v if acc is None else 0.95 * acc + 0.05 * v
            steps.append(s)
            ema.append(acc)
        label = f"{r['variant']} s{r['seed']}"
        line, = ax1.plot(steps, ema, label=f"{label} train (EMA)")
        ev = [(s, v) for s, v in r.get("eval_loss", []) if v is not None]
        if ev:
            ax1.plot(*zip(*ev), "o--", color=line.get_color(), label=f"{label} held-out")
        if r.get("step_ms_median"):  # the same curve against time at the measured step time
            ax2.plot([s * r["step_ms_median"] / 1e3 for s in steps], ema, color=line.get_color(),
                     label=f"{label}: {r['tokens_per_s']:,.0f} tok/s")
    ax1.set(xlabel="step", ylabel="loss (nats / byte)", title="loss by step")
    ax2.set(xlabel="seconds at the median step time", ylabel="train loss (EMA)", title="loss by time")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    c = doc["config"]
    fig.suptitle(f"{doc['device']} @ {doc['commit']}: {c['layers']}L d{c['dim']} E{c['experts']} K{c['top_k']} "
                 f"n{c['hidden']}, {c['batch']}x{c['seq']} bytes/step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="smoe,torchtitan,sonicmoe", help=f"comma list of {','.join(ALL_VARIANTS)}")
    p.add_argument("--token-rounding", choices=("nr", "up", "down", "sr"), default=None,
                   help="rounding mode of smoe_tr (added to --variants when given; default nr)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256, help="expert hidden size n")
    p.add_argument("--shared", type=int, default=0, help="shared experts (hidden n each), 0 = none")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="sequences per step: batch x seq tokens")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-warmup", type=int, default=100, help="linear warmup steps (at most steps / 10)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine ends at lr x this")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seeds", type=int, default=1, help="runs per variant, seeds 0 .. N-1 (init and data order)")
    p.add_argument("--warmup-steps", type=int, default=20, help="steps left out of the timing")
    p.add_argument("--profile-steps", type=int, default=3, help="steps after warm-up timed per module (breakdown)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--max-seconds", type=float, default=float("inf"), help="wall budget of each run (setup included)")
    p.add_argument("--total-seconds", type=float, default=float("inf"),
                   help="wall budget of the whole script, shared evenly by the runs not yet started")
    p.add_argument("--compile", action="store_true", help="torch.compile attention and the loss head (not the MoE)")
    p.add_argument("--out", default="train_lm.json")
    p.add_argument("--plot", default=None, help="loss-curve PNG (default: --out with .png; 'none' for no plot)")
    p.add_argument("--commit", default=None, help="recorded in the JSON (default: SMOE_COMMIT or git rev-parse)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU: tests the script, not the kernels")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        for k, v in SMOKE.items():
            if p.get_default(k) == getattr(a, k):  # explicit options still win
                setattr(a, k, v)
    return a


def main(argv=None):
    a = parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cpu" if a.cpu_smoke or not torch.cuda.is_available() else "cuda")
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if a.token_rounding and "smoe_tr" not in variants:
        variants.append("smoe_tr")
    bad = [v for v in variants if v not in ALL_VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}; choose from {ALL_VARIANTS}")
    commit = a.commit or os.environ.get("SMOE_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    train, held, corpus = load_corpus()
    train, held = train.to(device), held.to(device)
    print(f"corpus: {corpus['files']} stdlib .py files of Python {corpus['python']}, {corpus['bytes']:,} bytes "
          f"({corpus['heldout_bytes']:,} held out); device {device}", flush=True)
    avail = availability(device, a, variants)
    with torch.device("meta"):
        n_total = sum(p.numel() for p in LM(a, avail["torchtitan"][0], torch.float32).parameters())
    cuda = device.type == "cuda"
    config = {k: finite(v) if isinstance(v, float) else v for k, v in vars(a).items()}  # no Infinity in the JSON
    config.update(variants=variants, head_dim=a.dim // a.heads, tokens_per_step=a.batch * a.seq,
                  vocab="byte-level: the 256 byte values are the tokens (no tokenizer)", params_total=n_total,
                  params_active_per_token=n_total - a.layers * (a.experts - a.top_k) * 3 * a.hidden * a.dim,
                  model_flops_per_token=flops_per_token(a),
                  precision="fp32 master weights, bf16 autocast, bf16 MoE input" if cuda else "fp32 (CPU)",
                  optimizer=f"AdamW(betas=(0.9, 0.95), fused={cuda}), warmup + cosine, clip {a.clip}")
    plot_path = None if a.plot == "none" else (a.plot or os.path.splitext(a.out)[0] + ".png")
    doc = {"benchmark": "examples/train_lm/train_lm.py", "commit": commit,
           "created": time.strftime("%Y-%m-%d %H:%M:%S"),
           "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
           "torch": torch.__version__, "python": platform.python_version(), "config": config, "corpus": corpus,
           "runs": [], "summary": {}}
    save = lambda: write_json(doc, a.out)  # noqa: E731
    plan = [(seed, v) for seed in range(a.seeds) for v in variants]
    for i, (seed, v) in enumerate(plan):
        factory, why = avail[v]
        res = {"variant": v, "seed": seed, "status": "running"}
        doc["runs"].append(res)
        if why:
            res.update(status="skipped", reason=why)
            print(f"[{v}] skipped: {why}", flush=True)
            save()
            continue
        budget = min(a.max_seconds, (a.total_seconds - (time.perf_counter() - t0)) / (len(plan) - i))
        try:
            run(v, seed, a, (train, held), device, {v: factory}, budget, res, save)
        except Exception as e:  # noqa: BLE001  (a failed variant must not lose the others' results)
            res.update(status="failed", error=f"{type(e).__name__}: {e}"[:2000],
                       traceback=traceback.format_exc()[-3000:])
            print(f"[{v} s{seed}] failed: {res['error'][:500]}", flush=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        doc["summary"] = summarize(doc)
        if res.get("tokens_per_s"):
            bd = res.get("breakdown_fraction", {})
            print(f"[{v} s{seed}] {res['status']}: {res['steps_done']} steps, {res['tokens_per_s']:,.0f} tokens/s "
                  f"({res['tokens_per_day'] / 1e9:.1f} B tokens/day), step {res['step_ms_median']:.1f} ms, "
                  + " / ".join(f"{k} {f:.0%}" for k, f in bd.items())
                  + f", final held-out loss {res['final_eval_loss'] or float('nan'):.4f}"
                  + (f", peak {res['peak_mem_bytes'] / 1e9:.1f} GB" if res.get("peak_mem_bytes") else ""), flush=True)
        if plot_path:
            doc["plot"] = plot(doc, plot_path)
        save()
    print(json.dumps(doc["summary"], indent=1))
    if plot_path:
        print(f"plot: {doc.get('plot')}")
    print(f"wrote {a.out} ({time.perf_counter() - t0:.0f} s)")
    return doc


if __name__ == "__main__":
    main()
